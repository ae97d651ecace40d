"""Integrity of the store: sha256 checksums in every manifest, checked when artefacts are read,
kept or reused; corrupt artefacts named in one line, never reused, replaced by a re-run; and
``retexo store verify [--repair]``.

Every test works on a private copy of one small template store (a 60-node tables dataset, a
random partition into 3 parts, one trained 2-layer Retexo run), so the session store is never
touched. Training runs its ranks as threads where a test only needs training to read files.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import TableFiles, flat, run_cli, snapshot, table_rows, write_tables
from graphstore.errors import StoreError
from graphstore.integrity import artefact_files, check_artefact
from graphstore.layout import MANIFEST, Store
from graphstore.lookup import PartitionRef, existing_dataset, find_dataset
from graphstore.partition.build import build_partition
from graphstore.partition.methods import PartitionOptions
from retexo_core.comm.network import NetworkModel
from retexo_core.config import TrainConfig
from runner.launch import WorkerFailed
from runner.lifecycle import run_training
from runner.plan import RunPlan, layer_state, plan_run
from training_helpers import IN_PROCESS

CONFIG = TrainConfig(hidden=8, rounds=[3, 2], lr=0.05, dropout=0.0, eval_every=1, timeout_s=60)
OPTIONS = PartitionOptions(method="random", parts=3, seed=0)
TRAIN_ARGS = ("train", "tiny", "--partition-method", "random", "--parts", "3", "--partition-seed", "0",
              "--hidden", "8", "--rounds", "2", "--timeout", "60")


@dataclass(frozen=True)
class Template:
    """The template store and the source files its dataset was ingested from."""

    root: Path
    files: TableFiles
    run_fp: str


def ingest_args(files: TableFiles) -> tuple[object, ...]:
    return ("ingest", "tables", "--edges", files.edges, "--nodes", files.nodes, "--features", files.features,
            "--name", "tiny", "--undirected")


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Template:
    root = tmp_path_factory.mktemp("integrity-template") / "store"
    files = write_tables(tmp_path_factory.mktemp("integrity-tables"), num_nodes=60)
    ingested = run_cli(*ingest_args(files), store=root)
    assert ingested.returncode == 0, ingested.stderr
    store = Store.open(root)
    dataset = find_dataset(store, "tiny")
    partition = build_partition(store, dataset, OPTIONS)
    plan = plan_run(store, dataset, partition, CONFIG, NetworkModel())
    run_training(plan, IN_PROCESS)
    return Template(root, files, plan.run_fp)


@pytest.fixture
def store(template: Template, tmp_path: Path) -> Store:
    """A private copy of the template store (file mtimes kept, as the checksums record them)."""
    root = tmp_path / "store"
    shutil.copytree(template.root, root)
    return Store.open(root)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def manifest_of(folder: Path) -> dict:
    return json.loads((folder / MANIFEST).read_text())


def partition_dir(store: Store) -> Path:
    (folder,) = (store.root / "partitions").glob("dataset=*/fp=*")
    return folder


def refs(store: Store) -> tuple:
    return find_dataset(store, "tiny"), PartitionRef.at(partition_dir(store))


def plan_for(store: Store, config: TrainConfig = CONFIG) -> RunPlan:
    return plan_run(store, *refs(store), config, NetworkModel())


def zero_features(path: Path) -> None:
    """Rewrite a Parquet file with the same schema and rows, every feature value 0 (valid Parquet)."""
    table = pq.read_table(path)
    column = table.column("x").combine_chunks()
    zeros = pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(len(column) * column.type.list_size, np.float32)),
                                              column.type.list_size)
    pq.write_table(table.set_column(table.schema.get_field_index("x"), "x", zeros), path, compression="zstd")


def truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def rot(path: Path) -> None:
    """Flip bytes in the middle of a file, keeping its size and mtime (silent media corruption)."""
    before = path.stat()
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 8] = bytes(b ^ 0xFF for b in data[middle:middle + 8])
    path.write_bytes(bytes(data))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def drop_checksums(folder: Path) -> None:
    """Make an artefact look as written before checksums were recorded."""
    payload = manifest_of(folder)
    del payload["files"]
    (folder / MANIFEST).write_text(json.dumps(payload))


def error_line(stderr: str) -> str:
    """The CLI's final ``error: ...`` message (spawned workers may print their traceback before it)."""
    assert "error: " in stderr, stderr
    return flat(stderr[stderr.rindex("error: "):])


