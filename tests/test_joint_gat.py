"""GAT's last two layers trained together (``strategies.joint.GatPair``, ``retexo_core.two_hop``).

On real Cora in 4 random parts:

- after the one extra exchange (the halo nodes' in-edges and the rows of the sources a rank does
  not hold), every rank computes a GAT layer at its owned and halo nodes exactly as the whole graph
  does, and the exchange's bytes are those counted from the partitions' edge and halo lists;
- a run with ``joint_rounds`` starts the pair from the greedy model (the same validation score,
  computed from the exchanged rows) and sends layer 2's rows of the two-hop sources once;
- GAT's pair is off unless asked for or planned where labels are scarce
  (``test_joint_training.py``), and sites refuse it.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from dist_helpers import run_threads
from graphstore.errors import RetexoError
from retexo_core.comm.network import NetworkModel
from retexo_core.config import TrainConfig
from retexo_core.data import PartData, load_part
from retexo_core.exchange import full_plan
from retexo_core.halo import build_plan
from retexo_core.models import Block, local_graph
from retexo_core.two_hop import two_hop
from runner.plan import plan_site_run
from training_helpers import comm_log, small_config, train

PARTS, WIDTH, HIDDEN = 4, 6, 8


def in_degrees(data: PartData) -> dict[int, int]:
    """Node id -> in-edges without self loops, of the part's owned nodes."""
    keep = data.src != data.dst
    counts = np.bincount(data.dst[keep], minlength=data.num_owned)
    return dict(zip(data.node_id.tolist(), counts.tolist()))


def far_sources(parts: list[PartData]) -> list[set[int]]:
    """Per rank: the sources of its halo nodes' in-edges that it holds neither as owned nor as halo."""
    sources: dict[int, set[int]] = {}
    for data in parts:
        ids = np.concatenate([data.node_id, data.halo_id])
        keep = data.src != data.dst
        for s, d in zip(ids[data.src[keep]].tolist(), data.node_id[data.dst[keep]].tolist()):
            sources.setdefault(d, set()).add(s)
    far = []
    for data in parts:
        held = set(data.node_id.tolist()) | set(data.halo_id.tolist())
        far.append({s for u in data.halo_id.tolist() for s in sources.get(u, ())} - held)
    return far


@pytest.fixture(scope="module")
def parts(cora) -> list[PartData]:
    return [load_part(cora.partitions["random"].path, p) for p in range(PARTS)]


def test_every_rank_computes_a_gat_layer_at_its_halo_nodes_as_the_whole_graph_does(parts) -> None:
    ids = np.unique(np.concatenate([p.node_id for p in parts]))
    x = torch.randn(len(ids), WIDTH, generator=torch.Generator().manual_seed(0))
    src = np.concatenate([np.concatenate([p.node_id, p.halo_id])[p.src] for p in parts])
    dst = np.concatenate([p.node_id[p.dst] for p in parts])
    whole_graph = local_graph("gat", np.searchsorted(ids, src), np.searchsorted(ids, dst), torch.zeros(0), len(ids))
    torch.manual_seed(0)
    block = Block("gat", WIDTH, HIDDEN, 2, 0.0, last=False, skip=True).eval()
    with torch.no_grad():
        whole = block(x, whole_graph)

    def rank(comm):
        data = parts[comm.rank]
        plan = full_plan(build_plan(comm, data, inductive=False))
        before = len(comm.log.rows)
        local = x[torch.from_numpy(np.searchsorted(ids, np.concatenate([data.node_id, data.halo_id])))]
        inputs = two_hop(comm, data, plan, local, torch.device("cpu"))
        with torch.no_grad():
            return block(inputs.x, inputs.graph), comm.log.rows[before:]

    results = run_threads(rank, PARTS)
    far = far_sources(parts)
    degree = {k: v for data in parts for k, v in in_degrees(data).items()}
    for data, ((outputs, rows), _) in zip(parts, results):
        held = np.searchsorted(ids, np.concatenate([data.node_id, data.halo_id]))
        torch.testing.assert_close(outputs, whole[torch.from_numpy(held)], rtol=0, atol=1e-5)
    sent = {kind: sum(r[6] for (_, rows), _ in results for r in rows if r[3] == kind)
            for kind in ("control", "two_hop_rows")}
    halo = sum(len(d.halo_id) for d in parts)
    edges = sum(degree[u] for d in parts for u in d.halo_id.tolist())
    lengths = 2 * 8 * PARTS * (PARTS - 1)  # two exchanges of unknown lengths: 8 B to each peer first
    assert sent["control"] == 8 * halo + 8 * edges + 8 * sum(len(f) for f in far) + lengths
    assert sent["two_hop_rows"] == sum(len(f) for f in far) * WIDTH * 4


def manifest(plan, layer: int) -> dict:
    return json.loads((plan.store.run_dir(plan.run_fp) / f"layer={layer}" / "manifest.json").read_text())


def test_a_gat_run_trains_the_pair_from_the_greedy_model_after_one_exchange_of_two_hop_rows(cora, parts) -> None:
    """5: every layer in one launch; 0: layers 1-2 reused from it, greedy; 6: the launch starts at
    layer 3 and rebuilds layer 2's inputs from the store (its halo exchange made again)."""
    config = dict(model="gat", hidden=HIDDEN, heads=2, layers=3, rounds=[4, 3, 3], lr=0.05)
    plans = {rounds: train(cora.store, cora.dataset, cora.partitions["random"],
                           small_config(**config, joint_rounds=rounds, joint_fresh=rounds > 0)) for rounds in (5, 0, 6)}
    greedy = manifest(plans[0], 3)
    assert "joint" not in greedy["recipe"]
    for rounds in (5, 6):
        joint = manifest(plans[rounds], 3)["recipe"]["joint"]
        assert joint["start_val"] == greedy["best_val"]
        assert joint["rounds"] == joint["fresh_rounds"] == rounds  # no patience: every round trains
        assert joint["best_val"] >= joint["start_val"]
        assert comm_log(plans[rounds])["two_hop_rows"] == sum(len(f) for f in far_sources(parts)) * HIDDEN * 4
    assert "two_hop_rows" not in comm_log(plans[0])

    def pair_rounds(plan) -> list[dict]:
        table = pq.read_table(plan.store.run_dir(plan.run_fp) / "layer=3" / "metrics.parquet").to_pylist()
        return [r for r in table if 3 <= r["round"] < 3 + 5]  # the pair's first 5 rounds, after the greedy 3

    assert pair_rounds(plans[6]) == pair_rounds(plans[5]) and len(pair_rounds(plans[5])) == 5 * 3


def test_gats_pair_is_off_unless_asked_for_and_sites_refuse_it(cora) -> None:
    """The configuration alone (before planning decides by the labels): off unless given."""
    assert not TrainConfig(model="gat").trains_jointly
    assert TrainConfig(model="gat", joint_rounds=5).trains_jointly
    assert TrainConfig(model="gcn").trains_jointly
    config = TrainConfig(model="gat", joint_rounds=5, choose_depth=False)
    with pytest.raises(RetexoError, match="sites do not train GAT's last two layers together"):
        plan_site_run(cora.store, cora.dataset, cora.partitions["random"], config, NetworkModel(), site=0, sites=4)
