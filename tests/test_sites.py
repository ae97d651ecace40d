"""Sites that keep their own stores train one model together (``retexo site train``).

Cora is split among three sites; each site ingests only its own tables (its nodes, their features,
labels and splits, and the edges into them, whose sources may be another site's ids) into its own
store. The three train retexo GCN together: in network namespaces (each site its own address on a
bridge) when this machine can make them, else over the loopback interface. The result must equal
a central run of the same graph partitioned by the ``column`` method, and no site may open a
file of another site's store.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch

from conftest import CORA_DIR, REPO, cli_env, run_cli, run_together
from graphstore.ingest.api import ingest_planetoid, ingest_tables
from graphstore.ingest.splits import SplitFractions
from graphstore.ingest.tables import TableOptions
from graphstore.layout import Store
from graphstore.manifests import RunManifest, read_manifest
from graphstore.parquet_io import features_of, read_table
from graphstore.runs import read_embeddings
from netns import link_name, netns_missing, sites
from processes import communicate_all, cpu_share
from retexo_core.sites import SITE_EPOCH
from runner.launch import free_port
from runner.provision import provision

pytestmark = pytest.mark.slow
SITES = 3
TIMEOUT_S = 600
TRAIN = ("--hidden", 16, "--rounds", 30, "--timeout", 60)


@dataclass(frozen=True)
class Loopback:
    """A site on this host's loopback interface (when namespaces cannot be made)."""

    address: str = "127.0.0.1"

    def command(self, *argv: str) -> list[str]:
        return list(argv)


@contextmanager
def hosts(count: int) -> Iterator[list]:
    if netns_missing() is None:
        with sites(count) as made:
            yield made
    else:
        yield [Loopback() for _ in range(count)]


def write_tables(folder: Path, nodes: pa.Table, features: pa.Table, edges: pa.Table) -> Path:
    folder.mkdir(parents=True)
    for name, table in (("nodes", nodes), ("features", features), ("edges", edges)):
        pq.write_table(table, folder / f"{name}.parquet")
    return folder


@pytest.fixture(scope="module")
def tables(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    """Cora as central tables with a ``site`` column, and as each site's own tables."""
    root = tmp_path_factory.mktemp("site-tables")
    source = ingest_planetoid(Store.open(root / "source"), CORA_DIR, "cora", "dense")
    nodes, edges = read_table(source.path / "nodes.parquet"), read_table(source.path / "edges.parquet")
    x = features_of(read_table(source.path / "features.parquet"), source.num_features)
    ids = nodes.column("node_id").to_numpy()
    site = np.random.default_rng(1).integers(0, SITES, len(ids))
    features = pa.table({"node_id": ids, "x": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), x.shape[1])})
    central = write_tables(root / "central", nodes.append_column("site", pa.array(site)), features, edges)
    into = edges.column("dst").to_numpy()
    own = [write_tables(root / f"site{s}", nodes.filter(pa.array(site == s)), features.filter(pa.array(site == s)),
                        edges.filter(pa.array(np.isin(into, ids[site == s])))) for s in range(SITES)]
    return central, own


def ingest(store: Path, folder: Path, name: str, remote: bool) -> None:
    ingest_tables(Store.open(store), name, folder / "edges.parquet", folder / "nodes.parquet",
                  folder / "features.parquet", TableOptions(remote_sources=remote), SplitFractions())


def train_sites(stores: list[Path], audit: Path, port: int, *extra: object, kits: Path | None = None,
                wire: bytearray | None = None, dataset: str = "cora-site") -> list[subprocess.CompletedProcess]:
    """Every site's ``retexo site train`` (with site r's kit ``kits/site-<r>`` when given); ``wire``
    receives every frame that crossed site 0's link (its link in the root namespace, else the
    loopback interface)."""
    env = {**cli_env(), "GLOO_SOCKET_IFNAME": "eth0" if netns_missing() is None else "lo"}
    with hosts(len(stores)) as made, capture(link_name(0) if netns_missing() is None else "lo", wire):
        return run_together([host.command(*site_train(s, len(stores), port, stores[s], "--master-addr", made[0].address,
                                                      "--dataset-name", dataset,
                                                      "--audit-dir", audit / f"site{s}", *extra,
                                                      *(("--kit", kits / f"site-{s}") if kits else ())))
                             for s, host in enumerate(made)], env, TIMEOUT_S,
                            [cpu_share(s, len(made)) for s in range(len(made))])


