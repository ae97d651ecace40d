"""Byte encoding of a block of sparse rows (e.g. bag-of-words features of halo nodes) for the wire.

Payload layout (uint8, no header; the receiver knows ``rows`` and ``cols``)::

    nnz per row      int32   rows * 4 bytes
    column indices   int32   nnz * 4 bytes   (sorted within each row)
    values           "none": float32, nnz * 4 bytes
                     "fp16": float16, nnz * 2 bytes
                     "int8": one float32 scale per row (rows * 4 bytes), then one int8 per value
                             (nnz bytes), quantised symmetrically: value ~= q * scale, |q| <= 127

An empty block (0 rows) encodes to an empty payload. Like :mod:`retexo_core.comm.codec`, the
payload length is exactly what the byte log counts.
"""

from __future__ import annotations

import torch

from retexo_core.comm.codec import Compression
from retexo_core.sparse import SparseMatrix

_INT32_MAX = 2**31 - 1


def _value_nbytes(rows: int, nnz: int, compression: Compression) -> int:
    if compression == "none":
        return nnz * 4
    if compression == "fp16":
        return nnz * 2
    if compression == "int8":
        return rows * 4 + nnz
    raise ValueError(f"unknown compression {compression!r}")


def encoded_rows_nbytes(a: SparseMatrix, compression: Compression) -> int:
    """Exactly ``len(encode_rows(a, compression))`` in bytes, without encoding."""
    rows = a.shape[0]
    if rows == 0:
        _value_nbytes(0, 0, compression)  # still reject an unknown compression
        return 0
    return rows * 4 + a.nnz * 4 + _value_nbytes(rows, a.nnz, compression)


def encode_rows(a: SparseMatrix, compression: Compression) -> torch.Tensor:
    """(rows x cols) sparse block -> uint8 payload (layout in the module docstring).

    Values are sent as float32 (detached); columns must fit in int32.
    """
    rows, cols = a.shape
    _value_nbytes(rows, a.nnz, compression)
    if rows == 0:
        return torch.empty(0, dtype=torch.uint8)
    if cols - 1 > _INT32_MAX:
        raise ValueError(f"{cols} columns do not fit int32 indices")
    counts = a.crow.diff().to(torch.int32)
    col = a.col.to(torch.int32)
    val = a.val.detach().to(torch.float32).contiguous()
    parts = [counts.view(torch.uint8), col.view(torch.uint8)]
    if compression == "none":
        parts.append(val.view(torch.uint8))
    elif compression == "fp16":
        parts.append(val.to(torch.float16).view(torch.uint8))
    else:
        row = a.row_index()
        peak = torch.zeros(rows, dtype=torch.float32).scatter_reduce(0, row, val.abs(), reduce="amax")
        scale = peak.clamp_min(1e-30) / 127.0
        quantised = torch.round(val / scale[row]).clamp(-127, 127).to(torch.int8)
        parts += [scale.view(torch.uint8), quantised.view(torch.uint8)]
    return torch.cat(parts)


def decode_rows(payload: torch.Tensor, rows: int, cols: int, compression: Compression) -> SparseMatrix:
    """uint8 payload from :func:`encode_rows` -> (rows x cols) SparseMatrix (lossy for fp16 / int8).

    ``payload`` may be an unaligned slice of a larger receive buffer. Raises ``ValueError`` when
    its length or content does not fit ``rows`` x ``cols``.
    """
    _value_nbytes(rows, 0, compression)
    if rows == 0:
        if payload.numel():
            raise ValueError(f"expected an empty payload for 0 rows, got {payload.numel()} bytes")
        return SparseMatrix.from_csr(torch.zeros(1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                                     torch.zeros(0), (0, cols))
    if payload.numel() < rows * 4:
        raise ValueError(f"payload of {payload.numel()} bytes is too short for {rows} row counts")
    if payload.storage_offset() % 8:
        payload = payload.clone()  # a slice of a larger receive buffer: realign before reinterpreting
    counts = payload[: rows * 4].view(torch.int32).to(torch.int64)
    if bool((counts < 0).any()):
        raise ValueError("negative entry count in payload")
    nnz = int(counts.sum())
    expected = rows * 4 + nnz * 4 + _value_nbytes(rows, nnz, compression)
    if payload.numel() != expected:
        raise ValueError(f"payload has {payload.numel()} bytes, expected {expected} for {rows} rows, {nnz} entries")
    start = rows * 4
    col = payload[start: start + nnz * 4].view(torch.int32).to(torch.int64)
    start += nnz * 4
    crow = torch.zeros(rows + 1, dtype=torch.int64)
    torch.cumsum(counts, dim=0, out=crow[1:])
    if compression == "none":
        val = payload[start:].view(torch.float32).clone()
    elif compression == "fp16":
        val = payload[start:].view(torch.float16).to(torch.float32)
    else:
        scale = payload[start: start + rows * 4].view(torch.float32)
        quantised = payload[start + rows * 4:].view(torch.int8).to(torch.float32)
        val = quantised * torch.repeat_interleave(scale, counts, output_size=nnz)
    return SparseMatrix.from_csr(crow, col, val, (rows, cols), check=True)