def verify(store: Store, *extra: str):
    return run_cli("store", "verify", *extra, store=store.root)


def rows_by_path(stdout: str) -> dict[str, list[str]]:
    return {row[1]: row for row in table_rows(stdout) if len(row) == 3}


# --------------------------------------------------------------------------- checksums


def test_every_manifest_lists_the_sha256_of_its_files(template: Template) -> None:
    root = template.root
    kinds = {}
    for manifest_path in root.glob(f"**/{MANIFEST}"):
        folder = manifest_path.parent
        payload = manifest_of(folder)
        kinds[payload["kind"]] = kinds.get(payload["kind"], 0) + 1
        files = payload["files"]
        assert sorted(files) == artefact_files(folder, payload["kind"]), folder
        for name, recorded in files.items():
            path = folder / name
            assert recorded["sha256"] == sha256(path), path
            assert recorded["size"] == path.stat().st_size
            assert recorded["mtime_ns"] == path.stat().st_mtime_ns
    assert kinds == {"dataset": 1, "partition": 1, "layer": 2, "run": 1}

    dataset = next(root.glob("datasets/name=tiny/fp=*"))
    assert sorted(manifest_of(dataset)["files"]) == ["edges.parquet", "features.parquet", "nodes.parquet"]
    partition = next(root.glob("partitions/dataset=*/fp=*"))
    assert sorted(manifest_of(partition)["files"]) == sorted(["assignment.parquet", "stats.parquet"] + [
        f"part={i}/{name}.parquet" for i in range(3) for name in ("edges", "halo", "nodes")])
    run = root / "runs" / f"run={template.run_fp}"
    # a run covers its own files only: layers have their own manifests, events/ and logs/ grow later
    assert sorted(manifest_of(run)["files"]) == ["comm.parquet", "evaluation.parquet", "metrics.parquet", "recipe.json"]
    assert (run / "events").is_dir() and (run / "logs").is_dir()
    layer_files = set(manifest_of(run / "layer=1")["files"])
    assert {"model.pt", "part=0/embeddings.parquet", "part=2/comm.parquet"} <= layer_files
    assert "part=1/predictions.parquet" in manifest_of(run / "layer=2")["files"]


def test_a_copied_store_with_new_mtimes_is_still_intact(store: Store) -> None:
    """The quick check hashes a file whose mtime differs (a store copied without -p) instead of
    calling it corrupt: nothing is rebuilt, and verify finds nothing."""
    for path in store.root.rglob("*.parquet"):
        os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    dataset = find_dataset(store, "tiny")
    assert existing_dataset(store, "tiny", dataset.fp) is not None
    assert build_partition(store, dataset, OPTIONS).created is False
    assert all(layer_state(plan_for(store), layer) == "done" for layer in (1, 2))
    result = verify(store)
    assert result.returncode == 0, result.stdout
    assert "0 corrupt" in flat(result.stdout)


# --------------------------------------------------------------------------- read time


def test_truncated_partition_file_fails_training_naming_it(store: Store) -> None:
    plan = plan_for(store, CONFIG.model_copy(update={"seed": 1}))  # a new run: its layers read the partition
    path = partition_dir(store) / "part=1" / "nodes.parquet"
    truncate(path)
    with pytest.raises(WorkerFailed) as failed:
        run_training(plan, IN_PROCESS)
    message = str(failed.value)
    assert "\n" not in message
    assert (f"{path}: contents differ from the checksum in {partition_dir(store) / MANIFEST} "
            "(changed after it was written") in message
    assert "retexo store verify --repair" in message


