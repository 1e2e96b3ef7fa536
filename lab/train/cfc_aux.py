"""CfC perception trainer with an auxiliary supervision path and a conditional lift (seed 000).

DESIGN section 7. Per step, a batch of feature sequences from a price series
(``lab.data.prices.MultiHorizonLoader``) goes through

    encoder (per-step MLP) -> enriched sequence e (B, T, E)
      -> main CfC trunk -> linear head -> BCE on the main-horizon direction
      -> aux CfC trunk (one bucket, ``aux_units``) -> linear heads, one per
         (long | short) x horizon -> Huber loss against the scaled outcomes

CfC: Hasani et al. 2022, "Closed-form continuous-time neural networks" (``lab.models.cfc``).

*Asymmetric stop-gradient and its lift* (the rule: ``lab.rules.aux_lift``). The aux trunk and
heads always train on the Huber loss, with their own Adam optimizer (no optimizer state is
shared with the main path); their gradient at the encoder output joins the main path's only
after the lift, which fires at the first step s < ``lift_window`` (0: no deadline) after which
every horizon's aux Huber EMA is below ``lift_huber`` and its direction-accuracy EMA above
``lift_acc`` (EMAs of decay ``ema_decay``), and takes effect from step s + 1.
``aux = "never"`` trains the aux path with the lift disabled; ``aux = "none"`` has no aux path.

Each step logs one row (axis ``step``): ``train_loss`` (main BCE, the divergence key),
``train_acc``, ``aux_huber_ema/h{h}``, ``aux_acc_ema/h{h}``, ``lifted`` (0/1), ``lift_step``
(None before the lift) and, every ``eval_every`` steps, ``val_loss`` / ``val_acc`` on the
later, held-out part of the series.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import ConfigError, RunConfig, bounded, choice, configclass
from ..data import DataError
from ..data.identity import absolute, read_unchanged
from ..data.markets import ARCH_SERIES, arch_identity, arch_table
from ..data.prices import (
    DEFAULT_SYMBOL,
    SOURCES,
    SYNTHETIC_KINDS,
    VEGA_SYMBOLS,
    MarketLoader,
    MultiHorizonLoader,
    check_horizons,
    csv_prices,
    synthetic_prices,
    vega_identity,
    vega_prices,
)
from ..device import (
    check_fits,
    check_threads,
    configure_process,
    keeps_threads,
    resolve_device,
    seeded,
    sync,
)
from ..experiment import Divergence, Expectation, Experiment
from ..lifecycle import train
from ..models.cfc import ACTIVATIONS, MODES, CfC
from ..rules.aux_lift import AuxHealth, AuxJoin

AUX_MODES = ("lift", "never", "none")


SYNTHETIC_LENGTH_MAX = 1_000_000


@configclass
class CfCAuxConfig(RunConfig):
    """Everything one CfC-aux run depends on; ``asdict`` is stored in the record."""

    KIND: ClassVar[str] = "cfc_aux"  # the record kind its trainer writes (not a field)

    # data: the price series
    source: str = choice("vega", SOURCES)
    symbol: str = choice(DEFAULT_SYMBOL, VEGA_SYMBOLS)  # source "vega"
    csv_path: str = ""  # source "csv": the file (made absolute on construction) ...
    column: str = ""  # ... and the column holding prices, oldest row first
    synthetic: str = choice("random_walk", SYNTHETIC_KINDS)  # source "synthetic"
    # Steps of the generated series; each makes an example of seq_len x window returns,
    # so 10^6 steps at the defaults already hold about 0.6 GB of examples.
    synthetic_length: int = bounded(2000, 2, SYNTHETIC_LENGTH_MAX)
    drift: float = bounded(0.001, -1.0, 1.0)  # per-step log-return drift
    volatility: float = bounded(0.01, 0.0)  # per-step log-return noise (random_walk, regimes)
    regime_length: int = bounded(100, 1)  # steps between drift sign flips (regimes)
    series: str = choice("sp500", ARCH_SERIES)  # source "arch": the bundled daily series
    # source "arch": the last share of days kept for one test evaluation after training
    test_fraction: float = bounded(0.0, 0.0, 1.0, hi_open=True)
    scale_window: int = bounded(250, 2)  # source "arch": trailing days of each feature scale
    # data: examples
    window: int = bounded(12, 1)  # trailing log returns per step's features
    seq_len: int = bounded(12, 1)  # steps per example sequence
    horizons: tuple = (1, 5, 20)  # aux outcome horizons, strictly increasing
    main_horizon: int = bounded(5, 1)  # the direction label's horizon (one of horizons)
    val_fraction: float = bounded(0.2, 0.0, 1.0, lo_open=True, hi_open=True)
    # model
    enc_dim: int = bounded(32, 1)  # encoder output per step (the enriched sequence)
    units: int = bounded(64, 1)  # main trunk
    main_buckets: int = bounded(1, 1)  # main trunk time-scale buckets (taus up to main_tau_max)
    main_tau_max: float = bounded(1.0, 1.0)
    aux_units: int = bounded(64, 1)  # aux trunk (one bucket, tau = 1)
    backbone_units: int = bounded(64, 1)
    mode: str = choice("default", MODES)
    activation: str = choice("lecun_tanh", ACTIVATIONS)
    # aux path and its lift
    aux: str = choice("lift", AUX_MODES)
    lift_huber: float = bounded(0.4, 0.0, lo_open=True)  # every horizon's Huber EMA below
    # every horizon's direction-acc EMA above (strictly: 1.0 could never be passed)
    lift_acc: float = bounded(0.85, 0.0, 1.0, hi_open=True)
    lift_window: int = bounded(200, 0)  # the lift may fire at steps < this; 0 = any step
    ema_decay: float = bounded(0.95, 0.0, 1.0, hi_open=True)
    huber_delta: float = bounded(1.0, 0.0, lo_open=True)
    # optimisation
    steps: int = bounded(300, 1)
    batch_size: int = bounded(32, 1)
    lr: float = bounded(1e-3, 0.0, lo_open=True)  # main Adam: encoder, main trunk, main head
    aux_lr: float = bounded(1e-3, 0.0, lo_open=True)  # aux Adam: aux trunk and heads
    eval_every: int = bounded(25, 0)  # steps between validations; 0 = only the final one
    diverge_factor: float = bounded(1e3, 1.0, lo_open=True)
    checkpoint_every: int = bounded(50, 0)  # steps (RunConfig's field, another default)

    def __post_init__(self):
        try:
            check_horizons(self.horizons, self.main_horizon)
        except DataError as err:
            raise ConfigError(f"CfCAuxConfig.{err}") from None
        if self.source == "csv" and not (self.csv_path and self.column):
            raise ConfigError("CfCAuxConfig.source='csv' needs csv_path (the file) and column "
                              f"(the price column); got csv_path={self.csv_path!r}, "
                              f"column={self.column!r}")
        # Resolved once, where the config is built (`lab run` and its kernel share a working
        # directory), so the record names the file itself, not a name relative to somewhere.
        object.__setattr__(self, "csv_path", absolute(self.csv_path))
        if self.units % self.main_buckets:
            raise ConfigError(f"CfCAuxConfig.main_buckets={self.main_buckets} must divide "
                              f"units={self.units}")
        if self.source != "csv" and (self.csv_path or self.column):
            raise ConfigError(f"CfCAuxConfig.csv_path={self.csv_path!r} / column="
                              f"{self.column!r} are read only with source='csv' (source is "
                              f"{self.source!r}); leave them empty or set source='csv'")
        if self.source != "arch" and (self.series != "sp500" or self.test_fraction
                                      or self.scale_window != 250):
            raise ConfigError(f"CfCAuxConfig.series={self.series!r}, test_fraction="
                              f"{self.test_fraction!r} and scale_window={self.scale_window!r} "
                              f"are read only with source='arch' (source is {self.source!r}); "
                              "leave them at 'sp500', 0.0 and 250 or set source='arch'")
        if self.source == "arch" and self.val_fraction + self.test_fraction >= 1:
            raise ConfigError(f"CfCAuxConfig.val_fraction={self.val_fraction} + test_fraction="
                              f"{self.test_fraction} leaves no training days; allowed: a sum "
                              "below 1")
        if self.source != "vega" and self.symbol != DEFAULT_SYMBOL:
            # It would change nothing but the run's identity (a rerun with it refused).
            raise ConfigError(f"CfCAuxConfig.symbol={self.symbol!r} is read only with "
                              f"source='vega' (source is {self.source!r}); leave it at "
                              f"{DEFAULT_SYMBOL!r} or set source='vega'")

    def weight_floor(self) -> int:
        """At most the weight count: the encoder's matrices, each trunk's backbone matrix
        and one head row per state unit (the aux trunk only with an aux path)."""
        E, K = self.enc_dim, self.backbone_units
        trunks = (self.units,) + ((self.aux_units,) if self.aux != "none" else ())
        return self.window * E + E * E + sum((E + H) * K + K * H for H in trunks)

    def _check_model_fits(self) -> None:
        """ConfigError if the two trunks cannot fit in memory (units=10**9 died in torch's
        allocator after the kernel started). A lower bound, float32: the encoder, each
        trunk's backbone (its input and state in, backbone_units out) and one head per
        state unit, with their gradients; one step's encoded sequence, states and
        backbone outputs kept for backward; the Adam moments left out."""
        E, U, A, K = self.enc_dim, self.units, self.aux_units, self.backbone_units
        kept = self.batch_size * self.seq_len * (E + U + A + 2 * K)
        check_fits("CfCAuxConfig", (2 * self.weight_floor() + kept) * 4,
                   f"the encoder and trunks of units={U}, aux_units={A}, backbone_units={K}, "
                   f"enc_dim={E}, with one step of batch_size={self.batch_size} sequences of "
                   f"seq_len={self.seq_len},", "give smaller sizes or batch_size")

    def preflight(self) -> None:
        """What the price series decides, before a run starts (``lab run``, a sweep's
        pre-check, ``train_cfc_aux``): a readable CSV with the column, long enough for the
        window, sequence and horizons in both splits; and a device this machine has."""
        resolve_device(self.device)
        check_threads(self.threads)
        self._check_model_fits()
        # Here, not at construction: a config naming a file that exists only where its runs
        # were made (a cluster) still builds, so `lab runs` can list those runs.
        if self.source == "csv" and not Path(self.csv_path).is_file():
            raise ConfigError(f"CfCAuxConfig.csv_path={self.csv_path!r} does not exist or is "
                              "not a file; expected a CSV file with a header row naming "
                              f"column={self.column!r}")
        try:
            make_loader(self, *load_prices(self))
        except (DataError, OSError) as err:
            raise ConfigError(f"CfCAuxConfig: {err}") from None


def make_loader(config: CfCAuxConfig, prices, name: str) -> MultiHorizonLoader:
    """The loader of the configured source; for ``arch`` a split with fewer examples than
    one batch is refused (a daily study has days to spare; fewer means a wrong fraction)."""
    if config.source != "arch":
        return MultiHorizonLoader(prices, window=config.window, seq_len=config.seq_len,
                                  horizons=config.horizons, main_horizon=config.main_horizon,
                                  val_fraction=config.val_fraction, name=name)
    data = MarketLoader(prices, window=config.window, seq_len=config.seq_len,
                        horizons=config.horizons, main_horizon=config.main_horizon,
                        val_fraction=config.val_fraction, test_fraction=config.test_fraction,
                        scale_window=config.scale_window, name=name)
    sizes = data.split_sizes()
    for split, key in (("training", "n_train"), ("validation", "n_val"), ("test", "n_test")):
        if (key != "n_test" or config.test_fraction) and sizes[key] < config.batch_size:
            fraction = {"n_train": "val_fraction + test_fraction", "n_val": "val_fraction",
                        "n_test": "test_fraction"}[key]
            raise DataError(f"{name}: the {split} split holds {sizes[key]} examples, fewer than "
                            f"one batch (batch_size={config.batch_size}) with val_fraction="
                            f"{config.val_fraction}, test_fraction={config.test_fraction}; "
                            f"allowed: at least batch_size examples per split (change "
                            f"{fraction} or batch_size)")
    return data


def load_prices(config: CfCAuxConfig):
    """(prices, name) of the configured source."""
    if config.source == "vega":
        return vega_prices(config.symbol), f"vega_datasets stocks {config.symbol}"
    if config.source == "csv":
        return csv_prices(config.csv_path, config.column), f"{config.csv_path}:{config.column}"
    if config.source == "arch":
        return arch_table(config.series), f"arch {config.series}"
    prices = synthetic_prices(config.synthetic, length=config.synthetic_length,
                              drift=config.drift, volatility=config.volatility,
                              regime_length=config.regime_length, seed=config.seed)
    return prices, f"synthetic {config.synthetic}"


def data_identity(config: CfCAuxConfig, data: MultiHorizonLoader, csv: dict | None) -> dict:
    """What identifies a run's data (``record["data"]``, checked on resume): the CSV file's
    path, size and hash; the bundled vega series' symbol, length and hash (vega_datasets may
    change under an installed run); a synthetic series is fixed by the config; and the split
    the loader actually made (the clamp can move it off ``val_fraction``). ``csv``: the
    CSV's identity taken as it was read (``build_run``'s ``Run.csv``; None for the others)."""
    identity = {"split": data.split_sizes()}
    if config.source == "csv":
        identity["csv"] = csv
    elif config.source == "vega":
        identity["vega"] = vega_identity(config.symbol)
    elif config.source == "arch":
        identity["arch"] = arch_identity(config.series)
    return identity


def main_buckets(config: CfCAuxConfig):
    """Equal buckets whose tau ranges tile [1, main_tau_max] geometrically."""
    n, size = config.main_buckets, config.units // config.main_buckets
    edges = [config.main_tau_max ** (k / n) for k in range(n + 1)]
    return tuple((size, edges[k], edges[k + 1]) for k in range(n))


class Encoder(nn.Module):
    """Per-step MLP: features (B, T, window) -> enriched sequence (B, T, enc_dim)."""

    def __init__(self, window: int, enc_dim: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(window, enc_dim), nn.Tanh(),
                                 nn.Linear(enc_dim, enc_dim), nn.Tanh())

    def forward(self, x):
        return self.net(x)


class MainPath(nn.Module):
    """Main CfC trunk and the direction head: (B, T, E) -> logits (B,)."""

    def __init__(self, config: CfCAuxConfig):
        super().__init__()
        self.trunk = CfC(config.enc_dim, config.units, mode=config.mode,
                         backbone_units=config.backbone_units, activation=config.activation,
                         buckets=main_buckets(config))
        self.head = nn.Linear(config.units, 1)

    def forward(self, e):
        _, h_n = self.trunk(e)  # (B, units)
        return self.head(h_n)[:, 0]


class AuxPath(nn.Module):
    """Aux CfC trunk (one bucket) and linear heads: (B, T, E) -> long, short (B, n_h) each."""

    def __init__(self, config: CfCAuxConfig):
        super().__init__()
        self.trunk = CfC(config.enc_dim, config.aux_units, mode=config.mode,
                         backbone_units=config.backbone_units, activation=config.activation,
                         buckets=((config.aux_units, 1.0, 1.0),))
        self.heads = nn.Linear(config.aux_units, 2 * len(config.horizons))

    def forward(self, e):
        _, h_n = self.trunk(e)
        return self.heads(h_n).chunk(2, dim=-1)


class BestOnValidation:
    """The encoder and main path at the evaluation with the lowest validation loss: the state
    the test split is evaluated at (the step is chosen on validation, never on test)."""

    def __init__(self):
        self.step, self.loss, self.state = None, math.inf, None

    def offer(self, run: Run, step: int, loss: float) -> None:
        if math.isfinite(loss) and loss < self.loss:
            self.step, self.loss = step, loss
            self.state = {name: {k: v.detach().clone() for k, v in part.state_dict().items()}
                          for name, part in (("encoder", run.encoder), ("main", run.main))}

    def restore(self, run: Run) -> None:
        run.encoder.load_state_dict(self.state["encoder"])
        run.main.load_state_dict(self.state["main"])

    def state_dict(self) -> dict:
        return {"step": self.step, "loss": self.loss, "state": self.state}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.loss, self.state = state["step"], state["loss"], state["state"]


@dataclass
class Run:
    """The live objects of a CfC-aux run."""

    config: CfCAuxConfig
    device: torch.device
    data: MultiHorizonLoader
    encoder: Encoder
    main: MainPath
    aux: AuxPath | None
    opt_main: torch.optim.Optimizer
    opt_aux: torch.optim.Optimizer | None
    health: AuxHealth
    generator: torch.Generator  # batch order
    csv: dict | None = None  # the CSV's identity, of the very bytes read (source "csv")
    best: BestOnValidation | None = None  # with a test split: the step chosen on validation

    def parts(self) -> dict:
        """What a checkpoint restores."""
        parts = {"encoder": self.encoder, "main": self.main, "opt_main": self.opt_main,
                 "health": self.health, "generator": self.generator}
        if self.aux is not None:
            parts.update(aux=self.aux, opt_aux=self.opt_aux)
        if self.best is not None:
            parts["best"] = self.best
        return parts


def build_run(config: CfCAuxConfig) -> Run:
    """Data, encoder, trunks, heads and both optimizers, all fixed by ``config.seed``."""
    device = resolve_device(config.device)
    configure_process(config.threads)
    # A CSV is hashed as it is read: the record names the prices the run trained on.
    csv, (prices, name) = (read_unchanged(config.csv_path, lambda: load_prices(config))
                           if config.source == "csv" else (None, load_prices(config)))
    data = make_loader(config, prices, name)
    n_train = data.split_sizes()["n_train"]
    if config.batch_size > n_train:
        # Batches are drawn with replacement, so this runs, but each batch repeats examples
        # and the bill's train_examples counts draws, not distinct examples.
        warnings.warn(f"CfCAuxConfig.batch_size={config.batch_size} is more than the {n_train} "
                      f"training examples of {name}: each batch draws examples with "
                      f"replacement, so it repeats them; batch_size <= {n_train} draws "
                      "fewer repeats", stacklevel=2)
    for field in ("features", "long", "short", "direction"):
        setattr(data, field, getattr(data, field).to(device))
    with seeded(config.seed):
        encoder = Encoder(data.features.shape[-1], config.enc_dim).to(device)
        main = MainPath(config).to(device)
        aux = AuxPath(config).to(device) if config.aux != "none" else None
    opt_main = torch.optim.Adam([*encoder.parameters(), *main.parameters()], lr=config.lr)
    # Its own Adam: Adam normalises each parameter's step by its own gradient history, and
    # sharing one optimizer would tie nothing here but would mix the two paths' states.
    opt_aux = torch.optim.Adam(aux.parameters(), lr=config.aux_lr) if aux is not None else None
    return Run(config, device, data, encoder, main, aux, opt_main, opt_aux,
               AuxHealth(len(config.horizons), config.ema_decay),
               torch.Generator().manual_seed(config.seed), csv,
               BestOnValidation() if config.test_fraction else None)


def forward_losses(run: Run, batch, lifted: bool) -> dict:
    """Main BCE and aux Huber (per horizon) on one batch, gradients joined per ``lifted``."""
    cfg = run.config
    x = batch.x.to(run.device)
    enc = run.encoder(x)  # (B, T, E)
    out = {}
    if run.aux is None:
        main_in = enc
    else:
        main_in, aux_in = AuxJoin.apply(enc, lifted)
        long, short = run.aux(aux_in)  # (B, n_h) each
        huber_long = F.huber_loss(long, batch.long, reduction="none", delta=cfg.huber_delta)
        huber_short = F.huber_loss(short, batch.short, reduction="none", delta=cfg.huber_delta)
        per_h = 0.5 * (huber_long + huber_short).mean(0)  # (n_h,)
        out["aux_loss"] = per_h.sum()
        out["aux_huber"] = per_h.detach()
        with torch.no_grad():
            out["aux_acc"] = ((long > short) == (batch.long > batch.short)).float().mean(0)
    logits = run.main(main_in)  # (B,)
    out["logits"] = logits
    out["loss"] = F.binary_cross_entropy_with_logits(logits, batch.direction)
    return out


def train_step(run: Run, step: int) -> dict:
    """One optimizer step of both paths; returns the step's row."""
    cfg, health = run.config, run.health
    batch = run.data.sample(cfg.batch_size, run.generator)
    run.opt_main.zero_grad(set_to_none=True)
    if run.opt_aux is not None:
        run.opt_aux.zero_grad(set_to_none=True)
    out = forward_losses(run, batch, health.lifted)
    total = out["loss"] + out["aux_loss"] if run.aux is not None else out["loss"]
    total.backward()
    run.opt_main.step()
    row = {"train_loss": out["loss"].item(),
           "train_acc": float(((out["logits"] > 0).float() == batch.direction).float().mean())}
    if run.aux is None:
        return row
    run.opt_aux.step()
    health.update(out["aux_huber"].tolist(), out["aux_acc"].tolist())
    if cfg.aux == "lift":
        health.consider_lift(step, cfg.lift_huber, cfg.lift_acc, cfg.lift_window)
    huber, acc = health.huber, health.acc
    names = [f"h{h}" for h in cfg.horizons]
    row.update(aux_huber_ema=dict(zip(names, huber)), aux_acc_ema=dict(zip(names, acc)),
               lifted=int(health.lifted), lift_step=health.lift_step)
    return row


