"""Daily market series bundled in the ``arch`` wheel, their causal features, multi-horizon
labels and a walk-forward split (DESIGN sections 7, 9). numpy only: the report's baselines
read the same arrays the CfC trainer reads (``lab.data.prices.MarketLoader`` wraps them).

Series (``arch.data.<name>.load()``, read from the installed package, never downloaded):
``sp500`` and ``nasdaq`` — daily OHLCV 1999-2018; ``wti`` — the daily WTI crude close
1986-2019 (its missing days, exchange holidays, are dropped).

Features at day t, each scaled by statistics of a trailing window of ``scale_window`` days
ending at t (so no value after t enters a feature at t, and a 2008 scale does not set a 2018
feature's size):

- return: r_t = log(C_t / C_{t-1}) over the trailing root mean square of r;
- range: log(H_t / L_t) over its trailing root mean square (OHLCV only);
- close-open: log(C_t / O_t) over its trailing root mean square (OHLCV only);
- volume: the z-score of log V_t against the trailing mean and standard deviation of log V
  (OHLCV only; a day with no volume recorded carries the previous day's volume forward).

Labels (as for every price source, :func:`horizon_labels`): per horizon h the best long and
short log return within h days of t, over sigma_t * sqrt(h) with sigma_t the trailing RMS of
returns at t; the main label is 1 when the main horizon's return is up.

Split by time (:func:`split_ends`): the days from the first with a full feature history to
the end are cut at c_val and c_test (the shares asked); training examples end at
t < c_val - h_max, validation at c_val <= t < c_test - h_max and test at c_test <= t < n - h_max:
a training label reads no price from c_val on, a validation label none from c_test on (the
embargo is the longest horizon, h_max).
"""

from __future__ import annotations

import math

import numpy as np

from . import DataError, sha256_bytes

ARCH_SERIES = ("sp500", "nasdaq", "wti")
OHLCV = ("Open", "High", "Low", "Adj Close", "Volume")  # the close is the adjusted one
CHANNELS = {"ohlcv": ("return", "range", "close_open", "volume"), "close": ("return",)}


def arch_frame(series: str):
    """The bundled series as a pandas DataFrame indexed by date: the OHLCV columns, or
    ``Close`` for wti (its missing days dropped)."""
    if series not in ARCH_SERIES:
        raise DataError(f"arch series {series!r} is not bundled; choose one of: "
                        f"{', '.join(ARCH_SERIES)}")
    import importlib

    frame = importlib.import_module(f"arch.data.{series}").load()
    if series == "wti":
        return frame[["DCOILWTICO"]].dropna().rename(columns={"DCOILWTICO": "Close"})
    return frame[list(OHLCV)]


def arch_table(series: str) -> np.ndarray:
    """The series as read, float64 (N, 5) for OHLCV (Open, High, Low, Adj Close, Volume), or
    (N, 1) for a close-only series."""
    return np.ascontiguousarray(arch_frame(series).to_numpy(dtype=np.float64))


def arch_identity(series: str) -> dict:
    """What identifies the bundled series a run reads: the arch version, the series, its
    rows and the sha256 of the values as read (float64), so a changed arch is noticed."""
    import arch

    table = arch_table(series)
    return {"arch": arch.__version__, "series": series, "rows": int(table.shape[0]),
            "sha256": sha256_bytes(table.tobytes())}


def _trailing_mean(x: np.ndarray, window: int) -> np.ndarray:
    """mean of x[t-window+1..t] at every t >= window - 1 (NaN before)."""
    csum = np.concatenate([[0.0], np.cumsum(x)])
    out = np.full(len(x), np.nan)
    out[window - 1:] = (csum[window:] - csum[:-window]) / window
    return out


def _over_rms(x: np.ndarray, window: int) -> np.ndarray:
    rms = np.sqrt(_trailing_mean(x**2, window))
    return np.divide(x, rms, out=np.zeros_like(x), where=rms > 0)


def market_features(table: np.ndarray, scale_window: int = 250):
    """(features (N, C), sigma (N,)) of a table from :func:`arch_table`: the channels of
    :data:`CHANNELS` scaled on trailing windows; rows before ``scale_window`` are NaN (not
    enough history) and are never used. ``sigma`` is the trailing RMS of returns."""
    table = np.asarray(table, dtype=np.float64)
    close = table[:, 3] if table.shape[1] == 5 else table[:, 0]
    if not np.all(np.isfinite(table[:, :4] if table.shape[1] == 5 else table)) \
            or np.any(close <= 0):
        raise DataError("market prices must be finite and > 0 (log returns need them)")
    log_c = np.log(close)
    r = np.diff(log_c, prepend=log_c[0])  # r_0 = 0
    # r_0 is not a return: the first full window is r_1..r_W, ending at t = W.
    sigma = np.sqrt(_trailing_mean(r**2, scale_window))
    channels = [np.divide(r, sigma, out=np.zeros_like(r), where=sigma > 0)]
    if table.shape[1] == 5:
        opn, high, low, vol = table[:, 0], table[:, 1], table[:, 2], table[:, 4].copy()
        channels.append(_over_rms(np.log(high / low), scale_window))
        channels.append(_over_rms(np.log(close / opn), scale_window))
        # A day with no volume recorded (nasdaq has two) is no information: carry the last
        # one forward (a causal fill).
        for t in np.flatnonzero(~(vol > 0)):
            vol[t] = vol[t - 1] if t else 1.0
        lv = np.log(vol)
        mean = _trailing_mean(lv, scale_window)
        std = np.sqrt(np.maximum(_trailing_mean(lv**2, scale_window) - mean**2, 0.0))
        channels.append(np.divide(lv - mean, std, out=np.zeros_like(lv), where=std > 0))
    features = np.stack(channels, axis=1)
    features[:scale_window] = np.nan
    sigma[:scale_window] = np.inf  # no labels there either: a misuse gives 0, not a number
    return features, sigma


