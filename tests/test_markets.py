"""Daily markets for the CfC trainer (issue 38): the arch series offline, causal features,
an embargoed walk-forward split, the bootstrap's oracles, and bad inputs refused up front."""

from __future__ import annotations

import math
import socket
from pathlib import Path

import numpy as np
import pytest
import yaml

from analysis import markets as am
from lab.config import ConfigError
from lab.data.markets import (
    ARCH_SERIES,
    MarketArrays,
    arch_identity,
    arch_table,
    market_features,
)
from lab.data.prices import MarketLoader

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "notebooks" / "03-train-cfc-aux.ipynb"
SPLIT = dict(window=2, seq_len=5, horizons=(1, 5, 20), main_horizon=5, val_fraction=0.2,
             test_fraction=0.2, scale_window=60)


@pytest.fixture(scope="module")
def sp500():
    return arch_table("sp500")


@pytest.fixture
def offline(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a network connection was attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)


@pytest.mark.parametrize("series", ARCH_SERIES)
def test_each_series_loads_offline_with_its_identity(series, offline):
    import importlib

    import arch

    table = arch_table(series)
    raw = importlib.import_module(f"arch.data.{series}").load()
    assert table.shape == (len(raw.dropna()), 1 if series == "wti" else 5)
    assert np.all(np.isfinite(table)) and np.all(table[:, -1 if series == "wti" else 3] > 0)
    identity = arch_identity(series)
    assert identity["arch"] == arch.__version__ and identity["series"] == series
    assert identity["rows"] == len(table)
    # The hash is of the values as read: a one-ulp change of one value changes it.
    from lab.data import sha256_bytes

    assert identity["sha256"] == sha256_bytes(table.tobytes())
    changed = table.copy()
    changed[-1, 0] = np.nextafter(changed[-1, 0], np.inf)
    assert sha256_bytes(changed.tobytes()) != identity["sha256"]


def test_wti_drops_its_missing_days_and_has_only_the_return_channel():
    import arch.data.wti

    raw = arch.data.wti.load()
    assert raw.isna().to_numpy().sum() > 0  # the reason for the drop
    features, sigma = market_features(arch_table("wti"), 30)
    assert features.shape[1] == 1 and np.all(np.isfinite(features[30:]))


def test_features_are_scaled_as_documented(sp500):
    w = 30
    features, sigma = market_features(sp500, w)
    t = 1000
    log_c = np.log(sp500[:, 3])
    r = np.diff(log_c)[t - w:t]  # r_{t-w+1..t}
    assert sigma[t] == pytest.approx(np.sqrt(np.mean(r**2)), rel=1e-9)
    assert features[t, 0] == pytest.approx(r[-1] / sigma[t], rel=1e-9)
    rng = np.log(sp500[t - w + 1:t + 1, 1] / sp500[t - w + 1:t + 1, 2])
    assert features[t, 1] == pytest.approx(rng[-1] / np.sqrt(np.mean(rng**2)), rel=1e-9)
    co = np.log(sp500[t - w + 1:t + 1, 3] / sp500[t - w + 1:t + 1, 0])
    assert features[t, 2] == pytest.approx(co[-1] / np.sqrt(np.mean(co**2)), rel=1e-9)
    lv = np.log(sp500[t - w + 1:t + 1, 4])
    assert features[t, 3] == pytest.approx((lv[-1] - lv.mean()) / lv.std(), rel=1e-6)
    assert np.isnan(features[:w]).all() and np.isfinite(features[w:]).all()


@pytest.mark.parametrize("t", [300, 2500, 5000])
def test_no_feature_at_t_reads_a_price_after_t(sp500, t):
    rng = np.random.default_rng(t)
    later = sp500.copy()
    later[t + 1:] *= rng.uniform(0.5, 2.0, size=later[t + 1:].shape)  # every column
    before, _ = market_features(sp500, 60)
    after, _ = market_features(later, 60)
    np.testing.assert_array_equal(before[:t + 1], after[:t + 1])
    if t + 1 < len(sp500):
        assert not np.allclose(before[t + 1:], after[t + 1:])  # the change is seen later
    # and through the trainer's loader, whose day input is a trailing window of days
    a = MarketLoader(sp500, **SPLIT).features
    b = MarketLoader(later, **SPLIT).features
    assert np.array_equal(a[:t + 1].numpy(), b[:t + 1].numpy())


def _labels(arrays: MarketArrays, ends):
    return (arrays.long[ends], arrays.short[ends], arrays.direction[ends],
            arrays.inputs(ends))


