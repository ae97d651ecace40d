"""The suite's checks table (``benchmarks/accuracy.py``): gaps in points, paired seed by seed; the table of
today's defaults rebuilt from its kept runs (``benchmarks/todays_defaults.py``)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

from processes import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from accuracy import MARK, bytes_table, checks, checks_table, merged, paired_gap, score_table  # noqa: E402
from todays_defaults import MARK as TODAY  # noqa: E402
from todays_defaults import ROWS, VARIANTS, collect_runs, paired_rows  # noqa: E402


def test_paired_gap_is_the_gap_of_the_means_with_the_standard_error_of_the_per_seed_gaps():
    gap, error = paired_gap([0.80, 0.70, 0.75], [0.78, 0.71, 0.72])  # per seed: +2, -1, +3 points
    assert gap == pytest.approx(4 / 3)
    assert error == pytest.approx((((2 - 4 / 3) ** 2 + (-1 - 4 / 3) ** 2 + (3 - 4 / 3) ** 2) / 2) ** 0.5 / 3 ** 0.5)
    assert paired_gap([0.9], [0.8]) == (pytest.approx(10.0), None)
    with pytest.raises(ValueError):
        paired_gap([0.9, 0.8], [0.8])  # seeds must pair up


def test_checks_mark_a_gap_below_its_limit_and_omit_the_error_for_one_seed_or_unpaired_seeds():
    def row(graph: str, variant: str, test: list[float]) -> dict[str, object]:
        return {"graph": graph, "model": "gcn", "variant": variant, "test": test}

    rows = [row("a", "reference", [0.80, 0.82]), row("a", "centralized", [0.80, 0.80]),
            row("a", "retexo", [0.78, 0.79]),
            row("b", "reference", [0.50]), row("b", "centralized", [0.51]),
            row("c", "reference", [0.50, 0.60, 0.70]), row("c", "centralized", [0.62])]  # parts of unequal seeds
    lines = checks(rows)
    assert lines == [
        "| a | gcn | centralized − reference -1.0 ± 1.0 FAILS | retexo − centralized -1.5 ± 0.5 FAILS |",
        "| b | gcn | centralized − reference +1.0 ok |",
        "| c | gcn | centralized − reference +2.0 ok |",
    ]


def test_parts_merge_seed_lists_and_a_part_without_bytes_shows_a_dash():
    def row(variant: str, test: list[float], mb: float | None) -> dict[str, object]:
        return {"graph": "a", "model": "gcn", "variant": variant, "seeds": len(test), "val": test, "test": test,
                "mb": mb, "seconds": None if mb is None else 1.0}

    rows = merged([row("retexo", [0.7], 10.0), row("retexo", [0.8, 0.9], 40.0),
                   row("retexo avg/5 int8", [0.7], 1.0), row("retexo avg/5 int8", [0.8], None)])
    assert [(r["test"], r["seeds"], r["mb"]) for r in rows] == [([0.7, 0.8, 0.9], 3, 30.0), ([0.7, 0.8], 2, None)]
    assert rows[0]["seconds"] == 2.0 and rows[1]["seconds"] is None
    assert bytes_table(rows)[2] == "| a | gcn | 30.0 | – |"


def test_the_table_of_todays_defaults_is_rebuilt_from_the_kept_runs():
    """``benchmarks/todays_defaults.py`` assembles exactly the committed ``todays_defaults.json`` from
    the per-seed runs in ``benchmarks/suite_rows``, every variant of a pair with the same seeds."""
    rows = paired_rows(collect_runs())
    assert rows == json.loads((ROWS / "todays_defaults.json").read_text())
    pairs: dict[tuple[str, str], set[int]] = {}
    for row in rows:
        pairs.setdefault((row["graph"], row["model"]), set()).add(row["seeds"])
        assert len(row["val"]) == len(row["test"]) == row["seeds"]
    assert all(len(counts) == 1 for counts in pairs.values())
    assert len(rows) == len(pairs) * len(VARIANTS)


def block(path: Path, name: str, mark: str) -> list[str]:
    """The lines between ``mark``'s ``name start`` and ``name end`` lines of ``path``."""
    after_start = path.read_text().split(mark.format(f"{name} start") + "\n", 1)[1]
    return after_start.split("\n" + mark.format(f"{name} end"), 1)[0].split("\n")


