"""Every socket a job listens on binds to the address its ranks use (``MASTER_ADDR``), not to every interface.

A one-machine job's ranks talk over ``MASTER_ADDR=127.0.0.1``, yet torch's listeners do not follow it:

- the rendezvous store's server (``TCPStore``, hosted by rank 0 inside ``init_process_group``) binds
  ``[::]:MASTER_PORT`` whatever ``host_name`` says — torch 2.13 has no bind-address option, only
  ``master_listen_fd``, a socket the caller has bound and listens on. :func:`host_store` passes one bound to
  the ranks' address; the store is multi-tenant, so the store ``init_process_group`` creates on the same port
  in the same process shares that server instead of binding again;
- gloo binds each process group's listener to the address the machine's host name resolves to (its LAN
  address on most machines), unless ``GLOO_SOCKET_IFNAME`` names an interface;
- TensorPipe's RPC agents (``strategy=ps``) do the same, unless ``TP_SOCKET_IFNAME`` names one.

For a job whose ranks all run on this machine, :func:`bind_listeners` points all three at the interface of
``MASTER_ADDR`` (loopback for ``127.0.0.1``). For several machines only the store follows ``MASTER_ADDR``
(when it is an address of this machine); gloo and TensorPipe keep their choice, the host name's address,
which is one interface already, and ``GLOO_SOCKET_IFNAME``/``TP_SOCKET_IFNAME`` choose another.
A value the user set is never replaced.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from datetime import timedelta
from typing import Any

_SIOCGIFFLAGS = 0x8913
_SIOCGIFADDR = 0x8915
_IFF_LOOPBACK = 0x8
_hosted: dict[int, Any] = {}  # port → this process's handle on the store server it hosts (keeps it alive)


def listen_address(master_addr: str, one_machine: bool) -> str | None:
    """The address of this machine that the ranks reach as ``master_addr``, or None (leave torch's default).

    None when ``master_addr`` does not resolve, is the unspecified address, is not an address of this
    machine, or is a loopback address while other machines take part (their ranks could not reach it).
    """
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(master_addr, None, type=socket.SOCK_STREAM)[0]
    except (OSError, UnicodeError):
        return None
    address = ipaddress.ip_address(sockaddr[0])
    if address.is_unspecified or (address.is_loopback and not one_machine):
        return None
    try:  # an address of this machine is one a socket can bind to
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((str(address), 0))
    except OSError:
        return None
    return str(address)


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds ``address`` (IPv4; any loopback address → the loopback
    interface), or None."""
    try:
        wanted = ipaddress.ip_address(address)
    except ValueError:
        return None
    if wanted.version != 4:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                if wanted.is_loopback:
                    flags = struct.unpack("H", fcntl.ioctl(sock.fileno(), _SIOCGIFFLAGS, request)[16:18])[0]
                    if flags & _IFF_LOOPBACK:
                        return name
                elif socket.inet_ntoa(fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)[20:24]) == address:
                    return name
            except OSError:  # an interface without an IPv4 address
                continue
    return None


def host_store(address: str, port: int, timeout: timedelta = timedelta(seconds=60)) -> Any | None:
    """Start the job's rendezvous store server on ``address:port`` only (rank 0, before ``init_process_group``).

    Returns the handle (kept here too, until :func:`release_stores`), or None when the port is taken
    (a store already runs there: the early launch's, or another program's — ``init_process_group`` then
    joins it or says why it cannot).
    """
    import torch.distributed as dist

    if port in _hosted:
        return _hosted[port]
    family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a previous job's port in TIME_WAIT
        sock.bind((address, port))
        sock.listen(512)
    except OSError:
        sock.close()
        return None
    # wait_for_workers=False: this handle is not one of the job's ranks. The server owns the socket from
    # now on (detach: Python must not close it a second time).
    store = dist.TCPStore(address, port, is_master=True, wait_for_workers=False, multi_tenant=True,
                          master_listen_fd=sock.detach(), timeout=timeout)
    _hosted[port] = store
    return store


def release_stores() -> None:
    """Drop this process's handles: a server stops once the process group's own handle is gone too."""
    _hosted.clear()


def bind_listeners(master_addr: str, master_port: int, global_rank: int, one_machine: bool) -> str | None:
    """Before the process group exists, on every rank: make its listeners bind to ``master_addr``'s address.

    One machine: gloo's and TensorPipe's listeners on the interface of that address (unless the user chose
    one); rank 0 also hosts the store there. Returns the address used (None: torch's defaults).
    """
    address = listen_address(master_addr, one_machine)
    if address is None:
        return None
    if one_machine:
        interface = interface_of(address)
        if interface:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
            os.environ.setdefault("TP_SOCKET_IFNAME", interface)
    if global_rank == 0:
        host_store(address, master_port)
    return address


def bind_strategy_listeners(strategy: Any) -> str | None:
    """:func:`bind_listeners` for a Lightning strategy about to initialise its process group (outside torchrun).

    The address and port are the ones Lightning's ``init_process_group`` will use (its cluster environment);
    the job is on one machine when its node count is 1.
    """
    env = getattr(strategy, "cluster_environment", None)
    if env is None:
        return None
    strategy.set_world_ranks()  # Lightning does it first thing in setup_distributed too; the rank is needed now
    return bind_listeners(env.main_address, int(env.main_port), strategy.global_rank, strategy.num_nodes == 1)


def listening_sockets(pid: int | str = "self") -> list[str]:
    """The TCP sockets process ``pid`` listens on, as ``ADDRESS:PORT`` (``0.0.0.0``/``[::]``: every interface).

    Read from the kernel, like ``ss -ltnp`` without needing ``ss``: the socket inodes among the process's
    open files, looked up in ``/proc/net/tcp`` and ``/proc/net/tcp6`` (state 0A = LISTEN). Linux only.
    """
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] != "0A" or fields[9] not in inodes:
                    continue
                hex_addr, hex_port = fields[1].split(":")
                raw = bytes.fromhex(hex_addr)
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # each 32-bit word in host order
                address = ipaddress.ip_address(raw)
                if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
                    address = address.ipv4_mapped
                port = int(hex_port, 16)
                found.append(f"{address}:{port}" if address.version == 4 else f"[{address}]:{port}")
    return sorted(found)
