"""parallelkit.distributed.listeners: which address a job's listeners bind to, and the kernel's view of them."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest

from parallelkit.distributed import listeners


def test_listen_address_follows_master_addr():
    assert listeners.listen_address("127.0.0.1", one_machine=True) == "127.0.0.1"
    assert listeners.listen_address("localhost", one_machine=True) in ("127.0.0.1", "::1")
    # Other machines could not reach a loopback address: torch's default stays.
    assert listeners.listen_address("127.0.0.1", one_machine=False) is None
    assert listeners.listen_address("0.0.0.0", one_machine=True) is None  # the user asked for every interface
    assert listeners.listen_address("192.0.2.123", one_machine=True) is None  # TEST-NET: not this machine's
    assert listeners.listen_address("no-such-host.invalid", one_machine=True) is None


@pytest.mark.skipif(not hasattr(socket, "if_nameindex"), reason="needs interface names")
def test_interface_of_loopback():
    name = listeners.interface_of("127.0.0.1")
    assert name is not None
    assert listeners.interface_of("192.0.2.123") is None


def test_listening_sockets_sees_a_wildcard_and_a_loopback_listener():
    """The kernel's view the integration test relies on: a socket on every interface is reported as such."""
    with socket.socket() as everywhere, socket.socket() as loopback:
        everywhere.bind(("0.0.0.0", 0))
        everywhere.listen()
        loopback.bind(("127.0.0.1", 0))
        loopback.listen()
        wide, narrow = everywhere.getsockname()[1], loopback.getsockname()[1]
        found = listeners.listening_sockets()
        assert f"0.0.0.0:{wide}" in found
        assert f"127.0.0.1:{narrow}" in found
    assert f"0.0.0.0:{wide}" not in listeners.listening_sockets()  # closed: gone


def test_hosted_store_listens_on_the_address_only_and_is_shared():
    """The store torch's init_process_group creates on the same port joins the hosted server (multi-tenant)
    instead of binding [::]:port beside it."""
    import torch.distributed as dist

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    hosted = listeners.host_store("127.0.0.1", port, timeout=timedelta(seconds=10))
    try:
        assert hosted is not None
        assert listeners.host_store("127.0.0.1", port) is hosted  # once per port
        second = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, multi_tenant=True, timeout=timedelta(seconds=10))
        second.set("k", "v")
        assert hosted.get("k") == b"v"
        mine = [s for s in listeners.listening_sockets() if s.endswith(f":{port}")]
        assert mine == [f"127.0.0.1:{port}"], mine
        del second
    finally:
        listeners.release_stores()
        del hosted