@contextmanager
def capture(interface: str, wire: bytearray | None) -> Iterator[None]:
    """While inside: every frame on ``interface`` (both directions, a raw packet socket) is appended
    to ``wire``; nothing when ``wire`` is None."""
    if wire is None:
        yield
        return
    tap = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(0x0003))  # ETH_P_ALL
    tap.bind((interface, 0))
    tap.settimeout(0.2)
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                wire.extend(tap.recv(1 << 16))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        yield
    finally:
        stop.set()
        reader.join(5)
        tap.close()


def site_train(rank: int, world: int, port: int, store: Path, *options: object) -> list[str]:
    """The ``retexo site train`` command of site ``rank`` (the test's training options, then
    ``options``; ``--dataset-name NAME`` among them trains that dataset instead of cora-site)."""
    options = tuple(map(str, options))
    dataset = "cora-site"
    if "--dataset-name" in options:
        at = options.index("--dataset-name")
        dataset, options = options[at + 1], options[:at] + options[at + 2:]
    return [sys.executable, "-m", "cli", "site", "train", dataset, "--rank", str(rank), "--world", str(world),
            "--master-port", str(port), "--store", str(store), *map(str, TRAIN), *options]


def traffic(comm: pa.Table) -> dict[tuple, int]:
    """Bytes per (layer, epoch, kind, src, dst), without the sites' own coordination rows."""
    rows = comm.filter(pc.not_equal(comm.column("epoch"), SITE_EPOCH))
    grouped = rows.group_by(["layer", "epoch", "kind", "src", "dst"]).aggregate([("bytes", "sum")])
    keys = zip(*(grouped.column(c).to_pylist() for c in ("layer", "epoch", "kind", "src", "dst")))
    return dict(zip(keys, grouped.column("bytes_sum").to_pylist()))


