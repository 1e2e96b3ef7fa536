"""The three trainers' configs: ``ConvConfig``, ``EPConfig`` and ``CfCAuxConfig``.

Here, apart from the trainers, so that building a config imports neither torch, numba nor
any trainer: a bad value typed on the command line (``lab run``, ``lab train``, a sweep's
pre-check) is refused in a fraction of a second. Pydantic checks the plain fields before
``__post_init__`` runs; what needs torch or the rules (a rule's own parameters, which its
``Params`` in ``lab.rules`` check; the memory and data checks of ``preflight``) is imported
inside the method that needs it. The trainers re-export their config
(``from lab.train.conv import ConvConfig`` keeps working); a notebook names this module in
its ``lab_config`` metadata.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import ClassVar

import numpy as np

from ..config import (
    ConfigError,
    FrozenParams,
    RunConfig,
    bounded,
    check_in_dtype,
    choice,
    configclass,
)
from ..data.identity import absolute
from ..data.markets import ARCH_SERIES, arch_table
from ..data.specs import (
    DATA_SPECS,
    DATASETS,
    DEFAULT_SYMBOL,
    SOURCES,
    SYNTHETIC_KINDS,
    VEGA_SYMBOLS,
    DataError,
    check_horizons,
)

DTYPE_NAMES = ("float32", "float64")  # a model's floating-point types (lab.train.common.DTYPES)
ONECYCLE_MIN_STEPS = 4  # torch's OneCycleLR needs at least one step in each phase


@configclass
class ConvConfig(RunConfig):
    """Everything one conv run depends on; ``asdict`` is stored in the record."""

    KIND: ClassVar[str] = "conv"  # the record kind its trainer writes (not a field)

    # data
    dataset: str = choice("mnist1d", DATASETS)
    data_dir: str = ""  # "" -> $LAB_DATA_DIR or ~/.cache/lab; stored absolute
    val_fraction: float = bounded(0.1, 0.0, 0.9)
    n_train: int = bounded(0, 0)  # 0 = every training example
    augment: str = choice("auto", ("auto", "none", "shift", "crop_flip"))
    # model
    depth: int = bounded(20, 8)
    width: int = bounded(16, 1)
    normalization: str = choice("batchnorm", ("batchnorm", "none"))
    residual_scale: float = bounded(1.0, 0.0, lo_open=True)
    dtype: str = choice("float32", DTYPE_NAMES)
    # learning rule
    rule: str = "bp"
    rule_params: dict = dataclasses.field(default_factory=dict)
    # optimisation
    optimizer: str = choice("sgd", ("sgd", "adam"))
    lr: float = bounded(0.1, 0.0, lo_open=True)
    momentum: float = bounded(0.9, 0.0, 1.0, hi_open=True)
    nesterov: bool = True
    weight_decay: float = bounded(1e-3, 0.0)
    schedule: str = choice("onecycle", ("onecycle", "cosine", "constant"))
    warmup_fraction: float = bounded(0.25, 0.0, 1.0, lo_open=True, hi_open=True)
    epochs: int = bounded(60, 1)
    batch_size: int = bounded(128, 1)
    grad_clip: float = bounded(0.0, 0.0)  # max global grad norm; 0 = off
    # evaluation
    eval_split: str = choice("val", ("val", "test"))
    eval_every: int = bounded(1, 0)  # epochs between validation passes (and the last); 0 = never
    eval_batch_size: int = bounded(1000, 1)
    # diagnostics: alignment with backprop on a fixed probe batch of training examples
    alignment_every: int = bounded(0, 0)  # epochs between measurements (and the last); 0 = never
    alignment_batch: int = bounded(256, 1)
    # divergence (the run fields, seed to progress, come from RunConfig)
    diverge_factor: float = bounded(1e3, 1.0, lo_open=True)  # x the loss at initialisation

    def __post_init__(self):
        if self.data_dir and not self.data_dir.strip():
            raise ConfigError(f"ConvConfig.data_dir={self.data_dir!r} is blank; give a directory, "
                              "or '' for $LAB_DATA_DIR / ~/.cache/lab")
        # Absolute, so the record names the directory whatever the working directory of a
        # later reader or resume.
        object.__setattr__(self, "data_dir", absolute(self.data_dir))
        if self.augment == "crop_flip" and DATA_SPECS[self.dataset].dims == 1:
            # (it failed at the first batch, after the run had started)
            raise ConfigError(f"ConvConfig.augment='crop_flip' crops and flips images, and "
                              f"dataset {self.dataset!r} holds 1-D signals; use 'shift' "
                              "(circular shifts), 'auto' (the dataset's own) or 'none'")
        if (self.depth - 2) % 6:
            raise ConfigError(f"ConvConfig.depth={self.depth} is not allowed; use 6n+2 "
                              "(8, 14, 20, 32, 44, 56, 110)")
        if self.eval_split == "test" and self.eval_every:
            raise ConfigError(
                "ConvConfig.eval_split='test' with eval_every="
                f"{self.eval_every} would look at the test split during training; the test "
                "split is evaluated exactly once, after the last epoch. Use eval_split='val' "
                "(or eval_every=0)."
            )
        if self.eval_every and self.val_fraction == 0:
            raise ConfigError("ConvConfig.eval_every > 0 needs a validation split; set "
                              "val_fraction in (0, 0.9] or eval_every=0")
        # Last: the rules (and torch with them) are imported only for a config whose plain
        # fields hold. Each rule's Params live in its own file, so checking them needs it.
        from ..rules.registry import RULES, check_params_in_dtype, resolve_params
        from ..rules.registry import rule_params as params_of

        if self.rule not in RULES:
            raise ConfigError(f"ConvConfig.rule={self.rule!r} is unknown; known rules: "
                              f"{', '.join(sorted(RULES))}")
        # Store the rule's resolved hyper-parameters, defaults included, so the
        # record says exactly what ran.
        try:
            resolved = resolve_params(self.rule, self.rule_params)
        except ConfigError as err:
            raise ConfigError(f"ConvConfig.rule_params: {err}") from None
        object.__setattr__(self, "rule_params", FrozenParams(resolved))
        try:
            check_params_in_dtype(self.rule, params_of(self.rule, resolved), self.dtype)
        except ConfigError as err:
            raise ConfigError(f"ConvConfig.rule_params: {err}") from None

    def _check_model_fits(self) -> None:
        """ConfigError if the weights alone, with their gradients, momentum and a rule's
        feedback copy (4 tensors each), exceed this machine's memory (a huge width or depth
        would die in torch's allocator, or hang while the model is built)."""
        from ..device import check_fits
        from ..models import ResNet

        spec = DATA_SPECS[self.dataset]
        weights = ResNet.weight_count(self.depth, self.width, spec.dims, spec.in_channels,
                                      spec.n_classes)
        check_fits("ConvConfig", 4 * weights * np.finfo(self.dtype).bits // 8,
                   f"a ResNet-{self.depth} of width {self.width} on {self.dataset} has "
                   f"{weights:.3g} weights, which with their gradients, momentum and feedback in "
                   f"{self.dtype}", "give a smaller depth or width (ResNet-20: depth 20, "
                   "width 16)")

    def preflight(self) -> None:
        """What the data decides, checked before a run starts (``lab run``, ``lab train``
        and a sweep's pre-check call it): n_train, the examples the rule's preparation
        draws and the alignment probe must fit in the training set; and a device this
        machine has. ConfigError if not."""
        from ..data import train_size
        from ..device import check_threads, resolve_device
        from ..rules.base import check_example_needs
        from ..rules.registry import rule_class
        from ..rules.registry import rule_params as params_of

        resolve_device(self.device)
        check_threads(self.threads)
        self._check_model_fits()
        try:
            available = train_size(self.dataset, data_dir=self.data_dir or None,
                                   val_fraction=self.val_fraction, n_train=self.n_train)
        except DataError as err:
            raise ConfigError(f"ConvConfig: {err}") from None
        rule = rule_class(self.rule)
        needs = rule.example_needs(params_of(self.rule, self.rule_params))
        check_example_needs(self.rule, needs, available)
        if self.alignment_every and self.alignment_batch > available:
            raise ConfigError(f"ConvConfig.alignment_batch={self.alignment_batch} but the "
                              f"training set has only {available} examples (the probe batch "
                              f"is drawn from it); allowed: 1 to {available}")
        steps = self.epochs * math.ceil(available / self.batch_size)
        if self.schedule == "onecycle" and steps < ONECYCLE_MIN_STEPS:
            # torch's one-cycle needs a step in each phase; a constant rate under the
            # name onecycle would make the record lie about what ran.
            raise ConfigError(
                f"ConvConfig.schedule='onecycle' needs at least {ONECYCLE_MIN_STEPS} optimizer "
                f"steps; this run has {steps} (epochs={self.epochs} x ceil({available} "
                f"training examples / batch_size={self.batch_size})); use schedule='constant' "
                "or 'cosine', more epochs or a smaller batch_size")


