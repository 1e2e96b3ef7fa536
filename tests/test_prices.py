"""Price sources and the multi-horizon loader: definitions, no look-ahead, splits, bad inputs."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from lab.data import DataError
from lab.data.prices import (
    VAL_FRACTION_SLACK,
    MultiHorizonLoader,
    csv_prices,
    synthetic_prices,
    val_fraction_off,
    vega_prices,
)

HORIZONS = (1, 3, 7)


def _walk(n=120, seed=0):
    return synthetic_prices("random_walk", length=n, drift=0.0005, volatility=0.02, seed=seed)


def _loader(prices, **kw):
    args = dict(window=5, seq_len=4, horizons=HORIZONS, main_horizon=3, val_fraction=0.25)
    return MultiHorizonLoader(prices, **{**args, **kw})


def test_outcomes_equal_a_direct_computation():
    prices = _walk()
    data = _loader(prices)
    lp = np.log(prices)
    r = np.diff(lp, prepend=lp[0])
    for t in (20, 57, len(prices) - 1 - HORIZONS[-1]):
        sigma = math.sqrt(sum(r[k] ** 2 for k in range(1, t + 1)) / t)
        np.testing.assert_allclose(data.features[t].numpy(), r[t - 4:t + 1] / sigma, rtol=1e-6)
        for i, h in enumerate(HORIZONS):
            moves = [lp[t + k] - lp[t] for k in range(1, h + 1)]
            scale = sigma * math.sqrt(h)
            assert data.long[t, i].item() == pytest.approx(max(moves) / scale, rel=1e-6)
            assert data.short[t, i].item() == pytest.approx(max(-m for m in moves) / scale,
                                                             rel=1e-6)
        assert data.direction[t].item() == float(lp[t + 3] > lp[t])


def test_constant_drift_scales_to_known_values():
    data = _loader(synthetic_prices("constant", length=80, drift=0.01))
    t = data.train_ends[0]
    assert torch.allclose(data.features[t], torch.ones(5))
    expected_long = torch.tensor([math.sqrt(h) for h in HORIZONS])
    torch.testing.assert_close(data.long[t], expected_long)
    torch.testing.assert_close(data.short[t], -1 / expected_long)
    assert data.direction[data.train_ends].eq(1).all()


@pytest.mark.parametrize("t0", [30, 61, 90])
def test_no_look_ahead(t0):
    """Perturb every price after t0: features up to t0, and the horizon-h targets of every t
    with t + h <= t0, are unchanged; later ones change (so the check can fail)."""
    prices = _walk(seed=1)
    perturbed = prices.copy()
    perturbed[t0 + 1:] *= np.exp(np.random.default_rng(0).normal(0, 0.05, len(prices) - t0 - 1))
    a, b = _loader(prices), _loader(perturbed)
    assert torch.equal(a.features[:t0 + 1], b.features[:t0 + 1])
    assert not torch.equal(a.features[t0 + 1:], b.features[t0 + 1:])
    last = len(prices) - 1 - HORIZONS[-1]
    for i, h in enumerate(HORIZONS):
        safe = slice(0, t0 - h + 1)  # t + h <= t0
        assert torch.equal(a.long[safe, i], b.long[safe, i])
        assert torch.equal(a.short[safe, i], b.short[safe, i])
        if t0 - h + 1 <= last:
            reads_later = slice(t0 - h + 1, last + 1)
            assert not torch.equal(a.long[reads_later, i], b.long[reads_later, i])
    m = HORIZONS.index(3)
    assert m >= 0 and torch.equal(a.direction[:t0 - 3 + 1], b.direction[:t0 - 3 + 1])


def test_validation_is_the_later_part_and_training_targets_stop_before_it():
    data = _loader(_walk(200))
    h_max = HORIZONS[-1]
    assert data.train_ends.max() + h_max <= data.cut <= data.val_ends.min()
    assert data.val_ends.max() == 200 - 1 - h_max
    assert data.train_ends.min() - (data.seq_len - 1) - data.window >= 0
    # Every example's features were built from whole windows of real returns.
    batch = data.batch(data.train_ends[:3])
    assert batch.x.shape == (3, 4, 5) and batch.long.shape == (3, 3)
    torch.testing.assert_close(batch.x[:, -1], data.features[data.train_ends[:3]])
    sample = data.sample(64, torch.Generator().manual_seed(0))
    assert set(sample.ends.tolist()) <= set(data.train_ends.tolist())
    assert len(data.validation().ends) == len(data.val_ends)


def test_vega_prices_are_read_from_the_installed_wheel():
    from vega_datasets import data as vega

    assert vega.stocks.is_local and Path(vega.stocks.filepath).is_file()
    msft = vega_prices("MSFT")
    assert msft.shape == (123,) and msft[0] == pytest.approx(39.81)  # 2000-01
    assert vega_prices("GOOG").shape == (68,)
    pooled = vega_prices()  # the default: AAPL, AMZN, IBM, MSFT on the same 123 months
    assert pooled.shape == (4, 123)
    np.testing.assert_array_equal(pooled[3], msft)
    data = MultiHorizonLoader(pooled)  # the trainer's defaults fit the monthly series
    assert len(data.train_ends) == 4 * 44 and len(data.val_ends) == 4 * 17


def test_aligned_series_are_each_their_own_loader_cut_at_one_time():
    a, b = _walk(150, seed=2), _walk(150, seed=3)
    both, only_a, only_b = _loader(np.stack([a, b])), _loader(a), _loader(b)
    assert both.cut == only_a.cut
    n = 150
    torch.testing.assert_close(both.train_ends,
                               torch.cat([only_a.train_ends, only_b.train_ends + n]))
    torch.testing.assert_close(both.val_ends, torch.cat([only_a.val_ends, only_b.val_ends + n]))
    for name in ("features", "long", "short", "direction"):
        torch.testing.assert_close(getattr(both, name)[n:], getattr(only_b, name))
    # A sequence never crosses from one series into the next.
    x = both.batch(both.train_ends[len(only_a.train_ends):][:1]).x
    torch.testing.assert_close(x, only_b.batch(only_b.train_ends[:1]).x)
    with pytest.raises(DataError, match=r"price series\[1\] has 1 NaN"):
        _loader(np.stack([a, np.where(np.arange(n) == 5, np.nan, b)]))


def test_csv_source(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text("date,close\n" + "".join(f"{i},{100 + i}\n" for i in range(5)))
    np.testing.assert_array_equal(csv_prices(path, "close"), 100 + np.arange(5.0))


def test_synthetic_sources_are_seeded_and_leave_the_global_rng_alone():
    state = np.random.get_state()[1].copy()
    a = synthetic_prices("random_walk", length=50, seed=3)
    np.testing.assert_array_equal(a, synthetic_prices("random_walk", length=50, seed=3))
    assert not np.array_equal(a, synthetic_prices("random_walk", length=50, seed=4))
    assert np.array_equal(state, np.random.get_state()[1])
    regimes = synthetic_prices("regimes", length=41, drift=0.01, volatility=0.0, regime_length=10)
    steps = np.diff(np.log(regimes))
    np.testing.assert_allclose(steps, np.repeat([0.01, -0.01, 0.01, -0.01], 10))


# ---------------------------------------------------------------------------
# bad inputs: clear errors naming the value and what is allowed


def test_series_too_short():
    with pytest.raises(DataError, match=r"has 23 prices, too short for window=5, seq_len=4 and "
                                        r"the largest horizon 7: it needs at least 24"):
        _loader(_walk(30)[:23])
    with pytest.warns(UserWarning, match=r"val_fraction=0.25 cannot be honoured"):
        data = _loader(_walk(30)[:24])  # the shortest allowed: one example on each side
    assert len(data.train_ends) >= 1 and len(data.val_ends) >= 1
    with pytest.raises(DataError, match=r"too short"):
        _loader(_walk(30), horizons=(1, 20), main_horizon=1)


def test_nan_and_non_positive_prices():
    prices = _walk()
    bad = prices.copy()
    bad[17] = np.nan
    with pytest.raises(DataError, match=r"NaN or infinite price\(s\), the first at index 17"):
        _loader(bad)
    bad = prices.copy()
    bad[40] = -2.0
    with pytest.raises(DataError, match=r"non-positive price\(s\), the first at index 40 "
                                        r"\(-2.0\)"):
        _loader(bad)
    bad[40] = 0.0
    with pytest.raises(DataError, match=r"non-positive"):
        _loader(bad)


def test_csv_without_the_named_column(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text("date,close\n1,2\n")
    with pytest.raises(DataError, match=r"has no column 'price'; its columns are: 'date', "
                                         r"'close'$"):
        csv_prices(path, "price")
    # A semicolon-separated file reads as one column: say so.
    path.write_text("date;close\n1;2\n")
    with pytest.raises(DataError, match=r"has no column 'close'; its columns are: 'date;close'"
                                         r"; it reads as one column: the file looks separated "
                                         r"by ';', and lab reads comma-separated CSV"):
        csv_prices(path, "close")
    # A name with spaces around it: the spaces are visible, and named.
    path.write_text("date, close \n1,2\n")
    with pytest.raises(DataError, match=r"its columns are: 'date', ' close '; one is 'close' "
                                         r"with spaces around it"):
        csv_prices(path, "close")
    with pytest.raises(DataError, match=r"does not exist"):
        csv_prices(tmp_path / "missing.csv", "close")


def test_csv_with_text_in_the_price_column(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text("close\n" + "".join(f"{100 + i}\n" for i in range(60)) + "n/a\n")
    with pytest.raises(DataError, match=r"NaN or infinite price\(s\), the first at index 60"):
        _loader(csv_prices(path, "close"))


@pytest.mark.parametrize("horizons", [(5, 1, 20), (1, 1, 5), (20, 5)])
def test_horizons_not_increasing(horizons):
    with pytest.raises(DataError, match=r"are not strictly increasing"):
        _loader(_walk(), horizons=horizons, main_horizon=horizons[0])


def test_other_bad_arguments():
    with pytest.raises(DataError, match=r"main_horizon=4 is not one of horizons=\(1, 3, 7\)"):
        _loader(_walk(), main_horizon=4)
    with pytest.raises(DataError, match=r"integers >= 1"):
        _loader(_walk(), horizons=(0, 3), main_horizon=3)
    with pytest.raises(DataError, match=r"symbol 'TSLA' is not in the bundled.*all, AAPL"):
        vega_prices("TSLA")
    with pytest.raises(DataError, match=r"synthetic kind 'trend' is not known"):
        synthetic_prices("trend")
    with pytest.raises(DataError, match=r"does not move"):
        _loader(np.full(100, 5.0))


def test_split_sizes_and_a_warning_when_the_clamp_moves_the_split():
    # GOOG (68 months) at val_fraction 0.2 with the CfC defaults: the clamp that gives each side
    # an example leaves 2 training and 4 validation examples (trial finding 9).
    with pytest.warns(UserWarning) as caught:
        data = MultiHorizonLoader(vega_prices("GOOG"), window=12, seq_len=12,
                                  horizons=(1, 5, 20), main_horizon=5, val_fraction=0.2,
                                  name="GOOG")
    assert [str(w.message) for w in caught] == [
        "GOOG: val_fraction=0.2 cannot be honoured with window=12, seq_len=12 and the largest "
        "horizon 20 on 68 prices (the splits are 20 steps apart, and each needs an example): 2 "
        "training and 4 validation examples (validation fraction 0.667). Use a longer series or "
        "smaller window / seq_len / horizons"]
    assert data.split_sizes() == {"n_train": 2, "n_val": 4, "val_fraction": 4 / 6}


def test_a_warning_when_the_gap_between_the_splits_moves_the_fraction():
    # Not clamped, but the h_max steps left between the splits make 7 training and 5
    # validation examples of 33 prices: a fraction of 0.417 against the 0.25 asked.
    with pytest.warns(UserWarning, match=r"val_fraction=0.25 cannot be honoured .* 7 training "
                                         r"and 5 validation examples \(validation fraction "
                                         r"0.417\)"):
        data = _loader(_walk()[:33])
    sizes = data.split_sizes()
    assert (sizes["n_train"], sizes["n_val"]) == (len(data.train_ends), len(data.val_ends))
    assert abs(sizes["val_fraction"] - 0.25) > VAL_FRACTION_SLACK


def test_no_warning_when_the_split_is_as_requested():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        data = _loader(_walk(), val_fraction=0.25)
    # 120 prices: first = 8, last = 112, cut = 8 + round(0.75 * 104) = 86; training ends run
    # 8..79 (cut - 7), validation 86..112.
    assert data.split_sizes() == {"n_train": 72, "n_val": 27, "val_fraction": 27 / 99}


# --- trial findings F6 / F7: text cells, empty files, splits without price movement ----------


def test_text_in_the_price_column_is_named_not_reported_as_nan(tmp_path):
    path = tmp_path / "p.csv"
    # Row 0 is the first after the header; the blank line is skipped, not counted.
    path.write_text("date,price\n0,101.5\n1,102\n\n2,abc\n3,9x\n4,103\n")
    with pytest.raises(DataError) as err:
        csv_prices(path, "price")
    assert str(err.value) == (
        f"not a number: 'abc' at row 2 ({path}:price; row 0 is the first after the header, "
        "blank lines not counted); 2 cell(s) of the column are not numbers; give one price "
        "per row, as a plain number such as 101.25")
    # Blank and "NaN" cells are missing values, not text: they stay NaN prices, refused as such.
    path.write_text("price\n1\n\nNaN\n2\n")
    np.testing.assert_array_equal(csv_prices(path, "price"), [1.0, np.nan, 2.0])


@pytest.mark.parametrize("content, what", [
    ("", "is empty (0 bytes)"),
    ("\n\n  \n\n", "holds only blank lines"),
])
def test_empty_csv_names_the_file_and_what_is_expected(tmp_path, content, what):
    path = tmp_path / "p.csv"
    path.write_text(content)
    with pytest.raises(DataError) as err:
        csv_prices(path, "close")
    assert str(err.value) == (f"price CSV {str(path)!r} {what}; expected a header row naming "
                              "the column 'close', then one price per row (oldest first)")


def test_a_csv_pandas_cannot_parse_names_the_file_and_the_line(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text("date,close\n1,2\n3,4,5\n")
    with pytest.raises(DataError) as err:
        csv_prices(path, "close")
    assert str(err.value) == (f"price CSV {str(path)!r} cannot be read as CSV (Error tokenizing "
                              "data. C error: Expected 2 fields in line 3, saw 3); expected a "
                              "header row naming the column 'close', then one price per row "
                              "(oldest first)")


def _walk_then_flat(n=600, moving=100):
    """The trial's series: a random walk for ``moving`` prices, then the last one repeated."""
    prices = 100 * np.exp(np.cumsum(0.01 * np.random.default_rng(0).standard_normal(n)))
    prices[moving:] = prices[moving]
    return prices


