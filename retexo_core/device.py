"""Where a rank computes: ``--device auto|cpu|cuda`` resolved to a ``torch.device``.

The ranks of one machine are spread over its GPUs round robin (rank r computes on GPU
r mod G; several ranks may share one). Everything a rank trains with then lives on that device:
features, local graphs (``SparseMatrix.to``), parameters, optimizer state and the dropout masks,
drawn from a generator of that device. Setup work (partition files, halo plans, the CSR
structure) is done on the CPU first and moved once. The communicator stages every payload through
host memory for gloo (``retexo_core.comm.communicator``), so the bytes on the wire and in the log
are a CPU run's, and what a rank writes to the store (embeddings, predictions, parameters) is
moved back to the CPU first.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

CPU = torch.device("cpu")


class DeviceError(RuntimeError):
    """The requested device does not exist here, or a layer does not fit in its memory."""


def compute_device(requested: str, rank: int) -> torch.device:
    """The device of rank ``rank`` for ``requested`` (auto | cpu | cuda): the CPU, or GPU
    ``rank mod count`` (auto takes a GPU when torch sees one)."""
    if requested == "cpu":
        return CPU
    if not torch.cuda.is_available():
        if requested == "auto":
            return CPU
        raise DeviceError(f"--device cuda: torch {torch.__version__} sees no CUDA GPU on this machine "
                          f"(use --device cpu or auto)")
    return torch.device("cuda", rank % torch.cuda.device_count())


def platform(device: torch.device) -> dict[str, str | int]:
    """Where a rank trains, as a layer's manifest records it (``LayerManifest.platform``): the torch
    build, the device (``cpu`` or the GPU's name), the CPU's vector instruction set that torch's
    kernels dispatch to (``AVX2``, ``AVX512``, ..) and the torch threads of this rank. The same
    seed gives the same model only where all four are the same: float sums round differently
    under another instruction set or another split over threads."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"torch": torch.__version__, "device": name, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads()}


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in host memory (itself when it is there already)."""
    return tensor if tensor.device.type == "cpu" else tensor.cpu()


def host_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict with every tensor in host memory (what is stored is device independent)."""
    return {name: to_host(value) for name, value in state.items()}


def peak_memory_note(device: torch.device) -> str:
    """``, peak GPU memory X GB`` (what this process allocated on ``device`` at most so far) for
    a rank's log line; '' on the CPU."""
    if device.type != "cuda":
        return ""
    return f", peak GPU memory {torch.cuda.max_memory_allocated(device) / 1e9:.2f} GB"


def ranks_sharing(device: torch.device, world: int) -> int:
    """How many of ``world`` ranks compute on GPU ``device`` (round robin, ``compute_device``)."""
    count = torch.cuda.device_count()
    return sum(1 for rank in range(world) if rank % count == device.index)


@contextmanager
def layer_fits(device: torch.device, layer: int, world: int) -> Iterator[None]:
    """Turn a GPU running out of memory while ``layer`` trains into one ``DeviceError`` line with
    the advice (0 for ``layer``: the whole model of an end-to-end strategy; ``world`` ranks)."""
    try:
        yield
    except torch.OutOfMemoryError as exc:
        if device.type != "cuda":
            raise
        total = torch.cuda.get_device_properties(device).total_memory
        what = f"layer {layer}" if layer else "the model"
        sharing = ranks_sharing(device, world)
        shared = f", shared by {sharing} ranks" if sharing > 1 else ""
        raise DeviceError(f"{what} does not fit in the memory of {device} ({total / 1e9:.1f} GB{shared}): "
                          f"use --batch-size, more parts (--parts, or more machines), or --device cpu") from exc
