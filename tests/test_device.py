"""--device: where ranks compute. On this machine (no GPU) the CPU path and the one-line refusal of
``--device cuda``; where CUDA is available, every strategy and model trained on the GPU gives the
CPU run's bytes exactly and its outputs within float tolerance (these tests skip without CUDA)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import flat, run_cli
from graphstore.layout import Store
from graphstore.runs import read_embeddings
from graphstore.manifests import LayerManifest, RunManifest, read_manifest
from graphstore.sql_query import query
from retexo_core.device import CPU, DeviceError, compute_device, layer_fits
from retexo_core.sparse import SparseMatrix, dropout, gat_aggregate, spmm
from graphstore.limits import gpu_estimate
from retexo_core.config import TrainConfig
from runner.gpus import Gpu, _selected, ranks_per_gpu, training_gpus
from runner.launch import default_threads
from runner.preview import gpu_memory_for, training_sizes
from runner.plan import RunPlan
from training_helpers import comm_log, make_tiny, small_config, train

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (the device machine); CI has none")
no_cuda = pytest.mark.skipif(CUDA, reason="checks the refusal on a machine without a GPU")


# --------------------------------------------------------------------------- every machine


def test_cpu_and_auto_compute_on_the_cpu_without_a_gpu() -> None:
    assert compute_device("cpu", 3) == CPU
    if not CUDA:
        assert compute_device("auto", 3) == CPU
        with pytest.raises(DeviceError, match="--device cuda: torch .* sees no CUDA GPU"):
            compute_device("cuda", 0)
    assert training_gpus("cpu") == []


@no_cuda
def test_device_cuda_without_a_gpu_is_one_line_and_exit_code_2(tmp_path: Path) -> None:
    store = tmp_path / "store"
    assert run_cli("ingest", "synthetic", "--name", "g", "--nodes", "200", "--avg-degree", "4", store=store).returncode == 0
    result = run_cli("train", "g", "--parts", "2", "--device", "cuda", "--rounds", "2", store=store)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --device cuda: ") and "--device cpu" in lines[0], lines
    assert not list((store / "runs").glob("run=*/layer=*"))  # refused before any worker started


@no_cuda
def test_every_layer_and_run_records_where_it_trained(tmp_path: Path) -> None:
    """Torch version, device, CPU instruction set and threads per rank decide a run's floats: the
    manifests, ``runs.platform``, ``retexo train``'s output and the run's report record them, and
    an instruction set pinned by ``ATEN_CPU_CAPABILITY`` (as one would pin it to repeat a run on
    another kind of CPU) is the one recorded."""
    store = tmp_path / "store"
    assert run_cli("ingest", "synthetic", "--name", "g", "--nodes", "200", "--avg-degree", "4", store=store).returncode == 0
    pinned = {"ATEN_CPU_CAPABILITY": "default"}  # torch's plain kernels, which every CPU has
    result = run_cli("train", "g", "--parts", "2", "--rounds", "2", "--recipe", "default", "--no-choose-depth",
                     store=store, env=pinned)
    assert result.returncode == 0, result.stderr
    threads = default_threads(2)
    expected = {"torch": torch.__version__, "device": "cpu", "cpu_capability": "DEFAULT", "threads": threads}
    run_dir = next((store / "runs").glob("run=*"))
    layers = [read_manifest(d, LayerManifest) for d in sorted(run_dir.glob("layer=*"))]
    assert len(layers) == 2 and all(m.platform == expected for m in layers)
    label = f"torch {torch.__version__}, cpu, DEFAULT, {threads} thread" + ("s" if threads != 1 else "")
    assert read_manifest(run_dir, RunManifest).platform == label
    assert query(Store(store), "SELECT platform FROM runs")[1] == [(label,)]
    assert f"trained with {label}" in flat(result.stdout)
    report = run_cli("report", run_dir.name.removeprefix("run="), store=store)
    assert report.returncode == 0 and f"- trained with {label}" in report.stdout, report.stderr


def test_cuda_visible_devices_selects_gpus_as_cuda_does(monkeypatch: pytest.MonkeyPatch) -> None:
    uuids = ["GPU-aaaa-1", "GPU-bbbb-2", "GPU-cccc-3"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert _selected(3, uuids) == [0, 1, 2]
    for value, expected in (("2,0", [2, 0]), ("GPU-bbbb", [1]), ("", []), ("1,7,0", [1]), ("0,x,2", [0])):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
        assert _selected(3, uuids) == expected, value


def test_ranks_are_spread_over_the_gpus_round_robin() -> None:
    assert ranks_per_gpu(list(range(8)), 1) == {0: 8}
    assert ranks_per_gpu(list(range(5)), 2) == {0: 3, 1: 2}
    assert ranks_per_gpu([4, 5, 6, 7], 4) == {0: 1, 1: 1, 2: 1, 3: 1}  # the second node of two


def test_the_gpu_memory_estimate_counts_the_ranks_that_share_each_gpu(tiny) -> None:
    store, dataset, partition = tiny
    config = TrainConfig(device="cuda")
    gpus = [Gpu(0, "GPU A", 80 * 10**9, 70 * 10**9), Gpu(1, "GPU B", 80 * 10**9, 70 * 10**9)]
    estimates = gpu_memory_for(dataset, config, 3, partition.halo_total, [0, 1, 2], gpus)
    sizes = training_sizes(dataset, config, 3, partition.halo_total)
    assert [(e.what, e.bytes, gpu.index) for e, gpu in estimates] == [
        ("training 2 rank(s) on GPU 0 (GPU A)", gpu_estimate(sizes, "", 2).bytes, 0),
        ("training 1 rank(s) on GPU 1 (GPU B)", gpu_estimate(sizes, "", 1).bytes, 1)]
    assert gpu_memory_for(dataset, config, 3, partition.halo_total, [0, 1, 2], []) == []


# --------------------------------------------------------------------------- with a GPU


@needs_cuda
def test_sparse_kernels_on_the_gpu_equal_the_cpu_ones() -> None:
    gen = torch.Generator().manual_seed(0)
    a = SparseMatrix.from_dense((torch.rand(50, 40, generator=gen) < 0.1).float() * torch.rand(50, 40, generator=gen))
    x = torch.randn(40, 16, generator=gen, requires_grad=True)
    gpu_a, gpu_x = a.to("cuda"), x.detach().cuda().requires_grad_()
    out, gpu_out = spmm(a, x), spmm(gpu_a, gpu_x)
    out.sum().backward()
    gpu_out.sum().backward()
    torch.testing.assert_close(gpu_out.cpu(), out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gpu_x.grad.cpu(), x.grad, rtol=1e-5, atol=1e-5)
    for rows in (torch.tensor([3, 1, 3, 49]), torch.arange(0)):
        picked = gpu_a.select_rows(rows)
        assert picked.device.type == "cuda"
        torch.testing.assert_close(picked.to(CPU).to_dense(), a.select_rows(rows).to_dense())
    torch.testing.assert_close(gpu_a.t().to(CPU).to_dense(), a.t().to_dense())
    torch.testing.assert_close(gpu_a.columns(5, 30).to(CPU).to_dense(), a.columns(5, 30).to_dense())
    adj = SparseMatrix.from_dense((torch.rand(50, 50, generator=gen) < 0.2).float() + torch.eye(50))
    h, src, dst = torch.randn(50, 2, 4, generator=gen), torch.randn(50, 2, generator=gen), torch.randn(50, 2, generator=gen)
    torch.testing.assert_close(gat_aggregate(adj.to("cuda"), h.cuda(), src.cuda(), dst.cuda()).cpu(),
                               gat_aggregate(adj, h, src, dst), rtol=1e-5, atol=1e-5)
    kept = dropout(torch.ones(1000, 100, device="cuda"), 0.25, torch.Generator(device="cuda").manual_seed(1), True)
    assert kept.device.type == "cuda" and abs(float((kept == 0).float().mean()) - 0.25) < 0.01


def outputs(store: Store, run_fp: str, layer: int) -> np.ndarray:
    """(n, d) full-view outputs of a run's layer over every part, in node id order."""
    parts = [read_embeddings(p) for p in sorted(store.run_dir(run_fp).glob(f"layer={layer}/part=*/embeddings.parquet"))]
    ids = np.concatenate([ids for ids, _ in parts])
    return np.concatenate([views["full"] for _, views in parts])[np.argsort(ids)]