CFC_DEFAULTS = dict(window=12, seq_len=12, horizons=(1, 5, 20), main_horizon=5,
                    val_fraction=0.2)


def test_a_validation_split_without_price_movement_is_refused():
    prices = _walk_then_flat()
    # 600 prices: first = 12 + 12 - 1 = 23, last = 599 - 20 = 579, cut = 23 + round(0.8 * 556)
    # = 468; validation examples end at 468..579, their labels read prices 468..579 + 5.
    with pytest.raises(DataError) as err:
        MultiHorizonLoader(prices, **CFC_DEFAULTS, name="p.csv:price")
    assert str(err.value) == (
        f"p.csv:price: the validation split does not move: prices 468..584 (the ones its "
        f"direction labels read; its examples end at 468..579) are all {prices[100]}, so every "
        "label there is 'down' and a direction accuracy on it would mean nothing; use a series "
        "whose prices move in both splits, or another val_fraction")
    # The range's edges: a move just outside it changes nothing, one at its last price is
    # enough (and is the one "up" label: the example ending at 579).
    for outside in (467, 585):
        moved = prices.copy()
        moved[outside] *= 1.01
        with pytest.raises(DataError, match=r"validation split does not move: prices 468\.\.584"):
            MultiHorizonLoader(moved, **CFC_DEFAULTS)
    moved = prices.copy()
    moved[584] *= 1.01
    data = MultiHorizonLoader(moved, **CFC_DEFAULTS)
    assert data.val_ends[data.direction[data.val_ends] == 1].tolist() == [579]


