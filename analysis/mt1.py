"""MT-1: Kolen-Pollack under mixed apical traffic, raw vs matched vs innovation.

The protocol (``protocols/mt1.yaml``) runs ``kp_traffic`` with
``rule_params.traffic_rule`` in {none, raw, matched, innovation}: ``none`` is
clean KP with the same traffic formed and logged (the reference), the others
let the traffic into plasticity as it is, at the innovation's norm, or after
the local predictor has removed what it can; under each ``traffic_sign``
(``hebbian``: the traffic is added to the descent direction, the seed's and the
default; ``anti_hebbian``: to the gradient), a grid key or fixed. Every table and
figure is per (traffic_rule, traffic_sign), over seeds. A run that diverged is a
result: its trajectory counts up to the epoch where it diverged, and the tables
say so (``diverged``, ``diverged_at``); a run missing, failed or unfinished is a
gap. This module checks the runs hold
everything the comparison needs (one error listing every gap) and draws it:
final accuracy and loss per condition, feedback cosine and the five
mixed-apical RMS trajectories, the innovation/traffic and used/instruction
ratios over training, the predictor's residual ratio, and each signal's
alignment with the true gradient, with how many populations each alignment mean
covers (a collapsed network's mean can be one population's cosine).
"""

from __future__ import annotations

import difflib
import math

import pandas as pd

from .checks import flag
from .figures import NotebookFigure as Figure
from .figures import style_axes

CONDITION = "rule_params.traffic_rule"
SIGN = "rule_params.traffic_sign"
GROUP = [CONDITION, SIGN]
DEFAULT_SIGN = "hebbian"  # kp_traffic's, for a protocol that leaves the sign unset
SIGNALS = ("used", "instruction", "raw", "innovation", "traffic")
ALIGNED = ("instruction", "raw", "innovation", "matched", "used")
ROW_METRICS = (
    "train_loss", "rule/feedback/mean_cos", "rule/feedback/min_cos",
    "rule/feedback/mean_rel_err", "rule/feedback/max_rel_err",
    *(f"rule/apical/rms_{s}/mean" for s in SIGNALS),
)
# The predictor's residual ratio and the signal alignments are required too, but
# may be undefined (NaN), and that is a result, not a gap:
# - the residual ratio RMS(T - P h - b) / RMS(T) is 0/0 where no population carries
#   traffic: at traffic_ratio 0 (every calibrated gain is 0, ``rule/gains/<i>``), or
#   when a condition silenced the network;
# - a population whose layer above is silent receives no instruction, so its cosine is
#   undefined and the record's mean is over the populations where it is defined. With
#   every population silent the top one still is (the read-out instructs it), so the
#   mean can stand for one population: ``align_<signal>/populations`` counts them.
# ``silent_populations`` (required, finite) says how many populations are silent.
FINAL_METRICS = ("test_acc", "test_loss", "rule/silent_populations")
RESIDUAL = "rule/predictor_residual_ratio"
ALIGNMENT = "rule/signal_alignment/"
MEASURED = (RESIDUAL, *(f"{ALIGNMENT}{s}/mean" for s in ALIGNED))


