"""Joining torch.distributed across nodes: the authenticated store and the cluster interface."""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from datetime import timedelta

import torch.distributed as dist

from hybridllm.distributed.auth_store import AuthStore, StoreHandle

DEFAULT_TIMEOUT_S = 600.0
_SIOCGIFADDR = 0x8915  # ioctl: an interface's IPv4 address


class World:
    """This process's membership of the workers' torch.distributed world (gloo by default).

    The rendezvous goes through `AuthStore`, which only peers holding the run's key can
    reach; gloo and NCCL listen on the interface that carries `host` (GLOO_SOCKET_IFNAME
    and NCCL_SOCKET_IFNAME, unless the user set them), not on every interface.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        store: StoreHandle,
        host: str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        interface = interface_for_address(host)
        if interface is not None:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)
        self.store = AuthStore(store, timedelta(seconds=timeout_s))  # kept: see AuthStore.clone
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialised in this worker process")
        dist.init_process_group(
            "gloo",
            store=self.store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        self.store.close()


def interface_for_address(host: str) -> str | None:
    """The name of the network interface holding IPv4 address `host` (None: not found,
    not IPv4, or a loopback address, where gloo's own choice is right)."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if address.version != 4 or address.is_loopback:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
            except OSError:
                continue  # no IPv4 address on this interface
            if socket.inet_ntoa(reply[20:24]) == host:
                return name
    return None