def test_the_readme_and_the_docs_show_the_tables_of_todays_defaults():
    """README.md's score table and docs/accuracy.md's "Today's defaults" tables are what
    ``todays_defaults.py --write-docs`` writes from the committed rows."""
    rows = json.loads((ROWS / "todays_defaults.json").read_text())
    assert block(REPO / "README.md", "scores", MARK) == score_table(rows)
    docs = REPO / "docs" / "accuracy.md"
    for name, table in (("scores", score_table), ("bytes", bytes_table), ("checks", checks_table)):
        assert block(docs, name, TODAY) == table(rows)


def test_the_docs_show_the_tables_of_the_holdout_protocol():
    """docs/accuracy.md's tables of ``benchmarks/holdout_split.py`` (a 60/20/20 split drawn at
    ingest) are those of its committed rows, every variant of a pair with the same seeds."""
    rows = json.loads((ROWS / "holdout_split.json").read_text())
    assert all(len(r["val"]) == len(r["test"]) == r["seeds"] == 3 for r in rows) and len(rows) == 9 * len(VARIANTS)
    docs = REPO / "docs" / "accuracy.md"
    mark = "<!-- holdout split: {} -->"
    assert block(docs, "scores", mark) == score_table(rows)
    assert block(docs, "checks", mark) == checks_table(rows)


def test_the_docs_show_the_tables_of_ten_fresh_seeds():
    """docs/accuracy.md's tables of Cora and CiteSeer, GCN and GAT, on seeds 10-19 are those of their
    committed rows (today's defaults), alone and after the table's seeds 0-9 (paired seed by seed
    over twenty)."""
    fresh = json.loads((ROWS / "fresh_seeds.json").read_text())
    assert len(fresh) == 16 and all(r["seeds"] == len(r["val"]) == len(r["test"]) == 10 for r in fresh)
    pairs = {(r["graph"], r["model"]) for r in fresh}
    assert pairs == {(g, m) for g in ("cora", "citeseer") for m in ("gcn", "gat")}
    today = [r for r in json.loads((ROWS / "todays_defaults.json").read_text()) if (r["graph"], r["model"]) in pairs]
    docs, mark = REPO / "docs" / "accuracy.md", "<!-- fresh seeds: {} -->"
    assert block(docs, "scores", mark) == score_table(fresh)
    assert block(docs, "checks", mark) == checks_table(fresh)
    assert block(docs, "checks of twenty", mark) == checks_table(merged(today + fresh))


def test_the_docs_show_the_tables_of_the_depth_margin():
    """docs/accuracy-search.md's tables of ``benchmarks/depth_margin.py`` are those of its committed runs
    (layer-wise on the suite's splits and under 60/20/20, ``centralized`` end to end)."""
    from depth_margin import read_runs, summary, table

    docs = REPO / "docs" / "accuracy-search.md"
    margins = [0.0, 0.5, 1.0, float("inf")]
    for name in ("suite", "holdout", "centralized"):
        runs = read_runs(ROWS / f"depth_margin_{name}.jsonl")
        assert block(docs, name, "<!-- depth margin: {} -->") == table(runs, margins) + [""] + summary(runs, margins)


@pytest.mark.parametrize("page, mark, runs, against, against_variant", [
    # the probe that searches layer 1's skip connection and input features together
    ("accuracy-layerwise.md", "skip and features together", ["skip_features_together"],
     ["depth_margin_suite", "skip_features_greedy_actor"], None),
    ("accuracy-search.md", "layer-wise against end to end", ["depth_margin_suite"], ["depth_margin_centralized"],
     "centralized"),
    ("accuracy-search.md", "validation size", ["validation_half_a"], ["validation_whole"], None),
    # the probe of a smoothed statistic for the recipe search, layer-wise and end to end (not adopted)
    ("accuracy-search.md", "recipe score smoothed", ["recipe_score_smoothed"], ["depth_margin_suite"],
     "centralized --layerwise"),
    ("accuracy-search.md", "recipe score smoothed, end to end", ["recipe_score_smoothed_centralized"],
     ["depth_margin_centralized"], "centralized"),
    # the probe of ELU after GAT's hidden blocks, end to end (not adopted)
    ("accuracy-search.md", "gat elu, end to end", ["gat_elu_centralized"], ["depth_margin_centralized"], "centralized"),
    ("accuracy-search.md", "candidate ensembles, gat", ["candidate_ensembles_gat"], ["depth_margin_centralized"],
     "centralized"),
])
def test_the_docs_show_the_paired_tables_of_the_committed_runs(page, mark, runs, against, against_variant):
    """The docs' paired tables are ``depth_margin.py --tables ... --against ...`` of their committed runs."""
    from depth_margin import paired_table, read_runs

    table = paired_table(read_runs(*(ROWS / f"{name}.jsonl" for name in runs)),
                         read_runs(*(ROWS / f"{name}.jsonl" for name in against)), 0.0, against_variant)
    assert block(REPO / "docs" / page, "paired", f"<!-- {mark}: {{}} -->") == table


