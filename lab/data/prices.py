"""Price series and a multi-horizon loader for the CfC perception trainer (DESIGN sections 7, 9).

Sources (all offline): ``vega`` — the monthly closing prices bundled inside the
``vega_datasets`` wheel (``stocks.csv``: AAPL, AMZN, GOOG, IBM, MSFT, 2000-01 to 2010-03; read
from the installed file, never downloaded; by default the four symbols that span all 123
months, as aligned series, see :data:`DEFAULT_SYMBOL`);
``csv`` — a column of a CSV file the user names; ``synthetic`` — a random walk with drift, a
constant drift, or regime switches (drift flips sign every ``regime_length`` steps).

:class:`MultiHorizonLoader` turns prices p_0..p_{N-1} into examples. With log prices l_t and
one-step log returns r_t = l_t - l_{t-1}:

- scale sigma_t: the root mean square of r_1..r_t, an expanding window, so it reads no price
  after t (a fixed scale fitted on a training part would carry later prices into early
  features);
- features at t: the trailing window r_{t-window+1}..r_t divided by sigma_t;
- outcomes at t for each horizon h: long = max_{1<=k<=h} (l_{t+k} - l_t), the best log return
  a long position opened at t reaches within h steps; short = max_{1<=k<=h} (l_t - l_{t+k}),
  the same for a short. Both are divided by sigma_t * sqrt(h) (a random walk's typical h-step
  move), so every horizon's outcome is O(1);
- main label at t: 1 when l_{t+main_horizon} > l_t (the main horizon's return is up), else 0.

An example is the sequence of features over ``seq_len`` steps ending at t; its targets are t's.
Features at t never read a price after t, targets at t never read past t + h
(tests/test_prices.py perturbs later prices to prove it).

Validation is the later part of the series, by time: with cut the first validation step, a
training example ends at t <= cut - max(horizons) (its targets read no price after the cut) and
a validation example ends at t >= cut (its features may read older prices, as a deployed model
would; its targets read only prices after the cut). A split whose direction labels read only
equal prices is refused: its labels are all "down" and an accuracy on it says nothing.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import DataError, sha256_bytes
from .markets import MarketArrays, horizon_labels
from .specs import DEFAULT_SYMBOL, SYNTHETIC_KINDS, VEGA_SYMBOLS, check_horizons
from .specs import SOURCES as SOURCES  # the facts a config checks live in the torch-free specs

FULL_LENGTH = ("AAPL", "AMZN", "IBM", "MSFT")  # 2000-01 to 2010-03; GOOG starts in 2004-08


def vega_prices(symbol: str = DEFAULT_SYMBOL) -> np.ndarray:
    """Monthly closing prices from vega_datasets' bundled stocks.csv, by date: (N,) for one
    symbol, (4, 123) for ``"all"`` (the four symbols that span the same 123 months)."""
    if symbol not in VEGA_SYMBOLS:
        raise DataError(f"vega symbol {symbol!r} is not in the bundled stocks.csv; "
                        f"choose one of: {', '.join(VEGA_SYMBOLS)}")
    from vega_datasets import local_data  # the local (wheel-bundled) files only

    frame = local_data.stocks()
    if symbol == "all":
        series = [frame[frame["symbol"] == s].sort_values("date") for s in FULL_LENGTH]
        if any(not part["date"].reset_index(drop=True).equals(
                series[0]["date"].reset_index(drop=True)) for part in series):
            raise DataError(f"vega stocks {', '.join(FULL_LENGTH)} are not on the same dates; "
                            "this vega_datasets version differs from 0.9.0's stocks.csv")
        return np.stack([part["price"].to_numpy(dtype=np.float64) for part in series])
    frame = frame[frame["symbol"] == symbol].sort_values("date")
    return frame["price"].to_numpy(dtype=np.float64)


def vega_identity(symbol: str) -> dict:
    """What identifies the bundled vega series a run reads (no file path to hash: the data
    lives inside the installed vega_datasets): the symbol, its months and the sha256 of the
    prices as read (float64), so a changed vega_datasets is noticed on resume and after."""
    prices = np.ascontiguousarray(vega_prices(symbol), dtype=np.float64)
    return {"vega": symbol, "length": int(prices.shape[-1]),
            "sha256": sha256_bytes(prices.tobytes())}


def csv_prices(path: str | Path, column: str) -> np.ndarray:
    """The column ``column`` of the CSV file ``path``, in file order (oldest first)."""
    import pandas as pd  # slow to import: only for a CSV source

    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"price CSV {str(path)!r} does not exist; give the path of a CSV file "
                        "with a header row")
    expected = (f"expected a header row naming the column {column!r}, then one price per row "
                "(oldest first)")
    try:
        frame = pd.read_csv(path)
    except pd.errors.EmptyDataError:
        # pandas' own "No columns to parse from file" names neither the file nor the fix.
        what = "is empty (0 bytes)" if path.stat().st_size == 0 else "holds only blank lines"
        raise DataError(f"price CSV {str(path)!r} {what}; {expected}") from None
    except (pd.errors.ParserError, UnicodeDecodeError) as err:
        raise DataError(f"price CSV {str(path)!r} cannot be read as CSV ({str(err).strip()}); "
                        f"{expected}") from None
    # pandas renames a repeated header name ("close", "close" -> "close", "close.1") and
    # frame[column] would then be the first of them, silently: read the header as written.
    header = pd.read_csv(path, header=None, nrows=1, dtype=str, keep_default_na=False)
    header = [str(name) for name in header.iloc[0]] if len(header) else []
    repeats = [i for i, name in enumerate(header) if name == column]
    if len(repeats) > 1:
        raise DataError(f"price CSV {str(path)!r} has {len(repeats)} columns named {column!r} "
                        f"(columns {', '.join(str(i + 1) for i in repeats)} of: "
                        f"{', '.join(header)}), so column={column!r} is ambiguous; rename "
                        "them so that one column holds the prices")
    if column not in frame.columns:
        names = [str(name) for name in frame.columns]
        hint = ""
        separators = [sep for sep in ";\t|" if len(names) == 1 and sep in names[0]]
        if separators:
            hint = (f"; it reads as one column: the file looks separated by "
                    f"{separators[0]!r}, and lab reads comma-separated CSV (convert it, e.g. "
                    f"pd.read_csv(path, sep={separators[0]!r}).to_csv(new_path, index=False))")
        elif any(name.strip() == column for name in names):
            hint = (f"; one is {column!r} with spaces around it: strip the header's names "
                    f"or give column as written")
        raise DataError(f"price CSV {str(path)!r} has no column {column!r}; its columns are: "
                        f"{', '.join(map(repr, names))}{hint}")
    raw = frame[column]
    values = pd.to_numeric(raw, errors="coerce")
    # Coercion turns text into NaN; a cell that held something and is NaN now was not a
    # number (blank and "NaN" cells stay NaN prices, which check_prices names as such).
    text = (raw.notna() & values.isna()).to_numpy()
    if text.any():
        row = int(np.flatnonzero(text)[0])
        raise DataError(f"not a number: {raw.iloc[row]!r} at row {row} ({path}:{column}; row 0 "
                        "is the first after the header, blank lines not counted); "
                        f"{int(text.sum())} cell(s) of the column are not numbers; give one "
                        "price per row, as a plain number such as 101.25")
    return values.to_numpy(dtype=np.float64)


def synthetic_prices(kind: str = "random_walk", *, length: int = 2000, drift: float = 0.001,
                     volatility: float = 0.01, regime_length: int = 100,
                     seed: int = 0) -> np.ndarray:
    """A price series from 100: log returns drift + volatility * N(0, 1) (``random_walk``),
    exactly ``drift`` (``constant``), or with the drift's sign flipping every
    ``regime_length`` steps (``regimes``). Local generator: no global RNG is touched."""
    if kind not in SYNTHETIC_KINDS:
        raise DataError(f"synthetic kind {kind!r} is not known; choose one of: "
                        f"{', '.join(SYNTHETIC_KINDS)}")
    if length < 2:
        raise DataError(f"synthetic length={length} is too short; allowed: >= 2")
    rng = np.random.default_rng(seed)
    n = length - 1
    if kind == "constant":
        returns = np.full(n, float(drift))
    else:
        sign = np.ones(n)
        if kind == "regimes":
            sign = np.where((np.arange(n) // max(regime_length, 1)) % 2 == 0, 1.0, -1.0)
        returns = drift * sign + volatility * rng.standard_normal(n)
    # A huge drift or volatility overflows to inf: check_prices refuses that series with a
    # clear message, so numpy's overflow warning before it would only be noise.
    with np.errstate(over="ignore"):
        return 100.0 * np.exp(np.concatenate([[0.0], np.cumsum(returns)]))


def check_prices(prices: np.ndarray, name: str = "price series") -> np.ndarray:
    """Refuse NaN / infinite / non-positive prices, naming the first bad index and value."""
    prices = np.asarray(prices, dtype=np.float64)
    if prices.ndim != 1:
        raise DataError(f"{name} must be one-dimensional, got shape {prices.shape}")
    bad = np.flatnonzero(~np.isfinite(prices))
    if bad.size:
        raise DataError(f"{name} has {bad.size} NaN or infinite price(s), the first at index "
                        f"{bad[0]} ({prices[bad[0]]}); prices must be finite and > 0")
    bad = np.flatnonzero(prices <= 0)
    if bad.size:
        raise DataError(f"{name} has {bad.size} non-positive price(s), the first at index "
                        f"{bad[0]} ({prices[bad[0]]}); log returns need prices > 0")
    return prices


@dataclass(frozen=True)
class Batch:
    """x (B, seq_len, window) features; long/short (B, n_horizons) scaled outcomes at the
    last step; direction (B,) float 0/1 main label; ends (B,) the last step's time index."""

    x: torch.Tensor
    long: torch.Tensor
    short: torch.Tensor
    direction: torch.Tensor
    ends: torch.Tensor


