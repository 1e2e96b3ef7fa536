"""Comparing learning rules: accuracy, alignment with backprop, feedback, compute.

Built on a protocol's runs (``analysis.load.ProtocolRuns``): the tidy metrics
hold per-epoch ``alignment/update_cos/<layer>``,
``alignment/teaching_cos/<population>`` and ``rule/feedback/cos/<layer>``; the
compute bill lives in each record's ``work`` section (``lab.diagnostics.work``).
Figures are ``analysis.figures.NotebookFigure`` (no pyplot state).
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import pandas as pd

from lab import records

from .checks import check_group_keys, config_twins, listing, summary_for, unrun_hint
from .completeness import IncompleteProtocolError, advice, find_problems
from .figures import NotebookFigure as Figure
from .figures import check_tables, style_axes

# Quantities the README and the comparison notebook report per rule (each run's
# record declares its rows; these are what this analysis needs on top).
FINAL_FIELDS = ("test_acc",)
FEEDBACK_FIELDS = ("rule/feedback/mean_cos", "rule/feedback/min_cos",
                   "rule/feedback/mean_rel_err")
# rules_table's alignment columns: required at each run's last epoch.
ALIGNMENT_FIELDS = ("alignment/mean_update_cos", "alignment/mean_teaching_cos")
# Alignment cosines may be NaN in a complete run: 0/0 at a silent layer or population
# (lab.diagnostics.alignment), which is the run's result, not a gap. NaN is never a
# fault here: the probe is skipped (the row holds no alignment) when the loss is not finite.
UNDEFINED = ("alignment/",)
FEEDBACK_RULES = ("fa", "kp", "usf", "brsf", "frsf", "wm", "rrm")
# The per-name families this module draws (layer or population after the prefix). A run
# logs the feedback family only when its rule has feedback tensors, so a table none of
# whose runs logs one of these (bp and dfa only) is a result, not a typo.
PER_NAME_PREFIXES = ("alignment/update_cos/", "alignment/teaching_cos/", "rule/feedback/cos/")
# The record kind of lab.train.conv's runs (ConvConfig.KIND; not imported: no torch here),
# the only trainer whose work section is a per-example MAC bill by component.
CONV_KIND = "conv"


def _last_epoch(expect) -> int | None:
    """The axis value of a run's last row on the epoch axis, from its declaration."""
    if not isinstance(expect, dict) or expect.get("axis") != "epoch" or not expect.get("count"):
        return None
    return (expect["count"] - 1) * expect.get("stride", 1)


def _last_epoch_problems(data) -> tuple[list[str], list[str]]:
    """(missing, infinite): each complete run lacking an ``ALIGNMENT_FIELDS`` value at its
    last epoch, and each whose value there is infinite (a run that is not complete is
    already reported by its status). NaN is not listed: the cosine was measured and is
    undefined (``UNDEFINED``)."""
    m = data.metrics
    rows = m[(m["axis"] == "epoch") & m["metric"].isin(ALIGNMENT_FIELDS)]
    values = {(r, i, name): v for r, i, name, v in
              zip(rows["run_id"], rows["index"], rows["metric"], rows["value"])}
    runs = {run.run_id: run for run in data.runs.itertuples(index=False)}
    problems, infinite = [], []
    for run_id in data.expected_ids:
        run = runs.get(run_id)
        last = _last_epoch(getattr(run, "expect", None))
        if run is None or run.status != "complete" or last is None:
            continue  # find_problems names a missing, unfinished or undeclared run
        missing = [name for name in ALIGNMENT_FIELDS if (run_id, last, name) not in values]
        bad = [f"{name} ({values[(run_id, last, name)]})" for name in ALIGNMENT_FIELDS
               if name not in missing and math.isinf(values[(run_id, last, name)])]
        if missing:
            problems.append(f"{run_id}: {', '.join(map(repr, missing))} missing at its last "
                            f"epoch ({last})")
        if bad:
            infinite.append(f"{run_id}: infinite at its last epoch ({last}): {', '.join(bad)}")
    return problems, infinite