def _fraction(direction: torch.Tensor) -> float:
    return int(direction.sum()) / len(direction)  # exact, as the conv trainer's fractions


@torch.no_grad()
def evaluate(run: Run) -> dict:
    """Main BCE and accuracy on every validation example (the later part of the series)."""
    batch = run.data.validation()
    logits = run.main(run.encoder(batch.x.to(run.device)))
    loss = F.binary_cross_entropy_with_logits(logits, batch.direction)
    hits = ((logits > 0).float() == batch.direction).float()
    return {"val_loss": float(loss), "val_acc": _fraction(hits)}


@torch.no_grad()
def evaluate_test(run: Run) -> dict:
    """The test split, once, after training: loss, accuracy, and per test day (in time order
    from ``test_first_end``) the predicted probability of "up" and the label, so that an
    analysis can bootstrap any metric over test days."""
    batch = run.data.test()
    logits = run.main(run.encoder(batch.x.to(run.device)))
    loss = F.binary_cross_entropy_with_logits(logits, batch.direction)
    hits = ((logits > 0).float() == batch.direction).float()
    return {"test_loss": float(loss), "test_acc": _fraction(hits),
            "test_up_fraction": _fraction(batch.direction),
            "test_first_end": int(batch.ends[0]),
            "test_prob": [round(p, 6) for p in torch.sigmoid(logits).tolist()],
            "test_label": [int(v) for v in batch.direction.tolist()]}


