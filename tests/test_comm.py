"""The communicator: codecs, the all-reduce and the exchange log exactly what they send.

Every communicator behaviour runs over both transports: real gloo process groups (spawned, seconds;
the scenarios of one world size share one spawned group) and K threads over a ``ThreadHub``
(milliseconds). Both must give identical values and identical log rows.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
import torch.distributed as dist

from dist_helpers import run_ranks_batch, run_threads
from retexo_core.comm.codec import decode, encode, encoded_nbytes, pack_nonzero, unpack_nonzero
from retexo_core.comm.communicator import CommunicationError, Communicator
from retexo_core.comm.transport import GlooTransport, ThreadHub

Runner = Callable[..., list[tuple[Any, list]]]


@pytest.mark.parametrize("compression,expected", [("none", 4 * 12), ("fp16", 2 * 12), ("int8", 3 * 4 + 12)])
def test_codec_sizes_and_roundtrip(compression: str, expected: int) -> None:
    x = torch.linspace(-3, 5, 12).reshape(3, 4)
    payload = encode(x, compression)  # type: ignore[arg-type]
    assert payload.dtype == torch.uint8 and payload.numel() == expected
    assert encoded_nbytes((3, 4), torch.float32, compression) == expected  # type: ignore[arg-type]
    back = decode(payload, (3, 4), torch.float32, compression)  # type: ignore[arg-type]
    tolerance = {"none": 0.0, "fp16": 1e-2, "int8": 5 / 127}[compression]
    assert torch.allclose(back, x, atol=tolerance + 1e-7)


def test_integers_are_never_compressed() -> None:
    ids = torch.arange(5, dtype=torch.int64)
    assert encode(ids, "int8").numel() == 40
    assert torch.equal(decode(encode(ids, "int8"), (5,), torch.int64, "int8"), ids)


def test_pack_nonzero_keeps_the_nonzero_entries_or_the_raw_bytes_whichever_is_shorter() -> None:
    sparse = torch.zeros(20)
    sparse[[3, 17]] = torch.tensor([1.5, -2.0])
    payload = pack_nonzero(sparse)
    assert payload.numel() == 3 + 2 * 4  # a 20-bit bitmap, then the two values
    assert torch.equal(unpack_nonzero(payload, 20, torch.float32), sparse)
    dense = torch.arange(1, 21, dtype=torch.float32)
    assert pack_nonzero(dense).numel() == 80
    assert torch.equal(unpack_nonzero(pack_nonzero(dense), 20, torch.float32), dense)
    assert torch.equal(unpack_nonzero(pack_nonzero(torch.zeros(9)), 9, torch.float32), torch.zeros(9))
    assert pack_nonzero(torch.zeros(9)).numel() == 2


# --------------------------------------------------------------------------- rank functions


def _sparse_input(rank: int) -> torch.Tensor:
    """60 entries, 3 chunks of 20: chunk 0 dense, chunks 1 and 2 with one non-zero per rank."""
    x = torch.zeros(60)
    x[:20] = torch.arange(1, 21, dtype=torch.float32) * (rank + 1)
    x[20 + rank] = 1.0
    x[40 + 2 * rank] = -float(rank + 1)
    return x


def _allreduce_nonzero(comm: Communicator) -> np.ndarray:
    comm.layer, comm.epoch = 2, 5
    comm.skip_zero_grads = True
    return comm.all_reduce(_sparse_input(comm.rank), "grad_sync").numpy()


def _allreduce_ten(comm: Communicator) -> np.ndarray:
    comm.layer, comm.epoch = 3, 7
    x = torch.arange(10, dtype=torch.float32) * (comm.rank + 1)
    return comm.all_reduce(x, "grad_sync").numpy()


def _allreduce_int8(comm: Communicator) -> np.ndarray:
    x = torch.linspace(-1, 1, 101) * (comm.rank + 1)
    return comm.all_reduce(x, "grad_sync").numpy()


def _exchange(comm: Communicator) -> list[list[float]]:
    send = [torch.full((comm.rank + 1, 2), float(comm.rank * 10 + j)) for j in range(comm.world)]
    shapes = [(j + 1, 2) for j in range(comm.world)]
    got = comm.exchange(send, shapes, torch.float32, "halo_embeddings")
    return [g.reshape(-1).tolist() for g in got]


def _exchange_int8(comm: Communicator) -> list[list[float]]:
    send = [torch.linspace(-1, 1, 3 * (comm.rank + j + 1)).reshape(-1, 3) for j in range(comm.world)]
    shapes = [(comm.rank + j + 1, 3) for j in range(comm.world)]
    return [g.reshape(-1).tolist() for g in comm.exchange(send, shapes, torch.float32, "halo_embeddings")]


def _bytes_length(src: int, dst: int) -> int:
    """Payload length src -> dst in _exchange_bytes, in bytes: 2, 0, 1, 1, 2, 0 for the 3-rank pairs
    (0, 1), (0, 2), (1, 0), (1, 2), (2, 0), (2, 1)."""
    return (src + 2 * dst) % 4


def _exchange_bytes(comm: Communicator) -> list[list[int]]:
    comm.layer, comm.epoch = 1, 4
    send = [torch.full((_bytes_length(comm.rank, j),), 10 * comm.rank + j, dtype=torch.uint8)
            for j in range(comm.world)]
    got = comm.exchange_bytes(send, "halo_features")
    return [g.tolist() for g in got]


def _barriers(comm: Communicator) -> int:
    comm.barrier_uncounted()
    comm.barrier()
    comm.barrier_uncounted()
    return comm.rank


# --------------------------------------------------------------------------- the two transports

GLOO_BATCHES: dict[int, list[tuple[Callable[[Communicator], Any], str]]] = {
    3: [(_allreduce_ten, "none"), (_allreduce_nonzero, "none"), (_exchange, "none"), (_exchange_int8, "int8"),
        (_exchange_bytes, "none"), (_barriers, "none")],
    4: [(_allreduce_int8, "int8")],
}
SCENARIOS = [(fn, world, compression) for world, calls in GLOO_BATCHES.items() for fn, compression in calls]


@functools.cache
def _gloo_batch(world: int) -> dict[tuple[str, str], list[tuple[Any, list]]]:
    calls = GLOO_BATCHES[world]
    return {(fn.__name__, c): results for (fn, c), results in zip(calls, run_ranks_batch(calls, world))}


def run_gloo(fn: Callable[[Communicator], Any], world: int, compression: str = "none") -> list[tuple[Any, list]]:
    """``run_ranks`` for the scenarios of ``GLOO_BATCHES``: one spawned group per world size runs them all."""
    return _gloo_batch(world)[(fn.__name__, compression)]


@pytest.fixture(params=[pytest.param("gloo", marks=pytest.mark.slow), "threads"])
def run(request: pytest.FixtureRequest) -> Runner:
    return {"gloo": run_gloo, "threads": run_threads}[request.param]


@pytest.mark.parametrize("fn,world,compression", SCENARIOS, ids=[f"{fn.__name__}-{c}" for fn, _, c in SCENARIOS])
@pytest.mark.slow
def test_threads_and_gloo_give_identical_values_and_log_rows(fn: Callable[[Communicator], Any], world: int,
                                                            compression: str) -> None:
    gloo, threads = run_gloo(fn, world, compression), run_threads(fn, world, compression)
    for (gloo_value, gloo_rows), (thread_value, thread_rows) in zip(gloo, threads, strict=True):
        np.testing.assert_equal(thread_value, gloo_value)
        assert thread_rows == gloo_rows


# --------------------------------------------------------------------------- contracts (both transports)


def test_all_reduce_sums_and_logs_what_reduce_scatter_and_all_gather_send(run: Runner) -> None:
    world = 3
    results = run(_allreduce_ten, world)
    expected = np.arange(10, dtype=np.float32) * sum(range(1, world + 1))
    chunks = [len(c) for c in np.array_split(np.arange(10), world)]  # elements per chunk: 4, 3, 3
    for rank, (value, rows) in enumerate(results):
        np.testing.assert_array_equal(value, expected)
        assert len(rows) == world - 1  # one row per peer
        for op, layer, epoch, kind, src, dst, nbytes, hops in rows:
            assert (layer, epoch, kind, src, hops) == (3, 7, "grad_sync", rank, 2)
            # reduce-scatter: the peer's chunk; all-gather: the sum of our own chunk
            assert nbytes == 4 * (chunks[dst] + chunks[rank])
    # in total each chunk crosses K-1 links twice, as in a ring: 2(K-1)/K * N per worker on average
    assert sum(row[6] for _, rows in results for row in rows) == 2 * (world - 1) * 40


def test_all_reduce_of_nonzero_entries_sums_exactly_and_logs_the_packed_lengths(run: Runner) -> None:
    world = 3
    results = run(_allreduce_nonzero, world)
    inputs = [_sparse_input(r) for r in range(world)]
    expected = sum(inputs)
    chunks = [list(torch.tensor_split(x, world)) for x in inputs]
    for rank, (value, rows) in enumerate(results):
        np.testing.assert_array_equal(value, expected.numpy())
        mine = torch.tensor_split(expected, world)[rank]
        logged = sorted((kind, dst, nbytes, hops) for _, layer, epoch, kind, _, dst, nbytes, hops in rows)
        peers = [j for j in range(world) if j != rank]
        # per step: the payload lengths (8 B to each peer), then the packed chunk (reduce-scatter:
        # the peer's chunk of our input; all-gather: our summed chunk)
        assert logged == sorted([("control", j, 8, 1) for j in peers] * 2
                                + [("grad_sync", j, pack_nonzero(chunks[rank][j]).numel(), 1) for j in peers]
                                + [("grad_sync", j, pack_nonzero(mine).numel(), 1) for j in peers])
    grad_bytes = sum(row[6] for _, rows in results for row in rows if row[3] == "grad_sync")
    # reduce-scatter: chunk 0 raw (80 B) from 2 ranks, chunks 1 and 2 one value each (3 + 4 B) from 2
    # ranks; all-gather: summed chunk 0 raw, chunks 1 and 2 three values each (3 + 12 B), to 2 ranks
    assert grad_bytes == 2 * 80 + 4 * (3 + 4) + 2 * 80 + 4 * (3 + 12)
    assert grad_bytes < 2 * (world - 1) * 60 * 4  # the dense all-reduce's bytes


def test_compressed_all_reduce_is_identical_on_every_rank(run: Runner) -> None:
    results = run(_allreduce_int8, 4, compression="int8")
    values = [r[0] for r in results]
    for other in values[1:]:
        np.testing.assert_array_equal(values[0], other)  # bit-identical replicas
    np.testing.assert_allclose(values[0], np.linspace(-1, 1, 101) * 10, atol=0.25)
    sizes = [len(c) for c in np.array_split(np.arange(101), 4)]
    # every chunk travels to K-1 ranks twice, as one int8 per value plus its float32 scale
    assert sum(row[6] for r in results for row in r[1]) == 2 * 3 * sum(s + 4 for s in sizes)


def test_exchange_delivers_and_logs_each_message_once_by_its_sender(run: Runner) -> None:
    results = run(_exchange, 3)
    for rank, (got, rows) in enumerate(results):
        for j in range(3):
            assert got[j] == ([] if j == rank else [float(j * 10 + rank)] * (2 * (j + 1)))
        assert sorted((r[5], r[6]) for r in rows) == [(j, 4 * 2 * (rank + 1)) for j in range(3) if j != rank]


def test_compressed_exchange_of_uneven_blocks_decodes_each_block(run: Runner) -> None:
    """int8 blocks (a scale per row + one byte per value) land at unaligned offsets of the receive buffer."""
    results = run(_exchange_int8, 3, compression="int8")
    for rank, (got, rows) in enumerate(results):
        for j in range(3):
            if j != rank:
                np.testing.assert_allclose(got[j], np.linspace(-1, 1, 3 * (j + rank + 1)), atol=1 / 127)
        assert sorted((r[5], r[6]) for r in rows) == [(j, (rank + j + 1) * (4 + 3)) for j in range(3) if j != rank]


def test_exchange_bytes_sends_lengths_then_variable_payloads_and_logs_both(run: Runner) -> None:
    results = run(_exchange_bytes, 3)
    for rank, (got, rows) in enumerate(results):
        assert got == [[] if j == rank else [10 * j + rank] * _bytes_length(j, rank) for j in range(3)]
        peers = [j for j in range(3) if j != rank]
        lengths = [(0, 1, 4, "control", rank, j, 8, 1) for j in peers]  # op 0: one int64 to every peer
        payloads = [(1, 1, 4, "halo_features", rank, j, _bytes_length(rank, j), 1)
                    for j in peers if _bytes_length(rank, j)]  # op 1: empty payloads are not logged
        assert sorted(rows) == sorted(lengths + payloads)
    assert sum(row[6] for _, rows in results for row in rows) == 6 * 8 + 2 + 1 + 1 + 2


def test_only_the_counted_barrier_is_logged(run: Runner) -> None:
    results = run(_barriers, 3)
    # one int64 over 3 ranks: chunks of 1, 0, 0 elements, so only chunk 0 costs bytes: ranks 1 and 2
    # send it to rank 0 (reduce-scatter), rank 0 sends the sum to ranks 1 and 2 (all-gather)
    assert [rows for _, rows in results] == [
        [(0, 0, -1, "control", 0, 1, 8, 2), (0, 0, -1, "control", 0, 2, 8, 2)],
        [(0, 0, -1, "control", 1, 0, 8, 2)],
        [(0, 0, -1, "control", 2, 0, 8, 2)],
    ]


# --------------------------------------------------------------------------- thread transport


SHORT = timedelta(seconds=0.3)


def test_a_wait_for_an_absent_peer_times_out_naming_it() -> None:
    """Rank 1 never shows up: every kind of wait gives up after the timeout and names it."""
    transport = ThreadHub(2).transport(0)
    waits = {
        "all_to_all": lambda: transport.all_to_all([torch.empty(0, dtype=torch.uint8)] * 2, [0, 4], SHORT),
        "barrier": lambda: transport.barrier(SHORT),
    }
    for op, wait in waits.items():
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"rank 0 waited 0.3 s for rank 1 \({op}\)"):
            wait()
        assert SHORT.total_seconds() <= time.monotonic() - start < SHORT.total_seconds() + 1.0


def test_the_communicator_reports_an_absent_peer_as_a_communication_error() -> None:
    comm = Communicator(0, 3, SHORT, transport=ThreadHub(3).transport(0))
    comm.layer, comm.epoch = 2, 5
    with pytest.raises(CommunicationError, match=r"rank 0: grad_sync all-reduce .* layer 2, epoch 5 .*"
                                                 r"rank 0 waited 0.3 s for ranks 1, 2"):
        comm.all_reduce(torch.ones(6), "grad_sync")
    with pytest.raises(CommunicationError, match=r"rank 0: barrier failed .* for ranks 1, 2 \(barrier\)"):
        comm.barrier_uncounted()
    assert comm.log.rows == []


def test_uncounted_barrier_holds_every_rank_until_the_last_arrives() -> None:
    def late_rank_zero(comm: Communicator) -> tuple[float, float]:
        if comm.rank == 0:
            time.sleep(0.2)
        arrived = time.monotonic()
        comm.barrier_uncounted()
        return arrived, time.monotonic()

    results = run_threads(late_rank_zero, 4)
    last_arrival = max(arrived for (arrived, _), _ in results)
    assert all(left >= last_arrival for (_, left), _ in results)
    assert all(rows == [] for _, rows in results)


def test_abort_wakes_every_waiting_rank_at_once_and_fails_later_operations() -> None:
    hub = ThreadHub(3)
    errors: dict[int, str] = {}

    def wait(rank: int) -> None:
        try:
            hub.transport(rank).barrier(timedelta(seconds=60))
        except RuntimeError as exc:
            errors[rank] = str(exc)

    threads = [threading.Thread(target=wait, args=(r,)) for r in (0, 1)]  # rank 2 "died"
    for thread in threads:
        thread.start()
    time.sleep(0.1)
    start = time.monotonic()
    hub.abort("rank 2 died")
    for thread in threads:
        thread.join(5)
    assert time.monotonic() - start < 1.0
    assert errors == {0: "rank 2 died", 1: "rank 2 died"}
    with pytest.raises(RuntimeError, match="rank 2 died"):
        hub.transport(1).barrier(timedelta(seconds=60))


def test_run_threads_aborts_the_peers_of_a_failed_rank_and_reraises_its_error() -> None:
    def rank_one_fails(comm: Communicator) -> None:
        if comm.rank == 1:
            raise ValueError("bad partition")
        comm.all_reduce(torch.ones(4), "grad_sync")

    start = time.monotonic()
    with pytest.raises(ValueError, match="bad partition"):
        run_threads(rank_one_fails, 3)  # peers wait with the 60 s default timeout
    assert time.monotonic() - start < 5.0


def test_a_message_of_the_wrong_size_is_an_error() -> None:
    def rank_one_expects_more(comm: Communicator) -> None:
        shapes = [(2,) if comm.rank == 1 and j == 0 else (1,) for j in range(comm.world)]
        comm.exchange([torch.ones(1)] * comm.world, shapes, torch.float32, "halo_features")

    with pytest.raises(CommunicationError, match=r"rank 1 expected 8 B from rank 0 \(all_to_all\) but 4 B arrived"):
        run_threads(rank_one_expects_more, 2)


def test_ranks_issuing_different_operations_is_an_error() -> None:
    def rank_one_skips_the_barrier(comm: Communicator) -> None:
        if comm.rank == 0:
            comm.barrier_uncounted()
        comm.all_reduce(torch.ones(2), "grad_sync")

    mismatch = r"expected a (all_to_all|barrier) message from rank [01] but got a (barrier|all_to_all) message"
    with pytest.raises(CommunicationError, match=mismatch + r" \(the ranks issued different operations\)"):
        run_threads(rank_one_skips_the_barrier, 2)


class _SumOverRanks(torch.autograd.Function):
    """Forward and backward both all-reduce (the backward communicates, like halo gradients)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator) -> torch.Tensor:  # type: ignore[override]
        ctx.comm = comm
        return comm.all_reduce(x.detach(), "grad_sync")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return ctx.comm.all_reduce(grad, "halo_grads"), None


