"""The CfC trainer on daily markets: test-split metrics with block-bootstrap intervals, the
spread over seeds, and the baselines (notebook 31-cfc-markets).

Each CfC run with a test split records, per test day in time order, the predicted probability
of "up" (``final.test_prob``) and the label (``final.test_label``); the test split is read once
per run, at the step its validation loss chose. Here:

- metrics: accuracy (threshold 0.5), balanced accuracy, ROC AUC and log loss (sklearn);
- an arm's point value: the metric of each seed's predictions, averaged over seeds; the seeds'
  spread is their standard deviation;
- its interval: a moving-block bootstrap over test days (blocks of ``block`` consecutive days,
  block >= the longest label horizon, so the overlap of neighbouring labels stays inside a
  block): every resample draws the same days for every seed and arm, and the interval is the
  2.5 / 97.5 percentiles of the resampled seed-mean;
- a difference between two arms: the same resamples, so the interval is paired.

Baselines (computed here from ``lab.data.markets.MarketArrays``, the arrays the trainer reads,
passed in as numpy): the training split's majority class, and a logistic regression on the
same flattened input window whose L2 strength is chosen by validation log loss.
No torch here: analysis reads records and numpy arrays only.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

METRICS = ("accuracy", "balanced_accuracy", "roc_auc", "log_loss")
RESAMPLES = 1000
BOOT_SEED = 0
LOGREG_C = (0.0001, 0.001, 0.01, 0.1, 1.0)
_EPS = 1e-7  # log loss clips probabilities here (as a float32 sigmoid can reach 0 or 1)


def metric(name: str, prob: np.ndarray, label: np.ndarray) -> float:
    """One metric of probabilities of "up" against 0/1 labels (NaN where undefined: AUC and
    balanced accuracy need both classes)."""
    prob, label = np.asarray(prob, dtype=np.float64), np.asarray(label, dtype=np.int64)
    pred = (prob > 0.5).astype(np.int64)
    if name == "accuracy":
        return float(np.mean(pred == label))
    both = 0 < label.sum() < len(label)
    if name == "balanced_accuracy":
        if not both:
            return math.nan
        return float(0.5 * (np.mean(pred[label == 1] == 1) + np.mean(pred[label == 0] == 0)))
    if name == "roc_auc":
        if not both:
            return math.nan
        # Mann-Whitney: the share of (up, down) pairs ranked right, ties counting half
        # (sklearn's roc_auc_score, without its per-call overhead in a bootstrap loop).
        from scipy.stats import rankdata

        n1 = int(label.sum())
        n0 = len(label) - n1
        return float((rankdata(prob)[label == 1].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))
    if name == "log_loss":
        p = np.clip(prob, _EPS, 1 - _EPS)
        return float(-np.mean(label * np.log(p) + (1 - label) * np.log(1 - p)))
    raise KeyError(f"metric {name!r} is not known; allowed: {', '.join(METRICS)}")


def block_indices(n: int, block: int, rng: np.random.Generator) -> np.ndarray:
    """One moving-block resample of n days: ceil(n / block) blocks of ``block`` consecutive
    days, each starting at a uniform day in [0, n - block], concatenated and cut to n."""
    if not 1 <= block <= n:
        raise ValueError(f"block={block} must be between 1 and the {n} test days")
    starts = rng.integers(0, n - block + 1, size=math.ceil(n / block))
    return (starts[:, None] + np.arange(block)).ravel()[:n]


def resamples(n: int, block: int, count: int = RESAMPLES, seed: int = BOOT_SEED) -> np.ndarray:
    """(count, n) day indices, the same for every arm and seed compared with them."""
    rng = np.random.default_rng(seed)
    return np.stack([block_indices(n, block, rng) for _ in range(count)])


def arm_metrics(probs: np.ndarray, label: np.ndarray, draws: np.ndarray,
                names=METRICS) -> dict:
    """{metric: {value, lo, hi, seed_std, n_seeds}} of an arm's (S, n) probabilities:
    value = mean over seeds, lo/hi = the bootstrap interval of that mean over ``draws``."""
    probs = np.atleast_2d(np.asarray(probs, dtype=np.float64))
    label = np.asarray(label)
    out = {}
    for name in names:
        per_seed = np.array([metric(name, p, label) for p in probs])
        boot = np.array([np.mean([metric(name, p[d], label[d]) for p in probs])
                         for d in draws])
        lo, hi = np.nanpercentile(boot, [2.5, 97.5])
        out[name] = {"value": float(per_seed.mean()), "lo": float(lo), "hi": float(hi),
                     "seed_std": float(per_seed.std(ddof=1)) if len(probs) > 1 else 0.0,
                     "n_seeds": len(probs)}
    return out


def difference(probs_a: np.ndarray, probs_b: np.ndarray, label: np.ndarray,
               draws: np.ndarray, names=METRICS) -> dict:
    """{metric: {value, lo, hi}}: arm a's seed-mean metric minus arm b's, with the paired
    bootstrap interval (both arms on the same resampled days)."""
    probs_a, probs_b = np.atleast_2d(probs_a), np.atleast_2d(probs_b)
    label = np.asarray(label)

    def gap(days):
        return {name: np.mean([metric(name, p[days], label[days]) for p in probs_a])
                - np.mean([metric(name, p[days], label[days]) for p in probs_b])
                for name in names}

    point = gap(np.arange(len(label)))
    boot = [gap(d) for d in draws]
    out = {}
    for name in names:
        lo, hi = np.nanpercentile([b[name] for b in boot], [2.5, 97.5])
        out[name] = {"value": float(point[name]), "lo": float(lo), "hi": float(hi)}
    return out


def majority(train_label: np.ndarray, n_test: int) -> np.ndarray:
    """The training split's majority class as a probability: its share of "up" every day
    (accuracy = the majority's; AUC 0.5; log loss that of the base rate)."""
    return np.full(n_test, float(np.mean(train_label)))


def logistic(train_x, train_y, val_x, val_y, test_x, cs=LOGREG_C) -> tuple[np.ndarray, float]:
    """(test probabilities, chosen C): a standardised logistic regression per C fitted on
    training, the C with the lowest validation log loss kept (test never consulted)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    best = None
    for c in cs:
        model = make_pipeline(StandardScaler(), LogisticRegression(C=c, max_iter=2000))
        model.fit(train_x, train_y)
        loss = metric("log_loss", model.predict_proba(val_x)[:, 1], val_y)
        if best is None or loss < best[0]:
            best = (loss, c, model)
    return best[2].predict_proba(test_x)[:, 1], best[1]


def test_predictions(data) -> pd.DataFrame:
    """One row per run of a ``ProtocolRuns``: its grid values, ``first_end`` and the test
    ``prob`` / ``label`` arrays read from its record."""
    from lab.records import load_record

    rows = []
    for spec in data.specs:
        record = load_record(Path(data.runs_dir) / spec.run_id)
        final = record.get("final") or {}
        if "test_prob" not in final:
            raise KeyError(f"run {spec.run_id}: its record has no final.test_prob; the test "
                           "split is recorded only by runs with source 'arch' and "
                           "test_fraction > 0")
        rows.append({**spec.grid, "run_id": spec.run_id, "config": record["config"],
                     "first_end": final["test_first_end"], "best_step": final["best_step"],
                     "lift_step": final.get("lift_step"),
                     "prob": np.asarray(final["test_prob"], dtype=np.float64),
                     "label": np.asarray(final["test_label"], dtype=np.int64)})
    return pd.DataFrame(rows)


def compare(preds: pd.DataFrame, baselines: dict, block: int, count: int = RESAMPLES,
            seed: int = BOOT_SEED, by: str = "aux", reference: str = "none") -> tuple:
    """(table, differences) for one series' runs: one row per arm (``by`` values) and per
    baseline ({name: (n,) probabilities}) with every metric's value, interval and seed spread;
    and every CfC arm minus ``reference`` (paired). Every run must have the same test days."""
    label = preds["label"].iloc[0]
    for other, first in zip(preds["label"], preds["first_end"]):
        if first != preds["first_end"].iloc[0] or not np.array_equal(other, label):
            raise ValueError("runs of one series hold different test days or labels; "
                             "compare runs of one split only")
    draws = resamples(len(label), block, count, seed)
    arms = {name: np.stack(list(group["prob"])) for name, group in preds.groupby(by, sort=False)}
    arms.update({name: prob[None] for name, prob in baselines.items()})
    rows = []
    for name, probs in arms.items():
        for key, m in arm_metrics(probs, label, draws).items():
            rows.append({by: name, "metric": key, **m})
    diffs = []
    if reference in arms:
        for name in arms:
            if name != reference and name in set(preds[by]):
                for key, m in difference(arms[name], arms[reference], label, draws).items():
                    diffs.append({"arm": f"{name} - {reference}", "metric": key, **m})
    return pd.DataFrame(rows), pd.DataFrame(diffs)


def formatted(table: pd.DataFrame, by: str = "aux") -> pd.DataFrame:
    """value [lo, hi] ± seed std, one column per metric."""
    cells = table.assign(cell=[
        f"{r.value:.3f} [{r.lo:.3f}, {r.hi:.3f}]" + (f" ±{r.seed_std:.3f}" if r.n_seeds > 1
                                                      else "")
        for r in table.itertuples()])
    return cells.pivot(index=by, columns="metric", values="cell")[list(METRICS)]