GPU_CASES = [  # without dropout, so that the device generators' masks play no part
    dict(strategy="retexo", model="gcn"),
    dict(strategy="retexo", model="sage", batch_size=7),
    dict(strategy="retexo", model="gat", sync="avg", sync_every=2, compress="int8"),
    dict(strategy="retexo", model="gcn", setting="inductive", skip=True),
    dict(strategy="centralized", model="gcn"),
    dict(strategy="centralized", model="sage", layerwise=True),
    dict(strategy="standard", model="gat", bns_rate=0.5),
    dict(strategy="varco", model="gcn"),
    dict(strategy="tma", model="sage"),
    dict(strategy="grappa", model="gcn"),
]


def trained_on_both(tmp_path_factory: pytest.TempPathFactory, **options: object) -> tuple[RunPlan, RunPlan]:
    """The same run trained on the CPU and on the GPU, each in a store of its own (the device is in
    no fingerprint, so one store would reuse the first run)."""
    runs = []
    for device in ("cpu", "cuda"):
        store, dataset, partition = make_tiny(tmp_path_factory)
        config = small_config(device=device, **options)
        runs.append(train(store, dataset, None if config.strategy_spec.whole_graph else partition, config))
    assert runs[0].run_fp == runs[1].run_fp
    logs = list(runs[1].store.run_dir(runs[1].run_fp).glob("logs/rank-*.log"))
    assert logs and all(" on cuda:0: " in p.read_text() for p in logs)
    return runs[0], runs[1]


