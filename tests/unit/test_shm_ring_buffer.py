"""ShmRingBuffer flag protocol, segment lifecycle and SpinTimer (stale cleanup: test_shm_segment)."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from hybridllm.distributed.shm_ring_buffer import ShmRingBuffer
from hybridllm.distributed.shm_segment import (
    SHM_DIR,
    new_segment_name,
    pid_alive,
    segment_creator_pid,
)
from hybridllm.distributed.spin_timer import SpinPolicy, SpinTimer
from tests.waiting import wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]


def _exists(name: str) -> bool:
    return os.path.exists(os.path.join(SHM_DIR, name))


@pytest.fixture
def ring():
    ring = ShmRingBuffer.create(n_readers=2, max_chunk_bytes=64, max_chunks=3)
    yield ring
    ring.close()


def test_segment_name_records_creator_pid_and_close_unlinks(ring):
    assert segment_creator_pid(ring.name) == os.getpid()
    assert _exists(ring.name)
    st = os.stat(os.path.join(SHM_DIR, ring.name))
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()  # ours alone
    assert os.path.getsize(os.path.join(SHM_DIR, ring.name)) == ShmRingBuffer.segment_size(2, 64, 3)
    ring.close()
    assert not _exists(ring.name)
    ring.close()  # idempotent


def test_each_reader_reads_each_chunk_once_in_order(ring):
    readers = [ShmRingBuffer.attach(ring.name, 2, 64, 3, reader_index=i) for i in range(2)]
    assert readers[0].try_acquire_read() is None  # nothing written yet
    for message in range(7):  # more than max_chunks: wraps around twice
        with ring.try_acquire_write() as chunk:
            chunk[:2] = message.to_bytes(2, "little")
        ring.publish()
        for reader in readers:
            with reader.try_acquire_read() as chunk:
                assert int.from_bytes(chunk[:2], "little") == message
            reader.release_read()
            assert reader.try_acquire_read() is None  # already read, not rewritten yet
    assert [r.reader_pid(i) for i, r in enumerate(readers)] == [os.getpid(), os.getpid()]
    for reader in readers:
        reader.close()


def test_writer_waits_for_the_slowest_reader(ring):
    fast = ShmRingBuffer.attach(ring.name, 2, 64, 3, reader_index=0)
    slow = ShmRingBuffer.attach(ring.name, 2, 64, 3, reader_index=1)
    for _ in range(3):
        ring.try_acquire_write().release()
        ring.publish()
        fast.try_acquire_read().release()
        fast.release_read()
    assert ring.try_acquire_write() is None  # ring full: reader 1 has read nothing
    assert ring.lagging_readers() == [1]
    slow.try_acquire_read().release()
    slow.release_read()
    assert ring.lagging_readers() == []
    ring.try_acquire_write().release()  # chunk 0 is free again
    fast.close()
    slow.close()
    assert ring.reader_pid(1) == -os.getpid()  # closed readers stay recognisable


def test_attach_rejects_bad_index_size_and_missing_segment(ring):
    with pytest.raises(ValueError, match="reader_index 2 out of range"):
        ShmRingBuffer.attach(ring.name, 2, 64, 3, reader_index=2)
    with pytest.raises(ValueError, match="attach with the writer.s sizes"):
        ShmRingBuffer.attach(ring.name, 2, 4096, 3, reader_index=0)
    with pytest.raises(FileNotFoundError, match="writer closed it or died"):
        ShmRingBuffer.attach(new_segment_name(), 2, 64, 3, reader_index=0)
    assert ring.reader_pid(0) is None  # failed attaches leave no trace


def test_reader_in_other_process_neither_unlinks_nor_shares_its_slot(ring):
    # A plain subprocess gets its own resource tracker; had the reader registered the
    # segment there (SharedMemory(name) on 3.11), the tracker would unlink it at exit.
    code = (
        "import sys\n"
        "from hybridllm.distributed.shm_ring_buffer import ShmRingBuffer\n"
        f"r = ShmRingBuffer.attach({ring.name!r}, 2, 64, 3, reader_index=0)\n"
        "print('ready', flush=True)\n"
        "sys.stdin.readline()\n"
        "r.close()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert child.stdout.readline().strip() == "ready"
    with pytest.raises(ValueError, match=f"already attached by pid {child.pid}"):
        ShmRingBuffer.attach(ring.name, 2, 64, 3, reader_index=0)
    _, stderr = child.communicate("done\n", timeout=20)
    assert child.returncode == 0, stderr
    assert "resource_tracker" not in stderr
    assert _exists(ring.name)
    assert ring.reader_pid(0) == -child.pid


def test_pid_alive_treats_zombies_as_dead():
    assert pid_alive(os.getpid())
    zombie = subprocess.Popen(["true"])
    # `true` exits at once; not reaped, it stays in the process table as a zombie
    wait_until(lambda: not pid_alive(zombie.pid), 10, "an exited, unreaped child counts as alive")
    assert os.path.exists(f"/proc/{zombie.pid}")
    zombie.wait()
    assert not pid_alive(zombie.pid)


def test_segment_creator_pid_parses_only_our_names():
    assert segment_creator_pid("hybridllm_123_456_789_abcdef") == 123
    assert segment_creator_pid("hybridllm_123_abcdef") == 123  # the older format
    assert segment_creator_pid("hybridllm_123") is None
    assert segment_creator_pid("psm_123_abc") is None


def test_spin_timer_spins_then_sleeps_and_honours_deadline():
    policy = SpinPolicy(spin_s=0.005, first_sleep_s=1e-4, max_sleep_s=2e-3)
    timer = SpinTimer(0.05, policy)
    spins = 0
    while timer.elapsed() < 0.004:
        timer.pause()  # spin window: returns at once
        spins += 1
    assert spins > 10
    while not timer.expired():
        timer.pause()
    assert 0.05 <= timer.elapsed() < 0.05 + 0.1  # the last sleep is cut to the deadline
    assert timer.remaining() == 0.0
    assert SpinTimer(None).remaining() is None and not SpinTimer(None).expired()
    with pytest.raises(ValueError, match="timeout"):
        SpinTimer(-1)
    with pytest.raises(ValueError, match="SpinPolicy"):
        SpinPolicy(max_sleep_s=1e-6)