# ---------------------------------------------------------------------------
# EP (lab.train.ep)

VAL_FRACTION = 0.1  # EP: the last 10% of the text is the validation split


@configclass
class EPConfig(RunConfig):
    """Everything one EP run depends on; ``asdict`` is stored in the record."""

    KIND: ClassVar[str] = "ep"  # the record kind its trainer writes (not a field)

    # data: "" = the bundled corpus (pydoc_data.topics), else a UTF-8 text file; a relative
    # path is made absolute on construction (against the working directory), so the record
    # names the file itself
    text_path: str = ""
    seq_len: int = bounded(64, 1)
    # model (the vocabulary comes from the data)
    d_model: int = bounded(64, 1)
    n_layers: int = bounded(3, 1)
    n_heads: int = bounded(4, 1)
    mlp_ratio: int = bounded(4, 1)
    dtype: str = choice("float32", DTYPE_NAMES)
    # equilibrium propagation
    beta: float = bounded(0.01, 0.0, lo_open=True)
    beta_schedule: str = choice("constant", ("constant", "cosine"))
    beta_final: float = bounded(0.001, 0.0, lo_open=True)  # the cosine schedule's end value
    K: int = bounded(2, 1)
    drift_bound: float = bounded(0.05, 0.0)  # 0 = no governor
    recover_after: int = bounded(50, 1)  # clean steps before beta/K step back up
    # optimisation (EP and its twin alike)
    steps: int = bounded(3000, 1)
    batch_size: int = bounded(32, 1)
    optimizer: str = choice("adamw", ("adamw", "adam", "sgd"))
    lr: float = bounded(3e-3, 0.0, lo_open=True)
    weight_decay: float = bounded(0.01, 0.0)
    schedule: str = choice("cosine", ("cosine", "constant"))
    warmup_steps: int = bounded(100, 0)
    grad_clip: float = bounded(1.0, 0.0)  # max global grad norm; 0 = off
    # evaluation and diagnostics
    eval_every: int = bounded(500, 0)  # steps between validations (and the last); 0 = at the end
    eval_batches: int = bounded(0, 0)  # batches of batch_size windows; 0 = the whole split
    cosine_every: int = bounded(100, 0)  # steps between EP/BP cosines (and the last); 0 = never
    checkpoint_every: int = bounded(100, 0)  # steps (RunConfig's field, another default)

    def __post_init__(self):
        if self.d_model % self.n_heads:
            raise ConfigError(f"EPConfig.d_model={self.d_model} is not divisible by "
                              f"n_heads={self.n_heads}; each head gets d_model / n_heads "
                              "channels")
        # Resolved once, where the config is built (`lab run` and its kernel share a working
        # directory): a run started elsewhere then differs visibly in its config instead of
        # silently reading another file of the same name.
        object.__setattr__(self, "text_path", absolute(self.text_path))
        _check_beta(self)
        if self.warmup_steps > self.steps:
            raise ConfigError(f"EPConfig.warmup_steps={self.warmup_steps} exceeds "
                              f"steps={self.steps}: the learning rate would still be warming up "
                              "when the run ends; use warmup_steps <= steps")

    def weight_floor(self) -> int:
        """At most the model's weight count: its blocks' matrices and the positions."""
        return self.n_layers * (4 + 2 * self.mlp_ratio) * self.d_model ** 2 \
            + self.seq_len * self.d_model

    def _check_model_fits(self) -> None:
        """ConfigError if the model and its twin cannot fit in memory (a huge d_model would
        die in torch's allocator after the kernel started). A lower bound: the blocks'
        weights (4 + 2 mlp_ratio) d_model^2 per layer and the positions, for both models
        with their gradients; one step's free and nudged states, one layer's attention
        scores and MLP hidden units; the vocabulary and the optimizer's moments left out."""
        from ..device import check_fits

        B, T, D, L = self.batch_size, self.seq_len, self.d_model, self.n_layers
        elements = 4 * self.weight_floor() + 2 * B * T * D * L + B * self.n_heads * T * T \
            + B * T * D * self.mlp_ratio
        check_fits("EPConfig", elements * np.finfo(self.dtype).bits // 8,
                   f"a transformer of n_layers={L}, d_model={D}, mlp_ratio={self.mlp_ratio} "
                   f"and its backprop twin, with one step of batch_size={B} windows of "
                   f"seq_len={T}, in {self.dtype},",
                   "give a smaller model, batch_size or seq_len")

    def preflight(self) -> None:
        """What the text decides, before a run starts (``lab run``, a sweep's pre-check,
        ``train_ep``): readable UTF-8, long enough for ``seq_len`` in both splits; and a
        device this machine has."""
        from ..data.text import TextError, load_corpus
        from ..device import check_threads, resolve_device

        resolve_device(self.device)
        check_threads(self.threads)
        self._check_model_fits()
        # Here, not at construction: see CfCAuxConfig.preflight.
        if self.text_path and not Path(self.text_path).is_file():
            raise ConfigError(f"EPConfig.text_path={self.text_path!r} does not exist or is not "
                              "a file; expected a UTF-8 text file, or '' for the bundled corpus")
        try:
            load_corpus(self.text_path, seq_len=self.seq_len, val_fraction=VAL_FRACTION)
        except (TextError, OSError) as err:
            raise ConfigError(f"EPConfig: {err}") from None