def test_three_sites_with_their_own_stores_train_what_a_central_column_partition_trains(
        tables: tuple[Path, list[Path]], tmp_path: Path) -> None:
    central_tables, site_tables = tables
    central = tmp_path / "central"
    ingest(central, central_tables, "cora-central", remote=False)
    # as the sites train by default: one depth, and no fresh pair (Cora's split would turn it on centrally)
    trained = run_cli("train", "cora-central", "--parts", SITES, "--partition-method", "column",
                      "--partition-column", "site", *TRAIN, "--no-choose-depth",
                      "--no-joint-fresh", store=central, timeout=TIMEOUT_S)
    assert trained.returncode == 0, trained.stderr
    stores = [tmp_path / f"store{s}" for s in range(SITES)]
    for s in range(SITES):
        ingest(stores[s], site_tables[s], "cora-site", remote=True)
    done = train_sites(stores, tmp_path / "audit", free_port())
    assert [p.returncode for p in done] == [0] * SITES, [p.stderr[-2000:] for p in done]

    (expected,) = central.glob("runs/run=*")
    runs = [next(store.glob("runs/run=*")) for store in stores]
    reference = read_manifest(expected, RunManifest)
    manifests = [read_manifest(run, RunManifest) for run in runs]
    coordinator = manifests[0]
    assert coordinator.evaluation == reference.evaluation
    assert [m.site for m in manifests] == list(range(SITES))
    assert all(m.evaluation == [] and m.test_acc is None for m in manifests[1:])
    for layer in (1, 2):
        ours, theirs = (torch.load(r / f"layer={layer}" / "model.pt") for r in (runs[0], expected))
        assert all(torch.allclose(ours[k], theirs[k], atol=1e-5) for k in theirs)
        assert not any((r / f"layer={layer}" / "model.pt").exists() for r in runs[1:])
        for s, run in enumerate(runs):
            assert sorted(p.name for p in (run / f"layer={layer}").glob("part=*")) == [f"part={s}"]
            (ids, ours), (central_ids, theirs) = (read_embeddings(r / f"layer={layer}" / f"part={s}" / "embeddings.parquet")
                                                  for r in (run, expected))
            assert np.array_equal(ids, central_ids)
            assert np.abs(ours["full"] - theirs["full"]).max() <= 1e-5
    for s, run in enumerate(runs):
        predictions = pq.read_table(run / "layer=2" / f"part={s}" / "predictions.parquet")
        assert predictions.select(["node_id", "predicted"]).equals(
            pq.read_table(expected / "layer=2" / f"part={s}" / "predictions.parquet").select(["node_id", "predicted"]))

    # the same bytes per link, kind, layer and epoch; the sites' coordination is extra, as control
    central_comm = pq.read_table(expected / "comm.parquet")
    site_comms = [pq.read_table(run / "comm.parquet") for run in runs]
    for s, comm in enumerate(site_comms):
        assert set(comm.column("src").to_pylist()) == {s}
        assert traffic(comm) == traffic(central_comm.filter(pc.equal(central_comm.column("src"), s)))
    coordination = sum(pc.sum(c.filter(pc.equal(c.column("epoch"), SITE_EPOCH)).column("bytes")).as_py() for c in site_comms)
    assert 0 < coordination < 200_000
    sent = [pc.sum(c.column("bytes")).as_py() for c in site_comms]
    assert coordinator.total_bytes == sum(sent) == reference.total_bytes + coordination
    assert coordinator.bytes_by_kind == {**reference.bytes_by_kind,
                                         "control": reference.bytes_by_kind["control"] + coordination}
    assert coordinator.bytes_by_site == {str(s): b for s, b in enumerate(sent)}
    assert [m.total_bytes for m in manifests[1:]] == sent[1:]

    # residency: every site's rank read its own store and nothing of another's
    for s in range(SITES):
        opened = (tmp_path / "audit" / f"site{s}" / f"rank-{s}.txt").read_text().split()
        assert any(path.startswith(f"{stores[s]}/") for path in opened)
        assert not [p for p in opened if p.startswith((f"{central}/", *(f"{o}/" for o in stores if o != stores[s])))]

    # each site queries its own store
    answer = run_cli("sql", "SELECT sum(bytes) AS b FROM comm_log", store=stores[1])
    assert answer.returncode == 0 and str(manifests[1].total_bytes) in answer.stdout, answer.stdout + answer.stderr
    assert "unreadable" not in answer.stderr, answer.stderr  # no empty curves or evaluation files at a site
    assert not (runs[1] / "metrics.parquet").exists() and not (runs[1] / "evaluation.parquet").exists()


def planted(site_tables: list[Path], folder: Path) -> tuple[list[Path], np.ndarray]:
    """The sites' tables with one node of site 1 that site 0 needs (a source of an edge into site 0)
    given a feature row of distinctive float32 values; the tables and that row."""
    sources = pq.read_table(site_tables[0] / "edges.parquet").column("src").to_numpy()
    nodes = pq.read_table(site_tables[1] / "nodes.parquet").column("node_id").to_numpy()
    node = np.intersect1d(sources, nodes)[0]
    features = pq.read_table(site_tables[1] / "features.parquet")
    x = features_of(features, len(features.column("x")[0]))
    row = (1.0 + np.arange(x.shape[1], dtype=np.float32) / 4096).astype(np.float32)
    x[features.column("node_id").to_numpy() == node] = row
    copies = []
    for s, source in enumerate(site_tables):
        copy = folder / f"site{s}"
        shutil.copytree(source, copy)
        if s == 1:
            pq.write_table(pa.table({"node_id": features.column("node_id"),
                                     "x": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), x.shape[1])}),
                           copy / "features.parquet")
        copies.append(copy)
    return copies, row


