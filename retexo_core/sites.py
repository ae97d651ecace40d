"""Sites that keep their own data: they meet in the process group, find out who owns the remote
sources of their edges, agree on what to train, and (at the end) tell the coordinator their byte
totals. Every message here is logged as ``control`` at layer 0 with epoch ``SITE_EPOCH`` (-2), so the
traffic of site coordination is told apart from the halo setup (epoch -1) and from training.

Discovery: a hash-sharded directory of owned ids.

1. Site r registers each owned id v with the directory shard ``shard(v) = mix(v) mod K`` (a
   64-bit mixing hash, so that structured ids spread evenly): 8 B per id, except the ids of its
   own shard, which stay local.
2. Site r asks each shard for the owner of each remote source id in it (8 B per id) and the shard
   answers with the owning site (4 B per id); ids of its own shard it looks up locally.

What this reveals: shard j learns the ids (not the features, labels, edges or degrees) of the
nodes that hash to j and which site owns each, and which sites hold edges from each of them (one
request per remote source, no count). About (K-1)/K of every site's node ids thus reach some other
site. Nothing else leaves a site in discovery.

Agreement: one exchange of five integers per pair of sites (the digest of the training options,
the feature width, the classes, whether every feature is non-negative, the first layer this site
has not finished): the options must be identical, the widths equal; the class count is the
largest, non-negativity must hold everywhere, and training starts at the earliest unfinished layer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from retexo_core.comm.communicator import Communicator
from retexo_core.comm.log import KINDS
from retexo_core.comm.network import NetworkModel
from graphstore.layout import UNKNOWN_OWNER
from retexo_core.data import PartData, local_positions

SITE_EPOCH = -2  # epoch tag of every site-coordination message in the comm log


class SiteMismatch(RuntimeError):
    """The sites cannot train together: different options, feature widths or node ownership."""


def shard_of(ids: np.ndarray, world: int) -> np.ndarray:
    """(n,) int64 directory shard of each id: splitmix64's finaliser of the id, modulo ``world``."""
    z = ids.astype(np.uint64)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z % np.uint64(world)).astype(np.int64)


def _by_shard(ids: np.ndarray, world: int) -> list[np.ndarray]:
    shards = shard_of(ids, world)
    return [ids[shards == j] for j in range(world)]


def discover_owners(comm: Communicator, owned: np.ndarray, remote: np.ndarray) -> np.ndarray:
    """(h,) int64 owning site of each of the (h,) ``remote`` ids, through the directory above.

    ``owned``: (n,) this site's node ids. Raises ``SiteMismatch`` when an id is owned by two sites,
    or when a remote id is owned by none (an edge names a node no site holds).
    """
    world, rank = comm.world, comm.rank
    registered = comm.exchange_variable([torch.from_numpy(ids) for ids in _by_shard(owned, world)], "control")
    mine = [owned[shard_of(owned, world) == rank]] + [registered[j].numpy() for j in range(world) if j != rank]
    owners = [rank] + [j for j in range(world) if j != rank]
    directory_ids = np.concatenate(mine)
    directory_owner = np.concatenate([np.full(len(ids), site, np.int64) for ids, site in zip(mine, owners)])
    order = np.argsort(directory_ids, kind="stable")
    directory_ids, directory_owner = directory_ids[order], directory_owner[order]
    twice = np.flatnonzero(directory_ids[1:] == directory_ids[:-1])
    if len(twice):
        i = twice[0]
        raise SiteMismatch(f"node {directory_ids[i]} is owned by sites {directory_owner[i]} and "
                           f"{directory_owner[i + 1]}: every node must be held by exactly one site")

    def look_up(ids: np.ndarray) -> np.ndarray:
        pos = np.searchsorted(directory_ids, ids).clip(0, max(len(directory_ids) - 1, 0))
        found = directory_ids[pos] == ids if len(directory_ids) else np.zeros(len(ids), bool)
        return np.where(found, directory_owner[pos] if len(directory_ids) else -1, UNKNOWN_OWNER)

    asks = _by_shard(remote, world)
    asked = comm.exchange_variable([torch.from_numpy(ids) for ids in asks], "control")
    answers = [torch.from_numpy(look_up(asked[j].numpy()).astype(np.int32)) if j != rank else None
               for j in range(world)]
    got = comm.exchange(answers, [(len(asks[j]),) for j in range(world)], torch.int32, "control")
    owner_of = {j: got[j].numpy().astype(np.int64) if j != rank else look_up(asks[j]) for j in range(world)}
    shards = shard_of(remote, world)
    owner = np.empty(len(remote), np.int64)
    for j in range(world):
        owner[shards == j] = owner_of[j]
    if (owner == UNKNOWN_OWNER).any():
        node = remote[np.flatnonzero(owner == UNKNOWN_OWNER)[0]]
        raise SiteMismatch(f"site {rank}: an edge comes from node {node}, which no site holds")
    return owner