def _check_beta(config: EPConfig) -> None:
    """beta (and a cosine schedule's end value) large enough to move the states at all."""
    # The top force is about beta per element on states of order 1: below the dtype's machine
    # epsilon the nudge is lost to rounding (drift 0; only the read-out learns), and far below
    # it E / (n beta) turns into NaN. The governor cannot catch that: zero drift looks clean.
    eps = float(np.finfo(config.dtype).eps)  # (numpy's and torch's agree)
    names = ("beta", "beta_final") if config.beta_schedule == "cosine" else ("beta",)
    # Far above the dtype's range the nudged phase overflows at its first step.
    check_in_dtype(config, names, config.dtype, by="nudged phase")
    for name in names:
        value = getattr(config, name)
        if value < eps:
            raise ConfigError(f"EPConfig.{name}={value!r} is too small for "
                              f"dtype={config.dtype!r}: below its machine epsilon ({eps:.4g}) "
                              "the nudge is lost to rounding and EP computes no gradient; "
                              f"allowed: {name} >= {eps:.4g}")
    # The schedule anneals: beta's error is O(beta) (see lab.train.ep), so it starts at the
    # exploratory value and ends at the less biased beta_final; ending higher makes no sense.
    if config.beta_schedule == "cosine" and config.beta_final > config.beta:
        raise ConfigError(f"EPConfig.beta_final={config.beta_final!r} > beta={config.beta!r}: "
                          "beta_schedule='cosine' anneals beta down to beta_final (a smaller "
                          "beta is a less biased estimate); use beta_final <= beta, or "
                          "beta_schedule='constant'")


