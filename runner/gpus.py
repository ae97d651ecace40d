"""This machine's GPUs as a launcher sees them before any worker starts, without importing torch:
NVIDIA's management library (NVML, through ``nvidia-ml-py``) tells how many there are, their names
and their memory. ``CUDA_VISIBLE_DEVICES`` selects among them as it does for torch (indices or
``GPU-`` UUIDs), so GPU i here is torch's ``cuda:i`` in the workers.

Used to refuse ``--device cuda`` on a machine without a GPU (or with a CPU-only torch) in one
line, and to check the GPU memory a training needs (``graphstore.limits.gpu_estimate``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import metadata

from graphstore.errors import RetexoError


@dataclass(frozen=True)
class Gpu:
    """One visible GPU: torch's index, its name, total and free memory (bytes)."""

    index: int
    name: str
    total: int
    free: int


def _selected(count: int, uuids: list[str]) -> list[int]:
    """NVML indices that ``CUDA_VISIBLE_DEVICES`` leaves visible, in torch's order."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return list(range(count))
    chosen = []
    for entry in (e.strip() for e in value.split(",")):
        if entry.isdigit() and int(entry) < count:
            chosen.append(int(entry))
        elif entry.startswith("GPU-") and any(u.startswith(entry) for u in uuids):
            chosen.append(next(i for i, u in enumerate(uuids) if u.startswith(entry)))
        else:
            break  # CUDA stops at the first entry it cannot use
    return chosen


def visible_gpus() -> list[Gpu]:
    """The GPUs torch would see here (none when NVML or its driver is missing)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no nvidia-ml-py, no driver library, or no device: no GPU for us
        return []
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        uuids = [str(pynvml.nvmlDeviceGetUUID(h)) for h in handles]
        gpus = []
        for index, nvml_index in enumerate(_selected(len(handles), uuids)):
            memory = pynvml.nvmlDeviceGetMemoryInfo(handles[nvml_index])
            gpus.append(Gpu(index, str(pynvml.nvmlDeviceGetName(handles[nvml_index])), int(memory.total),
                            int(memory.free)))
        return gpus
    finally:
        pynvml.nvmlShutdown()


def torch_build() -> str:
    """The installed torch's version (``2.13.0+cpu`` for a CPU-only build), '' when none is."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return ""


def training_gpus(device: str) -> list[Gpu]:
    """The GPUs a training with ``--device device`` will use here: none for cpu (and for auto on a
    machine without one); ``RetexoError`` (one line) for cuda where there is no GPU or torch was
    built without CUDA."""
    if device == "cpu":
        return []
    build = torch_build()
    cpu_only = build.endswith("+cpu")
    gpus = [] if cpu_only else visible_gpus()
    if device == "cuda" and not gpus:
        why = (f"the installed torch ({build}) is a CPU-only build" if cpu_only
               else "no NVIDIA GPU is visible on this machine (NVML found none"
                    + (f" among CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']}"
                       if "CUDA_VISIBLE_DEVICES" in os.environ else "") + ")")
        raise RetexoError(f"--device cuda: {why}; use --device cpu, or auto to take a GPU only where there is one")
    return gpus


def ranks_per_gpu(ranks: list[int], count: int) -> dict[int, int]:
    """GPU index -> how many of this machine's ``ranks`` compute on it (rank r on GPU r mod count,
    as ``retexo_core.device.compute_device`` places them)."""
    placed: dict[int, int] = {}
    for rank in ranks:
        placed[rank % count] = placed.get(rank % count, 0) + 1
    return placed
