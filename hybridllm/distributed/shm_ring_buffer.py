"""Lock-free single-writer, multi-reader ring of fixed-size chunks in one shared-memory segment."""

from __future__ import annotations

import os
import struct
import threading
import weakref

from hybridllm.distributed.shm_segment import (
    MappedSegment,
    attach_segment,
    create_segment,
    new_segment_name,
    pid_alive,
    release_segment,
)

_PID = struct.Struct("<q")


class ShmRingBuffer:
    """`max_chunks` chunks of `max_chunk_bytes`, one written flag and one read flag per reader each.

    Layout: [chunk 0 | ... | chunk C-1 | flags: C x (written, read_0..read_{N-1}) | pad |
    reader pids: N x int64]. A chunk is free when written == 0 or every reader has read it.
    Writer: fence, written = 0, clear read flags, copy payload, fence, written = 1.
    Reader: load own flag (must be 0) *then* written (must be 1), fence, read, fence, flag = 1.
    Loading the read flag first matters: a cleared flag proves the writer already stored
    written = 0 for this round, so a written == 1 seen after it is the new payload's.

    Fence: x86-64 keeps stores in order and loads in order (TSO), so the protocol needs only
    that the interpreter not reorder, which it cannot across these opaque calls; acquiring and
    releasing a lock (an atomic read-modify-write) adds a real barrier on weaker CPUs.
    """

    def __init__(
        self,
        segment: MappedSegment,
        n_readers: int,
        max_chunk_bytes: int,
        max_chunks: int,
        reader_index: int | None,
    ) -> None:
        self._segment = segment
        self._buf = segment.buf
        self.n_readers = n_readers
        self.max_chunk_bytes = max_chunk_bytes
        self.max_chunks = max_chunks
        self.reader_index = reader_index  # None on the writer
        self._flags_offset = max_chunks * max_chunk_bytes
        self._pids_offset = _align8(self._flags_offset + max_chunks * (1 + n_readers))
        self._fence_lock = threading.Lock()
        self._index = 0  # next chunk to write (writer) or to read (reader)
        self._all_read = b"\x01" * n_readers
        self._finalizer = weakref.finalize(self, release_segment, segment, reader_index is None)

    @staticmethod
    def segment_size(n_readers: int, max_chunk_bytes: int, max_chunks: int) -> int:
        flags_end = max_chunks * max_chunk_bytes + max_chunks * (1 + n_readers)
        return _align8(flags_end) + n_readers * _PID.size

    @classmethod
    def create(cls, n_readers: int, max_chunk_bytes: int, max_chunks: int) -> ShmRingBuffer:
        """Create and own a new zero-filled segment (the writer's side), mode 0600 and its
        pages reserved: SharedMemoryFullError (an OSError) names the bytes a full /dev/shm
        lacked instead of a SIGBUS later."""
        if n_readers < 1 or max_chunk_bytes < 1 or max_chunks < 1:
            raise ValueError(
                f"ShmRingBuffer needs n_readers, max_chunk_bytes, max_chunks >= 1, got "
                f"{n_readers}, {max_chunk_bytes}, {max_chunks}"
            )
        size = cls.segment_size(n_readers, max_chunk_bytes, max_chunks)
        segment = create_segment(new_segment_name(), size)
        return cls(segment, n_readers, max_chunk_bytes, max_chunks, reader_index=None)

    @classmethod
    def attach(
        cls, name: str, n_readers: int, max_chunk_bytes: int, max_chunks: int, reader_index: int
    ) -> ShmRingBuffer:
        """Map an existing segment as reader `reader_index` and record this process's pid."""
        if not 0 <= reader_index < n_readers:
            raise ValueError(f"reader_index {reader_index} out of range for {n_readers} readers")
        try:
            segment = attach_segment(name)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"shared-memory segment {name!r} does not exist: the writer closed it or died"
            ) from None
        expected = cls.segment_size(n_readers, max_chunk_bytes, max_chunks)
        if len(segment.buf) != expected:
            actual = len(segment.buf)
            release_segment(segment, owner=False)
            raise ValueError(
                f"segment {name!r} is {actual} bytes but {n_readers} readers x {max_chunks} "
                f"chunks x {max_chunk_bytes} bytes need {expected}: attach with the writer's sizes"
            )
        ring = cls(segment, n_readers, max_chunk_bytes, max_chunks, reader_index)
        holder = ring.reader_pid(reader_index)
        if holder is not None and holder > 0 and holder != os.getpid() and pid_alive(holder):
            ring._finalizer()  # not close(): that would mark the holder's slot closed
            raise ValueError(
                f"reader {reader_index} of {name!r} is already attached by pid {holder}"
            )
        _PID.pack_into(ring._buf, ring._pids_offset + reader_index * _PID.size, os.getpid())
        return ring

    @property
    def name(self) -> str:
        return self._segment.name

    @property
    def index(self) -> int:
        """The chunk this side will write or read next."""
        return self._index

    def _fence(self) -> None:
        with self._fence_lock:
            pass

    def _chunk(self, index: int) -> memoryview:
        start = index * self.max_chunk_bytes
        return self._buf[start : start + self.max_chunk_bytes]

    # writer side

    def try_acquire_write(self) -> memoryview | None:
        """The next chunk's view if every reader is done with it, else None; then `publish`."""
        flags = self._flags_offset + self._index * (1 + self.n_readers)
        readers = slice(flags + 1, flags + 1 + self.n_readers)
        if self._buf[flags] == 1 and self._buf[readers] != self._all_read:
            return None
        self._fence()  # our payload writes must not overtake the readers' last reads
        self._buf[flags] = 0
        self._buf[readers] = bytes(self.n_readers)
        return self._chunk(self._index)

    def publish(self) -> None:
        """Mark the acquired chunk written; readers may read it from now on."""
        self._fence()  # the payload must be visible before the flag that announces it
        self._buf[self._flags_offset + self._index * (1 + self.n_readers)] = 1
        self._index = (self._index + 1) % self.max_chunks

    def lagging_readers(self) -> list[int]:
        """Readers that have not yet read the chunk the writer wants next."""
        flags = self._flags_offset + self._index * (1 + self.n_readers)
        if self._buf[flags] == 0:
            return []
        return [r for r in range(self.n_readers) if self._buf[flags + 1 + r] == 0]

    # reader side

    def try_acquire_read(self) -> memoryview | None:
        """The next chunk's view if the writer published it and we have not read it; then
        `release_read`."""
        flags = self._flags_offset + self._index * (1 + self.n_readers)
        if self._buf[flags + 1 + self.reader_index] != 0 or self._buf[flags] != 1:
            return None
        self._fence()  # our payload reads must see what the writer wrote before the flag
        return self._chunk(self._index)

    def release_read(self) -> None:
        """Mark the current chunk read by us and move on; the view must not be used after."""
        self._fence()
        self._buf[
            self._flags_offset + self._index * (1 + self.n_readers) + 1 + self.reader_index
        ] = 1
        self._index = (self._index + 1) % self.max_chunks

    def reader_pid(self, reader_index: int) -> int | None:
        """Pid of the reader's process: > 0 attached, < 0 (as -pid) closed, None never attached."""
        pid = _PID.unpack_from(self._buf, self._pids_offset + reader_index * _PID.size)[0]
        return pid or None

    def reader_alive(self, reader_index: int) -> bool | None:
        """False once the reader closed its end or its process died; None if never attached."""
        pid = self.reader_pid(reader_index)
        return None if pid is None else pid > 0 and pid_alive(pid)

    def describe_reader(self, reader_index: int) -> str:
        """For error messages: the reader's pid and whether it can still read."""
        pid = self.reader_pid(reader_index)
        if pid is None:
            return "not attached yet"
        if pid < 0:
            return f"closed by pid {-pid}"
        return f"pid {pid}, {'alive' if pid_alive(pid) else 'dead'}"

    def close(self) -> None:
        """Readers unmap (and mark themselves closed); the writer also unlinks the segment."""
        if not self._finalizer.alive:
            return
        if self.reader_index is not None:
            offset = self._pids_offset + self.reader_index * _PID.size
            _PID.pack_into(self._buf, offset, -os.getpid())
        self._buf = None
        self._finalizer()


def _align8(n: int) -> int:
    return (n + 7) & ~7