def test_a_training_split_without_price_movement_is_refused():
    prices = _walk()  # 120 prices, _loader's split: first 8, cut 86, training ends 8..79
    flat = prices.copy()
    flat[8:83] = flat[8]  # training labels (main_horizon 3) read prices 8..82; 83 on still move
    with pytest.raises(DataError) as err:
        _loader(flat)
    assert str(err.value) == (
        f"price series: the training split does not move: prices 8..82 (the ones its "
        f"direction labels read; its examples end at 8..79) are all {prices[8]}, so every "
        "label there is 'down' and a direction accuracy on it would mean nothing; use a series "
        "whose prices move in both splits, or another val_fraction")
    flat[82] *= 1.01  # the last price a training label reads: the split moves now
    _loader(flat)
    # Several aligned series: the one that does not move is named by its row.
    with pytest.raises(DataError, match=r"^price series\[1\]: the training split does not move"):
        _loader(np.stack([prices, np.where(np.arange(120) < 8, prices, prices[8])]))


# --- trial6 findings F5 and minor notes: repeated columns, relative split slack, overflow ----


def test_a_repeated_price_column_name_is_refused_naming_the_columns(tmp_path):
    # pandas would rename the second "close" to "close.1" and read the first, silently.
    path = tmp_path / "p.csv"
    path.write_text("date,close,close\n0,1,10\n1,2,20\n2,3,30\n")
    with pytest.raises(DataError) as err:
        csv_prices(path, "close")
    assert str(err.value) == (
        f"price CSV {str(path)!r} has 2 columns named 'close' (columns 2, 3 of: date, close, "
        "close), so column='close' is ambiguous; rename them so that one column holds the "
        "prices")
    # Another, unrepeated column of the same file still reads (the repeat is only ambiguous
    # for its own name), and a real column named like pandas' rename is not mistaken for one.
    np.testing.assert_array_equal(csv_prices(path, "date"), [0.0, 1.0, 2.0])
    path.write_text("close,close.1\n1,10\n2,20\n")
    np.testing.assert_array_equal(csv_prices(path, "close"), [1.0, 2.0])
    np.testing.assert_array_equal(csv_prices(path, "close.1"), [10.0, 20.0])


