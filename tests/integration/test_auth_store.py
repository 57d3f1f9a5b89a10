"""The rendezvous store of multi-node runs answers only peers holding the run's CURVE key."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import zmq

from hybridllm.distributed.auth_store import AuthStore, StoreServer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def server():
    s = StoreServer("127.0.0.1")
    yield s
    s.close()


def test_store_operations_for_a_key_holder(server):
    store = AuthStore(server.handle, timedelta(seconds=5))
    try:
        store.set("a", b"1")
        assert store.get("a") == b"1"
        assert store.add("n", 3) == 3 and store.add("n", 2) == 5
        assert store.compare_set("c", b"", b"x") == b"x"
        assert store.compare_set("c", b"wrong", b"y") == b"x"
        assert store.check(["a", "n"]) and not store.check(["a", "missing"])
        assert store.multi_get(["a", "c"]) == [b"1", b"x"]
        # a blocking get returns once another client sets the key
        other = AuthStore(server.handle, timedelta(seconds=5))
        timer = threading.Timer(0.2, other.set, ("late", b"v"))
        timer.start()
        assert store.get("late") == b"v"
        timer.join()
        other.close()
        assert store.delete_key("a") and not store.check(["a"])
        with pytest.raises(TimeoutError):
            store.wait(["never"], timedelta(seconds=0.3))
    finally:
        store.close()


def _stranger(ctx: zmq.Context, address: str, server_public: bytes | None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if server_public is not None:  # knows the server's public key, not the run's client key
        sock.curve_serverkey = server_public
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
    sock.connect(address)
    return sock


def test_a_peer_without_the_key_can_neither_write_nor_read(server):
    ctx = zmq.Context()
    try:
        for key in (None, server.handle.curve.server_public):
            sock = _stranger(ctx, server.handle.address, key)
            sock.send_multipart([b"", b"\0" * 8, b"set", b"injected", b"1"])
            sock.send_multipart([b"", b"\1" * 8, b"num"])
            assert not sock.poll(1000, zmq.POLLIN), "the store answered a stranger"
            sock.close()
    finally:
        # closes a socket a failed assertion left open (term alone would wait on it forever)
        ctx.destroy(linger=0)
    store = AuthStore(server.handle, timedelta(seconds=5))
    assert not store.check(["injected"]) and store.num_keys() == 0
    store.close()
