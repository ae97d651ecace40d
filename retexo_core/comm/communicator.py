"""The one communicator every inter-worker byte goes through (see docs/architecture.md).

The communicator encodes tensors into uint8 payloads, counts and logs them; a ``Transport``
(``retexo_core.comm.transport``) moves the bytes: a gloo process group (one rank per process, the
default) or a ``ThreadHub`` (K ranks as threads of one process; same bytes, same results, same log).
Every operation is one or two all-to-all (alltoallv) steps of uint8 payloads: point-to-point
traffic is one, the all-reduce two (reduce-scatter, all-gather), so what is logged is literally
what is sent: ``2(K-1)/K * N`` bytes per worker for N bytes, as in a ring, with 2 sequential steps.
Every send is logged once, by the sender, with kind, layer, epoch, src, dst, bytes and steps
(hops). All waits have a timeout; a dead peer surfaces as an error naming the rank.

Tensors may live on a GPU: payloads are encoded in host memory (the tensor is copied there
first) and what arrives is decoded there and handed back on the device of the tensors sent, so a
GPU run sends, and logs, exactly a CPU run's bytes over gloo.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from retexo_core.comm.codec import Compression, decode, encode, encoded_nbytes, pack_nonzero, unpack_nonzero
from retexo_core.comm.log import COMPRESSIBLE, CommLog
from retexo_core.comm.network import NetworkModel
from retexo_core.comm.secure_agg import MASKED_KINDS, PairwiseMasks, from_fixed, to_fixed
from retexo_core.comm.transport import GlooTransport, ThreadTransport, Transport
from retexo_core.device import CPU, to_host


class CommunicationError(RuntimeError):
    """A collective failed or timed out; names this rank and the peer when known."""


class Communicator:
    """Byte-counting collectives for one rank of K (or a single process).

    ``transport`` moves the bytes; None means the default gloo process group when ``world > 1``
    (no transport is needed for a single rank).

    Attributes:
        layer, epoch: tags for the log rows of subsequent operations (set by the strategy).
        skip_zero_grads: uncompressed ``grad_sync`` all-reduces send each chunk's non-zero
            entries only (``all_reduce_nonzero``).
        members: partition id of each group rank (changes after a ``rejoin``); generation: how
            many times the group was re-formed.
    """

    def __init__(
        self,
        rank: int,
        world: int,
        timeout: timedelta,
        compression: Compression = "none",
        network: NetworkModel | None = None,
        transport: Transport | None = None,
        skip_zero_grads: bool = False,
    ):
        self.rank = rank  # index in the current process group
        self.world = world
        self.members = list(range(world))  # partition id of each group rank (changes after a rejoin)
        self.generation = 0
        self.transport: Transport | None = transport if transport is not None or world == 1 else GlooTransport()
        self.timeout = timeout
        self.compression = compression
        self.network = network
        self.log = CommLog(rank)
        self.layer = 0
        self.epoch = -1
        self.skip_zero_grads = skip_zero_grads  # grad_sync all-reduces send non-zero entries only
        self.masks: PairwiseMasks | None = None  # secure aggregation of gradient and model sums (sites)

    @property
    def rendezvous(self) -> dist.Store | None:
        """The launcher's key-value store, for ``rejoin`` (gloo transport only)."""
        return self.transport.rendezvous if isinstance(self.transport, GlooTransport) else None

    @rendezvous.setter
    def rendezvous(self, store: dist.Store | None) -> None:
        if isinstance(self.transport, GlooTransport):
            self.transport.rendezvous = store
        elif store is not None:
            raise ValueError(f"rank {self.log.rank}: a rendezvous store serves only the gloo transport, "
                             f"not {type(self.transport).__name__}")

    # -- helpers --------------------------------------------------------------------------
    def codec(self, kind: str) -> Compression:
        """The encoding of traffic of ``kind`` (control traffic is never compressed)."""
        return self.compression if kind in COMPRESSIBLE else "none"

    def _finish(self, op: int, kind: str, sent: dict[int, int], hops: int) -> None:
        for dst, nbytes in sent.items():
            self.log.add(op, self.layer, self.epoch, kind, self.members[dst], nbytes, hops)
        if self.network is not None and self.network.mode == "sleep":
            time.sleep(self.network.seconds(hops, sum(sent.values())))

    def _transport(self) -> Transport:
        if self.transport is None:
            raise CommunicationError(f"rank {self.log.rank}: {self.world} ranks but no transport")
        return self.transport

    def _all_to_all(self, payloads: list[torch.Tensor], recv_sizes: list[int], kind: str,
                    what: str = "exchange", copy: bool = True) -> list[torch.Tensor]:
        """Move uint8 ``payloads[j]`` to rank j; returns what each rank j sent us (``recv_sizes[j]`` B).
        ``copy`` False: this rank writes no payload before its receiver has read it, so the thread
        transport hands them over uncopied."""
        transport = self._transport()
        try:
            if not copy and isinstance(transport, ThreadTransport):
                return transport.all_to_all(payloads, recv_sizes, self.timeout, copy=False)
            return transport.all_to_all(payloads, recv_sizes, self.timeout)
        except RuntimeError as exc:
            raise self._fail(f"{kind} {what}", exc) from exc

    def _fail(self, what: str, exc: Exception) -> CommunicationError:
        return CommunicationError(
            f"rank {self.log.rank}: {what} failed at layer {self.layer}, epoch {self.epoch} "
            f"(a peer died, hung, or timed out after {self.timeout.total_seconds():.0f} s): {exc}"
        )

    # -- point to point -------------------------------------------------------------------
    def exchange(
        self,
        send: list[torch.Tensor | None],
        recv_shapes: list[tuple[int, ...] | None],
        dtype: torch.dtype,
        kind: str,
    ) -> list[torch.Tensor]:
        """All-to-all: ``send[j]`` goes to rank j; returns ``recv[j]`` from rank j (own slot empty).

        Receivers must know the shapes (``recv_shapes[j]``); all tensors share ``dtype``. Empty
        tensors are not logged. What arrives is on the device of the tensors sent (the CPU when
        this rank sends none).
        """
        codec = self.codec(kind)
        op = self.log.new_op()
        device = next((t.device for t in send if t is not None), CPU)
        if self.world == 1:
            return [torch.empty(0, dtype=dtype, device=device)]
        payloads, sent = [], {}
        for j in range(self.world):
            tensor = send[j] if j != self.rank else None
            payload = encode(to_host(tensor).to(dtype), codec) if tensor is not None else torch.empty(0, dtype=torch.uint8)
            payloads.append(payload)
            if payload.numel():
                sent[j] = payload.numel()
        recv_sizes = [
            encoded_nbytes(shape, dtype, codec) if shape is not None and j != self.rank else 0
            for j, shape in enumerate(recv_shapes)
        ]
        buffers = self._all_to_all(payloads, recv_sizes, kind)
        self._finish(op, kind, sent, hops=1)
        return [
            (decode(buffers[j], recv_shapes[j], dtype, codec) if recv_shapes[j] is not None and j != self.rank
             else torch.empty(0, dtype=dtype)).to(device)
            for j in range(self.world)
        ]

    def exchange_counts(self, counts: list[int], kind: str = "control") -> list[int]:
        """Tell every rank j an integer ``counts[j]``; returns what each rank told us (8 B each)."""
        send = [torch.tensor([c], dtype=torch.int64) for c in counts]
        received = self.exchange(send, [(1,)] * self.world, torch.int64, kind)
        return [int(r[0]) if j != self.rank else counts[j] for j, r in enumerate(received)]

    def exchange_variable(self, send: list[torch.Tensor], kind: str) -> list[torch.Tensor]:
        """All-to-all of tensors whose lengths the receivers do not know (lengths sent first).

        ``send[j]`` is (n_j, *tail) with the same tail and dtype for all j.
        """
        tail = tuple(send[0].shape[1:])
        lengths = self.exchange_counts([int(t.shape[0]) for t in send])
        shapes = [(n, *tail) for n in lengths]
        return self.exchange(send, shapes, send[0].dtype, kind)

    def exchange_bytes(self, payloads: list[torch.Tensor], kind: str) -> list[torch.Tensor]:
        """All-to-all of raw uint8 payloads whose lengths the receivers do not know.

        ``payloads[j]``: (n_j,) uint8 bytes for rank j (own slot ignored), e.g. a variable-size
        encoding such as sparse feature rows; never compressed. The lengths go first
        (``exchange_counts``, ``control``, 8 B to each peer), then the payloads, logged under
        ``kind`` with their length in bytes (empty payloads are not logged). Returns ``recv[j]``,
        the (m_j,) uint8 payload from rank j (own slot empty).
        """
        for j, payload in enumerate(payloads):
            if j != self.rank and payload.dtype != torch.uint8:
                raise ValueError(f"rank {self.log.rank}: exchange_bytes sends uint8 payloads, "
                                 f"got {payload.dtype} for rank {j}")
        send = [to_host(p).reshape(-1) if j != self.rank else torch.empty(0, dtype=torch.uint8)
                for j, p in enumerate(payloads)]
        lengths = self.exchange_counts([int(p.numel()) for p in send])
        op = self.log.new_op()
        if self.world == 1:
            return [torch.empty(0, dtype=torch.uint8)]
        recv_sizes = [n if j != self.rank else 0 for j, n in enumerate(lengths)]
        received = self._all_to_all(send, recv_sizes, kind)
        self._finish(op, kind, {j: p.numel() for j, p in enumerate(send) if p.numel()}, hops=1)
        return [r if j != self.rank else torch.empty(0, dtype=torch.uint8) for j, r in enumerate(received)]

    # -- collectives ----------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, kind: str) -> torch.Tensor:
        """Sum over ranks; returns a new tensor, identical on every rank.

        Reduce-scatter then all-gather, each one all-to-all step: the tensor is split into K chunks,
        rank j receives everyone's chunk j and sums them in rank order, then sends the sum of chunk
        j to every rank. Over all ranks that is 2(K-1)N bytes for N bytes, as a ring sends, in 2
        sequential steps instead of 2(K-1). The summed chunk is encoded once and every rank
        (its owner included) decodes that same payload, so replicas are bit-identical even when
        compressed. The sum is returned on ``tensor``'s device.
        """
        if self.masks is not None and kind in MASKED_KINDS and self.world > 1:
            return self.all_reduce_masked(tensor, kind)
        if self.skip_zero_grads and kind == "grad_sync" and self.codec(kind) == "none" and self.world > 1:
            return self.all_reduce_nonzero(tensor, kind)
        op = self.log.new_op()
        if self.world == 1:
            return tensor.clone()
        codec, dtype = self.codec(kind), tensor.dtype
        chunks = list(torch.tensor_split(to_host(tensor.detach()).reshape(-1), self.world))
        shapes = [tuple(c.shape) for c in chunks]
        nothing = torch.empty(0, dtype=torch.uint8)
        scatter = [encode(c, codec) if j != self.rank else nothing for j, c in enumerate(chunks)]
        mine = encoded_nbytes(shapes[self.rank], dtype, codec)
        # uncopied payloads: every receiver has read this rank's chunks before it sends its sum (so
        # before this call returns), and the sums are never written again
        got = self._all_to_all(scatter, [mine if j != self.rank else 0 for j in range(self.world)], kind, "all-reduce",
                               copy=False)
        total = torch.zeros(shapes[self.rank], dtype=dtype)
        for j in range(self.world):
            total += chunks[j] if j == self.rank else decode(got[j], shapes[self.rank], dtype, codec)
        reduced = encode(total, codec)
        sizes = [encoded_nbytes(shapes[j], dtype, codec) if j != self.rank else 0 for j in range(self.world)]
        gathered = self._all_to_all([reduced if j != self.rank else nothing for j in range(self.world)], sizes, kind,
                                    "all-reduce", copy=False)
        out = [decode(reduced if j == self.rank else gathered[j], shapes[j], dtype, codec) for j in range(self.world)]
        sent = {j: scatter[j].numel() + reduced.numel() for j in range(self.world) if j != self.rank}
        self._finish(op, kind, {j: b for j, b in sent.items() if b}, hops=2)
        return torch.cat(out).reshape(tensor.shape).to(tensor.device)

    def all_reduce_masked(self, tensor: torch.Tensor, kind: str) -> torch.Tensor:
        """``all_reduce`` under secure aggregation (``retexo_core.comm.secure_agg``): the values go as
        int64 fixed point plus this rank's pairwise mask, so a chunk's owner sees only masked
        chunks and everyone the exact fixed-point sum. Logged: the float payload under ``kind``,
        the excess of int64 over it under ``secure_agg``."""
        assert self.masks is not None
        op = self.log.new_op()
        values = to_host(tensor.detach()).reshape(-1)
        try:
            fixed = to_fixed(values, self.world)
        except OverflowError as exc:
            raise CommunicationError(f"rank {self.log.rank}: {kind} at layer {self.layer}: {exc}") from exc
        chunks = list(torch.tensor_split(fixed + self.masks.next_mask(fixed.numel()), self.world))
        nothing = torch.empty(0, dtype=torch.uint8)
        scatter = [encode(c, "none") if j != self.rank else nothing for j, c in enumerate(chunks)]
        sizes = [c.numel() * 8 for c in chunks]
        got = self._all_to_all(scatter, [sizes[self.rank] if j != self.rank else 0 for j in range(self.world)], kind,
                               "masked all-reduce")
        total = chunks[self.rank].clone()
        for j in range(self.world):
            if j != self.rank:
                total += decode(got[j], (sizes[self.rank] // 8,), torch.int64, "none")  # wraps modulo 2**64
        reduced = encode(total, "none")
        gathered = self._all_to_all([reduced if j != self.rank else nothing for j in range(self.world)],
                                    [sizes[j] if j != self.rank else 0 for j in range(self.world)], kind,
                                    "masked all-reduce")
        out = [total if j == self.rank else decode(gathered[j], (sizes[j] // 8,), torch.int64, "none")
               for j in range(self.world)]
        plain = {j: (chunks[j].numel() + chunks[self.rank].numel()) * values.element_size()
                 for j in range(self.world) if j != self.rank}
        self._finish(op, kind, plain, hops=2)
        self._finish(op, "secure_agg", {j: scatter[j].numel() + reduced.numel() - plain[j] for j in plain}, hops=0)
        return from_fixed(torch.cat(out), tensor.dtype).reshape(tensor.shape).to(tensor.device)

    def all_reduce_nonzero(self, tensor: torch.Tensor, kind: str) -> torch.Tensor:
        """``all_reduce`` (uncompressed) whose chunks travel as ``pack_nonzero`` payloads: a bitmap
        of the non-zero entries and those entries, or the raw chunk when that is shorter. The sums
        are those of ``all_reduce``, bit for bit (the same chunks, added in rank order). Each of the
        two steps is an ``exchange_bytes``: the payload lengths go first (``control``, 8 B to each
        peer), so an operation is four all-to-all steps instead of two. Gradients of layer-wise
        training on bag-of-words features are zero for every feature that no train node of the
        rank has in its neighbourhood, so their chunks shrink."""
        dtype = tensor.dtype
        chunks = list(torch.tensor_split(to_host(tensor.detach()).reshape(-1), self.world))
        nothing = torch.empty(0, dtype=torch.uint8)
        got = self.exchange_bytes([pack_nonzero(c) if j != self.rank else nothing for j, c in enumerate(chunks)], kind)
        mine = chunks[self.rank].numel()
        total = torch.zeros(mine, dtype=dtype)
        for j in range(self.world):
            total += chunks[j] if j == self.rank else unpack_nonzero(got[j], mine, dtype)
        reduced = pack_nonzero(total)
        gathered = self.exchange_bytes([reduced if j != self.rank else nothing for j in range(self.world)], kind)
        out = [total if j == self.rank else unpack_nonzero(gathered[j], chunks[j].numel(), dtype)
               for j in range(self.world)]
        return torch.cat(out).reshape(tensor.shape).to(tensor.device)

    def barrier(self) -> None:
        """Synchronise all ranks (a counted 8-byte control all-reduce)."""
        self.all_reduce(torch.zeros(1, dtype=torch.int64), "control")

    def barrier_uncounted(self) -> None:
        """Wait until every rank arrived: a coordination point with no payload, NOT logged (e.g.
        every rank has written its files before rank 0 commits). A missing rank is named."""
        if self.world == 1:
            return
        transport = self._transport()
        try:
            transport.barrier(self.timeout)
        except RuntimeError as exc:
            raise self._fail("barrier", exc) from exc

    def rejoin(self) -> None:
        """After a peer died: wait for the launcher to publish the survivors of the next generation
        (key ``members/<g>``), then form a new process group with them (tolerant strategies, gloo
        transport only)."""
        transport = self.transport
        if not isinstance(transport, GlooTransport) or transport.rendezvous is None:
            raise CommunicationError(f"rank {self.log.rank}: cannot rejoin without the launcher's store")
        generation = self.generation + 1
        try:
            members = transport.published_members(generation, self.timeout)
        except RuntimeError as exc:
            raise CommunicationError(f"rank {self.log.rank}: no new membership was published ({exc})") from exc
        if self.log.rank not in members:
            raise CommunicationError(f"rank {self.log.rank} was dropped from the group")
        transport.reform(generation, members.index(self.log.rank), len(members), self.timeout)
        self.generation, self.members = generation, members
        self.rank, self.world = members.index(self.log.rank), len(members)
