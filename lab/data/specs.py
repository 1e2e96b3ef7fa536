"""What the trainers' configs check at construction about their data, known without loading
it or importing torch: the datasets and their shapes, the price sources and the horizons
rule. ``lab.data`` and ``lab.data.prices`` re-export these; ``lab.train.configs`` reads them
here so a bad parameter is refused before torch is imported."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class DataError(ValueError):
    """A dataset could not be loaded or an argument to the data layer is out of range."""


@dataclass(frozen=True)
class _Spec:
    in_channels: int
    n_classes: int
    dims: int
    augment: str


DATASETS = ("mnist1d", "digits", "cifar10")
# each dataset's shape (channels, classes, dims), known without loading it
DATA_SPECS = {
    "mnist1d": _Spec(in_channels=1, n_classes=10, dims=1, augment="shift"),
    "digits": _Spec(in_channels=1, n_classes=10, dims=2, augment="none"),
    "cifar10": _Spec(in_channels=3, n_classes=10, dims=2, augment="crop_flip"),
}

# price series (lab.data.prices)
SOURCES = ("vega", "csv", "synthetic", "arch")
SYNTHETIC_KINDS = ("random_walk", "constant", "regimes")
VEGA_SYMBOLS = ("all", "AAPL", "AMZN", "GOOG", "IBM", "MSFT")
# "all": one monthly series gives only ~44 training examples at the default window / seq_len /
# horizons; the four symbols spanning the same 123 months give four times as many, and one
# calendar cut for all four keeps validation later than every training target (GOOG, shorter
# and on other dates, is left out). A single symbol is one config value away.
DEFAULT_SYMBOL = "all"


def check_horizons(horizons, main_horizon: int | None = None) -> tuple[int, ...]:
    horizons = tuple(horizons)
    if not horizons or any(isinstance(h, bool) or not isinstance(h, (int, np.integer)) or h < 1
                           for h in horizons):
        raise DataError(f"horizons={horizons!r} is not allowed; give a non-empty, strictly "
                        "increasing tuple of integers >= 1, e.g. (1, 5, 20)")
    if any(b <= a for a, b in zip(horizons, horizons[1:])):
        raise DataError(f"horizons={horizons!r} are not strictly increasing; give them in "
                        "increasing order without repeats, e.g. (1, 5, 20)")
    if main_horizon is not None and main_horizon not in horizons:
        raise DataError(f"main_horizon={main_horizon!r} is not one of horizons={horizons!r}")
    return tuple(int(h) for h in horizons)