def row_cell(row: dict) -> str:
    """A docs table's cell for a suite row: test mean ± std (validation mean), MB sent."""
    from accuracy import spread

    return f"{spread(row['test'])} ({statistics.mean(row['val']):.3f}), {row['mb']:,.0f} MB"


def suite_rows(*names: str) -> dict[tuple[str, str, str], dict]:
    """The runs of ``benchmarks/suite_rows/<name>`` by (graph, model, variant), a file's runs of one
    key merged seed by seed; a later file's row replaces an earlier one's."""
    return {(r["graph"], r["model"], r["variant"]): r for name in names
            for r in merged(json.loads((ROWS / name).read_text()))}


def gap_text(row: dict, against: dict, split: str) -> str:
    """The ``split`` gap of ``row`` to ``against`` in points, ± its standard error where seeds pair up."""
    gap, error = paired_gap(row[split], against[split])
    return f"{gap:+.1f}" + ("" if error is None else f" ± {error:.1f}")


def gap_check(row: dict, against: dict) -> str:
    """The test gap of ``row`` to ``against`` (``gap_text``) against the avg/5 int8 check's −1.5,
    with the validation gap in brackets."""
    gap, val_gap = (paired_gap(row[s], against[s])[0] for s in ("test", "val"))
    return f"{gap_text(row, against, 'test')} {'ok' if gap >= -1.5 else 'FAILS'} ({val_gap:+.1f})"


def test_the_docs_table_of_parts_cut_by_metis_is_that_of_its_committed_runs():
    """docs/accuracy-metis.md's table "Parts cut by METIS" gives each row's test mean ± std, validation mean
    and MB of ``parts_random_gcn.json`` and ``parts_metis_gcn.json``."""
    text = (REPO / "docs" / "accuracy-metis.md").read_text()
    for cut, label in (("random", "random"), ("metis", "METIS")):
        rows = {(r["graph"], r["variant"]): r for r in json.loads(
            (ROWS / f"parts_{cut}_gcn.json").read_text())}
        for graph in ("cora", "citeseer", "chameleon_filtered"):
            cells = [row_cell(rows[(graph, variant)]) for variant in ("retexo", "retexo avg/5 int8")]
            gap, error = paired_gap(rows[(graph, "retexo avg/5 int8")]["test"], rows[(graph, "retexo")]["test"])
            verdict = "ok" if gap >= -1.5 else "FAILS"
            line = f"| {graph} | {label} | {cells[0]} | {cells[1]} | {gap:+.1f} ± {error:.1f} {verdict} |"
            assert line.replace("-", "−") in text, line


def test_the_docs_tables_of_drift_correction_are_those_of_their_committed_runs():
    """docs/accuracy-metis.md's tables under "Drift correction closes it". GCN: ``retexo`` of
    ``parts_{cut}_gcn.json``, both averaging variants of ``parts_{cut}_dc_gcn.json`` and the
    corrected variant's paired test gap to ``retexo``; SAGE and GAT: the three variants of
    ``parts_metis_dc_sage_gat.json`` and both averaging variants' gaps (validation gaps in brackets);
    SAGE and GAT on random parts: both averaging variants of ``parts_random_dc_sage_gat.json`` and the
    corrected one's paired test and validation gaps to the plain one."""
    text = (REPO / "docs" / "accuracy-metis.md").read_text()
    variants = ("retexo", "retexo avg/5 int8", "retexo avg/5 int8 --drift-correction")
    for cut, label in (("random", "random"), ("metis", "METIS")):
        rows = suite_rows(f"parts_{cut}_gcn.json", f"parts_{cut}_dc_gcn.json")
        for graph in ("cora", "citeseer", "chameleon_filtered"):
            plain, averaged, corrected = (rows[(graph, "gcn", v)] for v in variants)
            line = (f"| {graph} | {label} | {row_cell(plain)} | {row_cell(averaged)} | {row_cell(corrected)} | "
                    f"{gap_check(corrected, plain)} |")
            assert line.replace("-", "−") in text, line
    rows = suite_rows("parts_metis_dc_sage_gat.json")
    for model in ("sage", "gat"):
        for graph in ("cora", "citeseer", "chameleon_filtered"):
            plain, averaged, corrected = (rows[(graph, model, v)] for v in variants)
            line = (f"| {graph} | {model} | {row_cell(plain)} | {row_cell(averaged)} | {row_cell(corrected)} | "
                    f"{gap_check(averaged, plain)} | {gap_check(corrected, plain)} |")
            assert line.replace("-", "−") in text, line
    rows = suite_rows("parts_random_dc_sage_gat.json")
    for model in ("sage", "gat"):
        for graph in ("cora", "citeseer", "chameleon_filtered"):
            averaged, corrected = (rows[(graph, model, v)] for v in variants[1:])
            (gap, error), (val_gap, val_error) = (paired_gap(corrected[s], averaged[s]) for s in ("test", "val"))
            line = (f"| {graph} | {model} | {row_cell(averaged)} | {row_cell(corrected)} | {gap:+.1f} ± {error:.1f} | "
                    f"{val_gap:+.1f} ± {val_error:.1f} |")
            assert line.replace("-", "−") in text, line


