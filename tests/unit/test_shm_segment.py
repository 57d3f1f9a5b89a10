"""Shared-memory segments: who may sweep a stale one, and a clear error when /dev/shm is full."""

import errno
import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from hybridllm.distributed import shm_segment
from hybridllm.distributed.message_queue import MessageQueue
from hybridllm.distributed.shm_ring_buffer import ShmRingBuffer
from hybridllm.distributed.shm_segment import (
    SHM_DIR,
    SegmentCreator,
    SharedMemoryFullError,
    cleanup_stale_segments,
    new_segment_name,
    pid_alive,
    pid_namespace,
    process_start_time,
    segment_creator,
    this_creator,
)

pytestmark = pytest.mark.skipif(
    pid_namespace() is None or not os.path.isdir(SHM_DIR), reason="needs procfs and /dev/shm"
)


def _exists(name: str) -> bool:
    return os.path.exists(os.path.join(SHM_DIR, name))


def _name(pid: int, start_time: int, namespace: int) -> str:
    return f"hybridllm_{pid}_{start_time}_{namespace}_{uuid.uuid4().hex[:12]}"


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()  # reaped: the pid no longer exists
    return proc.pid


def _our_segments() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if (c := segment_creator(n)) and c.pid == os.getpid()}


@pytest.fixture
def make_segments():
    """Create plain files in /dev/shm under the given names; remove whatever is left after."""
    made = []

    def make(*names: str) -> None:
        for name in names:
            Path(SHM_DIR, name).write_bytes(b"\0" * 16)
            made.append(name)

    yield make
    for name in made:
        Path(SHM_DIR, name).unlink(missing_ok=True)


def test_new_names_record_pid_start_time_and_pid_namespace():
    me = this_creator()
    assert me == SegmentCreator(os.getpid(), process_start_time(os.getpid()), pid_namespace())
    assert me.start_time > 0 and me.pid_namespace > 0
    assert segment_creator(new_segment_name()) == me
    assert segment_creator("hybridllm_123_abcdef012345") is None  # older format: no namespace
    assert segment_creator("hybridllm_1_2_x_abc") is None
    assert segment_creator("psm_1_2_3_abc") is None


def test_dead_creator_is_swept_live_one_kept(make_segments):
    me = this_creator()
    dead = _name(_dead_pid(), me.start_time, me.pid_namespace)
    live = _name(me.pid, me.start_time, me.pid_namespace)
    make_segments(dead, live)
    removed = cleanup_stale_segments()
    assert dead in removed and not _exists(dead)
    assert live not in removed and _exists(live)


def test_reused_pid_is_swept(make_segments):
    # Our pid, but a start time that is not ours: the creator died and the pid was reused.
    me = this_creator()
    reused = _name(me.pid, me.start_time - 1, me.pid_namespace)
    make_segments(reused)
    assert reused in cleanup_stale_segments() and not _exists(reused)


def test_zombie_creator_is_swept(make_segments):
    me = this_creator()
    zombie = subprocess.Popen(["true"])
    start = process_start_time(zombie.pid)
    try:
        deadline = time.monotonic() + 10
        while pid_alive(zombie.pid) and time.monotonic() < deadline:
            time.sleep(0.01)  # exits at once; not reaped until wait()
        assert os.path.exists(f"/proc/{zombie.pid}")  # a zombie, pid still taken
        name = _name(zombie.pid, start, me.pid_namespace)
        make_segments(name)
        assert name in cleanup_stale_segments()
    finally:
        zombie.wait()


def test_foreign_namespace_old_format_and_foreign_uid_are_kept(make_segments, monkeypatch):
    me = this_creator()
    dead = _dead_pid()
    # Another container's engine sharing /dev/shm: its pids mean nothing here, live or not.
    foreign_ns = _name(dead, me.start_time, me.pid_namespace + 1)
    old_format = f"hybridllm_{dead}_{uuid.uuid4().hex[:12]}"  # cannot say whose pid it is
    unknown_start = _name(dead, 0, me.pid_namespace)  # made where procfs was unreadable
    make_segments(foreign_ns, old_format, unknown_start)
    removed = cleanup_stale_segments()
    assert not {foreign_ns, old_format, unknown_start} & set(removed)
    assert _exists(foreign_ns) and _exists(old_format) and _exists(unknown_start)

    stale = _name(dead, me.start_time, me.pid_namespace)
    make_segments(stale)
    monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 1)  # the file is now another uid's
    assert stale not in cleanup_stale_segments() and _exists(stale)
    monkeypatch.undo()
    assert stale in cleanup_stale_segments()


def test_full_dev_shm_fails_at_creation_with_a_clear_error(monkeypatch):
    calls = []

    def no_space(fd, offset, length):
        calls.append((offset, length))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    before = _our_segments()
    size = ShmRingBuffer.segment_size(2, 1 << 20, 10)
    with pytest.raises(SharedMemoryFullError) as info:
        ShmRingBuffer.create(2, 1 << 20, 10)
    assert calls == [(0, size)]  # every page of the segment, reserved at creation
    assert isinstance(info.value, OSError) and info.value.errno == errno.ENOSPC
    message = str(info.value)
    assert "/dev/shm is full" in message and f"needs {size} bytes" in message
    assert "--shm-size" in message
    assert _our_segments() == before  # the half-created segment was unlinked
    with pytest.raises(OSError, match="--shm-size"):
        MessageQueue(1)  # the queue's constructor surfaces it as is
    assert _our_segments() == before


def test_a_filesystem_that_cannot_reserve_still_gets_a_segment(monkeypatch):
    def unsupported(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    ring = ShmRingBuffer.create(1, 64, 2)
    try:
        assert os.path.getsize(os.path.join(SHM_DIR, ring.name)) == ring.segment_size(1, 64, 2)
    finally:
        ring.close()


def test_segments_are_created_0600_whatever_the_umask():
    old = os.umask(0)
    try:
        segment = shm_segment.create_segment(new_segment_name(), 4096)
    finally:
        os.umask(old)
    try:
        assert os.stat(os.path.join(SHM_DIR, segment.name)).st_mode & 0o777 == 0o600
        assert bytes(segment.buf[:16]) == bytes(16)
    finally:
        shm_segment.release_segment(segment, owner=True)
    assert not _exists(segment.name)