def test_cli_names_a_corrupt_partition_file_of_an_older_store(store: Store) -> None:
    """A partition written before checksums: the truncated file is named (not '<Buffer>'), exit 2."""
    drop_checksums(partition_dir(store))
    path = partition_dir(store) / "part=0" / "edges.parquet"
    truncate(path)
    result = run_cli(*TRAIN_ARGS, "--seed", "1", store=store.root, timeout=300)
    assert result.returncode == 2, result.stderr
    error = error_line(result.stderr)
    assert f"{path}: corrupt Parquet file (Parquet magic bytes not found in footer)" in error
    assert "<Buffer>" not in result.stderr


def test_cli_names_a_silently_corrupted_partition_file(store: Store) -> None:
    """Same size, same mtime (what the quick check cannot see): training hashes what it reads."""
    path = partition_dir(store) / "part=2" / "halo.parquet"
    rot(path)
    result = run_cli(*TRAIN_ARGS, "--seed", "1", store=store.root, timeout=300)
    assert result.returncode == 2, result.stderr
    assert f"{path}: contents differ from the checksum in {partition_dir(store) / MANIFEST}" in error_line(result.stderr)


def test_zeroed_features_are_detected_named_and_rebuilt(store: Store, caplog: pytest.LogCaptureFixture) -> None:
    path = partition_dir(store) / "part=0" / "nodes.parquet"
    original = pq.read_table(path)
    zero_features(path)
    assert pq.read_table(path).column("x").combine_chunks().flatten().to_numpy().max() == 0

    # training reads it: named, never trained on
    with pytest.raises(WorkerFailed, match=f"{path}: contents differ from the checksum"):
        run_training(plan_for(store, CONFIG.model_copy(update={"seed": 1})), IN_PROCESS)

    # verify lists it (and nothing else)
    result = verify(store)
    assert result.returncode == 1
    rows = rows_by_path(result.stdout)
    relative = str(path.relative_to(store.root))
    assert list(rows) == [relative]
    assert rows[relative][0] == "partition" and rows[relative][2].startswith("changed after it was written")

    # building the partition again replaces it (warning names the file), with the real features back
    with caplog.at_level(logging.WARNING, logger="graphstore.atomic"):
        rebuilt = build_partition(store, find_dataset(store, "tiny"), OPTIONS)
    assert rebuilt.created and rebuilt.path == partition_dir(store)
    assert any(str(path) in record.getMessage() and "replacing the corrupt artefact" in record.getMessage()
               for record in caplog.records)
    assert pq.read_table(path).equals(original)
    assert verify(store).returncode == 0


def test_partition_of_a_corrupt_dataset_file_is_refused_naming_it(store: Store) -> None:
    dataset = find_dataset(store, "tiny")
    path = dataset.path / "edges.parquet"
    truncate(path)
    result = run_cli("partition", "tiny", "--method", "random", "--parts", "2", store=store.root)
    assert result.returncode == 2
    text = flat(result.stderr)
    assert f"{path}: contents differ from the checksum in {dataset.path / MANIFEST}" in text
    assert "ingest the data again" in text and "Traceback" not in text
    assert list((store.root / "partitions").glob("dataset=*/fp=*")) == [partition_dir(store)]  # nothing new


def test_partition_of_a_corrupt_dataset_file_of_an_older_store_is_refused_naming_it(store: Store) -> None:
    dataset = find_dataset(store, "tiny")
    drop_checksums(dataset.path)
    path = dataset.path / "nodes.parquet"
    path.write_bytes(b"not parquet at all")
    result = run_cli("partition", "tiny", "--method", "random", "--parts", "2", store=store.root)
    assert result.returncode == 2
    assert f"error: {path}: corrupt Parquet file (" in flat(result.stderr)
    assert "Traceback" not in result.stderr


# --------------------------------------------------------------------------- re-running replaces