@pytest.mark.parametrize("name, count", [("parts_metis_dc_large.json", 6), ("parts_metis_dc_602020.json", 9)])
def test_the_docs_tables_of_the_default_correction_under_metis_are_those_of_their_committed_runs(name: str,
                                                                                                  count: int):
    """docs/accuracy-metis.md's tables of the default correction under METIS (amazon_computers and
    coauthor_cs on the suite's split; Cora, CiteSeer and chameleon_filtered on a 60/20/20 split):
    ``retexo``, plain averaging and the default (corrected there), the runs of ``name`` merged seed
    by seed, and both averaging variants' paired test gaps to ``retexo`` (validation gaps in
    brackets), one line for each of the file's ``count`` pairs of graph and model."""
    rows = suite_rows(name)
    text = (REPO / "docs" / "accuracy-metis.md").read_text()
    pairs = dict.fromkeys((graph, model) for graph, model, _ in rows)
    assert len(pairs) == count
    for graph, model in pairs:
        synced, plain, default = (rows[(graph, model, v)] for v in
                                  ("retexo", "retexo avg/5 int8 --no-drift-correction", "retexo avg/5 int8"))
        line = (f"| {graph} | {model} | {synced['seeds']} | {row_cell(synced)} | {row_cell(plain)} | "
                f"{row_cell(default)} | {gap_check(default, synced)} | {gap_check(plain, synced)} |")
        assert line.replace("-", "−") in text, line


def test_the_docs_table_of_the_default_correction_by_parts_is_that_of_its_committed_runs():
    """docs/accuracy-metis.md's table of amazon_computers and coauthor_cs GCN cut by METIS into 4, 8 and 16
    parts: plain averaging and the default (corrected on every cut), the runs of
    ``parts_metis_dc_large.json`` (4 parts), ``parts_metis_dc_8parts.json`` and
    ``parts_metis_dc_16parts.json`` merged seed by seed, with the default's paired validation and
    test gaps to plain averaging (± their standard errors where seeds pair up)."""
    text = (REPO / "docs" / "accuracy-metis.md").read_text()
    train_nodes = {"amazon_computers": 8252, "coauthor_cs": 11000}  # the suite's 60/20/20 split (seed 0)
    for parts, name in ((4, "parts_metis_dc_large.json"), (8, "parts_metis_dc_8parts.json"),
                        (16, "parts_metis_dc_16parts.json")):
        rows = suite_rows(name)
        for graph, nodes in train_nodes.items():
            plain, default = (rows[(graph, "gcn", v)] for v in
                              ("retexo avg/5 int8 --no-drift-correction", "retexo avg/5 int8"))
            line = (f"| {graph} | {parts} | {round(nodes / parts):,} | {plain['seeds']} | {row_cell(plain)} | "
                    f"{row_cell(default)} | {gap_text(default, plain, 'val')} | {gap_text(default, plain, 'test')} |")
            assert line.replace("-", "−") in text, line