def remote_ids(data: PartData) -> np.ndarray:
    """(r,) sorted ids whose site a site partition does not know: its halo, and (link task) the
    sources of its pairs that another site holds."""
    if data.pairs is None:
        return data.halo_id
    unknown = data.pairs.src_owner == UNKNOWN_OWNER
    return np.union1d(data.halo_id, data.pairs.src_id[unknown])


def with_owners(data: PartData, rank: int, world: int, remote: np.ndarray, owner: np.ndarray) -> PartData:
    """The site partition ``data`` (one part, owners unknown) as part ``rank`` of ``world``, given
    the owning site of each ``remote`` id (``remote_ids``, ``discover_owners``): the halo ordered by
    (owner, id), the edges' source positions renumbered to match, the pairs' source sites set."""
    def owner_of(ids: np.ndarray) -> np.ndarray:
        return owner[np.searchsorted(remote, ids)] if len(ids) else np.empty(0, np.int64)

    halo_owner = owner_of(data.halo_id)
    order = np.lexsort((data.halo_id, halo_owner))
    halo_id, halo_owner = data.halo_id[order], halo_owner[order]
    ids = np.concatenate([data.node_id, data.halo_id])[data.src]
    pairs = data.pairs
    if pairs is not None:
        unknown = pairs.src_owner == UNKNOWN_OWNER
        src_owner = np.full(len(unknown), rank, np.int64)
        src_owner[unknown] = owner_of(pairs.src_id[unknown])
        pairs = dataclasses.replace(pairs, src_owner=src_owner)
    return dataclasses.replace(data, part=rank, num_parts=world, halo_id=halo_id, halo_owner=halo_owner,
                               src=local_positions(data.node_id, halo_id, ids), held_by_site=True, pairs=pairs)


@dataclass(frozen=True)
class Agreement:
    """What the sites agreed on: the class count, non-negativity of all features, the first layer
    to train (``layers + 1`` when every site has finished every layer)."""

    num_classes: int
    features_nonnegative: bool
    start_layer: int


def options_digest(payload: object) -> int:
    """A 63-bit digest of ``payload``'s canonical JSON (training options, or one of them), compared across sites."""
    text = json.dumps(payload, sort_keys=True, default=str)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1


def agree(comm: Communicator, data: PartData, options: dict[str, object], first_unfinished: int) -> Agreement:
    """Exchange (options digest, features, classes, non-negative, first unfinished layer) with every
    site; ``SiteMismatch`` names the first site whose options (and which of them) or feature width differ."""
    mine = torch.tensor([options_digest(options), int(data.x.shape[1]), data.num_classes,
                         int(data.features_nonnegative), first_unfinished], dtype=torch.int64)
    got = comm.exchange([mine if j != comm.rank else None for j in range(comm.world)],
                        [(5,)] * comm.world, torch.int64, "control")
    rows = [mine if j == comm.rank else got[j] for j in range(comm.world)]
    if any(int(row[0]) != int(mine[0]) for row in rows):  # every site sees the same rows, so all come here
        raise SiteMismatch(differing_options(comm, options, [int(row[0]) for row in rows]))
    for j, row in enumerate(rows):
        if int(row[1]) != int(mine[1]):
            raise SiteMismatch(f"site {j} has {int(row[1])} features per node, site {comm.rank} {int(mine[1])}")
    return Agreement(num_classes=max(int(r[2]) for r in rows), features_nonnegative=all(int(r[3]) for r in rows),
                     start_layer=min(int(r[4]) for r in rows))


