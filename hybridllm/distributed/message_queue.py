"""One-writer, N-reader broadcast queue: a shared-memory ring on one node, ZeroMQ for the rest."""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from functools import partial
from stat import S_ISDIR
from typing import Any

import zmq

from hybridllm.distributed import message_codec as codec
from hybridllm.distributed.curve_auth import CurveKeys, CurveServer, secure_client
from hybridllm.distributed.shm_ring_buffer import ShmRingBuffer
from hybridllm.distributed.shm_segment import (
    creator_gone,
    creator_tag,
    owned_by,
    parse_creator_tag,
    pid_alive,
)
from hybridllm.distributed.spin_timer import SpinPolicy, SpinTimer

_LIVENESS_INTERVAL_S = 0.05  # how often a blocked side checks whether its peer process died
_LOOPBACK = "127.0.0.1"
_IPC_PATH_MAX = 107  # sun_path holds 108 bytes with the terminating NUL
_SOCKET_DIR_PREFIX = "hybridllm-mq-"
# after the base directory: "/hybridllm-mq-<pid>_<start>_<ns>-XXXXXXXX/reader-NNNN.sock"
_IPC_NAME_ROOM = 80


class ReaderDiedError(TimeoutError):
    """The writer gave up early: a reader it waits for is dead or closed its end."""


class WriterDiedError(TimeoutError):
    """A reader gave up early: the writer process died and the next message will never come."""


@dataclass(frozen=True)
class Handle:
    """What a reader needs to attach; picklable, sent to worker processes."""

    n_readers: int
    max_chunk_bytes: int
    max_chunks: int
    shm_name: str | None  # None when every reader is remote
    local_reader_ranks: tuple[int, ...]  # readers on the writer's node, in ring-slot order
    reader_addresses: tuple[str, ...]  # ipc:// (local) or tcp:// (remote) endpoint per rank
    writer_pid: int
    spin_policy: SpinPolicy
    # Remote readers only: the writer's CURVE public key and the one client key pair it
    # accepts. A secret: send the handle only over a channel as private as the data.
    curve: CurveKeys | None = field(default=None, repr=False)