def _check_rule_grid(data, function: str) -> None:
    # First, so a protocol with a fixed rule is told so, not a KeyError further on.
    if "rule" not in data.group_keys:
        raise ValueError(f"{function}: the protocol {data.protocol.name!r} has no rule in its "
                         f"grid (grid keys: {', '.join(data.group_keys) or 'seed only'}); a "
                         "rule comparison needs a grid over rule, e.g. rule: [bp, fa, kp]")


def check_rules_complete(data) -> None:
    """Every run complete with its alignment; rules with feedback tensors also with tracking.

    ``data`` is a ``ProtocolRuns`` whose grid has a ``rule`` key. Alignment means
    ``ALIGNMENT_FIELDS``, present at each run's last epoch (what :func:`rules_table`
    reports): a protocol run with ``alignment_every: 0``, or with an
    ``alignment_every`` that does not divide ``epochs``, is refused, with that advice.
    Measured but NaN is not a gap: the cosine is undefined (a silent layer or
    population, e.g. a collapsed network) and :func:`rules_table` counts such runs.
    One error lists every gap across the checks. Runs another trainer made (EP, CfC)
    are a ValueError saying so, not a gap in each run (:func:`check_conv_runs`).
    """
    check_conv_runs(data, "check_rules_complete")
    _check_rule_grid(data, "check_rules_complete")
    problems = find_problems(data.runs, data.metrics, data.expected_ids, (), FINAL_FIELDS,
                             undefined=UNDEFINED)
    with_feedback = [s.run_id for s in data.specs if s.grid.get("rule") in FEEDBACK_RULES]
    present = set(data.runs["run_id"])
    problems += find_problems(data.runs, data.metrics, [i for i in with_feedback if i in present],
                              FEEDBACK_FIELDS, undefined=UNDEFINED)
    alignment, infinite = _last_epoch_problems(data)
    problems = list(dict.fromkeys(problems + alignment + infinite))
    if problems:
        lines = "\n".join(f"  - {line}" for line in problems)
        # A rerun does not fill missing alignment (the config does not measure it): the
        # general advice covers the other lines. Advice before the list, where a long
        # list of gaps cannot hide it.
        gaps = [p for p in problems if p not in alignment]
        hint = (" The rule comparison reports alignment with backprop at each run's last "
                "epoch: run the protocol with alignment_every dividing epochs (alignment_every: "
                "1 measures every epoch)." if alignment else "")
        raise IncompleteProtocolError(
            f"incomplete data: {len(problems)} problem(s) across {len(data.expected_ids)} "
            f"expected runs ({advice(gaps)}).{hint}\n{lines}", problems)


def check_conv_runs(data, caller: str = "check_rules_complete") -> None:
    """Refuse a protocol whose runs another trainer made (an EP or CfC protocol): each
    would otherwise read as a conv run with its test accuracy and alignment missing, a
    gap no rerun fills. (A conv run's record says ``kind: conv``; a notebook of one's own
    that trains nothing says ``notebook``; either is let through.)"""
    runs = data.runs
    kinds = sorted({kind for kind in runs["kind"]
                    if records.another_trainers({"kind": kind}, CONV_KIND)})
    if kinds:
        some = ", ".join(runs.loc[runs["kind"] == kinds[0], "run_id"].head(3))
        raise ValueError(
            f"{caller}: the protocol {data.protocol.name!r} holds {' and '.join(kinds)} runs "
            f"(e.g. {some}), not conv runs: the rule comparison (test accuracy, alignment "
            "with backprop, MAC bill per rule) needs runs of the conv trainer "
            f"(notebooks/01-train-conv.ipynb); {summary_for(kinds)}")


