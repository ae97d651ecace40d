"""Real links instead of the network model: Cora trained by K sites, each a network namespace with its
own address on a bridge and its egress shaped to ``--bandwidth-mbit`` by ``tc tbf``, the ranks
talking over real TCP (``tests/netns.py``; needs root and iproute2).

Three configurations (4 random parts, the defaults of ``retexo worker`` otherwise): standard,
retexo (gradient sync every round) and retexo with ``--sync avg --sync-every 5 --compress int8``.
Each runs twice in namespaces, unshaped and shaped, from fresh copies of one store. The measured
communication time is the shaped run's wall time minus the unshaped one's (same compute, same
start-up); the simulated time is the project's network model (``retexo_core.comm.network``) for the
same comm log at that bandwidth and zero latency (tbf adds none). ``foreign_opens`` counts the store
files a site's ranks opened that belong to another site's part (partition or layer ``part=<j>``),
from the workers' audit hooks.

    sudo .venv/bin/python benchmarks/network_emulation.py [--bandwidth-mbit 100] [--sites 4]

The last line is ``summary: standard_s=... retexo_s=... retexo_avg_int8_s=...
standard_measured_over_simulated=... retexo_measured_over_simulated=... foreign_opens=...``
(``*_s``: wall seconds of the shaped runs).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import pyarrow.parquet as pq  # noqa: E402

from graphstore.ingest.api import ingest_planetoid  # noqa: E402
from graphstore.layout import Store  # noqa: E402
from graphstore.partition.build import build_partition  # noqa: E402
from graphstore.partition.methods import PartitionOptions  # noqa: E402
from netns import netns_missing, sites  # noqa: E402
from retexo_core.comm.network import NetworkModel, simulated_seconds  # noqa: E402

CONFIGS = {
    "standard": "strategy: standard",
    "retexo": "strategy: retexo",
    "retexo_avg_int8": "strategy: retexo, sync: avg, sync_every: 5, compress: int8",
}
GROUP_PORT = 29520  # the ranks' process group, on site 0's address
TIMEOUT_S = 1800


def preset(folder: Path, name: str, sites_count: int) -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(f"dataset: {{name: cora, source: planetoid, path: {REPO / 'data' / 'cora'}}}\n"
                    f"partition: {{method: random, parts: {sites_count}, seed: 0}}\n"
                    f"train: {{{CONFIGS[name]}, timeout_s: 600}}\n")
    return path


def pin(site: int):  # -> a preexec_fn
    """Site ``site`` runs on one CPU of this machine (round robin), as a machine of its own would
    have its own: its workers then take one torch thread each instead of oversubscribing."""
    cpus = sorted(os.sched_getaffinity(0))
    return lambda: os.sched_setaffinity(0, {cpus[site % len(cpus)]})


def run_sites(job: Path, store: Path, audit: Path, count: int, bandwidth_mbit: float | None) -> float:
    """One training by ``count`` sites in namespaces; wall seconds until every site finished."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "GLOO_SOCKET_IFNAME": "eth0", "COLUMNS": "120"}
    with sites(count, bandwidth_mbit) as hosts:
        started = time.perf_counter()
        nodes = [subprocess.Popen(site.command(sys.executable, "-m", "flows.cli", "worker", str(job),
                                               "--nnodes", str(count), "--node-rank", str(k),
                                               "--master-addr", hosts[0].address, "--master-port", str(GROUP_PORT),
                                               "--audit-dir", str(audit), "--store", str(store)),
                                  cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True, preexec_fn=pin(k))
                 for k, site in enumerate(hosts)]
        try:
            errors = [node.communicate(timeout=TIMEOUT_S)[1] for node in nodes]
        finally:
            for node in nodes:
                node.kill()
        seconds = time.perf_counter() - started
    failed = [(k, e.strip().splitlines()[-1:]) for k, (node, e) in enumerate(zip(nodes, errors)) if node.returncode]
    if failed:
        raise SystemExit(f"sites failed: {failed}")
    return seconds


def foreign_opens(audit: Path) -> int:
    """Store files a rank opened that belong to another rank's part."""
    count = 0
    for listing in audit.glob("rank-*.txt"):
        rank = int(listing.stem.removeprefix("rank-"))
        for path in listing.read_text().split():
            part = re.search(r"/part=(\d+)/", path)
            count += part is not None and int(part.group(1)) != rank
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bandwidth-mbit", type=float, default=100.0)
    parser.add_argument("--sites", type=int, default=4)
    args = parser.parse_args()
    missing = netns_missing()
    if missing is not None:
        raise SystemExit(f"cannot emulate the network here: {missing}")
    work = Path(tempfile.mkdtemp(prefix="retexo-netem-"))
    template = Store.open(work / "template")
    dataset = ingest_planetoid(template, REPO / "data" / "cora", "cora")
    build_partition(template, dataset, PartitionOptions(method="random", parts=args.sites, seed=0))
    model = NetworkModel(latency_ms=0.0, bandwidth_mbps=args.bandwidth_mbit)
    print(f"Cora, {args.sites} sites in network namespaces, egress shaped to {args.bandwidth_mbit:g} Mbit/s (tc tbf)")
    print("| configuration | MB sent | wall s, unshaped | wall s, shaped | measured comm s | simulated comm s "
          "| measured / simulated |")
    print("|---|---|---|---|---|---|---|")
    results: dict[str, tuple[float, float]] = {}
    foreign = 0
    for name in CONFIGS:
        job = preset(work, name, args.sites)
        walls = {}
        for shaped in (False, True):
            store = work / f"{name}-{'shaped' if shaped else 'free'}"
            shutil.copytree(template.root, store)
            audit = work / f"audit-{name}-{'shaped' if shaped else 'free'}"
            walls[shaped] = run_sites(job, store, audit, args.sites, args.bandwidth_mbit if shaped else None)
            foreign += foreign_opens(audit)
        (run,) = store.glob("runs/run=*")
        comm = pq.read_table(run / "comm.parquet")
        simulated = simulated_seconds(comm, model)[0]
        measured = walls[True] - walls[False]
        ratio = measured / simulated if simulated else float("nan")
        results[name] = (walls[True], ratio)
        total = sum(comm.column("bytes").to_pylist())
        print(f"| {name} | {total / 1e6:,.1f} | {walls[False]:.1f} | {walls[True]:.1f} | {measured:.1f} | "
              f"{simulated:.1f} | {ratio:.2f} |", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    print(f"summary: standard_s={results['standard'][0]:.1f} retexo_s={results['retexo'][0]:.1f} "
          f"retexo_avg_int8_s={results['retexo_avg_int8'][0]:.1f} "
          f"standard_measured_over_simulated={results['standard'][1]:.2f} "
          f"retexo_measured_over_simulated={results['retexo'][1]:.2f} foreign_opens={foreign}")


if __name__ == "__main__":
    main()
