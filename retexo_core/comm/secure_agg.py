"""Secure aggregation of the sites' gradient and model sums (``--secure-agg``): pairwise masks that
cancel in the sum, so that no site sees another site's gradient or model, only the sum of all.

Setup (once per launch, ``PairwiseMasks.agree``): for every pair of sites i < j, site i draws a
32-byte seed and sends it to site j (kind ``secure_agg``; over the sites' TLS links, so nobody
else learns it). Site i's mask for its n-th masked sum is

    mask_i = sum over j != i of sign(i, j) * PRG(seed_ij, n),   sign = +1 if i < j else -1,

with PRG a PCG64 stream of uniform 64-bit integers. Every value is sent in fixed point,
``round(x * 2**FRACTION_BITS)`` as int64, plus its mask, with int64 arithmetic wrapping modulo
2**64: the masks cancel exactly in the sum over all sites, so the sum is the exact sum of the
fixed-point values. What a site receives from another in the reduce-scatter is that site's chunk
plus a mask that depends on seeds the receiver does not all know (with three sites or more),
uniform modulo 2**64; the all-gather carries only sums.

Cost: the all-reduce sends int64 instead of float32 values, twice the bytes; the excess and the
seeds are logged as ``secure_agg``, the rest under the sum's own kind. Precision: each value is
rounded to 2**-32 (2.3e-10) before summing; values must stay below 2**62 / (K * 2**32) in
magnitude (about 10**9 / K), or the sum fails with one line.

Dropout: a site that goes away in the middle of a sum ends the run (as without secure
aggregation: runs of sites do not drop members); its masks never cancel, so no partial sum is
revealed.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from retexo_core.comm.communicator import Communicator

FRACTION_BITS = 32  # fixed point: values are sent as round(x * 2**32) in int64
SEED_BYTES = 32
MASKED_KINDS = frozenset({"grad_sync", "model_sync"})


class PairwiseMasks:
    """This site's seeds shared with every other site, and the count of masked sums so far."""

    def __init__(self, rank: int, world: int, seeds: dict[int, bytes]) -> None:
        self.rank = rank
        self.world = world
        self.seeds = {j: int.from_bytes(seed, "big") for j, seed in seeds.items()}
        self.count = 0

    @classmethod
    def agree(cls, comm: Communicator) -> PairwiseMasks:
        """Exchange the pairwise seeds through ``comm``: the lower rank of each pair draws."""
        rank, world = comm.rank, comm.world
        drawn = {j: os.urandom(SEED_BYTES) for j in range(rank + 1, world)}
        send = [torch.frombuffer(bytearray(drawn[j]), dtype=torch.uint8) if j in drawn else None for j in range(world)]
        shapes = [(SEED_BYTES,) if j < rank else None for j in range(world)]
        got = comm.exchange(send, shapes, torch.uint8, "secure_agg")
        seeds = {**drawn, **{j: bytes(got[j].numpy()) for j in range(rank)}}
        return cls(rank, world, seeds)

    def next_mask(self, size: int) -> torch.Tensor:
        """(size,) int64: this site's mask for its next masked sum (the sites' masks sum to 0 mod 2**64)."""
        self.count += 1
        mask = np.zeros(size, np.int64)
        low, high = np.iinfo(np.int64).min, np.iinfo(np.int64).max
        with np.errstate(over="ignore"):
            for j, seed in sorted(self.seeds.items()):
                stream = np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=(self.count,))))
                draw = stream.integers(low, high, size=size, dtype=np.int64, endpoint=True)
                mask = mask + draw if self.rank < j else mask - draw
        return torch.from_numpy(mask)


def to_fixed(values: torch.Tensor, world: int) -> torch.Tensor:
    """(n,) int64 fixed point of float ``values``; ``OverflowError`` when a sum of ``world`` could overflow."""
    scaled = values.detach().to(torch.float64) * 2.0 ** FRACTION_BITS
    limit = 2.0 ** 62 / world
    if scaled.numel() and float(scaled.abs().max()) >= limit:
        raise OverflowError(f"a value of {float(values.abs().max()):.3g} is too large for secure aggregation's fixed "
                            f"point (|x| < {limit / 2.0 ** FRACTION_BITS:.3g} with {world} sites)")
    return torch.round(scaled).to(torch.int64)


def from_fixed(total: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float values (``dtype``) of an int64 fixed-point sum."""
    return (total.to(torch.float64) / 2.0 ** FRACTION_BITS).to(dtype)