def differing_options(comm: Communicator, options: dict[str, object], digests: list[int]) -> str:
    """One line naming the first site whose options differ from this site's, and the options: every
    site sends every other its option names' digest and one digest per option (``control`` bytes)."""
    names = sorted(options)
    mine = torch.tensor([options_digest(names)] + [options_digest([k, options[k]]) for k in names], dtype=torch.int64)
    got = comm.exchange_variable([mine if j != comm.rank else mine[:0] for j in range(comm.world)], "control")
    other = next(j for j, digest in enumerate(digests) if digest != digests[comm.rank])
    theirs = got[other]
    head = f"site {other} trains with other options than site {comm.rank}"
    if theirs.numel() != mine.numel() or int(theirs[0]) != int(mine[0]):
        return f"{head}: another version of retexo (other option names); every site must run the same version"
    differ = [k for k, a, b in zip(names, mine[1:].tolist(), theirs[1:].tolist()) if a != b]
    here = ", ".join(f"{k} (here: {json.dumps(options[k], default=str)})" for k in differ)
    return f"{head}: {here}; every site must give the same training options"


def gather_traffic(comm: Communicator, rows: pa.Table, network: NetworkModel) -> dict[str, object] | None:
    """The run's traffic of every site, at the coordinator (site 0; None elsewhere).

    ``rows``: this site's whole comm log of the run so far. Each site sends the coordinator its
    bytes per kind and, per operation (layer, op), its time under ``network``: K-1 small
    messages of 8 B per kind and 24 B per operation (its keys too), after their lengths
    (8 B to every site). The coordinator adds these messages' own bytes to what the sites
    reported (it knows their sizes), so the totals are those of every site's log exactly.

    Returns ``{"bytes_by_kind": {kind: bytes}, "bytes_by_site": {site: bytes}, "sim_comm_s": s}``.
    """
    world, rank = comm.world, comm.rank
    kinds = {k: 0 for k in KINDS}
    if rows.num_rows:
        grouped = rows.group_by("kind").aggregate([("bytes", "sum")])
        kinds.update(zip(grouped.column("kind").to_pylist(), grouped.column("bytes_sum").to_pylist()))
    per_op = op_seconds(rows, network)
    comm.layer, comm.epoch = 0, SITE_EPOCH
    totals = comm.exchange([torch.tensor([kinds[k] for k in KINDS]) if j == 0 else None for j in range(world)],
                           [(len(KINDS),) if rank == 0 else None] * world, torch.int64, "control")
    ops = torch.tensor(per_op, dtype=torch.float64).reshape(-1, 3)
    got = comm.exchange_variable([ops if j == 0 else ops[:0] for j in range(world)], "control")
    if rank != 0:
        return None
    by_kind = dict(kinds)
    by_kind["control"] += 8 * (world - 1)  # the coordinator's own part of the gather: the lengths it sent
    by_site = {0: sum(by_kind.values())}
    slowest: dict[tuple[int, int], float] = {(int(l), int(o)): s for l, o, s in per_op}
    for j in range(1, world):
        reported = dict(zip(KINDS, (int(v) for v in totals[j])))
        own_messages = 8 * len(KINDS) + 8 * (world - 1) + got[j].numel() * 8  # the three messages above
        reported["control"] += own_messages
        for kind, value in reported.items():
            by_kind[kind] += value
        by_site[j] = sum(reported.values())
        for l, o, s in got[j].tolist():
            slowest[(int(l), int(o))] = max(slowest.get((int(l), int(o)), 0.0), s)
    largest = max((got[j].numel() * 8 for j in range(1, world)), default=0)
    sim = sum(slowest.values()) + sum(network.seconds(1, b) for b in (8 * len(KINDS), 8 * (world - 1), largest))
    return {"bytes_by_kind": {k: v for k, v in by_kind.items() if v}, "bytes_by_site": by_site, "sim_comm_s": sim}


def op_seconds(rows: pa.Table, network: NetworkModel) -> list[tuple[int, int, float]]:
    """(layer, op, seconds) of every operation in which this site sent: its bytes over ``network``."""
    if rows.num_rows == 0:
        return []
    grouped = rows.group_by(["layer", "op"]).aggregate([("bytes", "sum"), ("hops", "max")])
    return [(l, o, network.seconds(h, b)) for l, o, b, h in zip(
        *(grouped.column(c).to_pylist() for c in ("layer", "op", "bytes_sum", "hops_max")))]