def test_truncated_manifest_is_listed_then_replaced_by_ingesting_again(store: Store, template: Template) -> None:
    dataset = find_dataset(store, "tiny")
    digests = {name: sha256(dataset.path / name) for name in ("nodes.parquet", "edges.parquet", "features.parquet")}
    manifest = dataset.path / MANIFEST
    truncate(manifest, 0.3)

    listed = verify(store)
    assert listed.returncode == 1
    row = rows_by_path(listed.stdout)[str(manifest.relative_to(store.root))]
    assert row[0] == "dataset" and row[2].startswith("manifest unreadable")

    again = run_cli(*ingest_args(template.files), store=store.root)
    assert again.returncode == 0, again.stderr
    assert f"replacing the corrupt artefact {dataset.path}" in flat(again.stderr)
    assert find_dataset(store, "tiny").fp == dataset.fp
    assert {name: sha256(dataset.path / name) for name in digests} == digests
    clean = verify(store)
    assert clean.returncode == 0 and "0 corrupt" in flat(clean.stdout)


def test_truncated_partition_manifest_is_replaced_by_partitioning_again(store: Store) -> None:
    partition = partition_dir(store)
    files = manifest_of(partition)["files"]
    truncate(partition / MANIFEST, 0.2)
    result = run_cli("partition", "tiny", "--method", "random", "--parts", "3", "--seed", "0", store=store.root)
    assert result.returncode == 0, result.stderr
    assert f"replacing the corrupt artefact {partition}" in flat(result.stderr)
    assert {k: v["sha256"] for k, v in manifest_of(partition)["files"].items()} == {
        k: v["sha256"] for k, v in files.items()}
    assert check_artefact(partition, "full", cached=False) == []


def test_truncated_run_manifest_is_written_again_by_training(store: Store, template: Template) -> None:
    run_dir = store.run_dir(template.run_fp)
    truncate(run_dir / MANIFEST, 0.5)
    summary, progress = run_training(plan_for(store), IN_PROCESS)
    assert [p.state for p in progress] == ["cached", "cached"]
    assert summary is not None and summary.fp == template.run_fp
    assert check_artefact(run_dir) == []


# --------------------------------------------------------------------------- reuse


def test_an_intact_layer_is_linked_with_its_checksums(store: Store, template: Template) -> None:
    plan = plan_for(store, CONFIG.model_copy(update={"rounds": [3, 4]}))  # same layer 1, another layer 2
    _, progress = run_training(plan, IN_PROCESS)
    assert [p.state for p in progress] == ["reused", "trained"]
    source, linked = store.layer_dir(template.run_fp, 1), plan.layer_dir(1)
    assert manifest_of(linked)["files"] == manifest_of(source)["files"]
    assert os.path.samefile(source / "model.pt", linked / "model.pt")
    assert check_artefact(linked, "full", cached=False) == []