@pytest.mark.parametrize("cut_name, kept", [("val", ("train",)), ("test", ("train", "val"))])
def test_no_label_reads_a_price_of_a_later_split(sp500, cut_name, kept):
    base = MarketArrays(sp500, **SPLIT)
    cut = int({"val": base.val_ends, "test": base.test_ends}[cut_name][0])
    later = sp500.copy()
    later[cut:] *= np.random.default_rng(0).uniform(0.5, 2.0, size=later[cut:].shape)
    moved = MarketArrays(later, **SPLIT)
    for split in kept:
        ends = getattr(base, f"{split}_ends")
        np.testing.assert_array_equal(getattr(moved, f"{split}_ends"), ends)
        for x, y in zip(_labels(base, ends), _labels(moved, ends)):
            np.testing.assert_array_equal(x, y)
    # not vacuous: the split after the cut sees the change in its labels
    after = base.val_ends if cut_name == "val" else base.test_ends
    assert not np.array_equal(base.long[after], moved.long[after])
    # and the embargo is the longest horizon: the last training (or validation) label reads
    # the price just before the cut
    last = int(getattr(base, f"{kept[-1]}_ends")[-1])
    assert last + SPLIT["horizons"][-1] == cut - 1


def test_the_split_is_in_time_order_with_the_asked_shares(sp500):
    a = MarketArrays(sp500, **SPLIT)
    assert a.train_ends[-1] < a.val_ends[0] and a.val_ends[-1] < a.test_ends[0]
    assert a.test_ends[-1] == len(sp500) - 1 - 20
    sizes = a.split_sizes()
    assert sizes["val_fraction"] == pytest.approx(0.2, abs=0.01)
    assert sizes["test_fraction"] == pytest.approx(0.2, abs=0.01)
    # the loader's batches are the arrays' inputs
    loader = MarketLoader(sp500, **SPLIT)
    batch = loader.test()
    np.testing.assert_allclose(batch.x.numpy(), a.inputs(a.test_ends), rtol=1e-6)
    np.testing.assert_array_equal(batch.direction.numpy(), a.direction[a.test_ends])


# ---------------------------------------------------------------------------
# metrics and the block bootstrap


def test_metrics_match_sklearn():
    from sklearn import metrics

    rng = np.random.default_rng(1)
    label = rng.integers(0, 2, 500)
    prob = np.round(np.clip(0.5 + 0.2 * (label - 0.5) + 0.3 * rng.standard_normal(500),
                            0.01, 0.99), 2)  # rounded: ties, which AUC counts half
    assert am.metric("accuracy", prob, label) == metrics.accuracy_score(label, prob > 0.5)
    assert am.metric("balanced_accuracy", prob, label) == pytest.approx(
        metrics.balanced_accuracy_score(label, prob > 0.5))
    assert am.metric("roc_auc", prob, label) == pytest.approx(
        metrics.roc_auc_score(label, prob))
    assert am.metric("log_loss", prob, label) == pytest.approx(metrics.log_loss(label, prob))
    assert math.isnan(am.metric("roc_auc", prob, np.ones(500, int)))


def test_block_indices_are_runs_of_consecutive_days():
    rng = np.random.default_rng(0)
    idx = am.block_indices(103, 20, rng)
    assert len(idx) == 103 and idx.min() >= 0 and idx.max() <= 102
    blocks = [idx[i:i + 20] for i in range(0, 103, 20)]
    for b in blocks:
        np.testing.assert_array_equal(np.diff(b), np.ones(len(b) - 1))
    with pytest.raises(ValueError, match="block=200"):
        am.block_indices(100, 200, rng)


def test_a_constant_metric_has_a_collapsed_interval_and_a_self_difference_of_zero():
    label = np.random.default_rng(2).integers(0, 2, 300)
    perfect = label.astype(float)
    draws = am.resamples(300, 20, 200, 0)
    out = am.arm_metrics(np.stack([perfect, perfect]), label, draws)
    for name in ("accuracy", "balanced_accuracy", "roc_auc"):
        assert out[name]["lo"] == out[name]["hi"] == out[name]["value"] == 1.0
    assert out["accuracy"]["seed_std"] == 0.0
    prob = np.random.default_rng(3).uniform(size=(2, 300))
    diff = am.difference(prob, prob, label, draws)
    assert all(d["lo"] == d["hi"] == d["value"] == 0.0 for d in diff.values())


