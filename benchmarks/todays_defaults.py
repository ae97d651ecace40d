"""The table "Today's defaults" (docs/accuracy.md: the four small graphs, actor and minesweeper,
amazon_computers and coauthor_cs (three seeds each)),
assembled from the per-seed runs kept in ``benchmarks/suite_rows``: writes
``todays_defaults.json`` in ``accuracy.py --out``'s format, which ``accuracy.py --tables`` prints.

Each run is ``accuracy.train_once`` with a variant's options (or the PyG reference), one seed (or
official split) per run; where each variant's runs come from:

- ``reference``: ``cora_citeseer.json`` (Cora, CiteSeer), ``defaults_runs.json`` (the others);
- ``centralized``: the depth choice made per seed as the code makes it (three layers where their
  validation score is higher than two layers') from the two-layer runs of ``cora_citeseer.json``
  and the three-layer runs of ``depth_choice.json`` / ``defaults_runs.json`` (Cora, CiteSeer);
  the runs with the defaults of ``defaults_runs.json`` (the others);
- ``retexo``: GCN and GAT, ``last_layer_start.json`` (the last layer from the head); SAGE, the
  depth choice's runs of ``depth_choice.json``; GAT on actor, minesweeper, amazon_computers and
  coauthor_cs and GCN and SAGE on coauthor_cs, ``defaults_runs.json``;
- ``retexo avg/5 int8``: ``defaults_runs.json``;
- both ``retexo`` variants with GCN and SAGE, since the last two layers train together by default:
  ``joint_runs.json`` (all of a (graph, model, variant)'s seeds from it where it has any;
  ``joint_validated_every_5.json``, not read, holds the gradient-sync runs it replaced, from before
  the pair validated every round);
- both ``retexo`` variants with GCN and SAGE on Cora and CiteSeer, since the pair is also trained
  from scratch by default where fewer than 10 % of the nodes train: ``joint_fresh.json``'s
  ``--joint-fresh`` runs, where they cover every seed;
- every variant but ``reference`` on wisconsin: ``wisconsin_rerun.json``, all ten splits trained
  again in one session with one code version (99dcaf9), on this machine, replacing the older rows
  of every source above (docs/accuracy.md, "Wisconsin trained again");
- both ``retexo`` variants with GCN and GAT on every graph of the suite: ``skip_first_rerun.json``,
  trained again since the layer-wise search tries ``skip`` before ``features``, replacing every
  source above (docs/accuracy-layerwise.md, "The order of the layer-wise search's knobs"), and
  amazon_computers GAT's and coauthor_cs GCN's training seeds 1 and 2 (stops 92 and 93) and
  coauthor_cs GAT's seeds 0, 1 and 2 (stop 94) (their other variants in ``defaults_runs.json``;
  coauthor_cs SAGE's ``retexo`` variants in ``joint_runs.json``).
- both ``retexo`` variants with GAT on Cora and CiteSeer, since GAT's last two layers train together
  by default where fewer than 10 % of the nodes train: ``gat_pair.json`` (stop 97), replacing
  every source above for them.

A (graph, model) keeps the seeds 0..n-1 that every variant has, so that the checks are paired
(none: no row).

``--write-docs`` also writes its score table into README.md and its three tables into
docs/accuracy.md's "Today's defaults" (between their ``<!-- todays defaults: ... -->`` marks).

    .venv/bin/python benchmarks/todays_defaults.py [--out benchmarks/suite_rows/todays_defaults.json] [--write-docs]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from accuracy import MODELS, REPO, SUITE, bytes_table, checks_table, score_table, write_block

ROWS = Path(__file__).resolve().parent / "suite_rows"
GRAPHS = tuple(graph.name for graph in SUITE)  # in the suite's order, as ``accuracy.py --tables`` prints them
METRICS = {"minesweeper": "ROC-AUC"}  # two classes; the others: accuracy
VARIANTS = ("reference", "centralized", "retexo", "retexo avg/5 int8")
THREE_LAYERS = "centralized --layers 3 --no-choose-depth"
MARK = "<!-- todays defaults: {} -->"
SCARCE_LABELS = ("cora", "citeseer")  # fewer than 10 % of their nodes are in the train split

Run = tuple[float, float, float | None]  # validation, test, MB sent (None: not kept)
Key = tuple[str, str, str, int]  # variant, graph, model, seed


def load(name: str) -> list[dict[str, Any]]:
    return json.loads((ROWS / name).read_text())


def collect_runs() -> dict[Key, Run]:
    """Every variant's run per (graph, model, seed), as the module docstring lists their sources."""
    runs: dict[Key, Run] = {}
    two_layers: dict[tuple[str, str, int], tuple[float, float]] = {}
    for row in load("cora_citeseer.json"):
        for seed, (val, test) in enumerate(zip(row["val"], row["test"])):
            if row["variant"] == "reference":
                runs[("reference", row["graph"], row["model"], seed)] = (val, test, 0.0)
            elif row["variant"] == "centralized":
                two_layers[(row["graph"], row["model"], seed)] = (val, test)
    three_layers: dict[tuple[str, str, int], tuple[float, float]] = {}
    for row in load("depth_choice.json"):
        graph = row["dataset"].split("_split")[0]
        if row["label"] == "centralized":
            three_layers[(graph, row["model"], row["seed"])] = (row["d3"]["val"], row["d3"]["test"])
        elif row["label"] == "retexo" and row["model"] == "sage":
            choice = row["choice"]
            runs[("retexo", graph, "sage", row["seed"])] = (choice["val"], choice["test"],
                                                           choice["bytes"] / 1e6 if choice["bytes"] else None)
    session = load("defaults_runs.json")
    for row in session:
        if row["variant"] == THREE_LAYERS:
            three_layers[(row["graph"], row["model"], row["seed"])] = (row["val"], row["test"])
    for key, (val2, test2) in two_layers.items():
        if key in three_layers:
            val3, test3 = three_layers[key]
            runs[("centralized", *key)] = (val3, test3, 0.0) if val3 > val2 else (val2, test2, 0.0)
    for row in session:
        if row["variant"] in VARIANTS:
            runs[(row["variant"], row["graph"], row["model"], row["seed"])] = (row["val"], row["test"], row["mb"])
    for row in load("last_layer_start.json"):
        if row["variant"] == "retexo, last layer from the head":
            runs[("retexo", row["graph"], row["model"], row["seed"])] = (row["val"], row["test"], row.get("mb"))
    runs = with_rerun(with_fresh_pair(with_rerun(runs, "joint_runs.json")), "wisconsin_rerun.json")
    return with_rerun(with_rerun(runs, "skip_first_rerun.json"), "gat_pair.json")