@pytest.mark.parametrize("asked, n_train, n_val, off", [
    (0.2, 80, 20, False),  # as asked
    (0.2, 69, 31, True),  # 0.31: more than 0.1 off (the absolute slack)
    (0.01, 236, 8, True),  # trial: 0.033 for 0.01, 3.3x, 5.6 examples more
    (0.2, 176, 68, False),  # vega "all" at the default: 0.279, 39% more (the h_max gap)
    (0.05, 198, 2, True),  # 0.01 for 0.05: 80% off, 8 examples short of the 10 asked
    (0.012, 98, 2, False),  # 2 for 1.2 asked: 67% more, but under one example more...
    (0.01, 98, 2, True),  # ... 2 for 1.0 asked: 100% more and one example
    (0.3, 65, 35, False),  # 0.35: 17% more, within both slacks
])
def test_val_fraction_off_is_absolute_or_relative_with_an_example(asked, n_train, n_val, off):
    assert val_fraction_off(asked, n_train, n_val) is off


def test_a_small_val_fraction_realised_three_times_over_warns():
    # vega "all" at 0.01: 8 validation examples (0.033), within the absolute 0.1 slack.
    with pytest.warns(UserWarning, match=r"all: val_fraction=0.01 cannot be honoured .* 236 "
                                         r"training and 8 validation examples \(validation "
                                         r"fraction 0.033\)"):
        MultiHorizonLoader(vega_prices("all"), **{**CFC_DEFAULTS, "val_fraction": 0.01},
                           name="all")


def test_an_overflowing_synthetic_series_raises_without_numpy_warnings():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's overflow RuntimeWarning would fail here
        prices = synthetic_prices("random_walk", length=2000, drift=1.0, volatility=10.0)
        assert np.isinf(prices).any()
        with pytest.raises(DataError, match=r"NaN or infinite price\(s\)"):
            MultiHorizonLoader(prices, **CFC_DEFAULTS)
