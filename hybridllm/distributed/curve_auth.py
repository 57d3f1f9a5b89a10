"""ZeroMQ CURVE for our TCP sockets: fresh key pairs and a ZAP handler admitting one client key."""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field
from typing import Any

import zmq


@dataclass(frozen=True)
class CurveKeys:
    """Z85 CURVE keys a client needs to connect to one of our TCP sockets.

    The client key pair is the per-run secret a peer proves it holds: the server's ZAP
    handler admits no other client. Send these only over a channel as private as the data.
    """

    server_public: bytes
    client_public: bytes
    client_secret: bytes = field(repr=False)


class CurveServer:
    """The server side's keys and its ZAP handler thread (one per zmq context)."""

    def __init__(self, ctx: zmq.Context) -> None:
        if not zmq.has("curve"):
            raise RuntimeError(
                "remote peers need libzmq built with CURVE security (pyzmq's wheels include "
                "it); without it their TCP sockets could not be kept private"
            )
        from zmq.auth.thread import ThreadAuthenticator  # imports asyncio: only when needed

        server_public, self.server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        self.keys = CurveKeys(server_public, client_public, client_secret)
        self._authenticator: Any = ThreadAuthenticator(ctx)
        self._authenticator.start()  # before any bind: ZAP must be in place for the handshakes
        # without a handler libzmq would accept any client that knows the server key
        self._authenticator.configure_curve_callback("*", _OneClientKey(client_public))

    def secure(self, sock: zmq.Socket) -> None:
        """Make `sock` (not yet bound) a CURVE server behind this handler."""
        sock.curve_server = True
        sock.curve_secretkey = self.server_secret

    def stop(self) -> None:
        """Stop the handler thread; its sockets belong to the context, which would wait."""
        self._authenticator.stop()


def secure_client(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make `sock` (not yet connected) a CURVE client holding the run's key pair."""
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret


class _OneClientKey:
    """ZAP credentials provider: admits the one client public key (Z85) it was given."""

    def __init__(self, client_public: bytes) -> None:
        self._key = client_public

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self._key)
