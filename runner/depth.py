"""The depth of a model, chosen on validation (``TrainConfig.chooses_depth``: the default under
recipe auto, or ``--choose-depth``).

A run that chooses its depth is two runs in the store: its own (``layers`` = L) and the run one layer
deeper (``RunPlan.deeper``, L + 1), trained after it by the lifecycle. In layer-wise training their
first L - 1 layers have the same fingerprints (a layer depends on the options of layers 1..l and on
whether it is the last), so the deeper run links them from the shallower one instead of training
them: it trains layer L again as a hidden layer, and layer L + 1. An end-to-end model is trained
again as a whole. The kept run is the one with the higher validation score (accuracy, or ROC-AUC
where the run reports one); the shallower on ties. The test split is never read to choose.

The choice is a function of the two stored run manifests (``depth_choice``), so a scheduled
retraining over unchanged data finds both runs cached and keeps the same depth. Its cost is both
runs' traffic with the layers they share counted once; of the deeper run's own traffic, the
second launch's halo setup and layer L's halo exchange repeat what the shallower run sent.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from graphstore.layout import Store
from graphstore.lookup import completed_run
from graphstore.manifests import RunManifest
from graphstore.parquet_io import read_table
from runner.plan import RunPlan


@dataclass(frozen=True)
class DepthChoice:
    """The two runs of a depth choice and what the choice cost."""

    shallower: RunManifest
    deeper: RunManifest
    total_bytes: int  # both runs' traffic, the layers they share once

    @property
    def kept(self) -> RunManifest:
        """The deeper run when its validation score is higher, else the shallower one."""
        return self.deeper if self.deeper.score("val") > self.shallower.score("val") else self.shallower

    def describe(self) -> str:
        """One line: the validation score of each depth and the one kept."""
        short, deep = self.shallower, self.deeper
        return (f"depth chosen on validation: {len(self.kept.layers)} (val {short.score_name('val')} "
                f"{short.score('val'):.4f} with {len(short.layers)} layers, {deep.score('val'):.4f} with "
                f"{len(deep.layers)}); {self.total_bytes:,} bytes for both")


def shared_bytes(store: Store, deeper: RunManifest, shallower: RunManifest) -> int:
    """Bytes of the deeper run's log in the layers it shares with the shallower run (same layer
    fingerprint: linked, not trained again)."""
    mine = {ref.fp for ref in shallower.layers}
    shared = [ref.layer for ref in deeper.layers if ref.fp in mine]
    if not shared:
        return 0
    comm = read_table(store.run_dir(deeper.fp) / "comm.parquet", columns=["layer", "bytes"])
    return int(pc.sum(comm.filter(pc.is_in(comm["layer"], value_set=pa.array(shared, pa.int64())))["bytes"]).as_py() or 0)


def depth_choice(plan: RunPlan) -> DepthChoice:
    """The choice between ``plan``'s run and ``plan.deeper``'s, both completed in the store."""
    assert plan.deeper is not None, "depth_choice needs a plan that chooses its depth"
    store = plan.store
    shallower, deeper = completed_run(store, plan.run_fp), completed_run(store, plan.deeper.run_fp)
    total = shallower.total_bytes + deeper.total_bytes - shared_bytes(store, deeper, shallower)
    return DepthChoice(shallower, deeper, total)