def _check_table(table: pd.DataFrame, caller: str, columns: list[str]) -> None:
    """A table with runs and the columns ``caller`` reads, or a ValueError/KeyError saying so."""
    missing = [c for c in columns if c not in table.columns]
    if missing:
        raise KeyError(f"{caller}: column(s) {', '.join(missing)} not in the table"
                       f"{config_twins(missing, table.columns)}{unrun_hint(missing, table)}; "
                       f"columns: {listing(table.columns, 20)}")
    if not len(table):
        raise ValueError(f"{caller}: the table has no runs (one row per run is expected: "
                         "ProtocolRuns.table())")


def _epoch_rows(metrics: pd.DataFrame, table: pd.DataFrame, prefix: str) -> pd.DataFrame:
    rows = metrics[(metrics["axis"] == "epoch") & metrics["metric"].str.startswith(prefix)]
    rows = rows.merge(table[["run_id", "rule"]], on="run_id")
    return rows.assign(name=rows["metric"].str[len(prefix):])


def _prefixes(metrics: pd.DataFrame) -> list[str]:
    """The families of ``metrics``' names: each name up to its last "/" (names without one
    are not families)."""
    return sorted({name[: name.rindex("/") + 1] for name in metrics.unique() if "/" in name})


def per_name_over_epochs(metrics: pd.DataFrame, table: pd.DataFrame, prefix: str) -> pd.DataFrame:
    """Mean over seeds per (rule, name, epoch) of metrics ``<prefix><name>``; names in the
    order the records hold them (the model's forward order).

    A prefix that no epoch metric of the table's runs starts with is a ValueError naming
    the prefixes there are (a typo, not an empty frame), except one of
    ``PER_NAME_PREFIXES`` (``rule/feedback/cos/`` in a table of rules without feedback
    tensors): that gives an empty frame."""
    check_tables("per_name_over_epochs", metrics, table, ["rule"],
                 order="per_name_over_epochs(metrics, table, prefix)")
    if not isinstance(prefix, str) or not prefix:
        raise TypeError(f"per_name_over_epochs: prefix must be the start of metric names (a "
                        f"non-empty str), e.g. 'alignment/update_cos/', got {prefix!r} "
                        f"({type(prefix).__name__})")
    # A family is named up to its last "/": 'alignment/update_cos' means its members
    # (without the slash every name came out as '/blocks.0.conv1').
    given, prefix = prefix, prefix if prefix.endswith("/") else prefix + "/"
    rows = _epoch_rows(metrics, table, prefix)
    if not len(rows) and prefix not in PER_NAME_PREFIXES:
        there = metrics.loc[(metrics["axis"] == "epoch")
                            & metrics["run_id"].isin(set(table["run_id"])), "metric"]
        shown = ", ".join(map(repr, _prefixes(there))) or "none"
        raise ValueError(f"per_name_over_epochs: no field of any run of the table starts with "
                         f"{given!r} on the epoch axis; prefixes there: {shown}")
    out = rows.groupby(["rule", "name", "index"], sort=True)["value"].mean().reset_index()
    # Per rule, names in the order its records hold them, which is the model's forward
    # order (stem ... fc), not the alphabet's (blocks.0 ... fc, stem), so a line's shade
    # can say its depth; per rule, since two rules may log different names.
    position = {(rule, name): i for rule, part in rows.groupby("rule", sort=False)
                for i, name in enumerate(dict.fromkeys(part["name"]))}
    out = out.assign(_at=[position[key] for key in zip(out["rule"], out["name"])])
    out = out.sort_values(["rule", "_at", "index"], kind="stable", ignore_index=True)
    return out.drop(columns="_at").rename(columns={"index": "epoch"})