def test_thread_ranks_communicate_inside_their_concurrent_backward_passes() -> None:
    """CPU autograd runs each backward on the thread that called it, so ranks' backwards interleave."""
    def train_step(comm: Communicator) -> list[float]:
        x = torch.full((4,), float(comm.rank + 1), requires_grad=True)
        (_SumOverRanks.apply(2 * x, comm) * (comm.rank + 1)).sum().backward()
        return x.grad.tolist()  # type: ignore[union-attr]

    results = run_threads(train_step, 3)
    assert [value for value, _ in results] == [[2.0 * (1 + 2 + 3)] * 4] * 3
    # one row per peer and operation
    assert [[row[3] for row in rows] for _, rows in results] == [["grad_sync"] * 2 + ["halo_grads"] * 2] * 3


def test_a_sent_payload_is_a_copy_the_sender_may_overwrite() -> None:
    hub = ThreadHub(2)
    payload = torch.arange(5, dtype=torch.uint8)
    hub.put(0, 1, "all_to_all", payload)
    payload.zero_()
    (got,) = hub.take(1, [0], "all_to_all", [5], SHORT)
    assert got.tolist() == [0, 1, 2, 3, 4]


def test_thread_all_reduce_shares_no_memory_with_its_input_or_the_other_ranks_results() -> None:
    """The all-reduce hands its payloads over uncopied; what it returns is still every rank's own."""
    def reduce_then_write(comm: Communicator) -> list[float]:
        mine = torch.full((7,), float(comm.rank + 1))
        total = comm.all_reduce(mine, "grad_sync")
        mine.fill_(100.0)  # the caller writes its input again
        comm.barrier_uncounted()
        total += comm.rank  # and each rank its result
        comm.barrier_uncounted()
        return total.tolist()

    results = run_threads(reduce_then_write, 3)
    assert [value for value, _ in results] == [[6.0 + rank] * 7 for rank in range(3)]