def check_mt1_complete(data) -> None:
    """Every run complete with the MT-1 trajectories and final diagnostics (one error).

    The diagnostics in ``MEASURED`` must be present. They may be NaN only where they
    are undefined (see above): the residual ratio in a run without traffic (every gain
    0) or with silent populations, an alignment in a run with silent populations; the
    tables then average the seeds where it is defined, counting them (``<x>/n`` of
    ``seeds``), and show NaN where no seed defines it. A run that diverged is finished:
    it must hold every row up to the one where it diverged, with every trajectory field
    (a non-finite value there is the divergence, not a gap), and no final metrics. A
    protocol without the
    ``rule_params.traffic_rule`` grid key is not MT-1: one ValueError says so, instead
    of a list of everything such runs lack; so is one whose grid varies another key
    besides the seed and the sign (the tables would average it in).
    """
    from .completeness import IncompleteProtocolError, find_problems
    from .completeness import advice as completeness_advice

    _table(data)
    diverged = _diverged_ids(data)
    # A diverged run is checked as a complete one of the rows it logged, with no finals.
    runs = data.runs.copy()
    stop = runs["run_id"].isin(diverged)
    runs.loc[stop, "status"] = "complete"
    runs.loc[stop, "expect"] = pd.Series(
        [{**expect, "count": int(n), "final": []} for expect, n in
         zip(runs.loc[stop, "expect"], runs.loc[stop, "n_rows"])], index=runs.index[stop],
        dtype=object)
    problems = [line for line in find_problems(runs, data.metrics, data.expected_ids,
                                               ROW_METRICS, FINAL_METRICS)
                if not (line.split(":", 1)[0] in diverged and "is non-finite" in line)]
    # ROW_METRICS and FINAL_METRICS are asked of every run: a diverged one has no finals
    problems = [line for line in problems if not (
        line.split(":", 1)[0] in diverged and "final field" in line)]
    faults = []  # complete runs whose diagnostic is NaN where it is defined
    finals = data.metrics[data.metrics["axis"] == "final"]
    for run_id in data.expected_ids:
        if run_id in diverged:
            continue
        mine = finals[finals["run_id"] == run_id].set_index("metric")["value"]
        if not len(mine):
            continue
        silent = mine.get("rule/silent_populations", 0) > 0
        gains = mine[mine.index.str.startswith("rule/gains/")]
        no_traffic = len(gains) > 0 and bool((gains == 0).all())
        for name in MEASURED:
            if name not in mine:
                problems.append(f"{run_id}: final field {name!r} missing")
            elif mine[name] != mine[name] and not silent and not (
                    name == RESIDUAL and no_traffic):
                why = ("no population is silent" if name != RESIDUAL else
                       "no population is silent and the traffic gains are not all 0")
                faults.append(f"{run_id}: final field {name!r} is non-finite (nan) although "
                              f"{why}")
    if problems or faults:
        lines = "\n".join(f"  - {line}" for line in problems + faults)
        advice = (completeness_advice(problems) if problems else "rerunning reproduces a "
                  "NaN in a complete run: a fault of the run or the rule, not a gap")
        raise IncompleteProtocolError(
            f"incomplete data: {len(problems) + len(faults)} problem(s) across "
            f"{len(data.expected_ids)} expected runs ({advice}):\n{lines}", problems + faults)


def populations_covered(data) -> pd.DataFrame:
    """Per run, how many populations each signal's alignment mean covers (finite cosines),
    and ``populations``: how many the network has."""
    finals = data.metrics[(data.metrics["axis"] == "final")
                          & data.metrics["metric"].str.startswith(ALIGNMENT)
                          & ~data.metrics["metric"].str.endswith("/mean")]
    parts = finals["metric"].str[len(ALIGNMENT):].str.split("/", n=1, expand=True)
    finals = finals.assign(signal=parts[0], population=parts[1])
    finals = finals[finals["signal"].isin(ALIGNED)]
    defined = finals.assign(defined=finals["value"].map(math.isfinite)).pivot_table(
        index="run_id", columns="signal", values="defined", aggfunc="sum")
    covered = defined[list(ALIGNED)].rename(columns=lambda s: f"align_{s}/populations")
    covered["populations"] = finals.groupby("run_id")["population"].nunique()
    return covered.astype(float)


def _table(data) -> pd.DataFrame:
    table = data.table()
    if SIGN not in table:  # fixed, or left to the rule's default
        signs = {s.run_id: _fixed_sign(s.params) for s in data.specs}
        table[SIGN] = table["run_id"].map(signs)
    if CONDITION not in table:
        fixed = (f" ({CONDITION} is fixed here: give it as a grid key, a one-value list "
                 "selects one condition)" if CONDITION in data.protocol.fixed else "")
        raise ValueError(f"MT-1 needs the grid key {CONDITION!r}; this protocol's grid has "
                         f"{', '.join(sorted(data.protocol.grid))}{fixed}")
    # Every table and figure here is per condition, averaged over seeds: another grid key
    # (a weight decay, a traffic ratio) would be averaged in silently, and its points
    # counted as seeds. One setting per protocol, or analysis.summarize over all keys.
    # (a key given one value varies nothing: it selects one setting, and is fine)
    others = [key for key in data.group_keys if key not in GROUP
              and key in table and table[key].astype(str).nunique(dropna=False) > 1]
    if others:
        raise ValueError(
            f"MT-1 compares the traffic rules at one setting, over seeds; this protocol's "
            f"grid also varies {', '.join(others)}, which its tables would average in. "
            f"Put each setting in a protocol of its own (fixed: {others[0]}: ...), or "
            f"summarise with analysis.summarize(data.table(), data.group_keys, ...), which "
            f"keeps every grid point apart")
    return table