def pieces_on_the_wire(wire: bytearray, row: np.ndarray) -> int:
    """How many of the 16-byte windows (4 values) of ``row`` appear in the captured frames."""
    return sum(row[i:i + 4].tobytes() in wire for i in range(0, len(row) - 4, 5))


def test_provisioned_sites_train_what_plaintext_sites_train_and_the_wire_shows_no_feature_row(
        tables: tuple[Path, list[Path]], tmp_path: Path) -> None:
    """The same three sites trained over plaintext links, with kits (mutual TLS), and with kits and
    --secure-agg: TLS trains the same models, embeddings and evaluation with the same logged bytes;
    a capture of site 0's link reads a planted feature row of site 1 in the plaintext run and none
    of it over TLS; secure aggregation trains the same model to within its fixed point, and logs
    as much again as the gradient sums (int64 against float32) plus the seeds as secure_agg."""
    site_tables, row = planted(tables[1], tmp_path / "tables")
    provision(tmp_path / "job", "cora-sites", SITES)
    runs, wires = {}, {}
    for mode in ("plain", "tls", "secure"):
        stores = [tmp_path / mode / f"store{s}" for s in range(SITES)]
        for s in range(SITES):
            ingest(stores[s], site_tables[s], "cora-site", remote=True)
        wires[mode] = bytearray()
        done = train_sites(stores, tmp_path / mode / "audit", free_port(), *(["--secure-agg"] if mode == "secure" else []),
                           wire=wires[mode], kits=tmp_path / "job" if mode != "plain" else None)
        assert [p.returncode for p in done] == [0] * SITES, [p.stderr[-2000:] for p in done]
        assert ("links to the other sites are plaintext" in done[1].stderr) == (mode == "plain")
        runs[mode] = [next(store.glob("runs/run=*")) for store in stores]
    assert pieces_on_the_wire(wires["plain"], row) > 50  # the capture sees the row in clear without TLS
    assert len(wires["tls"]) > 1_000_000 and pieces_on_the_wire(wires["tls"], row) == 0
    plain, tls = runs["plain"], runs["tls"]
    assert read_manifest(tls[0], RunManifest).evaluation == read_manifest(plain[0], RunManifest).evaluation
    for layer in (1, 2):
        ours, theirs = (torch.load(r[0] / f"layer={layer}" / "model.pt") for r in (tls, plain))
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
        for s in range(SITES):
            (ids, ours_e), (their_ids, theirs_e) = (read_embeddings(r[s] / f"layer={layer}" / f"part={s}" / "embeddings.parquet")
                                                    for r in (tls, plain))
            assert np.array_equal(ids, their_ids) and np.array_equal(ours_e["full"], theirs_e["full"])
    for s in range(SITES):
        assert read_manifest(tls[s], RunManifest).bytes_by_kind == read_manifest(plain[s], RunManifest).bytes_by_kind
    assert "TLS links to site 1" in (tls[0] / "logs" / "rank-0.log").read_text()

    secure = runs["secure"]
    for layer in (1, 2):
        ours, theirs = (torch.load(r[0] / f"layer={layer}" / "model.pt") for r in (secure, tls))
        assert all(torch.allclose(ours[k], theirs[k], rtol=0, atol=1e-4) for k in theirs), \
            max(float((ours[k] - theirs[k]).abs().max()) for k in theirs)
    masked, unmasked = (read_manifest(r[0], RunManifest) for r in (secure, tls))
    assert abs(masked.test_acc - unmasked.test_acc) <= 0.01, (masked.test_acc, unmasked.test_acc)
    seeds = 32 * SITES * (SITES - 1) // 2
    assert masked.bytes_by_kind["grad_sync"] == unmasked.bytes_by_kind["grad_sync"]
    assert masked.bytes_by_kind["secure_agg"] == unmasked.bytes_by_kind["grad_sync"] + seeds


