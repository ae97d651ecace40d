"""Secure aggregation (``retexo_core.comm.secure_agg``): three ranks sum under pairwise masks, as
threads over a ``ThreadHub`` whose transports record what each rank receives."""

from __future__ import annotations

import threading
from datetime import timedelta

import numpy as np
import pytest
import torch

from retexo_core.comm.communicator import Communicator, CommunicationError
from retexo_core.comm.secure_agg import FRACTION_BITS, SEED_BYTES, PairwiseMasks, to_fixed
from retexo_core.comm.transport import ThreadHub, ThreadTransport

WORLD = 3
SIZE = 10_001  # not a multiple of the world: chunks of unequal length


class Recording:
    """A rank's transport that keeps a copy of every payload it receives, by sender."""

    def __init__(self, inner: ThreadTransport) -> None:
        self.inner = inner
        self.received: list[tuple[int, torch.Tensor]] = []

    def all_to_all(self, send: list[torch.Tensor], recv_sizes: list[int], timeout: timedelta) -> list[torch.Tensor]:
        got = self.inner.all_to_all(send, recv_sizes, timeout)
        self.received += [(j, g.clone()) for j, g in enumerate(got) if j != self.inner.rank and g.numel()]
        return got

    def barrier(self, timeout: timedelta) -> None:
        self.inner.barrier(timeout)


def gradients(rank: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(rank).normal(0, 1e-3, SIZE).astype(np.float32))


def on_every_rank(body) -> dict[int, object]:  # body(comm) -> result
    hub = ThreadHub(WORLD)
    comms = [Communicator(r, WORLD, timedelta(seconds=30), transport=Recording(hub.transport(r))) for r in range(WORLD)]
    results: dict[int, object] = {}

    def run(rank: int) -> None:
        try:
            results[rank] = body(comms[rank])
        except BaseException as exc:  # noqa: BLE001  (reported to the test)
            results[rank] = exc
            hub.abort(repr(exc))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(WORLD)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return {"results": results, "comms": comms}  # type: ignore[dict-item]


def test_masked_sums_equal_the_fixed_point_sum_and_no_rank_receives_another_ranks_values() -> None:
    def body(comm: Communicator) -> tuple[torch.Tensor, torch.Tensor]:
        plain = comm.all_reduce(gradients(comm.rank), "grad_sync")
        comm.masks = PairwiseMasks.agree(comm)
        comm.transport.received.clear()  # type: ignore[union-attr]
        return plain, comm.all_reduce(gradients(comm.rank), "grad_sync")

    done = on_every_rank(body)
    results, comms = done["results"], done["comms"]
    fixed = [to_fixed(gradients(r), WORLD) for r in range(WORLD)]
    exact = (sum(fixed) / 2.0 ** FRACTION_BITS).to(torch.float32)  # type: ignore[union-attr]
    for rank in range(WORLD):
        plain, masked = results[rank]  # type: ignore[index, misc]
        assert torch.equal(masked, exact)  # the exact sum of the fixed-point values, on every rank
        assert torch.allclose(masked, plain, rtol=0, atol=WORLD * 2.0 ** -FRACTION_BITS + 1e-9)
    for rank in range(WORLD):  # what rank received in the masked sum: nothing of another rank's values
        own_chunk = torch.tensor_split(torch.arange(SIZE), WORLD)[rank]
        for sender, payload in comms[rank].transport.received:  # type: ignore[union-attr]
            values = payload.view(torch.int64)
            if values.numel() == own_chunk.numel() and sender != rank:
                assert not (values == fixed[sender][own_chunk]).any()
            floats = gradients(sender).numpy().tobytes()
            assert floats[:16] not in payload.numpy().tobytes()


def test_masked_sums_log_the_plain_bytes_and_the_excess_as_secure_agg() -> None:
    def body(comm: Communicator) -> None:
        comm.masks = PairwiseMasks.agree(comm)
        comm.all_reduce(gradients(comm.rank), "grad_sync")

    done = on_every_rank(body)
    chunks = [c.numel() for c in torch.tensor_split(torch.arange(SIZE), WORLD)]
    for rank, comm in enumerate(done["comms"]):  # type: ignore[attr-defined]
        rows = comm.log.to_table().to_pylist()
        by_kind: dict[str, int] = {}
        for row in rows:
            by_kind[row["kind"]] = by_kind.get(row["kind"], 0) + row["bytes"]
        plain = sum((chunks[j] + chunks[rank]) * 4 for j in range(WORLD) if j != rank)  # as an unmasked float32 sum
        seeds = SEED_BYTES * (WORLD - 1 - rank)  # the lower rank of each pair draws and sends the seed
        assert by_kind == {"grad_sync": plain, "secure_agg": plain + seeds}


def test_a_value_too_large_for_the_fixed_point_is_one_line() -> None:
    def body(comm: Communicator) -> None:
        comm.masks = PairwiseMasks.agree(comm)
        comm.all_reduce(torch.full((4,), 1e12), "grad_sync")

    results = on_every_rank(body)["results"]
    assert all(isinstance(results[r], CommunicationError) for r in range(WORLD))  # type: ignore[index]
    assert "too large for secure aggregation's fixed point" in str(results[0])  # type: ignore[index]


def test_the_masks_of_all_ranks_cancel() -> None:
    seeds = {(i, j): bytes([i, j]) * (SEED_BYTES // 2) for i in range(WORLD) for j in range(i + 1, WORLD)}
    masks = [PairwiseMasks(r, WORLD, {j: seeds[min(r, j), max(r, j)] for j in range(WORLD) if j != r})
             for r in range(WORLD)]
    for _ in range(3):
        drawn = [m.next_mask(1000) for m in masks]
        assert torch.equal(drawn[0] + drawn[1] + drawn[2], torch.zeros(1000, dtype=torch.int64))
        assert (drawn[0] != 0).all()


@pytest.mark.parametrize("bad", [{"compress": "int8"}, {"skip_zero_grads": True}])
def test_secure_aggregation_refuses_lossy_or_sparse_sums(bad: dict[str, object]) -> None:
    from retexo_core.config import TrainConfig

    with pytest.raises(ValueError, match="secure_agg sums masked fixed-point values"):
        TrainConfig(secure_agg=True, **bad)