# How far the realised validation fraction may fall from the one asked before a warning:
# VAL_FRACTION_SLACK absolute, or VAL_FRACTION_RELATIVE of the asked fraction when that is
# at least one example (0.01 realised as 0.033 is 3x the validation asked for, though
# within 0.1; at one or two examples, a single example more is not worth a warning).
VAL_FRACTION_SLACK = 0.1
VAL_FRACTION_RELATIVE = 0.5


def val_fraction_off(asked: float, n_train: int, n_val: int) -> bool:
    """Whether a split of n_train / n_val examples is too far from ``asked`` to go unsaid."""
    realised = n_val / (n_train + n_val)
    gap = abs(realised - asked)
    examples = abs(n_val - asked * (n_train + n_val))
    return gap > VAL_FRACTION_SLACK or (gap > VAL_FRACTION_RELATIVE * asked and examples >= 1)


class MultiHorizonLoader:
    """Examples over one price series, or several aligned ones (same dates, one per row of a
    (S, N) array) cut at the same time; see the module docstring for every definition.

    Time indices are flat: series s, time t is ``s * N + t`` (just t for one series).
    """

    def __init__(self, prices, *, window: int = 12, seq_len: int = 12,
                 horizons=(1, 5, 20), main_horizon: int = 5, val_fraction: float = 0.2,
                 name: str = "price series"):
        self.horizons = check_horizons(horizons, main_horizon)
        prices = np.asarray(prices, dtype=np.float64)
        rows = prices[None] if prices.ndim == 1 else prices
        if window < 1 or seq_len < 1:
            raise DataError(f"window={window} and seq_len={seq_len} must both be >= 1")
        if not 0.0 < val_fraction < 1.0:
            raise DataError(f"val_fraction={val_fraction!r} is out of range; allowed: (0, 1)")
        self.window, self.seq_len, self.main_horizon = window, seq_len, main_horizon
        n, h_max = rows.shape[1], self.horizons[-1]
        # The first example's first step needs `window` returns; its last step t needs h_max
        # later prices. Training and validation each need at least one example.
        first = window + seq_len - 1
        last = n - 1 - h_max
        needed = first + 2 * h_max + 2
        if n < needed:
            raise DataError(
                f"{name} has {n} prices, too short for window={window}, seq_len={seq_len} and "
                f"the largest horizon {h_max}: it needs at least {needed} (window + seq_len + "
                f"2 x largest horizon + 1, so that training and validation each get an "
                "example); use a longer series or smaller window / seq_len / horizons")
        asked = first + int(round((1.0 - val_fraction) * (last - first)))
        cut = min(max(asked, first + h_max + 1), last)
        names = [name if len(rows) == 1 else f"{name}[{i}]" for i in range(len(rows))]
        rows = [check_prices(row, row_name) for row, row_name in zip(rows, names)]
        blocks = [self._series(row, name) for row in rows]
        for row, row_name in zip(rows, names):
            # A split's direction labels compare the prices from its first example's end to
            # its last example's end + main_horizon. Where those do not move, every label is
            # "down": a direction accuracy of 1.0 there measures nothing (trial finding F7).
            for split, (start, end) in (("training", (first, cut - h_max)),
                                        ("validation", (cut, last))):
                a, b = start, end + main_horizon
                if np.all(row[a:b + 1] == row[a]):
                    raise DataError(
                        f"{row_name}: the {split} split does not move: prices {a}..{b} (the "
                        f"ones its direction labels read; its examples end at {start}..{end}) "
                        f"are all {row[a]}, so every label there is 'down' and a direction "
                        "accuracy on it would mean nothing; use a series whose prices move in "
                        "both splits, or another val_fraction")
        offsets = torch.arange(len(rows))[:, None] * n  # (S, 1)
        self.train_ends = (offsets + torch.arange(first, cut - h_max + 1)).flatten()
        self.val_ends = (offsets + torch.arange(cut, last + 1)).flatten()
        self.cut, self.length, self.n_series = cut, n, len(rows)
        self.val_fraction = val_fraction  # as requested; split_sizes() has the effective one
        sizes = self.split_sizes()
        if cut != asked or val_fraction_off(val_fraction, sizes["n_train"], sizes["n_val"]):
            # On a short series the clamp that gives each split an example, or the gap of
            # h_max steps left between the splits, can move the split far from the request
            # (GOOG at 0.2: 2 training and 4 validation examples): say so.
            warnings.warn(
                f"{name}: val_fraction={val_fraction} cannot be honoured with window={window}, "
                f"seq_len={seq_len} and the largest horizon {h_max} on {n} prices (the "
                f"splits are {h_max} steps apart, and each needs an example): "
                f"{sizes['n_train']} training and {sizes['n_val']} validation examples "
                f"(validation fraction {sizes['val_fraction']:.3f}). Use a longer series or "
                "smaller window / seq_len / horizons", stacklevel=2)
        stack = [torch.from_numpy(np.concatenate(parts)) for parts in zip(*blocks)]
        self.sigma = stack[0]  # (S*N,)
        self.features = stack[1].float()  # (S*N, window)
        self.long = stack[2].float()  # (S*N, n_horizons)
        self.short = stack[3].float()
        self.direction = stack[4].float()  # (S*N,)

    def split_sizes(self) -> dict:
        """Training and validation example counts and the validation fraction they make.

        It differs from the requested ``val_fraction`` by the gap of max(horizons) steps
        between the splits, and wherever the clamp had to move the cut.
        """
        n_train, n_val = len(self.train_ends), len(self.val_ends)
        return {"n_train": n_train, "n_val": n_val, "val_fraction": n_val / (n_train + n_val)}

    def _series(self, prices: np.ndarray, name: str):
        """sigma, features, long, short, direction of one series (rows past the last usable
        step, and features before `window`, are zeros and never used)."""
        window, n = self.window, len(prices)
        log_p = np.log(prices)
        returns = np.diff(log_p, prepend=log_p[0])  # (N,), r_0 = 0
        sigma = np.sqrt(np.cumsum(returns**2) / np.maximum(np.arange(n), 1))  # (N,)
        if not np.all(sigma[window:] > 0):
            raise DataError(f"{name} does not move over its first {window + 1} prices "
                            "(every log return is 0), so it has no return scale; use a "
                            "series whose prices change")
        sigma[:window] = np.inf  # no features there; inf keeps a misuse from passing silently
        # features[t] = r_{t-window+1..t} / sigma_t  (N, window)
        windows = np.lib.stride_tricks.sliding_window_view(returns[1:], window)  # (N-w, w)
        features = np.zeros((n, window))
        features[window:] = windows / sigma[window:, None]
        long, short, direction = horizon_labels(log_p, sigma, self.horizons, self.main_horizon)
        return sigma, features, long, short, direction

    def batch(self, ends: torch.Tensor) -> Batch:
        """The examples ending at time indices ``ends`` (B,)."""
        steps = ends[:, None] + torch.arange(1 - self.seq_len, 1)  # (B, seq_len)
        return Batch(x=self.features[steps], long=self.long[ends], short=self.short[ends],
                     direction=self.direction[ends], ends=ends)

    def sample(self, batch_size: int, generator: torch.Generator) -> Batch:
        """A training batch of ``batch_size`` examples drawn with replacement."""
        pick = torch.randint(len(self.train_ends), (batch_size,), generator=generator)
        return self.batch(self.train_ends[pick])

    def validation(self) -> Batch:
        return self.batch(self.val_ends)