def test_provisioned_sites_refuse_a_foreign_certificate_and_a_taken_rank_and_train(
        tables: tuple[Path, list[Path]], tmp_path: Path) -> None:
    """Three provisioned sites, a process with a certificate of another CA and a copy of site 1's kit
    start together: the foreign one is refused by site 0's TLS handshake, one of the two holders of
    site 1's certificate is refused as a taken rank, each in one line, and the three sites train."""
    _, site_tables = tables
    provision(tmp_path / "job", "cora-sites", SITES)
    provision(tmp_path / "other", "cora-sites", SITES)  # same job name, another CA
    seats = [(0, "job"), (1, "job"), (2, "job"), (1, "other"), (1, "job")]
    stores = [tmp_path / f"store{k}" for k in range(len(seats))]
    for store, (s, _) in zip(stores, seats):
        ingest(store, site_tables[s], "cora-site", remote=True)
    port = free_port()
    done = run_together([site_train(s, SITES, port, store, "--timeout", 60, "--kit", tmp_path / job / f"site-{s}")
                         for store, (s, job) in zip(stores, seats)], {**cli_env()}, TIMEOUT_S)
    last = [p.stderr.strip().splitlines()[-1] if p.stderr.strip() else "" for p in done]
    assert done[3].returncode != 0 and re.match(
        r"^error: .*site 1: the TLS handshake with site 0 at 127\.0\.0\.1:\d+ failed: certificate verify failed", last[3]), last
    taken = [k for k in (1, 4) if "refused this site: rank 1 is taken: site 1 (site-1) joined already" in last[k]]
    assert len(taken) == 1 and done[taken[0]].returncode != 0, last
    assert [p.returncode for k, p in enumerate(done) if k not in (3, *taken)] == [0, 0, 0], last
    site_0_log = next(stores[0].glob("runs/run=*/logs/rank-0.log")).read_text()
    assert "site 0 refused site 1 (site-1) from 127.0.0.1:" in site_0_log and "rank 1 is taken" in site_0_log
    assert "the TLS handshake failed" in site_0_log


def test_sites_refuse_to_train_with_different_options(tables: tuple[Path, list[Path]], tmp_path: Path) -> None:
    _, site_tables = tables
    stores = [tmp_path / f"store{s}" for s in range(2)]
    for s in range(2):
        ingest(stores[s], site_tables[s], "cora-site", remote=True)
    port = free_port()
    done = run_together([site_train(s, 2, port, stores[s], "--lr", 0.01 * (s + 1)) for s in range(2)],
                        {**cli_env(), "GLOO_SOCKET_IFNAME": "lo"}, TIMEOUT_S)
    assert all(p.returncode not in (0, None) for p in done)
    # each site names the other and the option, with its own value
    assert any("site 1 trains with other options than site 0: lr (here: 0.01)" in p.stderr for p in done), \
        [p.stderr[-1500:] for p in done]
    assert not list(stores[0].glob("runs/run=*/layer=*"))  # nothing was committed


def test_a_second_site_with_a_taken_rank_is_refused_and_the_others_train(
        tables: tuple[Path, list[Path]], tmp_path: Path) -> None:
    _, site_tables = tables
    seats = [0, 1, 2, 1]  # the last one is a copy of site 1 that also says --rank 1
    stores = [tmp_path / f"store{k}" for k in range(len(seats))]
    for store, s in zip(stores, seats):
        ingest(store, site_tables[s], "cora-site", remote=True)
    port = free_port()
    done = run_together([site_train(s, SITES, port, store, "--timeout", 60) for store, s in zip(stores, seats)],
                        {**cli_env(), "GLOO_SOCKET_IFNAME": "lo"}, TIMEOUT_S)
    refused = [k for k, p in enumerate(done) if "rank 1 is taken: another process joined" in p.stderr]
    assert len(refused) == 1 and seats[refused[0]] == 1, [p.stderr[-1500:] for p in done]
    assert done[refused[0]].returncode not in (0, None)
    assert [p.returncode for k, p in enumerate(done) if k != refused[0]] == [0, 0, 0], \
        [p.stderr[-1500:] for p in done]