class MessageQueue:
    """Broadcast picklable objects from one writer to `n_readers` readers, in order.

    Local readers read each message from a shared-memory ring (`ShmRingBuffer`); a message
    larger than a chunk leaves a marker in the ring and travels, with its pickle-5
    out-of-band buffers as zero-copy frames, over a per-reader ZeroMQ PUSH socket. Readers
    listed in `remote_reader_ranks` (other nodes) get everything over their socket. The
    writer owns the segment: it is unlinked on close, garbage collection and interpreter
    exit; `cleanup_stale_segments` handles a writer killed by a signal.

    Who can connect: readers unpickle what arrives, and a PUSH socket deals messages
    round-robin to whoever connects, so no other local user may reach a socket. The
    segment is mode 0600; a local reader's socket is an `ipc://` file in a directory of
    the writer's made with mode 0700 (under $XDG_RUNTIME_DIR, else the temp dir) and removed
    with the queue. A remote reader's socket is TCP on `remote_host` secured with CURVE
    (encrypted, and the writer's ZAP handler admits only the client key pair the handle
    carries), so the handle of a queue with remote readers is a secret.

    Liveness: local readers record their pid in the segment, so a writer blocked on a dead
    (or closed) reader raises `ReaderDiedError` within ~50 ms even with `timeout=None`; a
    local reader likewise raises `WriterDiedError`. Remote peers are the executor's job.
    Each end belongs to one thread.
    """

    def __init__(
        self,
        n_readers: int,
        max_chunk_bytes: int = 1 << 20,
        max_chunks: int = 10,
        *,
        remote_reader_ranks: Iterable[int] = (),
        remote_host: str = _LOOPBACK,
        spin_policy: SpinPolicy | None = None,
    ) -> None:
        remote = frozenset(remote_reader_ranks)
        if n_readers < 1 or max_chunks < 1 or max_chunk_bytes < 64:
            raise ValueError(
                f"MessageQueue needs n_readers >= 1, max_chunks >= 1, max_chunk_bytes >= 64; "
                f"got {n_readers}, {max_chunks}, {max_chunk_bytes}"
            )
        if not remote <= set(range(n_readers)):
            raise ValueError(f"remote_reader_ranks {sorted(remote)} not in [0, {n_readers})")
        local = tuple(r for r in range(n_readers) if r not in remote)
        self._ring = (
            ShmRingBuffer.create(len(local), max_chunk_bytes, max_chunks) if local else None
        )
        self._init_end(rank=None)
        self._remote_ranks = sorted(remote)
        if remote:
            self._owned.curve = CurveServer(self._ctx)
        if local:
            self._owned.socket_dir = _private_socket_dir()
        for rank in range(n_readers):
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)  # enqueue waits until frames left; nothing lingers
            if rank in remote:
                self._owned.curve.secure(sock)
                sock.bind(f"tcp://{remote_host}:*")
            else:
                sock.bind(f"ipc://{os.path.join(self._owned.socket_dir, f'reader-{rank}.sock')}")
            self._sockets.append(sock)
        self._handle = Handle(
            n_readers=n_readers,
            max_chunk_bytes=max_chunk_bytes,
            max_chunks=max_chunks,
            shm_name=self._ring.name if self._ring else None,
            local_reader_ranks=local,
            reader_addresses=tuple(s.getsockopt_string(zmq.LAST_ENDPOINT) for s in self._sockets),
            writer_pid=os.getpid(),
            spin_policy=spin_policy or SpinPolicy(),
            curve=self._owned.curve.keys if remote else None,
        )

    def _init_end(self, rank: int | None) -> None:
        """State both ends have; the zmq resources are closed by a finalizer like the ring."""
        self._rank = rank  # None: this end is the writer
        self._num_messages = 0  # enqueued (writer) or dequeued (reader) so far
        self._broken: str | None = None  # why the writer can no longer keep order
        self._on_socket_pending = 0  # reader: markers read from the ring, message still due
        self._remote_ranks: list[int] = []  # writer: readers on other nodes
        self._remote_alive: Callable[[int], bool | None] | None = None
        self._ctx = zmq.Context()
        self._sockets: list[zmq.Socket] = []  # writer: PUSH per reader rank; reader: its PULL
        self._owned = _WriterResources(os.getpid())
        self._finalizer = weakref.finalize(self, _close_zmq, self._ctx, self._sockets, self._owned)

    @classmethod
    def attach(
        cls, handle: Handle, reader_rank: int, spin_policy: SpinPolicy | None = None
    ) -> MessageQueue:
        """Open reader `reader_rank`'s end of the queue described by `handle`."""
        if not 0 <= reader_rank < handle.n_readers:
            raise ValueError(f"reader_rank {reader_rank} not in [0, {handle.n_readers})")
        self = cls.__new__(cls)
        self._init_end(rank=reader_rank)
        self._handle = handle if spin_policy is None else replace(handle, spin_policy=spin_policy)
        local = handle.local_reader_ranks
        self._ring = None
        if reader_rank in local:
            sizes = (len(local), handle.max_chunk_bytes, handle.max_chunks)
            self._ring = ShmRingBuffer.attach(handle.shm_name, *sizes, local.index(reader_rank))
        sock = self._ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        if reader_rank not in local:
            if handle.curve is None:
                raise ValueError(f"the handle has no CURVE keys for remote reader {reader_rank}")
            secure_client(sock, handle.curve)
        sock.connect(handle.reader_addresses[reader_rank])
        self._sockets.append(sock)
        return self

    def export_handle(self) -> Handle:
        return self._handle

    def __reduce__(self):
        raise TypeError("a MessageQueue cannot be pickled: send export_handle() and attach()")

    def __enter__(self) -> MessageQueue:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close this end; the writer's close also unlinks the shared-memory segment."""
        self._finalizer()
        if self._ring is not None:
            self._ring.close()

    # writer side

    def enqueue(self, obj: Any, timeout: float | None = None) -> None:
        """Send `obj` to every reader; returns once the data no longer aliases `obj`.

        Blocks while the ring is full (the slowest reader sets the pace). Raises TimeoutError
        naming the lagging reader after `timeout` seconds, or ReaderDiedError sooner.
        """
        self._check_open("enqueue", writer=True)
        parts = codec.encode(obj)
        on_socket = codec.inline_size(parts) > self._handle.max_chunk_bytes
        timer = SpinTimer(timeout, self._handle.spin_policy)
        if self._ring is not None:
            view = self._wait(self._ring.try_acquire_write, timer, self._check_readers)
            with view:
                if on_socket:
                    codec.write_on_socket_marker(view)
                else:
                    codec.write_inline(view, parts)
            self._ring.publish()
        ranks = range(self._handle.n_readers) if on_socket else self._remote_ranks
        try:
            self._send(parts, ranks, timer)
        except TimeoutError as e:
            # some readers may hold this message and others not: order is lost for good
            self._broken = f"enqueue of message #{self._num_messages} failed: {e}"
            raise
        self._num_messages += 1

    def watch_remote_readers(self, alive: Callable[[int], bool | None]) -> None:
        """Let `is_reader_alive` ask `alive(rank)` about remote readers (pids mean nothing
        off-node: the executor knows), so that a writer blocked on a dead one stops waiting."""
        self._remote_alive = alive

    def is_reader_alive(self, reader_rank: int) -> bool | None:
        """Whether a local reader's process lives (False also once it closed its end);
        for a remote reader what `watch_remote_readers` says, else None: ask the executor."""
        if reader_rank in self._remote_ranks:
            return self._remote_alive(reader_rank) if self._remote_alive else None
        if self._ring is None or reader_rank not in self._handle.local_reader_ranks:
            return None
        return self._ring.reader_alive(self._handle.local_reader_ranks.index(reader_rank))

    def _check_readers(self, timer: SpinTimer) -> None:
        lagging = [(i, self._handle.local_reader_ranks[i]) for i in self._ring.lagging_readers()]
        if any(self._ring.reader_alive(i) is False for i, _ in lagging) or timer.expired():
            error = TimeoutError if timer.expired() else ReaderDiedError
            raise error(
                f"MessageQueue.enqueue: writer waited {timer.elapsed():.3f} s for ring chunk "
                f"{self._ring.index} to send message #{self._num_messages}; reader(s) "
                f"{', '.join(f'{r} ({self._ring.describe_reader(i)})' for i, r in lagging)} "
                f"have not read message #{self._num_messages - self._handle.max_chunks} in it yet"
            )

    def _send(self, parts: list[codec.Part], ranks: Iterable[int], timer: SpinTimer) -> None:
        trackers = []
        for rank in ranks:
            _poll(self._sockets[rank], zmq.POLLOUT, timer, partial(self._check_receiver, rank))
            for i, part in enumerate(parts):
                flags = zmq.NOBLOCK | (zmq.SNDMORE if i + 1 < len(parts) else 0)
                trackers.append(self._sockets[rank].send(part, flags, copy=False, track=True))
        for tracker in trackers:  # frames alias obj's memory until zmq has handed them off
            try:
                tracker.wait(-1 if timer.timeout_s is None else timer.remaining())
            except zmq.NotDone:
                raise TimeoutError(
                    f"MessageQueue.enqueue: message #{self._num_messages} was queued but not "
                    f"sent within {timer.timeout_s} s; a reader is not receiving"
                ) from None

    def _check_receiver(self, rank: int, timer: SpinTimer) -> None:
        dead = self.is_reader_alive(rank) is False
        if dead or timer.expired():
            raise (ReaderDiedError if dead else TimeoutError)(
                f"MessageQueue.enqueue: writer waited {timer.elapsed():.3f} s to send message "
                f"#{self._num_messages} to reader {rank} at {self._handle.reader_addresses[rank]}"
                f": it is {'dead' if dead else 'not connected or not receiving'}"
            )

    # reader side

    def dequeue(self, timeout: float | None = None) -> Any:
        """The next message, in enqueue order; TimeoutError after `timeout` seconds, or
        WriterDiedError as soon as a local reader sees the writer's process gone."""
        self._check_open("dequeue", writer=False)
        timer = SpinTimer(timeout, self._handle.spin_policy)
        if self._ring is not None and self._on_socket_pending == 0:
            view = self._wait(self._ring.try_acquire_read, timer, self._check_writer)
            try:
                with view:
                    kind = codec.chunk_kind(view)
                    obj = codec.read_inline(view) if kind == codec.INLINE else None
            finally:
                self._ring.release_read()  # consumed even if unpickling failed
            if kind == codec.INLINE:
                self._num_messages += 1
                return obj
            self._on_socket_pending += 1
        _poll(self._sockets[0], zmq.POLLIN, timer, self._check_writer)
        frames = self._sockets[0].recv_multipart(copy=False)
        if self._ring is not None:
            self._on_socket_pending -= 1
        self._num_messages += 1
        return codec.decode_frames(frames)

    def _check_writer(self, timer: SpinTimer) -> None:
        pid = self._handle.writer_pid
        dead = self._ring is not None and not pid_alive(pid)  # pids mean nothing off-node
        if dead or timer.expired():
            raise (WriterDiedError if dead else TimeoutError)(
                f"MessageQueue.dequeue: reader {self._rank} waited {timer.elapsed():.3f} s for "
                f"message #{self._num_messages}; the writer (pid {pid}) "
                f"{'died' if dead else 'has not sent it'}"
            )

    def _check_open(self, verb: str, writer: bool) -> None:
        if not self._finalizer.alive:
            raise RuntimeError(f"MessageQueue.{verb}: the queue is closed")
        if (self._rank is None) != writer:
            role = "the writer" if self._rank is None else f"reader {self._rank}"
            raise RuntimeError(f"MessageQueue.{verb} called on {role}'s end")
        if self._broken:
            raise RuntimeError(f"MessageQueue.{verb}: the queue is broken: {self._broken}")

    def _wait(
        self,
        try_acquire: Callable[[], memoryview | None],
        timer: SpinTimer,
        check: Callable[[SpinTimer], None],
    ) -> memoryview:
        """Poll `try_acquire` until it yields a chunk; `check` raises when waiting is futile."""
        next_check = _LIVENESS_INTERVAL_S
        while (view := try_acquire()) is None:
            if timer.expired() or timer.elapsed() >= next_check:
                next_check = timer.elapsed() + _LIVENESS_INTERVAL_S
                check(timer)
            timer.pause()
        return view


