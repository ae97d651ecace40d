"""The rendezvous a launch hosts listens on the address it is given, not on every interface."""

from __future__ import annotations

import socket
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from runner.launch import free_port
from runner.worker import connect_rendezvous


def listening_addresses(port: int) -> set[str]:
    """Local IPv4 addresses of this network namespace's listening TCP sockets on ``port`` (/proc/net/tcp)."""
    found = set()
    with open("/proc/net/tcp") as table:
        for line in list(table)[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.add(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
    return found


def test_the_host_listens_on_master_addr_only() -> None:
    port = free_port()
    job = SimpleNamespace(master_addr="127.0.0.1", master_port=port, timeout=timedelta(seconds=5))
    store = connect_rendezvous(job, host=True, wait_for_workers=False)
    try:
        assert listening_addresses(port) == {"127.0.0.1"}
        connect_rendezvous(job, host=False).set("joined", "yes")
        assert store.get("joined") == b"yes"
        # 127.0.0.2 is this machine too (the loopback interface holds all of 127/8): a server on every
        # interface would accept it
        with socket.socket() as other, pytest.raises(ConnectionRefusedError):
            other.settimeout(5)
            other.connect(("127.0.0.2", port))
        with pytest.raises(dist.DistNetworkError, match=f"cannot listen on 127.0.0.1:{port}"):
            connect_rendezvous(job, host=True, wait_for_workers=False)
    finally:
        del store