def kit_options(links: str, folder: Path) -> Callable[[int], tuple[object, ...]]:
    """Site r's extra options: its kit (provisioned once into ``folder``) over TLS links, none over plain ones."""
    if links == "plain":
        return lambda s: ()
    provision(folder, "cora-sites", SITES)
    return lambda s: ("--kit", folder / f"site-{s}")


# what the other sites say of site 1 when it went away, over each kind of link
WENT_AWAY = {"plain": "site 1 (rank 1) went away: no heartbeat", "tls": "site 1 (site-1) went away: "}
FROZE = {"plain": "site 1 (rank 1): no heartbeat for 10 s (frozen", "tls": "site 1 (site-1): no heartbeat for "}


@pytest.mark.parametrize("links", ["plain", "tls"])
def test_sites_killed_in_layer_2_resume_at_layer_2(tables: tuple[Path, list[Path]], tmp_path: Path, links: str) -> None:
    _, site_tables = tables
    kit = kit_options(links, tmp_path / "job")
    stores = [tmp_path / f"store{s}" for s in range(SITES)]
    for s in range(SITES):
        ingest(stores[s], site_tables[s], "cora-site", remote=True)
    env = {**cli_env(), "GLOO_SOCKET_IFNAME": "lo"}
    longer = ("--rounds", "30,150")  # after the test's options: layer 2 runs long enough to be killed in
    port = free_port()
    procs = [subprocess.Popen(site_train(s, SITES, port, stores[s], *longer, *kit(s)), cwd=REPO, env=env,
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for s in range(SITES)]
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not all(list(store.glob("runs/run=*/layer=1/manifest.json")) for store in stores):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.2)
        procs[1].kill()  # site 1's command dies during layer 2; its worker follows
        errors = [err for _, err in communicate_all(procs, 300)]
        codes = [p.returncode for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert codes[1] == -9 and codes[0] != 0 and codes[2] != 0
    for s in (0, 2):  # each other site names the one that went away, in its one error line
        line = errors[s].strip().splitlines()[-1]
        assert line.startswith("error: ") and WENT_AWAY[links] in line, errors[s][-1500:]
    runs = [next(store.glob("runs/run=*")) for store in stores]
    assert all(not (run / "layer=2").exists() and not list(run.glob(".tmp-*")) for run in runs)
    layer_1 = [(run / "layer=1" / "manifest.json").read_bytes() for run in runs]

    port = free_port()
    done = run_together([site_train(s, SITES, port, stores[s], *longer, *kit(s)) for s in range(SITES)], env, TIMEOUT_S)
    assert [p.returncode for p in done] == [0] * SITES, [p.stderr[-1500:] for p in done]
    assert [(run / "layer=1" / "manifest.json").read_bytes() for run in runs] == layer_1  # not trained again
    for s, run in enumerate(runs):
        launches = [line for line in (run / "logs" / f"rank-{s}.log").read_text().splitlines() if "owned nodes" in line]
        assert [line.rsplit("layers ", 1)[1] for line in launches] == ["[1, 2]", "[2]"]
        events = sorted((run / "events").glob("*.json"))
        assert [json.loads(e.read_text())["event"] for e in events][-1] == "completed"
    assert read_manifest(runs[0], RunManifest).test_acc is not None


@pytest.mark.parametrize("links", ["plain", "tls"])
def test_a_frozen_site_is_named_at_the_others_before_the_timeout(tables: tuple[Path, list[Path]],
                                                                   tmp_path: Path, links: str) -> None:
    """Site 1's machine stops (its command and worker get SIGSTOP) during layer 2: the others stop
    after the hang timeout (10 s here), not after --timeout (300 s), and name site 1."""
    _, site_tables = tables
    stores = [tmp_path / f"store{s}" for s in range(SITES)]
    for s in range(SITES):
        ingest(stores[s], site_tables[s], "cora-site", remote=True)
    env = {**cli_env(), "GLOO_SOCKET_IFNAME": "lo"}
    options = ("--rounds", "30,150", "--hang-timeout", 10, "--timeout", 300)
    kit = kit_options(links, tmp_path / "job")
    port = free_port()
    procs = [subprocess.Popen(site_train(s, SITES, port, stores[s], *options, *kit(s)), cwd=REPO, env=env,
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for s in range(SITES)]
    frozen = []
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not all(list(store.glob("runs/run=*/layer=1/manifest.json")) for store in stores):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.2)
        site_1 = psutil.Process(procs[1].pid)
        frozen = [site_1, *site_1.children(recursive=True)]
        for process in frozen:
            process.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        errors = {s: procs[s].communicate(timeout=120)[1] for s in (0, 2)}
        took = time.monotonic() - stopped
    finally:
        for process in frozen:
            with contextlib.suppress(psutil.Error):
                process.send_signal(signal.SIGKILL)
        for p in procs:
            p.kill()
            p.wait()
    assert took < 60, took  # the hang timeout and a few beats, never --timeout
    for s, error in errors.items():
        line = error.strip().splitlines()[-1]
        assert procs[s].returncode != 0 and line.startswith("error: "), error[-1500:]
        # its own watch stops it, or its collective fails first when the other waiting site stops
        assert FROZE[links] in line or WENT_AWAY[links] in line, error[-1500:]
    assert any(FROZE[links] in e for e in errors.values()), errors



def test_sites_train_the_link_task_on_splits_each_draws_alone(tables: tuple[Path, list[Path]], tmp_path: Path) -> None:
    """Each site derives its own link split (no site asks another); no site trains on an edge
    another holds out, every held-out edge is scored once, the metrics reach the coordinator as
    counts, and scores and recommendations stay at their site."""
    from graphstore.ingest.link_split import LinkSplitOptions, split_links
    from graphstore.lookup import find_dataset

    _, site_tables = tables
    stores = [tmp_path / f"store{s}" for s in range(SITES)]
    links = []
    for s in range(SITES):
        ingest(stores[s], site_tables[s], "cora-site", remote=True)
        store = Store.open(stores[s])
        links.append(split_links(store, find_dataset(store, "cora-site"), "cora-link", LinkSplitOptions(seed=3)))
    pairs = [read_table(ref.path / "link_pairs.parquet").to_pandas() for ref in links]
    held = {frozenset((u, v)) for p in pairs for u, v in zip(p.src[p.label == 1], p.dst[p.label == 1])}
    scored = sum(int((p.label == 1).sum()) for p in pairs)
    assert scored == len(held) > 100  # every held-out edge once, at one site
    for ref in links:
        edges = read_table(ref.path / "edges.parquet")
        kept = {frozenset((u, v)) for u, v in zip(edges.column("src").to_pylist(), edges.column("dst").to_pylist())}
        assert not kept & held
    done = train_sites(stores, tmp_path / "audit", free_port(), "--task", "link", "--recommend", 3,
                       dataset="cora-link")
    assert [p.returncode for p in done] == [0] * SITES, [p.stderr[-2000:] for p in done]
    runs = [next(store.glob("runs/run=*")) for store in stores]
    coordinator = read_manifest(runs[0], RunManifest)
    evaluation = {r["split"]: r for r in coordinator.evaluation}
    assert evaluation["test"]["pairs"] == sum(int((p.split == "test").sum()) for p in pairs)
    assert evaluation["test"]["roc_auc"] > 0.8 and 0 < evaluation["test"]["mrr"] <= 1
    for s, run in enumerate(runs):
        nodes = set(read_table(links[s].path / "nodes.parquet").column("node_id").to_pylist())
        scores = pq.read_table(run / "layer=2" / f"part={s}" / "link_scores.parquet").to_pandas()
        assert len(scores) == len(pairs[s]) and set(scores.dst) <= nodes
        recommended = pq.read_table(run / "layer=2" / f"part={s}" / "recommendations.parquet").to_pandas()
        assert set(recommended.node_id) == nodes and len(recommended) == 3 * len(nodes)
        opened = (tmp_path / "audit" / f"site{s}" / f"rank-{s}.txt").read_text().split()
        assert not [p for p in opened if p.startswith(tuple(f"{o}/" for o in stores if o != stores[s]))]