def _poll(
    sock: zmq.Socket, event: int, timer: SpinTimer, check: Callable[[SpinTimer], None]
) -> None:
    """Wait for `event` on `sock` in slices, letting `check` raise between them."""
    interval_ms = int(_LIVENESS_INTERVAL_S * 1000)
    while True:
        remaining_ms = timer.remaining_ms()  # -1: no deadline
        if sock.poll(interval_ms if remaining_ms < 0 else min(remaining_ms, interval_ms), event):
            return
        check(timer)


class _WriterResources:
    """What the writer's end owns besides its sockets; released by its finalizer."""

    def __init__(self, pid: int) -> None:
        self.pid = pid  # a forked child inherits the finalizer but owns none of this
        self.socket_dir: str | None = None  # private directory of the local ipc sockets
        self.curve: CurveServer | None = None  # keys and ZAP handler for the remote readers


def _socket_dir_bases() -> list[str]:
    """Where socket directories go, in order of preference (and where stale ones are)."""
    bases = [os.environ.get("XDG_RUNTIME_DIR"), tempfile.gettempdir(), "/tmp"]
    # a socket path longer than sun_path cannot be bound
    usable = [b for b in bases if b and len(b) + _IPC_NAME_ROOM <= _IPC_PATH_MAX]
    return list(dict.fromkeys(usable))