def accuracy_bars(table: pd.DataFrame, metric: str = "final.test_acc") -> Figure:
    """A final metric per rule (default the test accuracy): bar = mean over seeds, error
    bar = +-1 std over seeds (ddof 1; none for a rule with one seed), dots = the seeds.

    An accuracy (a metric ending in ``_acc``) is drawn in % on a 0-100 axis; any other
    metric as it is, labelled with its name (a loss drawn as "test accuracy (%)" read as
    100 % everywhere)."""
    _check_table(table, "accuracy_bars", ["rule", metric])
    fig = Figure(figsize=(7, 3.4), layout="constrained")
    ax = fig.subplots()
    percent = metric.endswith(("_acc", "_accuracy"))
    lower_is_better = any(word in metric for word in ("loss", "bpc", "err"))
    scale = 100 if percent else 1
    grouped = table.groupby("rule", sort=True)[metric]
    stats = grouped.agg(["mean", "std"]).sort_values("mean", ascending=lower_is_better)
    xs = range(len(stats))
    # A rule with one seed has no std: NaN draws no error bar (0 drew one, as if no spread).
    ax.bar(xs, scale * stats["mean"], yerr=scale * stats["std"], capsize=3, alpha=0.7)
    for x, rule in zip(xs, stats.index):
        values = table.loc[table["rule"] == rule, metric]
        ax.plot([x] * len(values), scale * values, "k.", markersize=4)
    ax.set_xticks(list(xs), stats.index)
    name = metric.removeprefix("final.").replace("_", " ")
    ax.set_ylabel(f"{name} (%)" if percent else name)
    ax.set_title("bar: mean over seeds; error bar: +-1 std over seeds; dots: seeds",
                 fontsize="small")
    # Bars from 0: a bar's length is its accuracy, so two bars' ratio is the accuracies'
    # (an axis cut near the lowest bar made 25.5 % look twice 19.7 %); the dots and the
    # error bars show the spread, and rules_table gives the digits.
    if percent:
        ax.set_ylim(0, 100)
    elif (table[metric].dropna() >= 0).all():
        ax.set_ylim(bottom=0)
    return fig


