"""Scheduled retraining over a changing tables folder: re-ingest on change, stable partitions, the
promotion gate (promote, refuse, keep), predictions in SQL, full caching of an unchanged source,
and warm start (including its 0-round evaluation form)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import prefect_test_server, write_table_version
from flows.params import PipelineParams
from graphstore.sql_query import query
from graphstore.layout import Store
from graphstore.lookup import completed_run, dataset_runs

# one worker runs the whole module: its tests share the temporary Prefect server below
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"), pytest.mark.slow,
              pytest.mark.xdist_group("prefect-retraining")]


@pytest.fixture(scope="module", autouse=True)
def prefect_server() -> Iterator[None]:
    """One temporary Prefect server for this module's flow runs."""
    with prefect_test_server():
        yield


def nightly(store: Path, export: Path, **train: object) -> PipelineParams:
    """The nightly pipeline over ``export`` (a folder with edges / nodes / features files)."""
    return PipelineParams.model_validate({
        "store": str(store),
        "dataset": {"name": "export", "source": "tables", "path": str(export), "tables": {"undirected": True}},
        "partition": {"method": "metis", "parts": 2, "stable_from": "previous"},
        "train": {"hidden": 16, "rounds": 30, "lr": 0.05, "timeout_s": 60, "choose_depth": False, **train},
        "promotion": {"pipeline": "nightly"},
        "retries": 0,
    })


def publish(export: Path, version: int, scratch: Path) -> None:
    """Replace the export folder's files by version ``version`` (as a nightly export job would)."""
    write_table_version(scratch / f"v{version}", version)
    for name in ("edges.csv", "nodes.csv", "features.csv"):
        shutil.copy(scratch / f"v{version}" / name, export / name)


def run(p: PipelineParams) -> tuple[str, dict[str, object]]:
    """(final state type, the flow's summary) of one pipeline run."""
    from flows.pipeline import pipeline_flow

    state = pipeline_flow(p, return_state=True)
    return state.type.value, state.result(raise_on_failure=False)


def sql(store: Path, text: str) -> list[tuple[object, ...]]:
    return query(Store.open(store), text)[1]


def test_nightly_runs_across_a_source_change(tmp_path: Path) -> None:
    store, export = tmp_path / "store", tmp_path / "export"
    export.mkdir()
    publish(export, 1, tmp_path)
    state, first = run(nightly(store, export))
    assert state == "COMPLETED" and first["stages"]["ingest"] == "written"
    assert first["promotion"]["decision"] == "promoted" and first["promotion"]["incumbent"] is None

    publish(export, 2, tmp_path)
    state, second = run(nightly(store, export))
    assert second["stages"]["ingest"] == "written" and second["stages"]["layer 1"] == "trained"
    assert second["dataset"] != first["dataset"]
    decision = second["promotion"]
    assert decision["incumbent"] == first["run"] and decision["incumbent_evaluation_run"] not in (None, first["run"])
    assert (state == "COMPLETED") == (decision["decision"] == "promoted")

    # stable partitions: every node of version 1 keeps its part; the new 5 % are placed
    moved = sql(store, f"""
        SELECT count(*) FILTER (WHERE o.part <> n.part), count(*), (SELECT count(*) FROM nodes WHERE dataset = '{second['dataset']}')
        FROM partitions po JOIN partition_nodes o ON o.partition = po.partition
        JOIN partitions pn ON pn.dataset = '{second['dataset']}'
        JOIN partition_nodes n ON n.partition = pn.partition AND n.node_id = o.node_id
        WHERE po.dataset = '{first['dataset']}'""")
    assert moved == [(0, 400, 420)]
    # predictions: one row per node of the new version, for the new run and for the incumbent's evaluation
    for run_fp in (second["run"], decision["incumbent_evaluation_run"]):
        rows = sql(store, f"SELECT count(*), count(DISTINCT node_id), min(score) > 0, max(score) <= 1, "
                          f"min(dataset) = '{second['dataset']}' FROM predictions WHERE run = '{run_fp}'")
        assert rows == [(420, 420, True, True, True)]
    current = sql(store, "SELECT pipeline, promoted_run, run, count(*) FROM current_predictions GROUP BY ALL")
    assert current == [("nightly", decision["promoted_run"], decision["serving_run"], 420)]

    # unchanged source: everything cached, the gate has nothing new to judge
    state, third = run(nightly(store, export))
    assert all(status == "cached" for stage, status in third["stages"].items() if stage != "promote"), third["stages"]
    assert third["run"] == second["run"]
    assert third["promotion"]["promoted_run"] == decision["promoted_run"] and third["promotion"]["run"] == third["run"]
    history = sql(store, "SELECT decision FROM promotions ORDER BY decided_at")
    assert [h[0] for h in history] == ["promoted", decision["decision"],
                                       "kept" if decision["decision"] == "promoted" else "refused"]