def test_the_bootstrap_interval_has_the_binomial_width_for_independent_days():
    # iid hits with p = 0.6 and block 1: the 95% interval of the accuracy is about
    # +-1.96 sqrt(p (1 - p) / n); blocks of correlated days widen it.
    n, p = 2000, 0.6
    rng = np.random.default_rng(4)
    label = rng.integers(0, 2, n)
    hit = rng.uniform(size=n) < p
    prob = np.where(hit, label, 1 - label).astype(float)
    out = am.arm_metrics(prob[None], label, am.resamples(n, 1, 1000, 0), ("accuracy",))
    width = out["accuracy"]["hi"] - out["accuracy"]["lo"]
    assert width == pytest.approx(2 * 1.96 * math.sqrt(p * (1 - p) / n), rel=0.15)
    # runs of 50 equal outcomes: the block bootstrap sees them, a day bootstrap would not
    runs = np.repeat(rng.uniform(size=n // 50) < p, 50)
    prob = np.where(runs, label, 1 - label).astype(float)
    wide = am.arm_metrics(prob[None], label, am.resamples(n, 50, 1000, 0), ("accuracy",))
    assert wide["accuracy"]["hi"] - wide["accuracy"]["lo"] > 4 * width


def test_baselines():
    rng = np.random.default_rng(5)
    y = (rng.uniform(size=600) < 0.7).astype(int)
    assert np.all(am.majority(y, 10) == pytest.approx(y.mean()))
    x = rng.standard_normal((600, 3))
    y = (x[:, 0] + 0.3 * rng.standard_normal(600) > 0).astype(int)
    prob, c = am.logistic(x[:400], y[:400], x[400:500], y[400:500], x[500:])
    assert c in am.LOGREG_C and am.metric("roc_auc", prob, y[500:]) > 0.9


# ---------------------------------------------------------------------------
# bad inputs, refused before a kernel starts


def _config(**fields):
    from lab.train.cfc_aux import CfCAuxConfig

    return CfCAuxConfig(**{"source": "arch", "window": 1, "seq_len": 20,
                           "test_fraction": 0.2, **fields})


def test_an_unknown_series_is_refused_naming_the_allowed_ones():
    with pytest.raises(ConfigError, match=r"series.*'dax'.*sp500.*nasdaq.*wti"):
        _config(series="dax")


@pytest.mark.parametrize("fields, message", [
    ({"test_fraction": 0.01}, r"the test split holds \d+ examples, fewer than one batch "
     r"\(batch_size=32\).*test_fraction=0.01"),
    ({"val_fraction": 0.005}, r"the validation split holds \d+ examples, fewer than one batch"),
    ({"test_fraction": 0.005, "horizons": (1, 5, 40), "batch_size": 1},
     r"horizons=\[1, 5, 40\] are longer than the test span: test_fraction=0.005 leaves it "
     r"24 days of 4762, and each label needs 40 days.*allowed"),
    ({"val_fraction": 0.5, "test_fraction": 0.5}, r"val_fraction=0.5 \+ test_fraction=0.5"),
])
def test_bad_splits_are_refused_at_preflight(fields, message):
    with pytest.raises(ConfigError, match=message):
        _config(**fields).preflight()


def test_arch_fields_need_source_arch():
    from lab.train.cfc_aux import CfCAuxConfig

    with pytest.raises(ConfigError, match=r"test_fraction=0.2.*source='arch'"):
        CfCAuxConfig(source="synthetic", test_fraction=0.2)


def test_a_protocol_with_a_bad_split_is_refused_before_any_kernel(tmp_path, monkeypatch):
    import lab.notebook
    from lab.sweep import ProtocolError, load_protocol

    monkeypatch.setattr(lab.notebook, "_papermill", lambda *a, **k: pytest.fail("kernel"))
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({
        "name": "t", "notebook": str(TRAIN), "out": "runs",
        "fixed": {"source": "arch", "window": 1, "seq_len": 20, "test_fraction": 0.01},
        "grid": {"series": ["sp500", "wti"]}}))
    with pytest.raises(ProtocolError, match="fewer than one batch"):
        load_protocol(path)


# ---------------------------------------------------------------------------
# the trainer reads the test split once, at the step validation chose


def test_a_short_arch_run_records_its_test_predictions(tmp_path):
    from lab.train.cfc_aux import train_cfc_aux

    config = _config(series="wti", steps=6, eval_every=2, batch_size=8, units=8, aux_units=8,
                     enc_dim=4, backbone_units=8, threads=1, progress=False,
                     checkpoint_every=0)
    record = train_cfc_aux(config, tmp_path / "run", run_id="run")
    final = record["final"]
    arrays = MarketArrays(arch_table("wti"), window=1, seq_len=20, horizons=(1, 5, 20),
                          main_horizon=5, val_fraction=0.2, test_fraction=0.2,
                          scale_window=250)
    assert record["status"] == "complete"
    assert final["test_first_end"] == arrays.test_ends[0]
    assert final["test_label"] == arrays.direction[arrays.test_ends].astype(int).tolist()
    assert len(final["test_prob"]) == len(arrays.test_ends)
    assert final["test_acc"] == pytest.approx(
        am.metric("accuracy", np.array(final["test_prob"]), np.array(final["test_label"])),
        abs=2 / len(arrays.test_ends))  # (probabilities are rounded to 6 digits)
    vals = {r["step"]: r["val_loss"] for r in record["steps"] if r["val_loss"] is not None}
    assert final["best_step"] == min(vals, key=vals.get)
    assert final["val_loss"] == pytest.approx(vals[final["best_step"]], rel=1e-5)
    assert record["data"]["arch"]["series"] == "wti"
    assert record["data"]["split"]["n_test"] == len(arrays.test_ends)


def test_a_run_on_an_arch_series_notices_when_arch_ships_other_data():
    from lab.data.identity import changed_files
    from lab.data.markets import arch_identity

    now = arch_identity("sp500")
    assert changed_files({"data": {"arch": now}}) == []
    assert changed_files({"arch": {**now, "rows": 10}}) == [
        f"arch's sp500 series (arch {now['arch']} then): 10 days then, {now['rows']} now"]
    assert changed_files({"arch": {**now, "sha256": "0" * 64}}) == [
        f"arch's sp500 series (arch {now['arch']} then): other prices (sha256)"]