# ---------------------------------------------------------------------------
# CfC with an auxiliary path (lab.train.cfc_aux)

AUX_MODES = ("lift", "never", "none")
# lab.models.cfc's MODES and ACTIVATIONS, written out so the config needs no torch
# (tests/test_fast_refusal.py holds them equal)
CFC_MODES = ("default", "no_gate", "pure")
CFC_ACTIVATIONS = ("lecun_tanh", "tanh", "relu", "silu", "gelu")
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
    mode: str = choice("default", CFC_MODES)
    activation: str = choice("lecun_tanh", CFC_ACTIVATIONS)
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
        """ConfigError if the two trunks cannot fit in memory (a huge units would die in
        torch's allocator after the kernel started). A lower bound, float32: the encoder,
        each trunk's backbone (its input and state in, backbone_units out) and one head per
        state unit, with their gradients; one step's encoded sequence, states and backbone
        outputs kept for backward; the Adam moments left out."""
        from ..device import check_fits

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
        from ..device import check_threads, resolve_device

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


def make_loader(config: CfCAuxConfig, prices, name: str):
    """The loader of the configured source (a ``lab.data.prices.MultiHorizonLoader``, or
    its ``MarketLoader`` for ``arch``); for ``arch`` a split with fewer examples than one
    batch is refused (a daily study has days to spare; fewer means a wrong fraction)."""
    from ..data.prices import MarketLoader, MultiHorizonLoader

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
    from ..data.prices import csv_prices, synthetic_prices, vega_prices

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