def test_the_gate_refuses_a_worse_model_and_promotes_within_tolerance(tmp_path: Path) -> None:
    store, export = tmp_path / "store", tmp_path / "export"
    export.mkdir()
    publish(export, 1, tmp_path)
    assert run(nightly(store, export))[1]["promotion"]["decision"] == "promoted"
    publish(export, 2, tmp_path)

    # one round at a negligible learning rate: about chance, far below the incumbent
    state, worse = run(nightly(store, export, rounds=1, lr=1e-6))
    refusal = worse["promotion"]
    assert state == "FAILED" and refusal["decision"] == "refused"
    assert refusal["val_acc"] < refusal["incumbent_val_acc"] - 0.005
    assert refusal["promoted_run"] == refusal["incumbent"] and refusal["serving_run"] == refusal["incumbent_evaluation_run"]
    assert sql(store, "SELECT count(*) FROM current_predictions") == [(420,)]

    # the export goes back to version 1: the candidate is the promoted run itself, and the record says so
    publish(export, 1, tmp_path)
    state, again = run(nightly(store, export))
    assert state == "COMPLETED" and again["run"] == refusal["promoted_run"]
    assert {k: again["promotion"][k] for k in ("decision", "run", "promoted_run")} == {
        "decision": "kept", "run": again["run"], "promoted_run": again["run"]}
    publish(export, 2, tmp_path)

    # the same worse model passes when the tolerance covers the gap
    relaxed = nightly(store, export, rounds=1, lr=1e-6).model_dump()
    state, accepted = run(PipelineParams.model_validate({**relaxed, "promotion": {"pipeline": "nightly", "tolerance": 1.0}}))
    assert state == "COMPLETED" and accepted["promotion"]["decision"] == "promoted"
    assert accepted["promotion"]["promoted_run"] == worse["run"]
    assert sql(store, "SELECT run FROM current_predictions LIMIT 1") == [(worse["run"],)]


def test_a_warm_started_night_trains_one_depth_the_promoted_models(tmp_path: Path) -> None:
    """With the depth choice on (the default) a cold night trains two depths and promotes the kept
    one; with ``promotion.warm_start`` the next night starts from that model, at its depth, and
    trains that depth alone."""
    store, export = tmp_path / "store", tmp_path / "export"
    export.mkdir()
    params = nightly(store, export, layers=1, choose_depth=None).model_dump()  # depths 1 and 2: 2 is kept
    params["promotion"] = {"pipeline": "nightly", "warm_start": True, "tolerance": 1.0}
    publish(export, 1, tmp_path)
    state, first = run(PipelineParams.model_validate(params))
    assert state == "COMPLETED" and first["promotion"]["decision"] == "promoted"
    publish(export, 2, tmp_path)
    state, second = run(PipelineParams.model_validate(params))
    assert state == "COMPLETED" and second["promotion"]["decision"] == "promoted"

    trained = {night["dataset"]: [r for r in dataset_runs(Store.open(store), str(night["dataset"]))
                                  if r.config["rounds"] > 0]  # not the incumbent's 0-round evaluation run
               for night in (first, second)}
    assert sorted(r.config["layers"] for r in trained[first["dataset"]]) == [1, 2]
    promoted = completed_run(Store.open(store), str(first["run"]))
    (warm,) = trained[second["dataset"]]
    assert warm.fp == second["run"] and warm.config["warm_start"] == first["run"]
    assert warm.config["layers"] == promoted.config["layers"] == 2


def test_nightly_link_retraining_gates_on_validation_roc_auc(tmp_path: Path) -> None:
    """The link task in the nightly pipeline: each export version gets its link split, the run
    trains on it, and the gate re-evaluates the promoted model on the new pairs (ROC-AUC)."""
    store, export = tmp_path / "store", tmp_path / "export"
    export.mkdir()
    params = nightly(store, export, task="link", link_dim=8).model_dump()
    params["dataset"]["link_split"] = {"val": 0.1, "test": 0.1, "seed": 0}
    publish(export, 1, tmp_path)
    state, first = run(PipelineParams.model_validate(params))
    assert state == "COMPLETED" and first["promotion"]["decision"] == "promoted"
    publish(export, 2, tmp_path)
    state, second = run(PipelineParams.model_validate(params))
    decision = second["promotion"]
    assert decision["incumbent"] == first["run"] and "val roc_auc" in decision["reason"]
    assert (state == "COMPLETED") == (decision["decision"] == "promoted")
    name, pairs = sql(store, f"SELECT d.name, count(*) FROM link_pairs p JOIN datasets d ON d.fp = p.dataset "
                             f"WHERE p.dataset = '{second['dataset']}' GROUP BY d.name")[0]
    assert name == "export_link"
    for run_fp in (second["run"], decision["incumbent_evaluation_run"]):  # both scored on the new version's pairs
        assert sql(store, f"SELECT count(*) FROM link_scores WHERE run = '{run_fp}'") == [(pairs,)]
        auc = sql(store, f"SELECT roc_auc FROM run_evaluation WHERE run = '{run_fp}' AND split = 'val'")[0][0]
        assert 0.5 < auc <= 1.0