# --------------------------------------------------------------------------- a single rank, rejoin


def test_a_single_rank_needs_no_transport() -> None:
    comm = Communicator(0, 1, SHORT)
    assert comm.transport is None
    comm.barrier_uncounted()
    assert [p.numel() for p in comm.exchange_bytes([torch.ones(3, dtype=torch.uint8)], "halo_features")] == [0]
    assert comm.all_reduce(torch.ones(2), "grad_sync").tolist() == [1.0, 1.0]
    assert comm.log.rows == [] and comm.log.next_op == 3


def test_the_rendezvous_store_belongs_to_the_gloo_transport() -> None:
    store = dist.HashStore()
    comm = Communicator(1, 3, SHORT)
    assert isinstance(comm.transport, GlooTransport) and comm.rendezvous is None
    comm.rendezvous = store
    assert comm.transport.rendezvous is store and comm.rendezvous is store
    threaded = Communicator(1, 3, SHORT, transport=ThreadHub(3).transport(1))
    threaded.rendezvous = None  # what a worker without a launcher store assigns
    with pytest.raises(ValueError, match="only the gloo transport"):
        threaded.rendezvous = store
    with pytest.raises(CommunicationError, match="rank 1: cannot rejoin without the launcher's store"):
        threaded.rejoin()


def test_rejoin_waits_for_the_published_members_and_leaves_a_dropped_rank_out() -> None:
    store = dist.HashStore()
    comm = Communicator(1, 3, SHORT)
    comm.rendezvous = store
    with pytest.raises(CommunicationError, match="rank 1: no new membership was published"):
        comm.rejoin()
    store.set("members/1", "0,2")
    with pytest.raises(CommunicationError, match="rank 1 was dropped from the group"):
        comm.rejoin()
    assert (comm.generation, comm.members, comm.world) == (0, [0, 1, 2], 3)