@torch.no_grad()
def initial_loss(run: Run) -> float:
    """The main BCE on a validation-free draw before any update (the divergence scale)."""
    state = run.generator.get_state()
    batch = run.data.sample(run.config.batch_size, run.generator)
    run.generator.set_state(state)  # the first training batch stays the same
    logits = run.main(run.encoder(batch.x.to(run.device)))
    return float(F.binary_cross_entropy_with_logits(logits, batch.direction))


def aux_loss_keys(config: CfCAuxConfig) -> tuple[str, ...]:
    """The aux path's training losses in a row (its divergence watch; none without it)."""
    if config.aux == "none":
        return ()
    return tuple(f"aux_huber_ema/h{h}" for h in config.horizons)


def expectation(config: CfCAuxConfig) -> Expectation:
    """A complete run: one row per step; aux signals every step; validation on its cadence."""
    metrics = ("train_loss", "train_acc")
    if config.aux != "none":
        metrics += ("aux_huber_ema/", "aux_acc_ema/", "lifted")
    periodic = ()
    if config.eval_every:
        periodic = tuple((name, config.eval_every, config.eval_every - 1)
                         for name in ("val_loss", "val_acc"))
    final = ("val_loss", "val_acc")
    if config.test_fraction:
        # (and the per-day test_prob / test_label lists, which analysis.markets checks: a
        # runs table holds numbers only)
        final += ("best_step", "test_loss", "test_acc")
    return Expectation(axis="step", count=config.steps, metrics=metrics, periodic=periodic,
                       final=final)