def horizon_labels(log_p: np.ndarray, sigma: np.ndarray, horizons, main_horizon: int):
    """long, short (N, n_h) and direction (N,) for log prices ``log_p`` (see the module
    docstring of ``lab.data.prices``); rows whose horizon passes the series' end are 0."""
    n, h_max = len(log_p), horizons[-1]
    long = np.zeros((n, len(horizons)))
    short = np.zeros((n, len(horizons)))
    t = np.arange(max(n - h_max, 0))
    for i, h in enumerate(horizons):
        ahead = np.stack([log_p[t + k] for k in range(1, h + 1)]) - log_p[t]  # (h, T)
        scale = sigma[t] * math.sqrt(h)
        long[t, i] = ahead.max(0) / scale
        short[t, i] = (-ahead).max(0) / scale
    direction = np.zeros(n)
    direction[t] = (log_p[t + main_horizon] > log_p[t]).astype(np.float64)
    return long, short, direction


def split_days(n: int, first: int, val_fraction: float, test_fraction: float):
    """(c_val, c_test): the first validation and test days; the shares are of the days
    from ``first`` (the first with a full feature history) to the end."""
    usable = n - first
    c_test = n - int(round(test_fraction * usable))
    return c_test - int(round(val_fraction * usable)), c_test


def split_ends(n: int, first: int, h_max: int, val_fraction: float, test_fraction: float):
    """(train, val, test) example ends (int arrays) by time; see the module docstring. A
    split of d days holds d - h_max examples: its last h_max days are read only as labels."""
    c_val, c_test = split_days(n, first, val_fraction, test_fraction)
    return (np.arange(first, c_val - h_max), np.arange(c_val, c_test - h_max),
            np.arange(c_test, n - h_max))


def window_inputs(features: np.ndarray, ends: np.ndarray, window: int, seq_len: int):
    """(B, seq_len, window * C): at each of the seq_len steps ending at each end, the
    channels of the trailing ``window`` days (oldest first), flattened."""
    steps = ends[:, None] + np.arange(1 - seq_len, 1)  # (B, T)
    days = steps[..., None] + np.arange(1 - window, 1)  # (B, T, window)
    return features[days].reshape(len(ends), seq_len, -1)


class MarketArrays:
    """Features, labels and the walk-forward split of one table, as numpy arrays.

    ``first``: the first example end whose every step has a full feature history.
    """

    def __init__(self, table, *, window: int = 1, seq_len: int = 20, horizons=(1, 5, 20),
                 main_horizon: int = 5, val_fraction: float = 0.2, test_fraction: float = 0.2,
                 scale_window: int = 250, name: str = "market series"):
        table = np.asarray(table, dtype=np.float64)
        self.horizons, self.main_horizon = tuple(horizons), main_horizon
        self.window, self.seq_len, self.scale_window = window, seq_len, scale_window
        h_max, n = self.horizons[-1], len(table)
        self.first = scale_window + window - 1 + seq_len - 1
        if not (0 < val_fraction and 0 <= test_fraction and val_fraction + test_fraction < 1):
            raise DataError(f"val_fraction={val_fraction} and test_fraction={test_fraction} "
                            "must be > 0 and >= 0 with a sum below 1")
        self.features, self.sigma = market_features(table, scale_window)
        close = table[:, 3] if table.shape[1] == 5 else table[:, 0]
        self.log_p = np.log(close)
        self.long, self.short, self.direction = horizon_labels(
            self.log_p, self.sigma, self.horizons, main_horizon)
        if n - 1 - h_max < self.first:
            raise DataError(f"{name} has {n} rows: too few for scale_window={scale_window}, "
                            f"window={window}, seq_len={seq_len} and horizons "
                            f"{self.horizons} (an example needs {self.first + h_max + 1})")
        self.train_ends, self.val_ends, self.test_ends = split_ends(
            n, self.first, h_max, val_fraction, test_fraction)
        c_val, c_test = split_days(n, self.first, val_fraction, test_fraction)
        spans = (("training", c_val - self.first, "1 - val_fraction - test_fraction",
                  1 - val_fraction - test_fraction),
                 ("validation", c_test - c_val, "val_fraction", val_fraction),
                 ("test", n - c_test, "test_fraction", test_fraction))
        for split, days, key, value in spans:
            if (split != "test" or test_fraction) and days <= h_max:
                raise DataError(
                    f"{name}: horizons={list(self.horizons)} are longer than the {split} span: "
                    f"{key}={value:g} leaves it {days} days of {n - self.first}, and each label "
                    f"needs {h_max} days after its example; allowed: a {split} span longer "
                    "than the largest horizon (a larger share, or shorter horizons)")
        self.n_channels = self.features.shape[1]

    def inputs(self, ends: np.ndarray) -> np.ndarray:
        return window_inputs(self.features, ends, self.window, self.seq_len)

    def split_sizes(self) -> dict:
        n = {"n_train": len(self.train_ends), "n_val": len(self.val_ends),
             "n_test": len(self.test_ends)}
        total = sum(n.values())
        return {**n, "val_fraction": n["n_val"] / total, "test_fraction": n["n_test"] / total,
                "first_val": int(self.val_ends[0]) if len(self.val_ends) else None,
                "first_test": int(self.test_ends[0]) if len(self.test_ends) else None}
