"""The shape of one experiment, as the run package drives it (``lab.lifecycle.train``).

A trainer module holds its maths and one :class:`Experiment`: how a config becomes the live
objects of a run, the named parts a checkpoint restores, what a complete run holds
(:class:`Expectation`), when it has diverged (:class:`Divergence`), one row of training (an
epoch or a logged step), and the final metrics and work bill. ``lab.lifecycle.train`` does
the rest, the same way for every trainer: lock, resume, rows, checkpoints, the record.

This module imports nothing from the run package, so the science core may import it.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

from .config import ConfigError

# The axes a run's rows are logged on (the row store's, ``lab.records.AXES``).
AXES = ("epoch", "step")


@dataclass(frozen=True)
class Expectation:
    """What a complete run holds; stored in the record as ``expect``.

    Row ``i`` has axis value ``i * stride``. ``metrics`` are required (present
    and finite) on every row, ``periodic`` entries ``(name, every, offset)`` on
    rows whose axis value ``v`` has ``(v - offset) % every == 0``, ``final`` in
    the final metrics. A name ending in "/" is a prefix: at least one metric
    under it, all finite. Nested row dicts flatten with "/". ``undefined`` names
    row metrics (or prefixes) that may be NaN in a complete run because the
    quantity is undefined there, a result and not a gap (a cosine at a silent
    layer is 0/0); present they must still be, and never infinite.
    """

    axis: str
    count: int
    stride: int = 1
    metrics: tuple[str, ...] = ()
    periodic: tuple[tuple[str, int, int], ...] = ()
    final: tuple[str, ...] = ()
    undefined: tuple[str, ...] = ()

    def __post_init__(self):
        if self.axis not in AXES:
            raise ConfigError(f"Expectation.axis={self.axis!r} is not allowed; choose one of: "
                              f"{', '.join(AXES)}")
        for name in ("count", "stride"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (name == "stride"):
                raise ConfigError(f"Expectation.{name}={value!r} is not allowed; use an int >= "
                                  f"{int(name == 'stride')}")
        for name, every, offset in self.periodic:
            if not isinstance(every, int) or every < 1 or not isinstance(offset, int):
                raise ConfigError(f"Expectation.periodic entry ({name!r}, {every!r}, "
                                  f"{offset!r}) needs an int every >= 1 and an int offset")

    def as_dict(self) -> dict:
        # ``undefined`` only where declared: records without it read as none.
        return {"axis": self.axis, "count": self.count, "stride": self.stride,
                "metrics": list(self.metrics), "final": list(self.final),
                "periodic": [list(p) for p in self.periodic],
                **({"undefined": list(self.undefined)} if self.undefined else {})}


@dataclass(frozen=True)
class Divergence:
    """When a run stops as ``diverged`` (the same policy for every trainer).

    The training loss (``loss_key`` of a row) is non-finite, or above ``factor``
    times the loss at initialisation (the lifecycle's ``baseline``; the first
    row's loss when none was given), or above ``cap``; or an evaluation loss
    (``eval_keys``, in a row or the final metrics) is non-finite. A run that trains a
    second arm beside the first (EP's backprop twin, CfC's auxiliary path) names that arm's
    training losses in ``companion_keys``: one that is non-finite, or above ``factor`` times
    its own first finite value, stops the run too, since the comparison the arm serves is
    void from then on. A row value named in ``finite_keys`` (a quantity of the trainer's
    own computation, such as EP's drift) that is non-finite stops the run too, with
    ``finite_hint`` appended to the reason.
    """

    loss_key: str = "train_loss"
    eval_keys: tuple[str, ...] = ("val_loss", "test_loss")
    factor: float = 1e3
    cap: float = math.inf
    companion_keys: tuple[str, ...] = ()
    finite_keys: tuple[str, ...] = ()
    finite_hint: str = ""

    def __post_init__(self):
        if not self.factor > 1 or not self.cap > 0:
            raise ConfigError(f"Divergence factor={self.factor!r} must be > 1 and "
                              f"cap={self.cap!r} > 0")

    def check(self, values: dict, baseline: float | None, where: str) -> str | None:
        """Why ``values`` (a row or the final metrics) means divergence, or None."""
        loss = values.get(self.loss_key)
        if _number(loss):
            if not math.isfinite(loss):
                return f"non-finite training loss {self.loss_key}={loss} at {where}"
            if loss > self.cap:
                return (f"training loss {self.loss_key}={loss:.4g} at {where} exceeds the "
                        f"absolute cap {self.cap:.4g}")
            if baseline is not None and loss > self.factor * baseline:
                return (f"training loss {self.loss_key}={loss:.4g} at {where} exceeds "
                        f"{self.factor:g} x the loss at initialisation ({baseline:.4g})")
        for key in self.eval_keys:
            value = values.get(key)
            if _number(value) and not math.isfinite(value):
                return f"non-finite evaluation loss {key}={value} at {where}"
        for key in self.finite_keys:
            value = values.get(key)
            if _number(value) and not math.isfinite(value):
                return f"non-finite {key}={value} at {where}{self.finite_hint}"
        return None

    def check_companions(self, row: dict, baselines: dict, where: str) -> str | None:
        """Why a companion arm's loss in ``row`` means divergence, or None.

        ``baselines`` maps each companion key to its first finite value; a key seen for
        the first time is added to it.
        """
        for key in self.companion_keys:
            value = row
            for part in key.split("/"):  # "aux_huber_ema/h5" is a nested row entry
                value = value.get(part) if isinstance(value, dict) else None
            if not _number(value):
                continue
            if not math.isfinite(value):
                return (f"non-finite {key}={value} at {where}: the companion arm diverged, "
                        "so the comparison it serves is void")
            first = baselines.setdefault(key, value)
            if first > 0 and value > self.factor * first:
                return (f"{key}={value:.4g} at {where} exceeds {self.factor:g} x its first "
                        f"value ({first:.4g}): the companion arm diverged, so the "
                        "comparison it serves is void")
        return None


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class Experiment(ABC):
    """One trainer, as ``lab.lifecycle.train`` drives it.

    ``train`` checks the config (an instance of ``config_class``, whose ``preflight`` it
    calls), calls :meth:`build`, hands the lifecycle the :meth:`parts`, :meth:`expectation`,
    :meth:`divergence` and :meth:`data_identity`; on a fresh run (no row done) it calls
    :meth:`prepare`; then :meth:`step` for each row still to do, and at the end (a complete
    or a diverged run) :meth:`finish`. The config gives ``checkpoint_every`` and
    ``progress``. ``life`` is the run's lifecycle: a step or preparation may tell it the
    training loss at initialisation (``life.baseline(loss)``), the scale of the divergence
    bound.
    """

    kind: str  # the record kind (the config class's KIND)
    config_class: type | None = None  # None: train checks neither config nor directory

    @abstractmethod
    def build(self, config):
        """The live objects of a run (data, model, optimizers, generators), by the seed."""

    def parts(self, run) -> dict:
        """What a checkpoint restores: objects with ``state_dict`` / ``load_state_dict``,
        or ``torch.Generator`` s."""
        return run.parts()

    @abstractmethod
    def expectation(self, config) -> Expectation:
        """What a complete run holds (a pure function of the config)."""

    def divergence(self, config) -> Divergence:
        return Divergence()

    def device(self, run) -> str | None:
        return str(run.device)

    def data_identity(self, run) -> dict | None:
        """What identifies the run's data (the record's ``data``; a resume on other data is
        refused), or None."""
        return None

    def describe(self, config) -> str:
        """The progress bar's label."""
        return self.kind

    def prepare(self, run, life) -> None:
        """Calibrations and warm-ups of a fresh run (a resumed one restores them)."""
        return None

    @abstractmethod
    def step(self, run, index: int, life) -> dict:
        """Train row ``index`` (an epoch, or a logged step); the row."""

    def postfix(self, row: dict) -> dict | None:
        """What the progress bar shows after a row, or None."""
        return None

    @abstractmethod
    def finish(self, run, rows: list[dict], diverged: bool) -> tuple[dict, dict | None]:
        """(final metrics, work bill) of the run after its last row (``diverged``: it
        stopped early)."""