def _row(run: Run, step: int) -> dict:
    """One training step's row, with validation on its cadence."""
    config = run.config
    row = train_step(run, step)
    row["val_loss"] = row["val_acc"] = None
    # on the cadence and at the last step (when the cadence does not divide steps)
    if config.eval_every and ((step + 1) % config.eval_every == 0 or step + 1 == config.steps) \
            and math.isfinite(row["train_loss"]):
        row.update(evaluate(run))
        if run.best is not None:
            run.best.offer(run, step, row["val_loss"])
    return row


def _final(run: Run, rows: list[dict], diverged: bool) -> tuple[dict, dict]:
    sync(run.device)
    final = {}
    if not diverged:
        if run.best is not None:
            # The test split is read once, at the step validation chose.
            run.best.offer(run, run.config.steps - 1, evaluate(run)["val_loss"])
            if run.best.state is not None:
                run.best.restore(run)
        final = {**evaluate(run), "val_up_fraction": _fraction(run.data.validation().direction),
                 "lifted": int(run.health.lifted), "lift_step": run.health.lift_step}
        if run.best is not None:
            final.update(best_step=run.best.step, **evaluate_test(run))
    # The lifecycle adds train_wall_s: the whole run's, summed over its sessions.
    work = {"optimizer_steps": len(rows), "train_examples": len(rows) * run.config.batch_size}
    return final, work


