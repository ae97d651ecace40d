"""Byte encodings of tensors on the wire: raw, fp16, or int8 with one float32 scale per row; and,
lossless and of variable length, the non-zero entries of a tensor (``pack_nonzero``).

Encoded payloads are uint8 tensors; their length is exactly what the log counts.
"""

from __future__ import annotations

import numpy as np
import torch

from retexo_core.config import Compression


def encoded_nbytes(shape: tuple[int, ...], dtype: torch.dtype, compression: Compression) -> int:
    """Payload size of a tensor of ``shape``/``dtype`` under ``compression`` (floats only compress)."""
    numel = 1
    for size in shape:
        numel *= size
    if numel == 0:
        return 0
    if dtype != torch.float32 or compression == "none":
        return numel * torch.empty((), dtype=dtype).element_size()
    if compression == "fp16":
        return numel * 2
    rows = shape[0] if len(shape) > 1 else 1
    return rows * 4 + numel


def encode(tensor: torch.Tensor, compression: Compression) -> torch.Tensor:
    """Tensor -> uint8 payload. int8 quantises symmetrically per row (per tensor for 1-D)."""
    tensor = tensor.detach().contiguous()
    if tensor.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    if tensor.dtype != torch.float32 or compression == "none":
        return tensor.reshape(-1).view(torch.uint8)
    if compression == "fp16":
        return tensor.to(torch.float16).reshape(-1).view(torch.uint8)
    rows = tensor.reshape(tensor.shape[0], -1) if tensor.dim() > 1 else tensor.reshape(1, -1)
    scale = rows.abs().amax(dim=1).clamp_min(1e-30) / 127.0
    quantised = torch.round(rows / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return torch.cat([scale.to(torch.float32).view(torch.uint8), quantised.reshape(-1).view(torch.uint8)])


def decode(payload: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, compression: Compression) -> torch.Tensor:
    """uint8 payload -> tensor of ``shape``/``dtype`` (lossy for fp16 / int8)."""
    if payload.numel() == 0:
        return torch.zeros(shape, dtype=dtype)
    if payload.storage_offset() % 8:
        payload = payload.clone()  # a slice of a larger receive buffer: realign before reinterpreting
    if dtype != torch.float32 or compression == "none":
        return payload.view(dtype).reshape(shape)  # a view of the receive buffer, which nobody reuses
    if compression == "fp16":
        return payload.view(torch.float16).to(torch.float32).reshape(shape)
    rows = shape[0] if len(shape) > 1 else 1
    scale = payload[: rows * 4].view(torch.float32)
    values = payload[rows * 4:].view(torch.int8).to(torch.float32).reshape(rows, -1)
    return (values * scale[:, None]).reshape(shape)


def pack_nonzero(values: torch.Tensor) -> torch.Tensor:
    """(n,) tensor -> uint8 payload: a bitmap of its non-zero entries (ceil(n / 8) B) followed by those
    entries, when that is shorter than the raw n * itemsize bytes; else the raw bytes. Lossless
    (a -0.0 entry comes back as +0.0); ``unpack_nonzero`` tells the two forms apart by the length."""
    flat = values.detach().contiguous().reshape(-1)
    mask = flat != 0
    bitmap_bytes = (flat.numel() + 7) // 8
    if bitmap_bytes + int(mask.sum()) * flat.element_size() >= flat.numel() * flat.element_size():
        return flat.view(torch.uint8)  # decided from the count: no gather for a chunk sent raw
    bitmap = torch.from_numpy(np.packbits(mask.numpy()))
    return torch.cat([bitmap, flat[mask].view(torch.uint8)])


def unpack_nonzero(payload: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The (numel,) tensor of ``dtype`` that ``pack_nonzero`` encoded as ``payload``."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    payload = payload.clone() if payload.storage_offset() % 8 else payload  # realign a slice of a buffer
    if payload.numel() == numel * itemsize:
        return payload.view(dtype).reshape(numel)
    bitmap_bytes = (numel + 7) // 8
    mask = torch.from_numpy(np.unpackbits(payload[:bitmap_bytes].numpy(), count=numel).astype(bool))
    out = torch.zeros(numel, dtype=dtype)
    out[mask] = payload[bitmap_bytes:].clone().view(dtype)
    return out
