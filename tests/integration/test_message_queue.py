"""MessageQueue across real spawned processes: order, overflow, throttling, failures, cleanup."""

import gc
import hashlib
import multiprocessing as mp
import os
import pickle
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from hybridllm.distributed.message_queue import (
    MessageQueue,
    ReaderDiedError,
    WriterDiedError,
    cleanup_stale_socket_dirs,
)
from hybridllm.distributed.shm_segment import SHM_DIR, cleanup_stale_segments
from hybridllm.engine.scheduler_output import CachedRequestData, SchedulerOutput
from tests.waiting import wait_until

SPAWN = mp.get_context("spawn")
REPO_ROOT = Path(__file__).resolve().parents[2]
RESULT_TIMEOUT_S = 30


def _exists(name: str) -> bool:
    return os.path.exists(os.path.join(SHM_DIR, name))


def _socket_dir(address: str) -> str:
    """The directory holding a local reader's ipc:// socket."""
    assert address.startswith("ipc://")
    return os.path.dirname(address[len("ipc://") :])


def _message(i: int):
    """Message i of a stream: mostly a small SchedulerOutput, every 10th one too big for a
    4 KiB chunk (a 20 KB array, so the overflow path interleaves with the ring)."""
    if i % 10 == 9:
        return {"i": i, "array": np.full(5000, i, dtype=np.int32)}
    # two KV cache groups (a full and a sliding one): a block table each
    cached = CachedRequestData(f"req-{i}", [i], ([i // 16], [i // 32]), num_computed_tokens=i)
    return SchedulerOutput(
        scheduled_cached_reqs=[cached],
        num_scheduled_tokens={f"req-{i}": 1},
        total_num_scheduled_tokens=i,
    )


def _index_of(message) -> int:
    """The i of `_message(i)`, after checking the whole message is intact."""
    if isinstance(message, dict):
        i = message["i"]
        assert np.array_equal(message["array"], np.full(5000, i, dtype=np.int32))
        return i
    assert message == _message(message.total_num_scheduled_tokens)
    return message.total_num_scheduled_tokens


def _stream_reader(handle, rank, n_messages, delay_s, results):
    with MessageQueue.attach(handle, rank) as queue:
        received = []
        for _ in range(n_messages):
            received.append(_index_of(queue.dequeue(timeout=RESULT_TIMEOUT_S)))
            time.sleep(delay_s)  # a slow reader on purpose: it throttles the writer
    results.put((rank, received))


def _run_stream(queue, n_messages, delays):
    results = SPAWN.Queue()
    readers = [
        SPAWN.Process(
            target=_stream_reader,
            args=(queue.export_handle(), rank, n_messages, delay, results),
        )
        for rank, delay in enumerate(delays)
    ]
    for p in readers:
        p.start()
    start = time.monotonic()
    for i in range(n_messages):
        queue.enqueue(_message(i), timeout=RESULT_TIMEOUT_S)
    enqueue_s = time.monotonic() - start
    received = dict(results.get(timeout=RESULT_TIMEOUT_S) for _ in readers)
    for p in readers:
        p.join(timeout=RESULT_TIMEOUT_S)
        assert p.exitcode == 0
    return received, enqueue_s


def test_four_readers_get_every_message_in_order_through_wraparound_and_overflow():
    with MessageQueue(4, max_chunk_bytes=4096, max_chunks=4) as queue:
        name = queue.export_handle().shm_name
        received, _ = _run_stream(queue, n_messages=200, delays=[0.0] * 4)
    assert received == {rank: list(range(200)) for rank in range(4)}
    assert not _exists(name)


def test_slow_reader_throttles_writer_and_nothing_is_lost():
    n_messages, max_chunks, delay_s = 30, 2, 0.02
    with MessageQueue(2, max_chunk_bytes=4096, max_chunks=max_chunks) as queue:
        received, enqueue_s = _run_stream(queue, n_messages, delays=[0.0, delay_s])
    assert received == {0: list(range(n_messages)), 1: list(range(n_messages))}
    # the writer can only be max_chunks messages ahead of the slow reader
    assert enqueue_s >= (n_messages - max_chunks - 1) * delay_s


def _big_reader(handle, rank, results):
    with MessageQueue.attach(handle, rank) as queue:
        array, blob, step = (queue.dequeue(timeout=RESULT_TIMEOUT_S) for _ in range(3))
    results.put(
        (
            rank,
            hashlib.sha256(array).hexdigest(),
            array.shape,
            hashlib.sha256(blob).hexdigest(),
            step,
        )
    )


def test_oversized_messages_arrive_intact_for_local_and_remote_readers():
    array = np.random.default_rng(0).standard_normal(5 * 2**20 // 8)  # 5 MiB of float64
    blob = os.urandom(5 * 2**20)
    expected = (hashlib.sha256(array).hexdigest(), array.shape, hashlib.sha256(blob).hexdigest())
    step = _message(3)
    results = SPAWN.Queue()
    with MessageQueue(2, remote_reader_ranks=[1]) as queue:  # 1 MiB chunks
        handle = queue.export_handle()
        assert handle.local_reader_ranks == (0,)
        local_address, remote_address = handle.reader_addresses
        assert local_address.startswith("ipc://") and remote_address.startswith("tcp://127.0.0.1:")
        readers = [SPAWN.Process(target=_big_reader, args=(handle, r, results)) for r in (0, 1)]
        for p in readers:
            p.start()
        queue.enqueue(array, timeout=RESULT_TIMEOUT_S)
        array[:] = 0  # enqueue returned: the frames no longer alias the array
        queue.enqueue(blob, timeout=RESULT_TIMEOUT_S)
        queue.enqueue(step, timeout=RESULT_TIMEOUT_S)
        got = dict((r[0], r[1:]) for r in (results.get(timeout=RESULT_TIMEOUT_S) for _ in readers))
        for p in readers:
            p.join(timeout=RESULT_TIMEOUT_S)
    assert got == {0: (*expected, step), 1: (*expected, step)}


def test_all_remote_readers_need_no_segment():
    with MessageQueue(1, max_chunk_bytes=4096, remote_reader_ranks=[0]) as writer:
        assert writer.export_handle().shm_name is None
        assert writer.is_reader_alive(0) is None  # remote: the executor knows, we cannot
        with MessageQueue.attach(writer.export_handle(), 0) as reader:
            for i in range(12):
                writer.enqueue(_message(i), timeout=5)
            assert [_index_of(reader.dequeue(timeout=5)) for _ in range(12)] == list(range(12))


def test_timeouts_name_the_side_and_the_lagging_reader():
    with MessageQueue(2, max_chunk_bytes=256, max_chunks=2) as writer:
        fast = MessageQueue.attach(writer.export_handle(), 0)
        stuck = MessageQueue.attach(writer.export_handle(), 1)
        with pytest.raises(TimeoutError, match=r"reader 0 waited 0\.1\d* s for message #0"):
            fast.dequeue(timeout=0.1)
        for i in range(2):
            writer.enqueue(i, timeout=1)
            assert fast.dequeue(timeout=1) == i
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=rf"reader\(s\) 1 \(pid {os.getpid()}, alive\)") as e:
            writer.enqueue(2, timeout=0.2)
        assert 0.2 <= time.monotonic() - start < 2 and not isinstance(e.value, ReaderDiedError)
        assert writer.is_reader_alive(1) is True
        stuck.close()  # a closed reader is as good as dead: fail fast, even with no timeout
        with pytest.raises(ReaderDiedError, match=r"1 \(closed by pid"):
            writer.enqueue(2)
        fast.close()


def _attach_and_hang(handle, rank, ready):
    MessageQueue.attach(handle, rank)
    ready.set()
    time.sleep(RESULT_TIMEOUT_S)  # attached and alive until the test kills it


def test_enqueue_raises_when_a_reader_is_killed():
    with MessageQueue(2, max_chunk_bytes=256, max_chunks=2) as writer:
        live = MessageQueue.attach(writer.export_handle(), 0)
        ready = SPAWN.Event()
        victim = SPAWN.Process(target=_attach_and_hang, args=(writer.export_handle(), 1, ready))
        victim.start()
        assert ready.wait(RESULT_TIMEOUT_S)
        for i in range(2):
            writer.enqueue(i)
            assert live.dequeue(timeout=5) == i
        victim.kill()  # not reaped: a zombie must count as dead too
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=rf"reader\(s\) 1 \(pid {victim.pid}, dead\)") as e:
            writer.enqueue(2, timeout=RESULT_TIMEOUT_S)
        assert isinstance(e.value, ReaderDiedError) and time.monotonic() - start < 5
        assert writer.is_reader_alive(1) is False and writer.is_reader_alive(0) is True
        victim.join()
        live.close()


def _writer_then_hang(handles, fail):
    queue = MessageQueue(1, max_chunk_bytes=4096)
    handles.put(queue.export_handle())
    queue.enqueue("hello", timeout=RESULT_TIMEOUT_S)
    if fail:
        raise RuntimeError("writer crashed on purpose (test)")
    time.sleep(RESULT_TIMEOUT_S)  # alive until the test kills it


def test_writer_exception_unlinks_segment():
    handles = SPAWN.Queue()
    writer = SPAWN.Process(target=_writer_then_hang, args=(handles, True))
    writer.start()
    name = handles.get(timeout=RESULT_TIMEOUT_S).shm_name
    writer.join(timeout=RESULT_TIMEOUT_S)
    assert writer.exitcode == 1
    assert not _exists(name)


def test_killed_writer_is_detected_and_its_segment_cleaned_up():
    handles = SPAWN.Queue()
    writer = SPAWN.Process(target=_writer_then_hang, args=(handles, False))
    writer.start()
    handle = handles.get(timeout=RESULT_TIMEOUT_S)
    with MessageQueue.attach(handle, 0) as reader:
        assert reader.dequeue(timeout=RESULT_TIMEOUT_S) == "hello"
        writer.kill()
        writer.join()
        start = time.monotonic()
        with pytest.raises(WriterDiedError, match=f"writer \\(pid {writer.pid}\\) died"):
            reader.dequeue()  # no timeout: must not hang
        assert time.monotonic() - start < 5
    assert _exists(handle.shm_name)  # SIGKILL: nobody could unlink it
    assert handle.shm_name in cleanup_stale_segments()
    assert not _exists(handle.shm_name)
    socket_dir = _socket_dir(handle.reader_addresses[0])
    assert os.path.isdir(socket_dir)  # nor remove its socket directory
    with MessageQueue(1) as live:
        assert socket_dir in cleanup_stale_socket_dirs()
        assert not os.path.exists(socket_dir)
        # a live writer's directory stays
        assert os.path.isdir(_socket_dir(live.export_handle().reader_addresses[0]))


def test_close_gc_and_interpreter_exit_unlink_segment():
    queue = MessageQueue(1)
    name = queue.export_handle().shm_name
    queue.close()
    assert not _exists(name)
    with pytest.raises(RuntimeError, match="closed"):
        queue.enqueue(1)
    with pytest.raises(FileNotFoundError, match="writer closed it or died"):
        MessageQueue.attach(queue.export_handle(), 0)

    queue = MessageQueue(1)
    name = queue.export_handle().shm_name
    socket_dir = _socket_dir(queue.export_handle().reader_addresses[0])
    del queue
    gc.collect()
    assert not _exists(name) and not os.path.exists(socket_dir)

    code = (
        "from hybridllm.distributed.message_queue import MessageQueue\n"
        "queue = MessageQueue(2, remote_reader_ranks=[1])\n"  # never closed: the exit
        "handle = queue.export_handle()\n"  # finalizer must unlink and remove everything
        "print(handle.shm_name, handle.reader_addresses[0])\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    name, address = out.stdout.split()
    assert name.startswith("hybridllm_") and not _exists(name)
    assert not os.path.exists(_socket_dir(address))
    assert out.stderr == ""


def test_misuse_is_reported_clearly():
    with MessageQueue(2, max_chunk_bytes=4096) as writer:
        with pytest.raises(RuntimeError, match="dequeue called on the writer's end"):
            writer.dequeue(timeout=0)
        with pytest.raises(TypeError, match="export_handle"):
            pickle.dumps(writer)
        with pytest.raises(ValueError, match="reader_rank 2 not in"):
            MessageQueue.attach(writer.export_handle(), 2)
    with pytest.raises(ValueError, match="remote_reader_ranks"):
        MessageQueue(2, remote_reader_ranks=[5])


def test_local_sockets_are_private_to_the_writer_uid():
    with MessageQueue(2, max_chunk_bytes=4096) as writer:
        handle = writer.export_handle()
        dirs = {_socket_dir(a) for a in handle.reader_addresses}
        assert len(dirs) == 1
        socket_dir = dirs.pop()
        st = os.stat(socket_dir)
        # 0700: no other user can reach (connect to) the sockets inside
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
        assert all(
            stat.S_ISSOCK(os.stat(a[len("ipc://") :]).st_mode) for a in handle.reader_addresses
        )
        shm = os.stat(os.path.join(SHM_DIR, handle.shm_name))
        assert stat.S_IMODE(shm.st_mode) == 0o600 and shm.st_uid == os.geteuid()
        readers = [MessageQueue.attach(handle, r) for r in range(2)]
        big = np.arange(10_000)  # larger than a chunk: travels over the ipc sockets
        writer.enqueue(big, timeout=5)
        for reader in readers:
            assert np.array_equal(reader.dequeue(timeout=5), big)
            reader.close()
    assert not os.path.exists(socket_dir)


_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


def _stranger(ctx: zmq.Context, address: str, curve_server_key: bytes | None = None):
    """A PULL socket of someone who knows the address (and maybe the writer's public key)
    but not the client key pair in the handle, and a monitor of its handshakes' outcomes."""
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    if curve_server_key is not None:
        sock.curve_serverkey = curve_server_key
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
    # monitored before it connects, so the first handshake's outcome is not missed
    monitor = sock.get_monitor_socket(_HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sock.connect(address)
    return sock, monitor


def test_remote_reader_socket_admits_only_the_handle_keys():
    ctx = zmq.Context()
    with MessageQueue(1, max_chunk_bytes=4096, remote_reader_ranks=[0]) as writer:
        handle = writer.export_handle()
        address = handle.reader_addresses[0]
        assert address.startswith("tcp://127.0.0.1:")
        assert handle.curve.client_secret not in repr(handle).encode()
        strangers = [_stranger(ctx, address), _stranger(ctx, address, handle.curve.server_public)]
        monitors = [monitor for _, monitor in strangers]
        wait_until(
            lambda: all(m.poll(0) for m in monitors), 10, "a stranger's handshake has no outcome"
        )
        outcomes = [recv_monitor_message(m)["event"] for m in monitors]
        assert all(event & _HANDSHAKE_FAILED for event in outcomes), outcomes
        with MessageQueue.attach(handle, 0) as reader:
            # A PUSH socket deals messages round-robin among its peers: had a stranger been
            # admitted, it would take some of them and the reader would see gaps.
            for i in range(20):
                writer.enqueue(_message(i), timeout=5)
            assert [_index_of(reader.dequeue(timeout=5)) for _ in range(20)] == list(range(20))
        for sock, monitor in strangers:
            assert sock.poll(200, zmq.POLLIN) == 0
            sock.disable_monitor()
            monitor.close()  # a socket left open would hang ctx.term()
            sock.close()
    ctx.term()
