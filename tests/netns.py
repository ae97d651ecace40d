"""Real hosts on one machine: network namespaces joined by veth pairs and a bridge.

``sites(k)`` creates ``k`` namespaces, each with one interface ``eth0`` holding its own address
in a private /24, all plugged into one bridge of the root namespace, optionally with its egress
shaped by a token bucket (``tc qdisc ... tbf``: netem is not available in this kernel). The
namespaces, the bridge and the veth pairs are removed on exit, also when the body fails. Names
carry this process's pid (``own_prefix``) so that concurrent test runs and parallel test workers do
not collide; Linux interface names are at most 15 characters (pids have at most 7 digits).

Needs root and iproute2; ``netns_missing()`` says why not when they are missing, for a skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

TBF_BURST = "32kbit"  # bucket size: a few packets, so the rate holds at short time scales
TBF_LATENCY = "400ms"  # longest a packet may wait in the bucket's queue before it is dropped


@dataclass(frozen=True)
class Site:
    """One namespace: its name, its address on the bridge and the command prefix to run in it."""

    name: str
    address: str

    def command(self, *argv: str) -> list[str]:
        """``argv`` run inside this namespace (same file system, own network)."""
        return ["ip", "netns", "exec", self.name, *argv]


def netns_missing() -> str | None:
    """Why namespaces cannot be made here (None when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"iproute2's `{tool}` is not installed"
    return None


def own_prefix() -> str:
    """The start of the name of every namespace ``sites`` makes in this process."""
    return f"rtx{os.getpid()}s"


def link_name(i: int) -> str:
    """The root namespace's end of site ``i``'s link (``sites``): a capture there sees all its traffic."""
    return f"rv{os.getpid()}h{i}"


def _run(*argv: str) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {result.stderr.strip()}")


@contextmanager
def sites(k: int, bandwidth_mbit: float | None = None, subnet: int = 77) -> Iterator[list[Site]]:
    """``k`` namespaces ``10.<subnet>.<pid % 250>.1 ...k`` on one bridge; egress of every site shaped
    to ``bandwidth_mbit`` (Mbit/s) when given. Everything is removed on exit."""
    tag = f"{os.getpid()}"
    bridge = f"rbr{tag}"
    third = os.getpid() % 250
    made: list[Site] = []
    host_ends: list[str] = []
    try:
        _run("ip", "link", "add", bridge, "type", "bridge")
        _run("ip", "link", "set", bridge, "up")
        for i in range(k):
            site = Site(f"{own_prefix()}{i}", f"10.{subnet}.{third}.{i + 1}")
            host_end, site_end = link_name(i), f"rv{tag}n{i}"
            _run("ip", "netns", "add", site.name)
            made.append(site)
            _run("ip", "link", "add", host_end, "type", "veth", "peer", "name", site_end)
            host_ends.append(host_end)
            _run("ip", "link", "set", host_end, "master", bridge)
            _run("ip", "link", "set", host_end, "up")
            _run("ip", "link", "set", site_end, "netns", site.name)
            _run(*site.command("ip", "link", "set", site_end, "name", "eth0"))
            _run(*site.command("ip", "addr", "add", f"{site.address}/24", "dev", "eth0"))
            _run(*site.command("ip", "link", "set", "eth0", "up"))
            _run(*site.command("ip", "link", "set", "lo", "up"))
            if bandwidth_mbit is not None:
                _run(*site.command("tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate",
                                   f"{bandwidth_mbit:g}mbit", "burst", TBF_BURST, "latency", TBF_LATENCY))
        yield made
    finally:  # pairs first: deleting a namespace removes its interfaces only later, in the background
        for name in host_ends:
            subprocess.run(["ip", "link", "del", name], capture_output=True, timeout=30)
        for site in made:
            subprocess.run(["ip", "netns", "del", site.name], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True, timeout=30)