def test_the_docs_table_of_the_search_under_the_correction_is_that_of_its_committed_runs():
    """docs/accuracy-metis.md's table of amazon_computers cut by METIS, per model, parts and seed: the
    validation score of 2 and 3 layers, and the kept depth's (the deeper where its validation is
    higher, as ``runner.depth`` keeps it) validation and test, for plain averaging, the default, and
    plain averaging's recipe trained with the correction (``parts_metis_dc_recipe_probe.json``)."""
    runs = json.loads((ROWS / "parts_metis_dc_recipe_probe.json").read_text())
    by_key = {(r["model"], r["parts"], r["seed"], r["variant"], r["layers"]): r for r in runs}
    variants = ("retexo avg/5 int8 --no-drift-correction", "retexo avg/5 int8",
                "retexo avg/5 int8 --drift-correction --recipe <the plain run's>")
    text = (REPO / "docs" / "accuracy-metis.md").read_text()
    cuts = list(dict.fromkeys((r["model"], r["parts"], r["seed"]) for r in runs))
    assert len(runs) == len(cuts) * len(variants) * 2
    for model, parts, seed in cuts:
        cells = []
        for variant in variants:
            two, three = (by_key[(model, parts, seed, variant, layers)] for layers in (2, 3))
            kept = three if three["val"] > two["val"] else two
            cells.append(f"{two['val']:.3f} / {three['val']:.3f} → {kept['val']:.3f} ({kept['test']:.3f})")
        line = f"| {model} | {parts} | {seed} | " + " | ".join(cells) + " |"
        assert line in text, line


def test_the_docs_table_of_screening_under_plain_averaging_is_that_of_its_committed_runs():
    """docs/accuracy-metis.md's table of ``--screen-uncorrected`` (not adopted), METIS: plain averaging,
    the default (corrected on these cuts: the ``--drift-correction`` runs of the three smaller graphs,
    the default's of amazon_computers) and the screened runs of
    ``parts_metis_dc_screen_uncorrected.json``, with the screened runs' paired validation and test
    gaps to the default."""
    text = (REPO / "docs" / "accuracy-metis.md").read_text()
    screened = suite_rows("parts_metis_dc_screen_uncorrected.json")
    small = suite_rows("parts_metis_dc_gcn.json", "parts_metis_dc_sage_gat.json")
    large = suite_rows("parts_metis_dc_large.json")
    assert len(screened) == 10
    for graph, model, variant in screened:
        if graph == "amazon_computers":
            plain, default = (large[(graph, model, v)] for v in
                              ("retexo avg/5 int8 --no-drift-correction", "retexo avg/5 int8"))
        else:
            plain, default = (small[(graph, model, v)] for v in
                              ("retexo avg/5 int8", "retexo avg/5 int8 --drift-correction"))
        row = screened[(graph, model, variant)]
        line = (f"| {graph} | {model} | {row['seeds']} | {row_cell(plain)} | {row_cell(default)} | {row_cell(row)} | "
                f"{gap_text(row, default, 'val')} | {gap_text(row, default, 'test')} |")
        assert line.replace("-", "−") in text, line


def test_the_docs_table_of_cora_gat_centralized_recipes_is_that_of_its_committed_runs():
    """docs/accuracy-search.md's table of what ``centralized`` keeps on Cora GAT: per seed the
    reference, the depth the choice keeps (the deeper where its validation is higher, as
    ``runner.depth`` keeps it) and that run's scores and recipe, from
    ``cora_gat_centralized_recipes.json``, whose kept runs are the table of today's defaults'."""
    from retexo_core.config import TrainConfig
    from retexo_core.recipe import knobs_of

    runs = {(r["seed"], r["layers"]): r for r in json.loads((ROWS / "cora_gat_centralized_recipes.json").read_text())}
    reference, centralized = ([r for r in json.loads((ROWS / "todays_defaults.json").read_text())
                               if (r["graph"], r["model"], r["variant"]) == ("cora", "gat", variant)][0]
                              for variant in ("reference", "centralized"))
    start = knobs_of(TrainConfig(model="gat"), 1, end_to_end=True)  # the start recipe of centralized's search
    lines = block(REPO / "docs" / "accuracy-search.md", "recipes", "<!-- cora gat centralized: {} -->")
    assert len(lines) == 2 + 10
    for seed in range(10):
        depth = 3 if runs[(seed, 3)]["val"] > runs[(seed, 2)]["val"] else 2
        kept = runs[(seed, depth)]
        assert kept["test"] == centralized["test"][seed] and kept["val"] == centralized["val"][seed]
        changed = ", ".join(f"{knob} {kept['recipe'][knob]}" for knob in start if kept["recipe"][knob] != start[knob])
        assert lines[2 + seed] == (f"| {seed} | {reference['val'][seed]:.3f} / {reference['test'][seed]:.3f} | {depth} "
                                   f"| {kept['val']:.3f} / {kept['test']:.3f} | {changed} |")