def _fixed_sign(params: dict) -> str:
    nested = params.get("rule_params")
    if isinstance(nested, dict) and SIGN.split(".")[1] in nested:
        return nested[SIGN.split(".")[1]]
    return params.get(SIGN, DEFAULT_SIGN)


def _diverged_ids(data) -> set[str]:
    runs = data.runs
    if not len(runs):
        return set()
    return set(runs.loc[runs["status"] == "diverged", "run_id"]) & set(data.expected_ids)


def outcomes(data) -> pd.DataFrame:
    """Per expected run: its traffic rule, sign and seed, ``status`` and, for a run that
    diverged, ``diverged_epoch`` (the epoch of its last row, where the divergence showed)
    and ``error`` (why)."""
    table = _table(data)
    rows = data.metrics[data.metrics["axis"] == "epoch"]
    last = rows.groupby("run_id")["index"].max()
    out = table[["run_id", *GROUP, "seed", "status"]].copy()
    stopped = out["status"] == "diverged"
    out["diverged_epoch"] = out["run_id"].map(last).where(stopped).astype("Int64")
    errors = data.runs.set_index("run_id")["error"] if len(data.runs) else pd.Series()
    out["error"] = out["run_id"].map(errors).where(stopped)
    return out.reset_index(drop=True)


def final_table(data) -> pd.DataFrame:
    """Per (traffic_rule, traffic_sign), mean and std over seeds of accuracy, loss and the
    final diagnostics.

    Beside each ``align_<signal>`` (the mean cosine over the populations where it is
    defined) ``align_<signal>/populations`` says how many populations that is, of
    ``populations``. Every quantity's mean and std are over the seeds where it is
    defined; ``<quantity>/n`` says how many of the condition's ``seeds`` that is. A run
    that diverged has no final metrics: ``diverged`` counts those seeds and
    ``diverged_at`` lists their divergence epochs ("" when none diverged).
    """
    table = _table(data)
    finals = data.metrics[data.metrics["axis"] == "final"].pivot_table(
        index="run_id", columns="metric", values="value", dropna=False)
    columns = ["test_acc", "test_loss", "rule/silent_populations", *MEASURED]
    frame = finals[columns].rename(columns=lambda c: c.replace(ALIGNMENT, "align_")
                                   .replace("/mean", "").replace("rule/", ""))
    frame = frame.join(populations_covered(data))
    order = ["test_acc", "test_loss", "silent_populations", "populations",
             "predictor_residual_ratio"]
    for signal in ALIGNED:
        order += [f"align_{signal}", f"align_{signal}/populations"]
    # (a diverged run has no finals: its row is all NaN, counted in seeds, not in /n)
    frame = table.set_index("run_id")[GROUP].join(frame[order])
    groups = frame.groupby(GROUP)
    # The mean is over the seeds where a value is defined (a NaN residual or alignment is
    # undefined, not zero): ``<x>/n`` counts them, of ``seeds``, so a partial mean shows.
    stats = groups.agg(["mean", "std", "count"])
    stats.columns = [f"{a}/{'n' if b == 'count' else b}" for a, b in stats.columns]
    stats = stats.join(groups.size().rename("seeds"))
    runs = outcomes(data).sort_values("diverged_epoch")
    epochs = {key: [int(e) for e in group["diverged_epoch"]] for key, group in
              runs[runs["status"] == "diverged"].groupby(GROUP)}
    stats["diverged"] = [len(epochs.get(key, [])) for key in stats.index]
    stats["diverged_at"] = [", ".join(map(str, epochs.get(key, []))) for key in stats.index]
    return stats


def _epoch_metric(data, metric, function: str, what: str = "metric") -> None:
    """A per-epoch metric the runs recorded, or a ValueError naming those they did: a
    mistyped name once gave an empty frame and a blank figure in a finished report."""
    have = set(data.metrics.loc[data.metrics["axis"] == "epoch", "metric"])
    if metric not in have:
        close = difflib.get_close_matches(metric, have, n=3)
        hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
        # summaries (a population mean, a top-level value) before per-population names
        names = sorted(have, key=lambda n: (not (n.endswith("/mean") or "/" not in n), n))
        shown = ", ".join(names[:30]) + (f", ... ({len(names) - 30} more)"
                                         if len(names) > 30 else "")
        raise ValueError(f"{function}: no run recorded the per-epoch {what} {metric!r}"
                         f"{hint}; recorded per epoch: {shown or 'none'}")


