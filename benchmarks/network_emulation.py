"""Real links instead of the network model: Cora trained by K sites, each a network namespace with its
own address on a bridge, its egress shaped to ``--bandwidth-mbit`` by ``tc tbf``, and its own store
built from its own tables (``retexo site train``; the ranks talk over real TCP; ``tests/netns.py``;
needs root and iproute2).

Cora's nodes are dealt to the K sites at random (seed 0); each site's tables hold its nodes and the
edges into them. Five configurations (the defaults of ``retexo site train`` otherwise): standard and
retexo (gradient sync every round), each with the default dense gradient encoding and with
``--skip-zero-grads`` (lossless: only the non-zero gradient entries travel), and retexo with
``--sync avg --sync-every 5 --compress int8``. The summary's standard and retexo are the
``--skip-zero-grads`` runs, the encoding to use on a slow link; ``--configs`` runs a subset.
Each runs twice in namespaces, unshaped and shaped, from fresh copies of the sites' stores. The
measured communication time is the shaped run's wall time minus the unshaped one's (same compute,
same start-up); the simulated time is the project's network model (``retexo_core.comm.network``)
for the union of the sites' comm logs at that bandwidth and zero latency (tbf adds none).
``foreign_opens`` counts the files a site's rank opened in another site's store, from the
workers' audit hooks.

``--links plain,tls`` runs every configuration over both kinds of links: plaintext (gloo, no kit)
and mutually authenticated TLS 1.3 (each site with its kit from ``retexo site provision``; the
sites' own mesh, ``retexo_core.comm.mesh``), and prints what TLS costs: the shaped run's wall time
over the plaintext one's (``secure:`` lines).

    sudo .venv/bin/python benchmarks/network_emulation.py [--bandwidth-mbit 100] [--sites 4] [--configs a,b]
        [--links plain|tls|plain,tls]

The last line is ``summary: standard_s=... retexo_s=... retexo_avg_int8_s=...
standard_measured_over_simulated=... retexo_measured_over_simulated=... foreign_opens=...``
(``*_s``: wall seconds of the shaped runs).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from graphstore.ingest.api import ingest_planetoid, ingest_tables  # noqa: E402
from graphstore.ingest.splits import SplitFractions  # noqa: E402
from graphstore.ingest.tables import TableOptions  # noqa: E402
from graphstore.layout import Store  # noqa: E402
from graphstore.manifests import RunManifest, read_manifest  # noqa: E402
from graphstore.parquet_io import features_of, read_table  # noqa: E402
from netns import netns_missing, sites  # noqa: E402
from processes import run_together  # noqa: E402
from retexo_core.comm.network import NetworkModel, simulated_seconds  # noqa: E402
from runner.provision import provision  # noqa: E402

CONFIGS = {
    "standard": ["--strategy", "standard"],
    "retexo": ["--strategy", "retexo"],
    "retexo_avg_int8": ["--strategy", "retexo", "--sync", "avg", "--sync-every", "5", "--compress", "int8"],
    "standard_skip_zeros": ["--strategy", "standard", "--skip-zero-grads"],
    "retexo_skip_zeros": ["--strategy", "retexo", "--skip-zero-grads"],
}
# the summary's standard and retexo: gradient sync every round, both with the lossless zero-skipping
# encoding that suits a slow link (the default, dense encoding's rows are printed above it)
SUMMARY = {"standard": "standard_skip_zeros", "retexo": "retexo_skip_zeros", "retexo_avg_int8": "retexo_avg_int8"}
GROUP_PORT = 29520  # the sites' process group, on site 0's address
TIMEOUT_S = 1800


def site_stores(work: Path, count: int) -> list[Path]:
    """Cora dealt to ``count`` sites; each site's own tables ingested into its own store."""
    source = ingest_planetoid(Store.open(work / "source"), REPO / "data" / "cora", "cora", "dense")
    nodes, edges = read_table(source.path / "nodes.parquet"), read_table(source.path / "edges.parquet")
    x = features_of(read_table(source.path / "features.parquet"), source.num_features)
    ids, into = nodes.column("node_id").to_numpy(), edges.column("dst").to_numpy()
    owner = np.random.default_rng(0).integers(0, count, len(ids))
    features = pa.table({"node_id": ids, "x": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), x.shape[1])})
    stores = []
    for k in range(count):
        tables = work / f"tables{k}"
        tables.mkdir()
        mine = pa.array(owner == k)
        for name, table in (("nodes", nodes.filter(mine)), ("features", features.filter(mine)),
                            ("edges", edges.filter(pa.array(np.isin(into, ids[owner == k]))))):
            pq.write_table(table, tables / f"{name}.parquet")
        stores.append(work / f"site{k}")
        ingest_tables(Store.open(stores[-1]), "cora-site", tables / "edges.parquet", tables / "nodes.parquet",
                      tables / "features.parquet", TableOptions(remote_sources=True), SplitFractions())
    return stores


def pin(site: int):  # -> a preexec_fn
    """Site ``site`` runs on one CPU of this machine (round robin), as a machine of its own would
    have its own: its workers then take one torch thread each instead of oversubscribing."""
    cpus = sorted(os.sched_getaffinity(0))
    return lambda: os.sched_setaffinity(0, {cpus[site % len(cpus)]})