class MarketLoader(MultiHorizonLoader):
    """A daily market table (``lab.data.markets``) as the trainer's loader: the same batches,
    with several feature channels per day and a test split after validation.

    Time indices are the table's rows (one series).
    """

    def __init__(self, table, *, window: int = 1, seq_len: int = 20, horizons=(1, 5, 20),
                 main_horizon: int = 5, val_fraction: float = 0.2, test_fraction: float = 0.2,
                 scale_window: int = 250, name: str = "market series"):
        self.horizons = check_horizons(horizons, main_horizon)
        if window < 1 or seq_len < 1:
            raise DataError(f"window={window} and seq_len={seq_len} must both be >= 1")
        arrays = MarketArrays(table, window=window, seq_len=seq_len, horizons=self.horizons,
                              main_horizon=main_horizon, val_fraction=val_fraction,
                              test_fraction=test_fraction, scale_window=scale_window, name=name)
        self.arrays, self.window, self.seq_len = arrays, window, seq_len
        self.main_horizon, self.val_fraction = main_horizon, val_fraction
        self.length, self.n_series, self.cut = len(arrays.log_p), 1, int(arrays.val_ends[0])
        self.train_ends, self.val_ends, self.test_ends = (
            torch.from_numpy(e).long() for e in (arrays.train_ends, arrays.val_ends,
                                                 arrays.test_ends))
        self.sigma = torch.from_numpy(arrays.sigma)
        # (N, window * C): each day's input is its trailing `window` days' channels
        days = np.arange(len(arrays.log_p))[:, None] + np.arange(1 - window, 1)
        flat = arrays.features[np.clip(days, 0, None)].reshape(len(days), -1)
        self.features = torch.from_numpy(np.nan_to_num(flat, nan=0.0)).float()
        self.long = torch.from_numpy(arrays.long).float()
        self.short = torch.from_numpy(arrays.short).float()
        self.direction = torch.from_numpy(arrays.direction).float()

    def split_sizes(self) -> dict:
        return self.arrays.split_sizes()

    def test(self) -> Batch:
        return self.batch(self.test_ends)