def _by_group(data, table, rows: pd.DataFrame) -> pd.DataFrame:
    """Per epoch, one column per (traffic_rule, traffic_sign): the mean over the seeds
    with a finite value there (a diverged run counts up to its divergence, where its
    values may leave the finite); ``attrs["diverged"]`` maps a column to its diverged
    runs' (seed, epoch)."""
    rows = rows.merge(table[["run_id", *GROUP]], on="run_id")
    finite = rows["value"].map(math.isfinite)
    rows = rows.assign(value=rows["value"].where(finite))
    frame = rows.groupby([*GROUP, "index"])["value"].mean().unstack(GROUP)
    stopped = outcomes(data)
    stopped = stopped[stopped["status"] == "diverged"]
    frame.attrs["diverged"] = {
        key: list(zip(group["seed"], group["diverged_epoch"].astype(int)))
        for key, group in stopped.groupby(GROUP)}
    return frame


def epoch_frame(data, metric: str) -> pd.DataFrame:
    """Mean over seeds per epoch of one per-epoch metric, one column per (traffic_rule,
    traffic_sign) (see :func:`_by_group` for diverged runs)."""
    table = _table(data)
    _epoch_metric(data, metric, "epoch_frame")
    rows = data.metrics[(data.metrics["axis"] == "epoch") & (data.metrics["metric"] == metric)]
    return _by_group(data, table, rows)


def ratio_frame(data, numerator: str, denominator: str) -> pd.DataFrame:
    """Per (traffic_rule, traffic_sign) and epoch, the mean over seeds of
    RMS(numerator) / RMS(denominator)."""
    table = _table(data)
    for signal in (numerator, denominator):
        _epoch_metric(data, f"rule/apical/rms_{signal}/mean", "ratio_frame",
                      f"RMS of signal {signal!r}, metric")
    m = data.metrics[data.metrics["axis"] == "epoch"]
    wide = m[m["metric"].isin([f"rule/apical/rms_{numerator}/mean",
                               f"rule/apical/rms_{denominator}/mean"])]
    wide = wide.pivot_table(index=["run_id", "index"], columns="metric", values="value")
    ratio = (wide[f"rule/apical/rms_{numerator}/mean"]
             / wide[f"rule/apical/rms_{denominator}/mean"]).rename("value").reset_index()
    frame = _by_group(data, table, ratio)
    # an undefined ratio (x/0 at traffic_ratio 0) stays one: inf, not a gap
    undefined = ratio.merge(table[["run_id", *GROUP]], on="run_id").groupby(GROUP)[
        "value"].apply(lambda v: not v.map(math.isfinite).any())
    for key in undefined[undefined].index:
        frame[key] = math.inf
    return frame


def _label(column, sep: str = ", ") -> str:
    return sep.join(map(str, column)) if isinstance(column, tuple) else str(column)


def lines(frame: pd.DataFrame, ylabel: str, *, log: bool = False) -> Figure:
    """One line per condition over epochs (``log``: a log y axis, True or False).

    A diverged run (``frame.attrs["diverged"]``, from :func:`epoch_frame`) is marked
    with an x on its condition's line at the epoch where it diverged, and named in the
    legend."""
    log = flag(log, "lines", "log")
    grouped = isinstance(frame.columns, pd.MultiIndex)
    fig = Figure(figsize=(8.5 if grouped else 5.5, 3.4), layout="constrained")
    ax = fig.subplots()
    # A condition with no finite value (a ratio over zero traffic at traffic_ratio 0) draws
    # nothing: named on the panel, not left as an empty axis.
    finite = frame.apply(pd.to_numeric).apply(lambda c: c.map(math.isfinite).any())
    diverged = frame.attrs.get("diverged", {})
    for k, condition in enumerate(frame.columns[finite.to_numpy()]):
        # styles cycle with the colours: conditions that coincide (innovation on none)
        # hid each other
        stops = diverged.get(condition, [])
        said = ", ".join(str(epoch) for _, epoch in stops)
        line, = ax.plot(frame.index, frame[condition],
                        label=_label(condition) + (f" (diverged at epoch {said})"
                                                   if said else ""),
                        linestyle=("-", "--", "-.", ":")[k % 4])
        at = [epoch for _, epoch in stops if epoch in frame.index]
        if at:
            ax.plot(at, frame.loc[at, condition], "x", color=line.get_color(),
                    markersize=8)
    undefined = [_label(c) for c in frame.columns[~finite.to_numpy()]]
    if undefined:
        ax.text(0.5, 0.5, f"undefined (no finite value) for: {', '.join(undefined)}",
                transform=ax.transAxes, ha="center", va="center", fontsize="small",
                wrap=True)
    style_axes(ax, "epoch", ylabel)
    if log and len(undefined) < len(frame.columns):
        ax.set_yscale("log")
    if ax.lines:
        # (beside the axes: eight conditions and their divergences hid the lines)
        ax.legend(fontsize="small", title="traffic_rule, traffic_sign" if grouped
                  else "traffic_rule", loc="upper left", bbox_to_anchor=(1.01, 1))
    return fig


