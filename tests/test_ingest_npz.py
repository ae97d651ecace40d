"""``retexo ingest npz``: the heterophilous-graphs and gnn-benchmark ``.npz`` layouts, plain or in a ``.zip``.

Small files written here check the exact content stored (edges symmetrised, features as given,
official or stratified splits), the storage layout, re-ingest and every refusal (one line naming
the file and the key, exit code 2, store unchanged). The real files of ``../shared/datasets`` are
checked against the statistics of their SOURCE.md when that folder exists (CI has only the
repository: those tests are skipped there).
"""

from __future__ import annotations

import io
import os
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from conftest import REPO, dataset_features, flat, run_cli, snapshot
from cli.app import app
from graphstore.errors import InputError
from graphstore.layout import Store
from graphstore.limits import ResourceError
from graphstore.lookup import DatasetRef, find_dataset
from graphstore.parquet_io import features_of

SHARED = REPO.parent / "shared" / "datasets"
Arrays = dict[str, np.ndarray]


# --------------------------------------------------------------------------- small files


def heterophilous(n: int = 40, f: int = 12, splits: int = 3, density: float = 0.05, seed: int = 0) -> Arrays:
    """A ring plus chords (i, i+2) for every 5th i, each undirected edge once; labels i % 3;
    0/1/2/3-valued features at about ``density``; ``splits`` random splits leaving 10 % of the
    nodes in no mask."""
    rng = np.random.default_rng(seed)
    ring = np.stack([np.arange(n), (np.arange(n) + 1) % n], axis=1)
    chords = np.stack([np.arange(0, n, 5), (np.arange(0, n, 5) + 2) % n], axis=1)
    x = np.where(rng.random((n, f)) < density, rng.integers(1, 4, (n, f)), 0).astype(np.float32)
    masks = np.zeros((3, splits, n), bool)
    for s in range(splits):
        order = rng.permutation(n)
        for k, (lo, hi) in enumerate(((0, n // 2), (n // 2, 3 * n // 4), (3 * n // 4, 9 * n // 10))):
            masks[k, s, order[lo:hi]] = True
    return {"node_features": x, "node_labels": np.arange(n) % 3, "edges": np.concatenate([ring, chords]),
            "train_masks": masks[0], "val_masks": masks[1], "test_masks": masks[2]}


def gnn_benchmark(n: int = 50, f: int = 20, density: float = 0.05, seed: int = 0) -> Arrays:
    """CSR adjacency (i -> i+1 for every i, the reverse only for even i: not symmetric), CSR
    count features (values 1..5), labels i % 4, and a ``class_names`` string array."""
    import scipy.sparse as sp

    rng = np.random.default_rng(seed)
    src = np.concatenate([np.arange(n), np.arange(0, n, 2) + 1])
    dst = np.concatenate([np.arange(n) + 1, np.arange(0, n, 2)]) % n
    adj = sp.csr_matrix((np.ones(len(src), np.float32), (src, dst)), shape=(n, n))
    attr = sp.csr_matrix(np.where(rng.random((n, f)) < density, rng.integers(1, 6, (n, f)), 0).astype(np.float32))
    arrays = {f"adj_{k}": v for k, v in csr_parts(adj).items()}
    arrays.update({f"attr_{k}": v for k, v in csr_parts(attr).items()})
    return {**arrays, "labels": np.arange(n) % 4, "class_names": np.array(["a", "b", "c", "d"])}


def csr_parts(matrix) -> Arrays:
    return {"data": matrix.data, "indices": matrix.indices, "indptr": matrix.indptr, "shape": np.array(matrix.shape)}


def write_npz(path: Path, arrays: Arrays) -> Path:
    np.savez(path, **arrays)
    return path


def zip_of(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path


def npz_bytes(arrays: Arrays) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def ingest(store: Path, file: Path, name: str, *args: str) -> DatasetRef:
    """``retexo ingest npz`` in process; the dataset it wrote (or found)."""
    result = CliRunner().invoke(app, ["ingest", "npz", str(file), "--name", name, *args, "--store", str(store)])
    assert result.exit_code == 0, (result.output, result.exception)
    return find_dataset(Store.open(store), name)


def stored(ref: DatasetRef) -> tuple[dict[str, np.ndarray], set[tuple[int, int]], np.ndarray]:
    """(nodes columns, edge set, dense features) of a stored dataset."""
    nodes = pq.read_table(ref.path / "nodes.parquet").to_pydict()
    edges = pq.read_table(ref.path / "edges.parquet").to_pydict()
    return ({k: np.array(v) for k, v in nodes.items()}, set(zip(edges["src"], edges["dst"])), dataset_features(ref))


def both_ways(pairs: np.ndarray) -> set[tuple[int, int]]:
    return {(int(a), int(b)) for a, b in pairs} | {(int(b), int(a)) for a, b in pairs}


# --------------------------------------------------------------------------- what is stored


def test_heterophilous_official_split_symmetrised_values_as_given(tmp_path: Path):
    arrays = heterophilous()
    ref = ingest(tmp_path / "store", write_npz(tmp_path / "g.npz", arrays), "het", "--split-index", "1")
    nodes, edges, x = stored(ref)
    n = len(arrays["node_labels"])
    assert (ref.num_nodes, ref.num_features, ref.num_classes) == (n, 12, 3)
    assert ref.num_edges == 2 * len(arrays["edges"]) and edges == both_ways(arrays["edges"])
    assert np.array_equal(nodes["node_id"], np.arange(n)) and np.array_equal(nodes["label"], arrays["node_labels"])
    assert np.array_equal(x, arrays["node_features"])  # not normalised: values 0..3 kept
    expected = np.full(n, "none", dtype=object)
    for key, split in (("train_masks", "train"), ("val_masks", "val"), ("test_masks", "test")):
        expected[arrays[key][1]] = split
    assert np.array_equal(nodes["split"], expected) and (expected == "none").sum() == n // 10
    m = ref.manifest
    assert m.symmetric and m.source["options"] == {"undirected": True, "feature_format": "auto", "split_index": 1}


def test_one_dimensional_masks_are_one_split(tmp_path: Path):
    arrays = heterophilous(splits=1)
    flat_masks = {**arrays, **{k: arrays[k][0] for k in ("train_masks", "val_masks", "test_masks")}}
    ref = ingest(tmp_path / "store", write_npz(tmp_path / "g.npz", flat_masks), "het")
    two_d = ingest(tmp_path / "store2", write_npz(tmp_path / "g2.npz", arrays), "het")
    assert np.array_equal(stored(ref)[0]["split"], stored(two_d)[0]["split"])
    assert ref.manifest.splits == {"train": 20, "val": 10, "test": 6, "none": 4}


def test_directed_keeps_the_edges_as_listed(tmp_path: Path):
    arrays = heterophilous()
    ref = ingest(tmp_path / "store", write_npz(tmp_path / "g.npz", arrays), "het", "--directed")
    assert stored(ref)[1] == {(int(a), int(b)) for a, b in arrays["edges"]}
    assert not ref.manifest.symmetric


def test_gnn_benchmark_symmetrised_with_a_stratified_split(tmp_path: Path):
    arrays = gnn_benchmark()
    ref = ingest(tmp_path / "store", write_npz(tmp_path / "g.npz", arrays), "gnn",
                 "--train-frac", "0.5", "--val-frac", "0.25", "--split-seed", "3")
    nodes, edges, x = stored(ref)
    adj = np.stack(np.nonzero(_dense(arrays, "adj")), axis=1)
    assert edges == both_ways(adj) and ref.num_edges == 2 * 50  # the ring, both ways: 50 undirected pairs
    assert len(adj) == 75 and ref.manifest.duplicates_removed == 2 * 75 - 100  # entries that had their reverse
    assert np.array_equal(x, _dense(arrays, "attr")) and x.max() == 5  # counts kept
    assert np.array_equal(nodes["label"], arrays["labels"]) and ref.num_classes == 4
    for cls in range(4):  # 12 or 13 nodes per class: round(0.5 n) train, round(0.75 n) - round(0.5 n) val
        members = nodes["split"][nodes["label"] == cls]
        size = len(members)
        assert (members == "train").sum() == round(0.5 * size)
        assert (members == "val").sum() == round(0.75 * size) - round(0.5 * size)
    assert ref.manifest.source["options"]["split"] == {"train": 0.5, "val": 0.25, "seed": 3}


def _csr_of(arrays: Arrays, prefix: str):
    """The CSR matrix of ``<prefix>_data/indices/indptr/shape`` (scipy's own reading)."""
    import scipy.sparse as sp

    parts = [arrays[f"{prefix}_{k}"] for k in ("data", "indices", "indptr")]
    return sp.csr_matrix(tuple(parts), shape=tuple(arrays[f"{prefix}_shape"]))


def _dense(arrays: Arrays, prefix: str) -> np.ndarray:
    return _csr_of(arrays, prefix).toarray()


def test_gnn_benchmark_variants_store_the_same_graph(tmp_path: Path):
    """A dense ``attr_matrix`` and one-hot CSR ``labels_*`` give what the CSR attributes and the
    label vector give; so does a ``.zip`` holding the ``.npz`` (read without extracting)."""
    import scipy.sparse as sp

    arrays = gnn_benchmark()
    attr = {k: arrays.pop(k) for k in [k for k in arrays if k.startswith("attr_")]}
    base = {**arrays, **attr}
    onehot = sp.csr_matrix((np.ones(50, np.float32), (np.arange(50), arrays["labels"])), shape=(50, 4))
    variants = {
        "dense-attr": {**arrays, "attr_matrix": _dense(attr, "attr")},
        "csr-labels": {**{k: v for k, v in base.items() if k != "labels"},
                       **{f"labels_{k}": v for k, v in csr_parts(onehot).items()}},
    }
    reference = stored(ingest(tmp_path / "s0", write_npz(tmp_path / "g.npz", base), "g"))
    for label, variant in variants.items():
        found = stored(ingest(tmp_path / label, write_npz(tmp_path / f"{label}.npz", variant), "g"))
        assert all(np.array_equal(a, b) for a, b in zip(found[0].values(), reference[0].values())), label
        assert found[1:2] == reference[1:2] and np.array_equal(found[2], reference[2]), label
    zipped = zip_of(tmp_path / "g.zip", {"inner/graph.npz": npz_bytes(base)})
    ref = ingest(tmp_path / "zip", zipped, "g")
    found = stored(ref)
    assert found[1] == reference[1] and np.array_equal(found[2], reference[2])
    assert ref.manifest.source["files"]["edges"] == f"{zipped} (inner/graph.npz)"


@pytest.mark.parametrize("maker, density, requested, expected", [
    (heterophilous, 0.05, "auto", "sparse"),
    (heterophilous, 0.3, "auto", "dense"),
    (gnn_benchmark, 0.05, "auto", "sparse"),
    (gnn_benchmark, 0.3, "auto", "dense"),  # a CSR matrix denser than 0.1 is stored dense
    (gnn_benchmark, 0.05, "dense", "dense"),
    (heterophilous, 0.3, "sparse", "sparse"),
])
def test_feature_storage_follows_the_density_rule(tmp_path: Path, maker: Callable[..., Arrays], density: float,
                                                   requested: str, expected: str):
    arrays = maker(density=density)
    ref = ingest(tmp_path / "store", write_npz(tmp_path / "g.npz", arrays), "g", "--feature-format", requested)
    assert ref.manifest.feature_format == expected
    source = arrays["node_features"] if "node_features" in arrays else _dense(arrays, "attr")
    assert np.array_equal(dataset_features(ref), source)


def test_draw_split_ignores_the_masks_and_draws_the_split_of_a_file_without_them(tmp_path: Path):
    arrays = heterophilous()
    masks = ("train_masks", "val_masks", "test_masks")
    drawn = ingest(tmp_path / "store", write_npz(tmp_path / "g.npz", arrays), "drawn", "--draw-split",
                   "--train-frac", "0.5", "--split-seed", "3")
    bare = ingest(tmp_path / "store", write_npz(tmp_path / "bare.npz", {k: v for k, v in arrays.items() if k not in masks}),
                  "bare", "--train-frac", "0.5", "--split-seed", "3")
    split = stored(drawn)[0]["split"]
    assert np.array_equal(split, stored(bare)[0]["split"])
    assert (split != "none").all() and abs((split == "train").sum() - len(split) / 2) <= 3  # the masks leave 10 % out
    assert drawn.manifest.source["options"] == {"undirected": True, "feature_format": "auto",
                                                "split": {"train": 0.5, "val": 0.2, "seed": 3}}


def test_reingest_is_unchanged_and_only_options_that_apply_enter_the_fingerprint(tmp_path: Path):
    file = write_npz(tmp_path / "g.npz", heterophilous())
    store = tmp_path / "store"
    first = CliRunner().invoke(app, ["ingest", "npz", str(file), "--name", "g", "--store", str(store)])
    assert first.exit_code == 0 and "written" in flat(first.output), first.output
    before = snapshot(store / "datasets")
    for extra in ([], ["--split-index", "0"], ["--split-seed", "5", "--train-frac", "0.3"]):
        again = CliRunner().invoke(app, ["ingest", "npz", str(file), "--name", "g", *extra, "--store", str(store)])
        assert again.exit_code == 0 and "unchanged" in flat(again.output), (extra, again.output)
    assert snapshot(store / "datasets") == before
    other = CliRunner().invoke(app, ["ingest", "npz", str(file), "--name", "g", "--split-index", "2",
                                     "--store", str(store)])
    assert "written" in flat(other.output), other.output
    assert len(list((store / "datasets" / "name=g").iterdir())) == 2


class _Payload:
    """Pickles to a call of ``os.system`` (never unpickled: the loader reads no object array)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_object_arrays_are_never_unpickled(tmp_path: Path, store_with_dataset: Path):
    marker = tmp_path / "pwned"
    evil = np.array([_Payload(marker), "b"], dtype=object)
    ingest(tmp_path / "store", write_npz(tmp_path / "ok.npz", {**gnn_benchmark(), "class_names": evil}), "g")
    assert not marker.exists()  # the unused key was not read
    broken = write_npz(tmp_path / "bad.npz", {**gnn_benchmark(), "labels": np.array([_Payload(marker)] * 50)})
    refused(store_with_dataset, broken, [], "key 'labels'", "would need unpickling")
    assert not marker.exists()


def test_memory_is_checked_from_the_headers_before_reading(tmp_path: Path, store_with_dataset: Path):
    """A header promising 10^7 x 10^5 float32 values (4 TB) in a few bytes: refused on memory
    before anything is read, and as a truncated array with --force (nothing allocated)."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (10**7, 10**5)})
    arrays = heterophilous()
    members = {f"{k}.npy": npz_member(v) for k, v in arrays.items() if k != "node_features"}
    file = zip_of(tmp_path / "huge.npz", {**members, "node_features.npy": header.getvalue()})
    result = CliRunner().invoke(app, ["ingest", "npz", str(file), "--name", "huge", "--store", str(store_with_dataset)])
    assert isinstance(result.exception, ResourceError), result.exception
    assert "needs about" in str(result.exception) and "--force" in str(result.exception)
    refused(store_with_dataset, file, ["--force"], "key 'node_features'", "promises", "holds")


def npz_member(values: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, values)
    return buffer.getvalue()


# --------------------------------------------------------------------------- refusals


def refused(store: Path, file: Path, args: list[str], *words: str) -> str:
    """In process: an ``InputError`` of one line naming ``file`` and ``words``; the store unchanged."""
    before = snapshot(store)
    result = CliRunner().invoke(app, ["ingest", "npz", str(file), "--name", "broken", *args, "--store", str(store)])
    assert isinstance(result.exception, InputError), (result.exit_code, result.output, result.exception)
    message = str(result.exception)
    assert "\n" not in message and message.startswith(str(file)), message
    for word in words:
        assert word in message, message
    assert snapshot(store) == before, "the store changed"
    return message


def _edit(maker: Callable[[], Arrays], **changes: object) -> Callable[[Path], tuple[Path, list[str]]]:
    """A broken file: ``maker()``'s arrays with ``changes``: None removes a key, a function maps
    its array, an array replaces or adds it."""
    def build(folder: Path) -> tuple[Path, list[str]]:
        arrays = maker()
        for key, value in changes.items():
            if value is None:
                del arrays[key]
            else:
                arrays[key] = value(arrays[key]) if callable(value) else value
        return write_npz(folder / "broken.npz", arrays), []
    return build


def _with_args(build: Callable[[Path], tuple[Path, list[str]]], *args: str):
    return lambda folder: (build(folder)[0], list(args))


def _set(key: str, index: object, value: object) -> Callable[[Path], tuple[Path, list[str]]]:
    """heterophilous() with ``arrays[key][index] = value``."""
    def change(array: np.ndarray) -> np.ndarray:
        array = array.copy()
        array[index] = value
        return array
    return _edit(heterophilous, **{key: change})


def _zip(members: dict[str, bytes]) -> Callable[[Path], tuple[Path, list[str]]]:
    return lambda folder: (zip_of(folder / "broken.zip", members), [])


def _text(name: str, text: str) -> Callable[[Path], tuple[Path, list[str]]]:
    def build(folder: Path) -> tuple[Path, list[str]]:
        (folder / name).write_text(text)
        return folder / name, []
    return build


N = 40  # nodes of heterophilous(); gnn_benchmark() has 50
REFUSALS: dict[str, tuple[Callable[[Path], tuple[Path, list[str]]], tuple[str, ...]]] = {
    "split index beyond the splits": (_with_args(_edit(heterophilous), "--split-index", "3"),
                                      ("key 'train_masks'", "--split-index 3 is out of range", "3 split(s)", "0..2")),
    "split index without splits": (_with_args(_edit(gnn_benchmark), "--split-index", "0"),
                                   ("no split masks", "--train-frac")),
    "split index with a drawn split": (_with_args(_edit(heterophilous), "--draw-split", "--split-index", "0"),
                                       ("--split-index cannot be combined with --draw-split",)),
    "missing edges": (_edit(heterophilous, edges=None), ("missing key 'edges'", "node_features")),
    "missing one mask": (_edit(heterophilous, val_masks=None), ("missing key 'val_masks'",)),
    "missing adjacency part": (_edit(gnn_benchmark, adj_indptr=None), ("missing key 'adj_indptr'",)),
    "missing labels": (_edit(gnn_benchmark, labels=None), ("missing key 'labels'",)),
    "missing features": (_edit(gnn_benchmark, attr_data=None), ("missing key 'attr_data'",)),
    "labels too short": (_edit(heterophilous, node_labels=np.arange(N - 1) % 3),
                         ("key 'node_labels'", f"expected shape ({N},)", f"found ({N - 1},)")),
    "labels 2-D": (_edit(heterophilous, node_labels=np.zeros((N, 1), np.int64)), ("key 'node_labels'", "(40,)")),
    "edges with 3 columns": (_edit(heterophilous, edges=np.zeros((5, 3), np.int64)),
                             ("key 'edges'", "expected shape (*, 2)", "found (5, 3)")),
    "masks too wide": (_edit(heterophilous, train_masks=np.zeros((3, N + 1), bool)),
                       ("key 'train_masks'", f"expected shape (*, {N})")),
    "masks with fewer splits": (_edit(heterophilous, val_masks=lambda a: a[:2]),
                                ("key 'val_masks'", "the shape of train_masks", "(3, 40)", "found (2, 40)")),
    "features 1-D": (_edit(heterophilous, node_features=np.zeros(N, np.float32)), ("key 'node_features'", "(*, *)")),
    "attribute rows": (_edit(gnn_benchmark, attr_shape=np.array([51, 20])), ("key 'attr_shape'", "(50, *)")),
    "adjacency not square": (_edit(gnn_benchmark, adj_shape=np.array([50, 49])),
                             ("key 'adj_shape'", "square", "[50, 49]")),
    "adjacency offsets": (_edit(gnn_benchmark, adj_indptr=lambda a: a[:-1]),
                          ("key 'adj_indptr'", "expected shape (51,)")),
    "adjacency column ids": (_edit(gnn_benchmark, adj_indices=lambda a: a + 1),
                             ("key 'adj_indices'", "out of range", "0..49")),
    "label out of range": (_set("node_labels", 7, -2), ("key 'node_labels'", "node_labels[7] = -2", "out of range")),
    "one-hot label outside its columns": (
        _edit(gnn_benchmark, labels=None, labels_data=np.ones(50, np.float32), labels_indices=np.arange(50) % 5,
              labels_indptr=np.arange(51), labels_shape=np.array([50, 4])),
        ("key 'labels_indices'", "labels_indices[4] = 4", "0..3")),
    "multi-label": (
        _edit(gnn_benchmark, labels=None, labels_data=np.ones(51, np.float32),
              labels_indices=np.r_[np.arange(50) % 4, 2], labels_indptr=np.r_[np.arange(50), 51],
              labels_shape=np.array([50, 4])),
        ("key 'labels_indices'", "node 49 has 2 labels", "multi-label")),
    "edge to an unknown node": (_set("edges", 5, [5, N]), ("key 'edges'", f"edges[5] = [5, {N}]", f"0..{N - 1}")),
    "float edges": (_edit(heterophilous, edges=lambda a: a.astype(np.float64)),
                    ("key 'edges'", "expected integers", "float64")),
    "non-finite feature": (_set("node_features", (3, 4), np.nan), ("key 'node_features'", "node 3, feature 4",
                                                                  "not finite")),
    "node in two masks": (_set("test_masks", (0, slice(None)), True), ("key 'test_masks'", "also in", "split 0")),
    "float mask": (_edit(heterophilous, val_masks=lambda a: a.astype(np.float32)),
                   ("key 'val_masks'", "boolean mask", "float32")),
    "zip without npz": (_zip({"readme.txt": b"hello"}), ("no .npy arrays and no .npz member",)),
    "zip with two npz": (_zip({"a.npz": npz_bytes(heterophilous()), "b.npz": npz_bytes(heterophilous())}),
                         ("holds 2 .npz members", "a.npz, b.npz", "exactly one")),
    "zip holding a non-npz": (_zip({"a.npz": b"not a zip"}), ("(a.npz)", "not an .npz file")),
    "text file": (_text("graph.npz", "node_id,label\n1,0\n"), ("not an .npz file",)),
    "unknown keys": (lambda folder: (write_npz(folder / "other.npz", {"x": np.zeros(3)}), []),
                     ("not a known graph layout", "found x")),
    "missing file": (lambda folder: (folder / "nowhere.npz", []), ("does not exist",)),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_bad_files_are_refused_in_one_line(case: str, tmp_path: Path, store_with_dataset: Path):
    build, words = REFUSALS[case]
    file, args = build(tmp_path)
    refused(store_with_dataset, file, args, *words)


@pytest.mark.parametrize("case", ["split index beyond the splits", "zip with two npz", "label out of range"])
def test_refusals_exit_with_code_2_through_the_real_cli(case: str, tmp_path: Path, store_with_dataset: Path):
    build, words = REFUSALS[case]
    file, args = build(tmp_path)
    before = snapshot(store_with_dataset)
    result = run_cli("ingest", "npz", file, "--name", "broken", *args, store=store_with_dataset)
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {file}"), result.stderr
    assert all(word in lines[0] for word in words), lines[0]
    assert snapshot(store_with_dataset) == before


# --------------------------------------------------------------------------- the real files


REAL = [  # file, nodes, directed edges (2 x undirected), features, classes, split 0 (train, val, test), layout
    ("wisconsin/wisconsin.npz", 251, 900, 1703, 5, (120, 80, 51), "sparse"),
    ("chameleon_filtered/chameleon_filtered.npz", 890, 17708, 2325, 5, (409, 287, 194), "sparse"),
    ("actor/actor.npz", 7600, 53318, 932, 5, (3648, 2432, 1520), "sparse"),
    ("minesweeper/minesweeper.npz", 10000, 78804, 7, 2, (5000, 2500, 2500), "dense"),
    ("amazon_computers/amazon-computers.zip", 13752, 491722, 767, 10, None, "dense"),
    ("coauthor_cs/coauthor-cs.zip", 18333, 163788, 6805, 15, None, "sparse"),
]
CLASS_SIZES = {
    "amazon_computers/amazon-computers.zip": [436, 2142, 1414, 542, 5158, 308, 487, 818, 2156, 291],
    "coauthor_cs/coauthor-cs.zip": [708, 462, 2050, 429, 1394, 2193, 371, 924, 775, 118, 1444, 2033, 420, 4136, 876],
}


@pytest.mark.skipif(not SHARED.is_dir(), reason=f"{SHARED} is not here (CI has only the repository)")
@pytest.mark.parametrize("file, nodes, edges, features, classes, split, layout", REAL,
                         ids=[r[0].split("/")[0] for r in REAL])
def test_real_files_match_their_source_statistics(tmp_path: Path, file: str, nodes: int, edges: int, features: int,
                                                   classes: int, split: tuple[int, int, int] | None, layout: str):
    ref = ingest(tmp_path / "store", SHARED / file, "real")
    m = ref.manifest
    assert (ref.num_nodes, ref.num_edges, ref.num_features, ref.num_classes) == (nodes, edges, features, classes)
    assert m.symmetric and m.self_loops == 0 and m.feature_format == layout
    if split is not None:
        assert (m.splits["train"], m.splits["val"], m.splits["test"], m.splits["none"]) == (*split, 0)
    else:  # stratified 60/20/20
        assert m.splits["none"] == 0 and abs(m.splits["train"] - 0.6 * nodes) < classes
    label = pq.read_table(ref.path / "nodes.parquet", columns=["label"]).column("label").to_numpy()
    if file in CLASS_SIZES:
        assert np.bincount(label).tolist() == CLASS_SIZES[file]
    if file.startswith("coauthor"):  # keyword counts (1 to 105), kept as they are
        x = features_of(pq.read_table(ref.path / "features.parquet"), features)
        assert x.nnz == 1092079 and int((x.data > 1).sum()) == 289674
        with zipfile.ZipFile(SHARED / file) as archive, np.load(io.BytesIO(archive.read("ms_academic_cs.npz"))) as raw:
            assert (x != _csr_of(raw, "attr")).nnz == 0
