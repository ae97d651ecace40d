"""Real sockets between real hosts: ``retexo worker`` nodes in separate network namespaces, each with
its own address on a bridge and its egress shaped by ``tc tbf``, train exactly what ``retexo train``
trains, and every byte the ranks of a node log as sent went through that node's shaped interface.

Skipped without root or iproute2; every namespace is removed even when a test fails."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch

from conftest import CORA_DIR, cli_env, run_cli, run_together
from graphstore.ingest.api import ingest_planetoid
from graphstore.layout import Store
from netns import netns_missing, own_prefix, sites
from processes import cpu_share

pytestmark = [pytest.mark.slow, pytest.mark.skipif(netns_missing() is not None, reason=str(netns_missing()))]
TIMEOUT_S = 600
BANDWIDTH_MBIT = 200


def namespace_names() -> set[str]:
    """The namespaces this process made (other test workers may be making their own meanwhile)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return {line.split()[0] for line in listed.splitlines() if line.startswith(own_prefix())}


def test_sites_talk_over_tcp_between_their_addresses_and_are_removed_even_on_failure() -> None:
    before = namespace_names()
    with pytest.raises(RuntimeError, match="the body failed"):
        with sites(2) as (first, second):
            assert namespace_names() - before == {first.name, second.name}
            server = subprocess.Popen(first.command(
                sys.executable, "-c",
                f"import socket\ns = socket.create_server(('{first.address}', 5005))\nc, peer = s.accept()\n"
                "print(peer[0], len(c.recv(100)))"), stdout=subprocess.PIPE, text=True)
            try:
                client = subprocess.run(second.command(
                    sys.executable, "-c",
                    "import socket, time\nfor _ in range(100):\n    try:\n"
                    f"        c = socket.create_connection(('{first.address}', 5005)); break\n"
                    "    except OSError:\n        time.sleep(0.05)\nc.sendall(b'hello')"), timeout=30)
                assert client.returncode == 0
                assert server.communicate(timeout=30)[0].split() == [second.address, "5"]
            finally:
                server.kill()
            raise RuntimeError("the body failed")
    assert namespace_names() == before


def test_two_nodes_in_namespaces_train_what_retexo_train_trains(tmp_path: Path) -> None:
    store = tmp_path / "store"
    ingest_planetoid(Store.open(store), CORA_DIR, "cora")
    reference = tmp_path / "reference"
    shutil.copytree(store, reference)
    job = tmp_path / "job.yaml"
    job.write_text(f"dataset: {{name: cora, source: planetoid, path: {CORA_DIR}}}\n"
                   "partition: {method: random, parts: 2}\n"
                   "train: {hidden: 16, rounds: 30, timeout_s: 60, choose_depth: false}\n")
    env = {**cli_env(), "GLOO_SOCKET_IFNAME": "eth0"}
    with sites(2, bandwidth_mbit=BANDWIDTH_MBIT) as hosts:
        master = hosts[0].address
        nodes = run_together([site.command(sys.executable, "-m", "cli", "worker", str(job), "--nnodes", "2",
                                           "--node-rank", str(k), "--master-addr", master, "--master-port", "29510",
                                           "--store", str(store)) for k, site in enumerate(hosts)], env, TIMEOUT_S,
                             [cpu_share(k, len(hosts)) for k in range(len(hosts))])
        assert [node.returncode for node in nodes] == [0, 0], [node.stderr[-1500:] for node in nodes]
        shaped = [subprocess.run(site.command("tc", "-s", "qdisc", "show", "dev", "eth0"), capture_output=True,
                                 text=True, timeout=30).stdout for site in hosts]
    trained = run_cli("train", "cora", "--parts", 2, "--partition-method", "random", "--hidden", 16, "--rounds", 30,
                      "--timeout", 60, "--no-choose-depth", store=reference, timeout=TIMEOUT_S)
    assert trained.returncode == 0, trained.stderr
    (run,), (expected,) = store.glob("runs/run=*"), reference.glob("runs/run=*")
    assert run.name == expected.name
    for layer in (1, 2):
        ours, theirs = (torch.load(r / f"layer={layer}" / "model.pt") for r in (run, expected))
        assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    comm = pq.read_table(run / "comm.parquet")
    assert comm.equals(pq.read_table(expected / "comm.parquet"))
    for rank, stats in enumerate(shaped):
        assert "tbf" in stats and f"rate {BANDWIDTH_MBIT}Mbit" in stats, stats
        wire = int(re.search(r"Sent (\d+) bytes", stats).group(1))  # type: ignore[union-attr]
        logged = pc.sum(pc.filter(comm.column("bytes"), pc.equal(comm.column("src"), rank))).as_py()
        assert wire >= logged > 0  # the payload the rank logged, plus headers, crossed its shaped link