def rms_panels(data) -> Figure:
    """The five mixed-apical RMS trajectories, one panel per traffic rule (columns) and
    sign (rows), log scale; a run that diverged is named in its panel's title."""
    table = _table(data)
    conditions = sorted(table[CONDITION].unique())
    signs = sorted(table[SIGN].unique())
    frames = {s: epoch_frame(data, f"rule/apical/rms_{s}/mean") for s in SIGNALS}
    fig = Figure(figsize=(3.2 * len(conditions), 3.0 * len(signs)), layout="constrained")
    grid = fig.subplots(len(signs), len(conditions), squeeze=False, sharex=True, sharey=True)
    for row, sign in zip(grid, signs):
        for ax, condition in zip(row, conditions):
            stops = frames[SIGNALS[0]].attrs["diverged"].get((condition, sign), [])
            for k, signal in enumerate(SIGNALS):
                frame = frames[signal]
                # points too: a run that diverged in epoch 0 has one, which no line draws
                ax.plot(frame.index, frame[(condition, sign)], label=signal,
                        linestyle=("-", "--", "-.", ":")[k % 4],  # equal signals stay apart
                        marker="." if stops else None)
            said = ", ".join(str(epoch) for _, epoch in stops)
            ax.set_title(f"{condition}, {sign}" + (f"\ndiverged at epoch {said}"
                                                    if said else ""), fontsize="small")
            ax.set_yscale("log")
            style_axes(ax, "epoch")
        row[0].set_ylabel("RMS (mean over populations)")
    grid[0][-1].legend(fontsize="small")
    return fig


def alignment_bars(data) -> Figure:
    """Mean over seeds of each signal's alignment mean (cos(signal, true gradient) over
    the populations where it is defined), per (traffic_rule, traffic_sign) (the seeds
    that did not diverge), with +-1 std over seeds as
    error bars (none for one seed). Each tick says how many
    populations the means cover (mean over seeds / all); a bar over fewer than
    all populations is hatched."""
    stats = final_table(data)
    fig = Figure(figsize=(max(7.0, 1.2 * len(stats)), 3.8), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / len(ALIGNED)
    total = stats["populations/mean"]
    for k, signal in enumerate(ALIGNED):
        xs = [i + k * width for i in range(len(stats))]
        # one seed has no std: no error bar (0 drew one, as if the seeds agreed)
        bars = ax.bar(xs, stats[f"align_{signal}/mean"], width,
                      yerr=stats[f"align_{signal}/std"], capsize=2, label=signal)
        for bar, partial in zip(bars, stats[f"align_{signal}/populations/mean"] < total):
            bar.set_hatch("//" if partial else "")
    ticks = []
    for key in stats.index:
        covered = stats.loc[key, [f"align_{s}/populations/mean" for s in ALIGNED]]
        low, high = covered.min(), covered.max()
        span = f"{low:g}" if low == high else f"{low:g}-{high:g}"
        stopped, name = stats.loc[key, "diverged"], _label(key, "\n")
        if stopped == stats.loc[key, "seeds"]:  # no finals: no bar, said on the tick
            ticks.append(f"{name}\nall {stopped} diverged")
            continue
        more = f"\n{stopped} of {stats.loc[key, 'seeds']} diverged" if stopped else ""
        ticks.append(f"{name}\n{span}/{total[key]:g} populations{more}")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(stats))], ticks, fontsize="small")
    ax.set_ylabel("cos(signal, BP gradient)")
    ax.set_title("mean over the populations where defined (hatched: not all of them); "
                 "error bar: +-1 std over seeds", fontsize="small")
    ax.axhline(0, color="grey", linewidth=0.5)
    ax.legend(fontsize="small", ncol=3)
    return fig


def styled(finals: pd.DataFrame):
    """:func:`final_table` transposed for reading: numbers to 3 significant digits, NaN
    as "undefined", ``diverged_at`` as written."""
    def number(value):
        if isinstance(value, str):
            return value
        return "undefined" if value != value else f"{value:.3g}"
    return finals.T.style.format(number)