@needs_cuda
@pytest.mark.slow
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_a_gpu_run_sends_the_cpu_runs_bytes_and_agrees_within_float_tolerance(
        tmp_path_factory: pytest.TempPathFactory, case: dict[str, object]) -> None:
    cpu, gpu = trained_on_both(tmp_path_factory, **case)
    assert comm_log(cpu) == comm_log(gpu)
    for layer in (1, 2):
        np.testing.assert_allclose(outputs(gpu.store, gpu.run_fp, layer), outputs(cpu.store, cpu.run_fp, layer),
                                   rtol=1e-3, atol=1e-4)


@needs_cuda
@pytest.mark.slow
def test_the_recipe_search_and_dropout_run_on_the_gpu_with_the_cpu_runs_halo_bytes(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """With dropout the masks come from each device's own generator, so the models, and which
    candidate the search keeps, may differ: the halo and control bytes do not (the same
    exchanges, the same candidates screened for the same rounds); the gradient bytes follow the
    kept candidate's parameters (a skip connection adds some)."""
    cpu, gpu = trained_on_both(tmp_path_factory, strategy="retexo", model="gcn", recipe="auto", recipe_screen=1,
                               dropout=0.5)
    on_cpu, on_gpu = comm_log(cpu), comm_log(gpu)
    assert on_cpu.pop("grad_sync") > 0 and on_gpu.pop("grad_sync") > 0
    assert on_cpu == on_gpu


@needs_cuda
def test_a_layer_that_does_not_fit_the_gpu_is_one_line_with_advice() -> None:
    with pytest.raises(DeviceError, match=r"^layer 2 does not fit in the memory of cuda:0 \(.* GB, shared by 3 ranks\): "
                                          r"use --batch-size, more parts .* or --device cpu$"):
        with layer_fits(torch.device("cuda", 0), 2, world=3 * torch.cuda.device_count()):
            raise torch.OutOfMemoryError("CUDA out of memory")