# ---------------------------------------------------------------------------
# the experiment, as lab.lifecycle.train drives it


class CfCAux(Experiment):
    """A CfC-aux run: one row per step."""

    kind, config_class = CfCAuxConfig.KIND, CfCAuxConfig

    def build(self, config: CfCAuxConfig) -> Run:
        return build_run(config)

    def expectation(self, config: CfCAuxConfig) -> Expectation:
        return expectation(config)

    def divergence(self, config: CfCAuxConfig) -> Divergence:
        return Divergence(eval_keys=("val_loss",), factor=config.diverge_factor,
                          companion_keys=aux_loss_keys(config))

    def data_identity(self, run: Run) -> dict:
        return data_identity(run.config, run.data, run.csv)

    def describe(self, config: CfCAuxConfig) -> str:
        return f"cfc-aux {config.aux} seed {config.seed}"

    def prepare(self, run: Run, life) -> None:
        life.baseline(initial_loss(run))

    def step(self, run: Run, step: int, life) -> dict:
        return _row(run, step)

    def postfix(self, row: dict) -> dict:
        return {"loss": f"{row['train_loss']:.3f}", "lifted": row.get("lifted", 0)}

    def finish(self, run: Run, rows: list[dict], diverged: bool) -> tuple[dict, dict]:
        return _final(run, rows, diverged)


EXPERIMENT = CfCAux()


@keeps_threads
def train_cfc_aux(config: CfCAuxConfig, out_dir: str | Path | None = None, *,
                  run_id: str | None = None) -> dict:
    """Train per ``config``; returns the run record with its rows under ``steps``.

    With ``out_dir`` the run is recorded there and an interrupted run of the same config
    resumes from its last checkpoint.
    """
    return train(EXPERIMENT, config, out_dir, run_id=run_id)