def run_sites(options: list[str], stores: list[Path], audit: Path, bandwidth_mbit: float | None,
              kits: Path | None = None) -> float:
    """One training by the sites in namespaces (with the kits ``kits/site-<k>``: over TLS); wall
    seconds until every site finished."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "GLOO_SOCKET_IFNAME": "eth0", "COLUMNS": "120"}
    with sites(len(stores), bandwidth_mbit) as hosts:
        started = time.perf_counter()
        commands = [site.command(sys.executable, "-m", "cli", "site", "train", "cora-site", "--rank", str(k),
                                 "--world", str(len(stores)), "--master-addr", hosts[0].address,
                                 "--master-port", str(GROUP_PORT), "--timeout", "600",
                                 "--audit-dir", str(audit / f"site{k}"), "--store", str(stores[k]), *options,
                                 *(["--kit", str(kits / f"site-{k}")] if kits else []))
                    for k, site in enumerate(hosts)]
        done = run_together(commands, env, TIMEOUT_S, [pin(k) for k in range(len(hosts))])
        seconds = time.perf_counter() - started
    failed = [(k, node.stderr.strip().splitlines()[-1:]) for k, node in enumerate(done) if node.returncode]
    if failed:
        raise SystemExit(f"sites failed: {failed}")
    return seconds


def foreign_opens(audit: Path, stores: list[Path]) -> int:
    """Files a site's rank opened inside another site's store."""
    count = 0
    for k in range(len(stores)):
        others = tuple(f"{store}/" for j, store in enumerate(stores) if j != k)
        for listing in (audit / f"site{k}").glob("rank-*.txt"):
            count += sum(path.startswith(others) for path in listing.read_text().split())
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bandwidth-mbit", type=float, default=100.0)
    parser.add_argument("--sites", type=int, default=4)
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma list of configurations to run (the summary needs {', '.join(SUMMARY.values())})")
    parser.add_argument("--links", default="plain", help="comma list of plain and tls: the links every configuration runs over")
    args = parser.parse_args()
    chosen = args.configs.split(",")
    links = args.links.split(",")
    if not links or any(link not in ("plain", "tls") for link in links):
        raise SystemExit(f"--links {args.links}: expected plain, tls or plain,tls")
    unknown = [c for c in chosen if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"--configs: unknown configuration {unknown[0]!r}; expected some of {', '.join(CONFIGS)}")
    missing = netns_missing()
    if missing is not None:
        raise SystemExit(f"cannot emulate the network here: {missing}")
    work = Path(tempfile.mkdtemp(prefix="retexo-netem-"))
    templates = site_stores(work, args.sites)
    kits = work / "job"
    provision(kits, "netem", args.sites)
    model = NetworkModel(latency_ms=0.0, bandwidth_mbps=args.bandwidth_mbit)
    print(f"Cora, {args.sites} sites in network namespaces, each with its own store, egress shaped to "
          f"{args.bandwidth_mbit:g} Mbit/s (tc tbf)")
    print("| configuration | links | MB sent | wall s, unshaped | wall s, shaped | measured comm s | simulated comm s "
          "| measured / simulated |")
    print("|---|---|---|---|---|---|---|---|")
    results: dict[str, tuple[float, float]] = {}
    shaped_walls: dict[tuple[str, str], float] = {}
    foreign = 0
    for name in chosen:
        for link in links:
            walls = {}
            for shaped in (False, True):
                label = f"{name}-{link}-{'shaped' if shaped else 'free'}"
                stores = [work / label / f"site{k}" for k in range(args.sites)]
                for template, store in zip(templates, stores):
                    shutil.copytree(template, store)
                audit = work / f"audit-{label}"
                walls[shaped] = run_sites(CONFIGS[name], stores, audit, args.bandwidth_mbit if shaped else None,
                                          kits if link == "tls" else None)
                foreign += foreign_opens(audit, stores)
            runs = [next(store.glob("runs/run=*")) for store in stores]
            comm = pa.concat_tables([pq.read_table(run / "comm.parquet") for run in runs])  # every site's own rows
            simulated = simulated_seconds(comm, model)[0]
            measured = walls[True] - walls[False]
            ratio = measured / simulated if simulated else float("nan")
            shaped_walls[(name, link)] = walls[True]
            if link == links[0]:
                results[name] = (walls[True], ratio)
            total = read_manifest(runs[0], RunManifest).total_bytes  # the coordinator's count of the whole run
            print(f"| {name} | {link} | {total / 1e6:,.1f} | {walls[False]:.1f} | {walls[True]:.1f} | {measured:.1f} | "
                  f"{simulated:.1f} | {ratio:.2f} |", flush=True)
        if len(links) == 2:
            plain, tls = shaped_walls[(name, "plain")], shaped_walls[(name, "tls")]
            print(f"secure: {name} plain_s={plain:.1f} tls_s={tls:.1f} tls_over_plain={tls / plain:.3f}", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    if any(name not in results for name in SUMMARY.values()):
        return
    standard, retexo, avg_int8 = (results[SUMMARY[key]] for key in ("standard", "retexo", "retexo_avg_int8"))
    print(f"summary: standard_s={standard[0]:.1f} retexo_s={retexo[0]:.1f} retexo_avg_int8_s={avg_int8[0]:.1f} "
          f"standard_measured_over_simulated={standard[1]:.2f} retexo_measured_over_simulated={retexo[1]:.2f} "
          f"foreign_opens={foreign}")


if __name__ == "__main__":
    main()
