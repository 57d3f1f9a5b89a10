"""A torch.distributed key-value store that only peers holding the run's CURVE key can reach."""

from __future__ import annotations

import itertools
import struct
import threading
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist
import zmq

from hybridllm.distributed.curve_auth import CurveKeys, CurveServer, secure_client

_POLL_MS = 100  # how often the server thread looks at its stop flag
_ID = struct.Struct("<Q")


@dataclass(frozen=True)
class StoreHandle:
    """What a worker needs to join: the server's address and the run's CURVE keys (a secret)."""

    address: str  # tcp://host:port
    curve: CurveKeys = field(repr=False)


class StoreServer:
    """The store's data and the thread that serves it; lives in the engine process.

    torch's TCPStore admits anyone who connects (and lists its keys), so rendezvous across
    nodes goes through this store instead: a ZeroMQ ROUTER socket bound to the cluster
    interface, secured with CURVE whose ZAP handler admits only the run's client key. gloo
    and NCCL learn each other's addresses from it and nothing else. Keys and values travel
    as raw frames: nothing here is unpickled.
    """

    def __init__(self, host: str) -> None:
        self._ctx = zmq.Context()
        self._curve = CurveServer(self._ctx)
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._curve.secure(self._sock)
        self._sock.bind(f"tcp://{host}:*")
        self.handle = StoreHandle(self._sock.getsockopt_string(zmq.LAST_ENDPOINT), self._curve.keys)
        self._data: dict[bytes, bytes] = {}
        self._pending: list[tuple[list[bytes], bytes, bytes, list[bytes]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="hybridllm-store", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(_POLL_MS, zmq.POLLIN):
                continue
            route, req_id, op, *args = _split(self._sock.recv_multipart())
            self._handle(route, req_id, op, args)

    def _handle(self, route: list[bytes], req_id: bytes, op: bytes, args: list[bytes]) -> None:
        data = self._data
        if op in (b"get", b"wait", b"mget"):
            self._pending.append((route, req_id, op, args))
            self._answer_pending()
            return
        if op == b"set":
            data[args[0]] = args[1]
            reply = [b""]
        elif op == b"add":
            value = int(data.get(args[0], b"0")) + int(args[1])
            data[args[0]] = str(value).encode()
            reply = [data[args[0]]]
        elif op == b"cas":
            key, expected, desired = args
            current = data.get(key)
            if (current is None and expected == b"") or current == expected:
                data[key] = desired
            reply = [data.get(key, expected)]
        elif op == b"append":
            data[args[0]] = data.get(args[0], b"") + args[1]
            reply = [b""]
        elif op == b"mset":
            data.update(zip(args[0::2], args[1::2]))
            reply = [b""]
        elif op == b"check":
            reply = [b"1" if all(k in data for k in args) else b"0"]
        elif op == b"del":
            reply = [b"1" if data.pop(args[0], None) is not None else b"0"]
        elif op == b"num":
            reply = [str(len(data)).encode()]
        else:
            reply = [b"unknown op"]
            req_id = b"!" + req_id
        self._sock.send_multipart([*route, b"", req_id, *reply])
        self._answer_pending()

    def _answer_pending(self) -> None:
        """Answer the blocking reads whose keys now all exist."""
        still = []
        for route, req_id, op, keys in self._pending:
            if all(k in self._data for k in keys):
                values = [self._data[k] for k in keys] if op != b"wait" else [b""]
                self._sock.send_multipart([*route, b"", req_id, *values])
            else:
                still.append((route, req_id, op, keys))
        self._pending = still

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self._curve.stop()
        self._sock.close(linger=0)
        self._ctx.term()


class AuthStore(dist.Store):
    """The client side, as a torch.distributed Store (one per worker process)."""

    def __init__(self, handle: StoreHandle, timeout: timedelta = timedelta(seconds=300)):
        super().__init__()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        secure_client(self._sock, handle.curve)
        self._sock.connect(handle.address)
        self._handle = handle
        self._clones: list[AuthStore] = []
        self._ids = itertools.count()
        self._lock = threading.Lock()  # gloo may call from its own threads
        self._timeout = timeout

    def _call(self, op: bytes, *args: bytes, timeout: timedelta | None = None) -> list[bytes]:
        limit = (timeout or self._timeout).total_seconds()
        with self._lock:
            req_id = _ID.pack(next(self._ids))
            self._sock.send_multipart([b"", req_id, op, *args])
            while True:
                if not self._sock.poll(int(limit * 1000), zmq.POLLIN):
                    raise TimeoutError(
                        f"store {op.decode()} {[a[:64] for a in args[:1]]} got no answer in "
                        f"{limit:.0f} s"
                    )
                _, got_id, *reply = self._sock.recv_multipart()
                if got_id == req_id:
                    return reply
                if got_id == b"!" + req_id:
                    raise RuntimeError(f"store does not know operation {op!r}")
                # a reply to an earlier request that timed out: drop it

    def set(self, key: str, value: bytes | str) -> None:
        self._call(b"set", _b(key), _b(value))

    def get(self, key: str) -> bytes:
        return self._call(b"get", _b(key))[0]

    def add(self, key: str, value: int) -> int:
        return int(self._call(b"add", _b(key), str(value).encode())[0])

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return self._call(b"cas", _b(key), _b(expected), _b(desired))[0]

    def append(self, key: str, value: bytes | str) -> None:
        self._call(b"append", _b(key), _b(value))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._call(b"mget", *map(_b, keys))

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        self._call(b"mset", *(_b(x) for kv in zip(keys, values) for x in kv))

    def check(self, keys: list[str]) -> bool:
        return self._call(b"check", *map(_b, keys))[0] == b"1"

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._call(b"wait", *map(_b, keys), timeout=timeout)

    def delete_key(self, key: str) -> bool:
        return self._call(b"del", _b(key))[0] == b"1"

    def num_keys(self) -> int:
        return int(self._call(b"num")[0])

    # the names torch's C++ trampoline looks up for its pure virtual methods
    deleteKey = delete_key  # noqa: N815
    getNumKeys = num_keys  # noqa: N815

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    @property
    def timeout(self) -> timedelta:
        return self._timeout

    def clone(self) -> AuthStore:
        """A new connection to the same store (gloo keeps one per background thread)."""
        clone = AuthStore(self._handle, self._timeout)
        self._clones.append(clone)  # the C++ side does not keep the Python object alive
        return clone

    def has_extended_api(self) -> bool:
        return True

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()


def _split(frames: list[bytes]) -> list:
    """ROUTER frames [routing ids..., b"", body...] -> [routing ids, *body]."""
    i = frames.index(b"")
    return [frames[:i], *frames[i + 1 :]]


def _b(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