def lines_per_rule(frame: pd.DataFrame, ylabel: str, rules=None) -> Figure:
    """One panel per rule, one line per name (layer or population) over epochs."""
    rules = sorted(rules or frame["rule"].unique())
    cols = min(5, len(rules)) or 1
    rows = -(-len(rules) // cols) or 1
    fig = Figure(figsize=(3.0 * cols, 2.4 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, rule in zip(axes, rules):
        part = frame[frame["rule"] == rule]
        names = list(dict.fromkeys(part["name"]))  # forward order (per_name_over_epochs')
        for name, line in part.groupby("name", sort=False):
            shade = 0.15 + 0.75 * names.index(name) / max(1, len(names) - 1)
            ax.plot(line["epoch"], line["value"], color=(shade, 0.2, 1 - shade), linewidth=1,
                    label=(f"{name} (first)" if name == names[0] else f"{name} (last)"
                           if name == names[-1] and len(names) > 1 else "_"))
        if names:  # the key to the shades: first layer blue ... last red
            ax.legend(fontsize="x-small", title=f"{len(names)} names, by depth",
                      title_fontsize="x-small")
        ax.set_title(rule)
        ax.set_ylim(-1.05, 1.05)
        ax.axhline(0, color="grey", linewidth=0.5)
        style_axes(ax, "epoch")
    axes[0].set_ylabel(textwrap.fill(ylabel, 28))
    for ax in axes[len(rules):]:
        ax.set_visible(False)
    return fig


def mean_lines(frame: pd.DataFrame, ylabel: str) -> Figure:
    """One line per rule of the mean over names (e.g. layers) and seeds."""
    fig = Figure(figsize=(5.5, 3.4), layout="constrained")
    ax = fig.subplots()
    for rule, part in frame.groupby("rule", sort=True):
        mean = part.groupby("epoch")["value"].mean()
        ax.plot(mean.index, mean.values, label=rule)
    style_axes(ax, "epoch", ylabel)
    ax.legend(fontsize="small", ncol=2)
    return fig


def _no_bill(run_id: str, record: dict) -> str | None:
    """Why run ``run_id`` has no per-example MAC bill (None when it has one)."""
    work = record.get("work") or {}
    missing = [key for key in ("examples", "macs") if key not in work]
    if not missing:
        return None
    what = f"{record.get('status')}, kind {record.get('kind')}"
    lacks = f"work.{' and work.'.join(missing)} missing"
    other = records.another_trainers(record, CONV_KIND)
    if other:
        why = f"another trainer's run ({other}), whose work is not a conv compute bill"
    elif not work or set(work) <= {"train_wall_s"}:
        why = "a run that never trained (its work is empty)"
    else:
        why = "its work is not a conv compute bill"
    return f"{run_id!r} ({what}): {lacks}: {why}"


def _own_record(runs_dir, run_id: str) -> dict:
    """Run ``run_id``'s record: from ``<runs_dir>/<run_id>`` when that holds it, else from
    the one directory of ``runs_dir`` that does (run directories swapped or renamed), as
    ``load_protocol_runs`` matches runs by their records' ids."""
    record = records.load_record(f"{runs_dir}/{run_id}", rows=False) \
        if (Path(runs_dir) / run_id / records.RECORD_FILE).is_file() else None
    if record is not None and record.get("run_id") == run_id:
        return record
    # by the ids the records hold (load_runs would rename ids that two runs share)
    paths = [p.parent for p in sorted(Path(runs_dir).glob(f"*/{records.RECORD_FILE}"))
             if records.load_record(p.parent, rows=False).get("run_id") == run_id]
    if not paths:
        there = ("is not that run" if (Path(runs_dir) / run_id).exists()
                 else "does not exist")
        raise ValueError(f"compute_bill: no directory of {runs_dir} holds run {run_id!r} "
                         f"({runs_dir}/{run_id} {there}); give the runs directory of the "
                         f"protocol the table comes from (its out)")
    if len(paths) != 1:
        raise ValueError(f"compute_bill: run {run_id!r} is not the run in {runs_dir}/{run_id}, "
                         f"and {len(paths)} directories of {runs_dir} hold it "
                         f"({', '.join(map(str, paths))}); give each run its own directory, "
                         "named by its run id")
    return records.load_record(paths[0], rows=False)


def compute_bill(table: pd.DataFrame, runs_dir, group_keys=("rule",)) -> pd.DataFrame:
    """Per group (default: per rule), MACs per training example by component (mean over
    seeds), and total. With several ``group_keys`` the index has one level per key.

    Every run of the table must have a conv compute bill (``work.examples`` and
    ``work.macs``, as ``lab.train.conv`` writes): a failed run that never trained, or
    another trainer's run (ep, cfc_aux), is a ValueError naming each such run, not left
    out: a group's mean over the runs that happen to have a bill, or a group gone from
    the bill, is not the protocol's result (as :func:`rules_table` refuses incomplete
    data). Drop those runs from the table to bill the others."""
    group_keys = check_group_keys(group_keys, "compute_bill")
    if not group_keys:
        raise ValueError("compute_bill: group_keys is empty; name the column(s) to bill per, "
                         "e.g. ['rule']")
    _check_table(table, "compute_bill", ["run_id", *group_keys])
    works, unbilled = [], []
    for run_id in table["run_id"]:
        record = _own_record(runs_dir, run_id)
        reason = _no_bill(run_id, record)
        if reason:
            unbilled.append((run_id, reason))
        works.append(record.get("work") or {})
    if unbilled:
        ids = [run_id for run_id, _ in unbilled]
        raise ValueError(f"compute_bill: {len(ids)} run(s) of the table have no conv compute "
                         f"bill: {'; '.join(reason for _, reason in unbilled)}. Drop them from "
                         f"the table, e.g. table[~table['run_id'].isin({ids!r})]")
    rows = []
    for work, point in zip(works, table[group_keys].itertuples(index=False, name=None)):
        examples = max(1, work["examples"])
        rows.append({**dict(zip(group_keys, point)),
                     **{k: v / examples for k, v in work["macs"].items()}})
    frame = pd.DataFrame(rows)
    components = [c for c in frame.columns if c not in group_keys]
    # A rule without a component (no feedback updates) spends 0 MACs on it.
    frame[components] = frame[components].fillna(0.0)
    frame = frame.groupby(group_keys, sort=True, dropna=False).mean()
    frame["total"] = frame.sum(axis=1)
    return frame


def bill_bars(bill: pd.DataFrame) -> Figure:
    """Stacked MACs per training example, per rule, by component."""
    fig = Figure(figsize=(7, 3.4), layout="constrained")
    ax = fig.subplots()
    parts = bill.drop(columns="total")
    bottom = pd.Series(0.0, index=parts.index)
    labels = [_label(parts.index.names, point) for point in parts.index]
    for component in parts.columns:
        ax.bar(labels, parts[component] / 1e6, bottom=bottom / 1e6, label=component)
        bottom += parts[component]
    ax.set_ylabel("MMACs per training example")
    ax.legend(fontsize="small", ncol=2)
    return fig


def _label(keys, point) -> str:
    """``kp`` for a rule alone; ``kp, weight_decay=0.1`` beside other grid keys."""
    point = point if isinstance(point, tuple) else (point,)
    parts = [str(v) if k == "rule" else f"{k}={v}" for k, v in zip(keys, point)]
    return ", ".join(parts)


def label_grid_points(table: pd.DataFrame, group_keys: list[str]) -> pd.DataFrame:
    """The table with its ``rule`` column naming each grid point (``kp, weight_decay=0.1``)
    when the grid has keys besides rule and seed, so the figures and the bill, which
    draw one bar or panel per ``rule``, show each grid point apart instead of pooling
    them; with rule and seed only, the table as it is."""
    group_keys = check_group_keys(group_keys, "label_grid_points")
    _check_table(table, "label_grid_points", ["rule", *group_keys])
    keys = ["rule"] + [k for k in group_keys if k != "rule"]
    if keys == ["rule"]:
        return table
    points = table[keys].itertuples(index=False, name=None)
    return table.assign(rule=[_label(keys, point) for point in points])


def _last_epoch_mean(data, table: pd.DataFrame, metric: str, keys=("rule",)) -> pd.Series:
    """Per group (``keys``), the mean over seeds of ``metric`` at each run's own last
    epoch (its declared row count). A group none of whose runs logged ``metric`` is
    left out (NaN in :func:`rules_table`: no feedback tensors); a run that logged it
    but not at its last epoch is a ValueError, never an earlier epoch's value in its
    place."""
    m = data.metrics
    rows = m[(m["axis"] == "epoch") & (m["metric"] == metric)
             & m["run_id"].isin(set(table["run_id"]))]
    last = {run_id: _last_epoch(expect) for run_id, expect in
            zip(data.runs["run_id"], data.runs["expect"])}
    at_last = rows[rows["index"] == rows["run_id"].map(last)]
    gaps = sorted(set(rows["run_id"]) - set(at_last["run_id"]))
    if gaps:
        raise ValueError(f"{metric!r} is missing at the last epoch of run(s) "
                         f"{', '.join(f'{r} (epoch {last.get(r)})' for r in gaps)}; "
                         "an earlier epoch's value is not the last epoch's")
    keys = list(keys)
    rows = at_last.merge(table[["run_id", *keys]], on="run_id")
    return rows.groupby(keys, dropna=False)["value"].mean()


# The ResNet's read-out layer (lab.models.resnet: ``fc``). Under every rule here it gets
# the exact output error, so its update's cosine with backprop's is 1 by construction and
# lifts a mean over all layers by about 1/(layers) for every rule alike.
READOUT = "fc"


def _last_epoch_hidden_update(data, table: pd.DataFrame, keys) -> pd.Series:
    """Per group, the mean over seeds of each run's mean update cosine over its layers
    but the read-out where defined, at its last epoch (as ``mean_update_cos`` is over all
    layers where defined)."""
    prefix = "alignment/update_cos/"
    rows = _last_epoch_rows(data, table, prefix)
    per_run = rows[rows["metric"] != prefix + READOUT].groupby("run_id")["value"].mean()
    keys = list(keys)
    frame = table[["run_id", *keys]].merge(per_run.rename("value").reset_index(), on="run_id")
    return frame.groupby(keys, dropna=False)["value"].mean()


def _last_epoch_rows(data, table: pd.DataFrame, prefix: str) -> pd.DataFrame:
    """Epoch rows of the metrics under ``prefix`` at each run's own last epoch."""
    m = data.metrics
    rows = m[(m["axis"] == "epoch") & m["metric"].str.startswith(prefix)
             & m["run_id"].isin(set(table["run_id"]))]
    last = {run_id: _last_epoch(expect) for run_id, expect in
            zip(data.runs["run_id"], data.runs["expect"])}
    return rows[rows["index"] == rows["run_id"].map(last)]


def _undefined_runs(data, table: pd.DataFrame, keys) -> pd.Series:
    """Per group, how many runs have an undefined (NaN) alignment cosine, at some layer
    or population, at their last epoch."""
    rows = _last_epoch_rows(data, table, "alignment/")
    undefined = rows.groupby("run_id")["value"].apply(lambda v: bool(v.isna().any()))
    keys = list(keys)
    frame = table[["run_id", *keys]].assign(
        undefined=table["run_id"].map(undefined).fillna(False).astype(int))
    return frame.groupby(keys, dropna=False)["undefined"].sum()


def _defined(data, table: pd.DataFrame, keys, prefix: str) -> pd.Series:
    """Per group, the mean over seeds of how many names under ``prefix`` (layers or
    populations) have a defined (finite) cosine at the run's last epoch."""
    rows = _last_epoch_rows(data, table, prefix)
    per_run = rows.assign(defined=rows["value"].notna()).groupby("run_id")["defined"].sum()
    keys = list(keys)
    frame = table[["run_id", *keys]].assign(defined=table["run_id"].map(per_run))
    return frame.groupby(keys, dropna=False)["defined"].mean()


def alignment_note(out: pd.DataFrame) -> str:
    """A sentence for a :func:`rules_table` with runs whose alignment is undefined
    (empty when there are none): what their alignment columns then mean."""
    count = out["align_undefined_runs"]
    if not count.sum():
        return ""
    points = ", ".join(
        f"{_label(out.index.names, point)} ({n} run(s); defined at "
        f"{out.loc[point, 'update_layers_defined']:g} layers and "
        f"{out.loc[point, 'teaching_populations_defined']:g} populations, mean over seeds)"
        for point, n in count[count > 0].items())
    return (f"Alignment undefined (NaN) at some layer or population at the last epoch in "
            f"{int(count.sum())} run(s): {points}. Their network went (partly) silent: a "
            "cosine with an all-zero update or gradient is 0/0. The alignment columns there "
            "are means over the layers, populations and seeds where it is defined, NaN "
            "where it is defined nowhere; accuracy and the bill cover every run.")


def per_seed_table(data, column: str) -> pd.DataFrame:
    """One row per grid point (as :func:`rules_table`), one column per seed: ``column``
    of each run. ``column`` is a column of ``data.table()`` (``final.test_acc``) or an
    epoch metric, read at each run's last epoch (``alignment/mean_teaching_cos``): the
    per-seed values behind a mean ± std."""
    table = data.table()
    _check_table(table, "per_seed_table", ["run_id", "seed"])
    keys = ["rule"] + [k for k in data.group_keys if k != "rule"]
    if column in table.columns:
        values = table.set_index("run_id")[column]
    else:
        rows = _last_epoch_rows(data, table, column)
        rows = rows[rows["metric"] == column]
        if not len(rows):
            known = sorted(data.metrics.loc[data.metrics["axis"] == "epoch", "metric"].unique())
            raise KeyError(f"per_seed_table: {column!r} is neither a column of the runs' table "
                           f"({', '.join(map(str, table.columns))}) nor an epoch metric at "
                           f"the runs' last epoch (epoch metrics: {', '.join(known[:12])}"
                           f"{', ...' if len(known) > 12 else ''})")
        values = rows.set_index("run_id")["value"]
    frame = table[["run_id", "seed", *keys]].assign(value=table["run_id"].map(values))
    out = frame.pivot_table(index=keys, columns="seed", values="value", dropna=False)
    return out.rename(columns=lambda seed: f"seed {seed}")


def rules_table(data) -> pd.DataFrame:
    """The README's table: per grid point, test accuracy (mean, std over seeds, in %),
    its gap to bp in points, alignment and feedback cosine at each run's last epoch
    (means over seeds; feedback_cos is NaN for a rule without feedback tensors;
    ``update_cos`` averages every layer, ``update_cos_hidden`` every layer but the
    read-out, whose cosine is 1 under every rule here), and
    MACs per training example as a multiple of one forward pass.

    A grid point is every grid key but the seed (``data.group_keys``): with rule and
    seed only, one row per rule (index ``rule``); a grid of rule x weight_decay has
    one row per (rule, weight_decay) (index with both levels), never a mean over
    different decays. ``vs_bp`` compares with bp at the same other keys; where the
    grid has no bp run at those keys (or no bp at all) it is NaN. Refuses incomplete
    data (:func:`check_rules_complete`): a mean over the runs that happen to exist is
    not the protocol's result. A run whose alignment was measured but is undefined
    (NaN: a silent layer or population) is summarised: its accuracy and bill count,
    the alignment columns are means over the layers, populations and seeds where it
    is defined (NaN where nowhere), ``align_undefined_runs`` counts, per grid point,
    the runs with an undefined cosine, and ``update_layers_defined`` /
    ``teaching_populations_defined`` say over how many layers / populations the
    cosine is defined (mean over seeds; a collapsed network's teaching mean can be
    one population's). :func:`alignment_note` says it in words."""
    check_conv_runs(data, "rules_table")
    _check_rule_grid(data, "rules_table")
    check_rules_complete(data)
    keys = ["rule"] + [k for k in data.group_keys if k != "rule"]
    others = keys[1:]
    table = data.table()
    acc = table.groupby(keys, sort=True, dropna=False)["final.test_acc"].agg(["mean", "std"])
    acc = acc * 100
    # bp's mean at each row's other keys (NaN where the grid has no bp there).
    bp = acc["mean"].reset_index()
    bp = bp[bp["rule"] == "bp"].drop(columns="rule").rename(columns={"mean": "bp"})
    rows = acc["mean"].reset_index()
    rows = rows.merge(bp, on=others, how="left") if others else rows.assign(
        bp=bp["bp"].iloc[0] if len(bp) else float("nan"))
    bp_mean = pd.Series(rows["bp"].to_numpy(), index=acc.index)
    bill = compute_bill(table, data.runs_dir, keys)
    out = pd.DataFrame({
        "test_acc_mean": acc["mean"], "test_acc_std": acc["std"],
        "vs_bp": acc["mean"] - bp_mean,
        "update_cos": _last_epoch_mean(data, table, "alignment/mean_update_cos", keys),
        "update_cos_hidden": _last_epoch_hidden_update(data, table, keys),
        "teaching_cos": _last_epoch_mean(data, table, "alignment/mean_teaching_cos", keys),
        # the length beside the direction: ||teaching|| / ||true gradient|| (NaN in runs
        # recorded before the diagnostic measured it)
        "teaching_norm": _last_epoch_mean(data, table, "alignment/mean_teaching_norm", keys),
        "feedback_cos": _last_epoch_mean(data, table, "rule/feedback/mean_cos", keys),
        "macs_x_forward": bill["total"] / bill["forward"],
        "align_undefined_runs": _undefined_runs(data, table, keys),
        "update_layers_defined": _defined(data, table, keys, "alignment/update_cos/"),
        "teaching_populations_defined": _defined(data, table, keys, "alignment/teaching_cos/"),
    })
    return out.sort_values("test_acc_mean", ascending=False)
