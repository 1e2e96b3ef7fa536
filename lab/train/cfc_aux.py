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

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..data.identity import read_unchanged
from ..data.markets import arch_identity
from ..data.prices import MultiHorizonLoader, vega_identity
from ..device import configure_process, keeps_threads, resolve_device, seeded, sync
from ..experiment import Divergence, Expectation, Experiment
from ..lifecycle import train
from ..models.cfc import CfC
from ..rules.aux_lift import AuxHealth, AuxJoin
from .configs import CfCAuxConfig, load_prices, make_loader


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