def test_rejoin_forms_a_new_group_of_the_survivors(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 1-rank gloo group in this process: partition 2 survives alone and re-forms as rank 0."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    store = dist.HashStore()
    dist.init_process_group("gloo", store=dist.PrefixStore("gen0", store), rank=0, world_size=1,
                            timeout=timedelta(seconds=10))
    try:
        comm = Communicator(2, 3, timedelta(seconds=10))
        comm.rendezvous = store
        store.set("members/1", "2")
        comm.rejoin()
        assert (comm.generation, comm.members, comm.rank, comm.world) == (1, [2], 0, 1)
        assert dist.is_initialized() and dist.get_world_size() == 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_the_network_model_counts_wire_bytes_acks_and_the_busiest_link_per_step() -> None:
    from retexo_core.comm.log import COMM_SCHEMA
    from retexo_core.comm.network import ACK_SHARE, FRAME_HEADERS, MSS, NetworkModel, simulated_seconds

    segment = MSS + FRAME_HEADERS
    rows = [  # (op, layer, epoch, kind, src, dst, bytes, hops)
        (0, 1, 0, "halo_embeddings", 0, 1, 10 * MSS, 1),  # rank 0 sends 10 full segments, rank 1 5
        (0, 1, 0, "halo_embeddings", 1, 0, 5 * MSS, 1),
        (1, 1, 0, "grad_sync", 0, 1, 4 * MSS, 2),  # an all-reduce: two steps of 2 segments each way
        (1, 1, 0, "grad_sync", 1, 0, 4 * MSS, 2),
    ]
    log = pa.Table.from_pylist([dict(zip(COMM_SCHEMA.names, r)) for r in rows], schema=COMM_SCHEMA)
    net = NetworkModel(latency_ms=10, bandwidth_mbps=8)  # 1 B per microsecond
    total, per_worker = simulated_seconds(log, net)
    exchange = 10 * segment + ACK_SHARE * 5 * segment  # rank 0's link: its data and its ACKs of rank 1's
    step = 2 * segment * (1 + ACK_SHARE)
    assert total == pytest.approx(0.010 + exchange * 1e-6 + 2 * (0.010 + step * 1e-6))
    assert per_worker[1] == pytest.approx(0.010 + (5 + 10 * ACK_SHARE) * segment * 1e-6 + 2 * (0.010 + step * 1e-6))