def test_a_corrupt_layer_is_not_linked_but_retrained(store: Store, template: Template,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    source = store.layer_dir(template.run_fp, 1)
    rot(source / "part=1" / "embeddings.parquet")  # invisible to the quick check: reuse hashes in full
    plan = plan_for(store, CONFIG.model_copy(update={"rounds": [3, 4]}))
    with caplog.at_level(logging.WARNING, logger="graphstore.integrity"):
        assert layer_state(plan, 1) == "pending"
        _, progress = run_training(plan, IN_PROCESS)
    assert [p.state for p in progress] == ["trained", "trained"]
    assert any(str(source / "part=1" / "embeddings.parquet") in r.getMessage() and "not reused" in r.getMessage()
               for r in caplog.records)
    linked = plan.layer_dir(1)
    assert manifest_of(linked)["reused_from"] is None
    assert not os.path.samefile(source / "model.pt", linked / "model.pt")
    assert check_artefact(linked, "full", cached=False) == []


@pytest.mark.parametrize("damaged", ["model.pt", MANIFEST])
def test_a_damaged_layer_of_the_run_itself_is_trained_again(store: Store, damaged: str) -> None:
    plan = plan_for(store)
    layer = plan.layer_dir(2)
    truncate(layer / damaged)
    assert [layer_state(plan, l) for l in (1, 2)] == ["done", "pending"]
    _, progress = run_training(plan, IN_PROCESS)
    assert [p.state for p in progress] == ["cached", "trained"]
    assert check_artefact(layer, "full", cached=False) == []


# --------------------------------------------------------------------------- store verify


def test_verify_repair_removes_exactly_the_corrupt_artefacts_and_training_rebuilds(store: Store,
                                                                                   template: Template) -> None:
    partition = partition_dir(store)
    layer = store.layer_dir(template.run_fp, 2)
    truncate(partition / "part=2" / "halo.parquet")
    rot(layer / "model.pt")
    untouched = {folder: snapshot(folder) for folder in (
        find_dataset(store, "tiny").path, store.layer_dir(template.run_fp, 1))}
    run_files = {name: sha256(store.run_dir(template.run_fp) / name)
                 for name in ("manifest.json", "comm.parquet", "metrics.parquet", "evaluation.parquet")}

    listed = verify(store)
    assert listed.returncode == 1
    assert sorted(rows_by_path(listed.stdout)) == sorted(
        str(p.relative_to(store.root)) for p in (partition / "part=2" / "halo.parquet", layer / "model.pt"))
    assert "2 corrupt" in flat(listed.stdout)

    repaired = verify(store, "--repair")
    assert repaired.returncode == 0, repaired.stdout
    assert "repaired 2 of 2 corrupt artefacts" in flat(repaired.stdout)
    assert not partition.exists() and not layer.exists()
    assert {folder: snapshot(folder) for folder in untouched} == untouched
    # no cascade: the run's own files stay until the next run finalises it again
    assert {name: sha256(store.run_dir(template.run_fp) / name) for name in run_files} == run_files
    assert list(store.root.rglob(".tmp-*")) == []
    clean = verify(store)
    assert clean.returncode == 0 and "0 corrupt" in flat(clean.stdout)
    counted = run_cli("sql", "SELECT count(*) AS n FROM partitions", "--format", "csv", store=store.root)
    assert counted.stdout.split() == ["n", "0"], counted.stderr  # the catalog no longer lists it

    dataset = find_dataset(store, "tiny")
    rebuilt = build_partition(store, dataset, OPTIONS)
    assert rebuilt.created and rebuilt.path == partition
    plan = plan_run(store, dataset, rebuilt, CONFIG, NetworkModel())
    assert plan.run_fp == template.run_fp
    summary, progress = run_training(plan, IN_PROCESS)
    assert [p.state for p in progress] == ["cached", "trained"]
    assert summary is not None and summary.test_acc is not None
    assert verify(store).returncode == 0


def test_verify_reports_older_manifests_as_unverified_and_keeps_them(store: Store) -> None:
    dataset = find_dataset(store, "tiny")
    drop_checksums(dataset.path)
    before = snapshot(dataset.path)
    result = verify(store, "--repair")
    assert result.returncode == 0
    row = rows_by_path(result.stdout)[str((dataset.path / MANIFEST).relative_to(store.root))]
    assert row[0] == "dataset" and row[2].startswith("unverified")
    assert "0 corrupt, 1 unverified" in flat(result.stdout)
    assert snapshot(dataset.path) == before


def test_verify_names_a_parquet_file_whose_footer_cannot_be_read(store: Store) -> None:
    partition = partition_dir(store)
    drop_checksums(partition)  # without checksums the footer is the only thing left to check
    path = partition / "stats.parquet"
    truncate(path, 0.9)
    result = verify(store)
    assert result.returncode == 1
    row = rows_by_path(result.stdout)[str(path.relative_to(store.root))]
    assert row[2].startswith("corrupt Parquet file")


def test_verify_files_raises_one_line_naming_file_and_manifest(store: Store) -> None:
    from graphstore.integrity import verify_files
    from graphstore.manifests import PartitionManifest

    partition = partition_dir(store)
    (partition / "part=0" / "halo.parquet").unlink()
    with pytest.raises(StoreError) as missing:
        verify_files(partition, ["part=0/halo.parquet"], PartitionManifest)
    assert str(missing.value).startswith(f"{partition / 'part=0' / 'halo.parquet'}: missing, but listed in "
                                         f"{partition / MANIFEST}")