def _private_socket_dir() -> str:
    """A new directory, mode 0700, for this queue's ipc sockets: only our uid can connect.
    Its name records its creator, so `cleanup_stale_socket_dirs` can tell when it is stale."""
    errors = []
    for base in _socket_dir_bases():
        try:
            # mkdtemp: created atomically with mode 0700, under a name nobody could predict
            return tempfile.mkdtemp(prefix=f"{_SOCKET_DIR_PREFIX}{creator_tag()}-", dir=base)
        except OSError as e:
            errors.append(f"{base}: {e}")
    longest = _IPC_PATH_MAX - _IPC_NAME_ROOM
    raise RuntimeError(
        "MessageQueue: no directory to hold its ipc sockets (tried $XDG_RUNTIME_DIR, the "
        f"temp dir and /tmp; one must be writable and at most {longest} characters long): "
        f"{'; '.join(errors) or 'none usable'}"
    )


def cleanup_stale_socket_dirs() -> list[str]:
    """Remove socket directories of writers killed by a signal (their finalizer never ran).

    Same rule as `cleanup_stale_segments`: only directories owned by our uid whose creator
    (recorded in the name) is provably gone from our pid namespace. Returns their paths.
    """
    removed = []
    uid = os.geteuid()
    for base in _socket_dir_bases():
        try:
            names = sorted(os.listdir(base))
        except OSError:
            continue
        for name in names:
            if not name.startswith(_SOCKET_DIR_PREFIX):
                continue
            creator = parse_creator_tag(name[len(_SOCKET_DIR_PREFIX) :].rpartition("-")[0])
            path = os.path.join(base, name)
            if creator is None or not creator_gone(creator) or not owned_by(path, uid, S_ISDIR):
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _close_zmq(ctx: zmq.Context, sockets: list[zmq.Socket], owned: _WriterResources) -> None:
    if owned.curve is not None:
        owned.curve.stop()  # its sockets belong to ctx: term() would wait for them
    for sock in sockets:
        sock.close(linger=0)
    ctx.term()  # libzmq unlinks the ipc socket files of the sockets bound here
    if owned.socket_dir is not None and owned.pid == os.getpid():
        shutil.rmtree(owned.socket_dir, ignore_errors=True)
