"""The depth choice (the default under recipe auto, or ``--choose-depth``): a layer-wise run and the
run one layer deeper, the one with the higher validation score kept (``runner.depth``).

The deeper run links the layers the two share (same fingerprints) instead of training them, it
is exactly the plain run with ``layers + 1`` (same fingerprint: a plain run finds it cached),
and the choice's bytes are both runs' logs with the shared layers once.
"""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from conftest import run_cli
from graphstore.errors import RetexoError
from graphstore.lookup import completed_run
from retexo_core.comm.network import NetworkModel
from runner.depth import depth_choice
from runner.lifecycle import run_training
from runner.plan import plan_run, plan_site_run
from training_helpers import IN_PROCESS, small_config


def layer_bytes(store, run_fp: str) -> dict[int, int]:
    """Bytes of a run's log per layer."""
    table = pq.read_table(store.run_dir(run_fp) / "comm.parquet").to_pandas()
    return table.groupby("layer")["bytes"].sum().to_dict()


@pytest.fixture(scope="module")
def chosen(tiny):
    store, dataset, partition = tiny
    plan = plan_run(store, dataset, partition, small_config(choose_depth=True, seed=4), NetworkModel())
    summary, progress = run_training(plan, IN_PROCESS)
    return plan, summary, progress


def test_the_deeper_run_links_the_shared_layers_and_trains_the_rest(chosen) -> None:
    plan, _, progress = chosen
    assert [(p.layer, p.depth, p.state) for p in progress] == [
        (1, 2, "trained"), (2, 2, "trained"), (1, 3, "reused"), (2, 3, "trained"), (3, 3, "trained")]
    shallower, deeper = completed_run(plan.store, plan.run_fp), completed_run(plan.store, plan.deeper.run_fp)
    assert deeper.layers[0].fp == shallower.layers[0].fp and deeper.layers[0].reused_from is not None
    assert deeper.layers[1].fp != shallower.layers[1].fp  # layer 2 is the last of one and hidden in the other
    assert (len(shallower.layers), len(deeper.layers)) == (2, 3)


def test_the_run_kept_is_the_one_with_the_higher_validation_score(chosen) -> None:
    plan, summary, _ = chosen
    choice = depth_choice(plan)
    higher = choice.deeper.score("val") > choice.shallower.score("val")
    assert summary.fp == (plan.deeper.run_fp if higher else plan.run_fp) == choice.kept.fp
    assert f"{len(summary.layers)} (val accuracy" in choice.describe()


def test_the_choice_counts_both_runs_bytes_with_the_shared_layers_once(chosen) -> None:
    plan, _, _ = chosen
    choice = depth_choice(plan)
    shallow, deep = layer_bytes(plan.store, plan.run_fp), layer_bytes(plan.store, plan.deeper.run_fp)
    assert deep[1] == shallow[1] > 0  # the linked layer's log
    assert choice.total_bytes == sum(shallow.values()) + deep[2] + deep[3]
    assert choice.total_bytes == choice.shallower.total_bytes + choice.deeper.total_bytes - deep[1]


def test_the_deeper_run_is_the_plain_run_one_layer_deeper_and_a_rerun_trains_nothing(tiny, chosen) -> None:
    store, dataset, partition = tiny
    plan, summary, _ = chosen
    plain = plan_run(store, dataset, partition, small_config(layers=3, seed=4), NetworkModel())
    assert plain.run_fp == plan.deeper.run_fp
    assert [p.state for p in run_training(plain, IN_PROCESS)[1]] == ["cached"] * 3
    again, progress = run_training(plan_run(store, dataset, partition, small_config(choose_depth=True, seed=4),
                                            NetworkModel()), IN_PROCESS)
    assert again.fp == summary.fp and {p.state for p in progress} == {"cached"}


def test_an_end_to_end_model_is_trained_again_at_both_depths(tiny) -> None:
    store, dataset, partition = tiny
    plan = plan_run(store, dataset, partition, small_config(strategy="standard", choose_depth=True), NetworkModel())
    summary, progress = run_training(plan, IN_PROCESS)
    assert [(p.layer, p.depth, p.state) for p in progress] == [
        (1, 2, "trained"), (2, 2, "trained"), (1, 3, "trained"), (2, 3, "trained"), (3, 3, "trained")]
    choice = depth_choice(plan)
    assert summary.fp == choice.kept.fp
    assert choice.total_bytes == choice.shallower.total_bytes + choice.deeper.total_bytes  # nothing shared


@pytest.mark.parametrize(("options", "message"), [
    ({"layers": 8}, "layers must be at most 7"),
    ({"rounds": [3, 3]}, "not one per layer"),
    ({"warm_start": "abc"}, "a warm start fits one"),
])
def test_a_depth_choice_it_cannot_make_is_refused(options: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        small_config(choose_depth=True, **options)


def test_sites_and_the_command_line_refuse_it_in_one_line(tiny) -> None:
    store, dataset, partition = tiny
    with pytest.raises(RetexoError, match="sites train one depth"):
        plan_site_run(store, dataset, partition, small_config(choose_depth=True), NetworkModel(), 0, 2)
    result = run_cli("train", dataset.name, "--layers", "8", "--choose-depth", store=store.root)
    assert result.returncode == 2
    assert "layers must be at most 7" in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(("options", "chooses"), [
    ({}, True),
    ({"strategy": "centralized"}, True),
    ({"strategy": "centralized", "layerwise": True}, True),
    ({"choose_depth": False}, False),
    ({"recipe": "default"}, False),
    ({"strategy": "standard"}, False),
    ({"strategy": "standard", "choose_depth": True}, True),
    ({"task": "link"}, False),
    ({"layers": 8}, False),
    ({"rounds": [3, 3]}, False),
    ({"warm_start": "abc"}, False),
])
def test_the_default_chooses_the_depth_where_the_recipe_search_runs_and_two_depths_fit(
        options: dict, chooses: bool) -> None:
    """Neither flag: on with recipe auto, task node, a layer-wise strategy or centralized, and a
    configuration that fits two depths; off, without a refusal, everywhere else."""
    from retexo_core.config import TrainConfig

    assert TrainConfig(**options).chooses_depth is chooses


def test_sites_train_one_depth_by_default(tiny) -> None:
    store, dataset, partition = tiny
    config = small_config(recipe="auto")
    assert config.chooses_depth
    plan = plan_site_run(store, dataset, partition, config, NetworkModel(), 0, 2)
    assert plan.deeper is None and plan.config.layers == config.layers