def with_rerun(runs: dict[Key, Run], name: str) -> dict[Key, Run]:
    """``runs`` with every (variant, graph, model) that ``name``'s per-seed rows hold replaced by
    those rows (all of its seeds: a group's older seeds that ``name`` lacks are dropped)."""
    rerun = {(row["variant"], row["graph"], row["model"], row["seed"]): (row["val"], row["test"], row["mb"])
             for row in load(name)}
    groups = {key[:3] for key in rerun}
    return {**{key: run for key, run in runs.items() if key[:3] not in groups}, **rerun}


def with_fresh_pair(runs: dict[Key, Run]) -> dict[Key, Run]:
    """``runs`` with both ``retexo`` variants on Cora and CiteSeer, where fewer than 10 % of the nodes
    train and the fresh pair is on by default (``retexo_core.config.SCARCE_LABELS``), taken from
    ``joint_fresh.json``'s ``--joint-fresh`` runs of the same variant: of every (graph, model,
    variant) whose runs there cover every seed that it has here (the others keep their rows)."""
    fresh: dict[Key, Run] = {}
    for row in load("joint_fresh.json"):
        if row["graph"] in SCARCE_LABELS:
            variant = row["variant"].removesuffix(" --joint-fresh")
            fresh[(variant, row["graph"], row["model"], row["seed"])] = (row["val"], row["test"], row["mb"])
    covered = {group for group in {key[:3] for key in fresh}
               if all(key in fresh for key in runs if key[:3] == group)}
    return {**{key: run for key, run in runs.items() if key[:3] not in covered},
            **{key: run for key, run in fresh.items() if key[:3] in covered}}


def paired_rows(runs: dict[Key, Run]) -> list[dict[str, Any]]:
    """``accuracy.py --out`` rows: per (graph, model), the seeds 0..n-1 that every variant has."""
    def count(variant: str, graph: str, model: str) -> int:
        n = 0
        while (variant, graph, model, n) in runs:
            n += 1
        return n

    rows = []
    for model in MODELS:
        for graph in GRAPHS:
            n = min(count(v, graph, model) for v in VARIANTS)
            if n == 0:
                continue
            for variant in VARIANTS:
                seeds = [runs[(variant, graph, model, s)] for s in range(n)]
                mbs = [mb for _, _, mb in seeds]
                rows.append({"graph": graph, "model": model, "variant": variant, "seeds": n,
                             "metric": METRICS.get(graph, "accuracy"),
                             "device": "cpu", "val": [v for v, _, _ in seeds], "test": [t for _, t, _ in seeds],
                             "mb": None if None in mbs else sum(mbs) / n,  # type: ignore[operator]
                             "seconds": None})
    return rows


def write_docs(rows: list[dict[str, Any]]) -> None:
    """The score table into README.md; the score, bytes and checks tables into docs/accuracy.md."""
    write_block(REPO / "README.md", "scores", score_table(rows))
    for name, table in (("scores", score_table), ("bytes", bytes_table), ("checks", checks_table)):
        write_block(REPO / "docs" / "accuracy.md", name, table(rows), MARK)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROWS / "todays_defaults.json")
    parser.add_argument("--write-docs", action="store_true", help="also write the tables into README.md and "
                        "docs/accuracy.md")
    args = parser.parse_args()
    rows = paired_rows(collect_runs())
    args.out.write_text(json.dumps(rows, indent=1) + "\n")
    if args.write_docs:
        write_docs(rows)
    for row in rows[::len(VARIANTS)]:
        print(f"{row['graph']} {row['model']}: {row['seeds']} seeds")


if __name__ == "__main__":
    main()
