"""Train the CIFAR-style ResNet with any registered learning rule.

Only the maths of a conv run lives here: build (data, model, rule, optimizer,
schedule), one epoch, evaluation. The rule writes ``.grad`` (see
``lab.rules.base``), a stock optimizer steps, a per-step LR schedule follows
(one-cycle by default: Smith & Topin 2019, "Super-convergence"). Resume,
checkpoints, the row store, divergence and the record come from the shared
run lifecycle (``lab.lifecycle``).

Per epoch a row holds training loss/accuracy, validation loss/accuracy, the
learning rate, the rule's own diagnostics under ``rule`` and, every
``alignment_every`` epochs and at the last, the alignment with backprop (validation
too is at its cadence and the last epoch); the test split is
evaluated exactly once, after the last epoch.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..config import ConfigError
from ..data import load_dataset
from ..data.augment import augment
from ..data.batches import iterate_batches
from ..device import configure_process, keeps_threads, resolve_device, seeded, sync
from ..diagnostics.alignment import alignment
from ..diagnostics.work import bill
from ..experiment import Divergence, Expectation, Experiment
from ..lifecycle import train
from ..models import ResNet
from ..rules import make_rule, rule_class
from ..rules.base import check_step_result
from .common import DTYPES
from .configs import ONECYCLE_MIN_STEPS, ConvConfig


def _evaluate(model, split, batch_size) -> tuple[float, float]:
    """(mean loss, accuracy) in eval mode, with no gradient and no BN update."""
    if len(split.y) == 0:
        return math.nan, math.nan
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=split.x.device)
    correct = torch.zeros((), dtype=torch.int64, device=split.x.device)
    with torch.no_grad():
        for x, y in iterate_batches(split, batch_size, shuffle=False, generator=None):
            logits = model(x)
            loss_sum += F.cross_entropy(logits, y, reduction="sum").double()
            correct += (logits.argmax(1) == y).sum()
    n = len(split.y)
    return float(loss_sum) / n, int(correct) / n


def onecycle_warmup(config: ConvConfig, total_steps: int) -> float:
    """The warm-up fraction one-cycle uses: ``warmup_fraction``, moved inside
    [1.5, total - 1.5] steps where a short run needs it (torch needs at least one step in
    each phase of the cycle); :func:`build_run` warns when it moves, the bill records it."""
    return min(max(config.warmup_fraction, 1.5 / total_steps), 1 - 1.5 / total_steps)


def _scheduler(config: ConvConfig, optimizer, total_steps: int):
    if config.schedule == "onecycle":
        if total_steps < ONECYCLE_MIN_STEPS:  # preflight refuses it; a direct call too
            raise ConfigError(f"ConvConfig.schedule='onecycle' needs at least "
                              f"{ONECYCLE_MIN_STEPS} optimizer steps; this run has "
                              f"{total_steps}")
        return torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=config.lr, total_steps=total_steps,
            pct_start=onecycle_warmup(config, total_steps),
            cycle_momentum=config.optimizer == "sgd")
    if config.schedule == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)


def _optimizer(config: ConvConfig, params):
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum,
                               nesterov=config.nesterov and config.momentum > 0,
                               weight_decay=config.weight_decay)
    # Decoupled decay (Loshchilov & Hutter 2019): an L2 term inside Adam's moments
    # would give W and a Kolen-Pollack B different effective decays.
    return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)


@dataclass
class Run:
    """The live objects of a conv run (what a notebook may want to inspect)."""

    config: ConvConfig
    device: torch.device
    data: object
    model: ResNet
    rule: object
    optimizer: torch.optim.Optimizer
    scheduler: object
    generator: torch.Generator  # data order and augmentation
    steps_per_epoch: int


def build_run(config: ConvConfig) -> Run:
    """Data, model, rule, optimizer and schedule, all fixed by ``config.seed``."""
    device = resolve_device(config.device)
    configure_process(config.threads)
    data = load_dataset(config.dataset, data_dir=config.data_dir or None,
                        val_fraction=config.val_fraction, split_seed=config.seed,
                        n_train=config.n_train)
    dtype = DTYPES[config.dtype]
    data = dataclasses.replace(data, **{
        name: type(split)(split.x.to(device, dtype), split.y.to(device))
        for name in ("train", "val", "test") for split in [getattr(data, name)]
    })
    with seeded(config.seed):
        model = ResNet(config.depth, config.width, dims=data.dims,
                       in_channels=data.in_channels, n_classes=data.n_classes,
                       normalization=config.normalization,
                       residual_scale=config.residual_scale, dtype=dtype).to(device)
    rule = make_rule(config.rule, model, config.rule_params, seed=config.seed)
    groups = [{"params": list(model.parameters()) + list(rule.parameters())}]
    optimizer = _optimizer(config, groups + list(rule.param_groups()))
    n_train = len(data.train.y)
    steps_per_epoch = math.ceil(n_train / config.batch_size)
    total = config.epochs * steps_per_epoch
    scheduler = _scheduler(config, optimizer, total)
    if config.schedule == "onecycle" and onecycle_warmup(config, total) != config.warmup_fraction:
        warnings.warn(f"ConvConfig.warmup_fraction={config.warmup_fraction:g} of this run's "
                      f"{total} optimizer steps leaves a phase of the one-cycle schedule under "
                      f"1.5 steps; the warm-up used is {onecycle_warmup(config, total):.4g} "
                      "(recorded as work.warmup_fraction_used). Give the run more steps "
                      "(epochs, n_train, smaller batch_size) for the schedule as configured",
                      stacklevel=2)
    generator = torch.Generator().manual_seed(config.seed)
    return Run(config, device, data, model, rule, optimizer, scheduler, generator,
               steps_per_epoch)


def _train_epoch(run: Run, epoch: int, kind: str, life) -> dict:
    model, cfg = run.model, run.config
    model.train()
    device = run.device
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    correct = torch.zeros((), dtype=torch.int64, device=device)
    batches = iterate_batches(run.data.train, cfg.batch_size, shuffle=True,
                              generator=run.generator)
    for i, (x, y) in enumerate(batches):
        x = augment(x, kind, run.generator)
        run.optimizer.zero_grad(set_to_none=True)
        out = check_step_result(run.rule, run.rule.compute_gradients(
            x, y, epoch * run.steps_per_epoch + i))
        if epoch == 0 and i == 0:
            life.baseline(float(out.loss))  # before any update: the divergence scale
        if cfg.grad_clip:
            run.rule.clip_gradients(cfg.grad_clip)
        lr = run.optimizer.param_groups[0]["lr"]  # the rate this step uses
        run.optimizer.step()
        run.scheduler.step()
        # Accumulate on the device: no host sync per step.
        loss_sum += out.loss.double() * len(y)
        correct += (out.logits.argmax(1) == y).sum()
    n = len(run.data.train.y)
    # lr: the rate the epoch's last step used (as EP's rows record the rate of their
    # step), not the scheduler's next value, which after the last step lies past the end.
    return {"train_loss": float(loss_sum) / n, "train_acc": int(correct) / n, "lr": lr}


def parts(run: Run) -> dict:
    """What a checkpoint restores: every object whose state the next epoch reads."""
    return {"model": run.model, "rule": run.rule, "optimizer": run.optimizer,
            "scheduler": run.scheduler, "generator": run.generator}


def expectation(config: ConvConfig) -> Expectation:
    """A complete conv run: one row per epoch, evaluations and alignment on their cadence."""
    periodic = []
    if config.eval_every:
        periodic += [(name, config.eval_every, config.eval_every - 1)
                     for name in ("val_loss", "val_acc")]
    if config.alignment_every:
        periodic.append(("alignment/", config.alignment_every, config.alignment_every - 1))
    return Expectation(
        axis="epoch", count=config.epochs,
        metrics=("train_loss", "train_acc", "lr")
        # A rule names the diagnostics it records every epoch (``Rule.row_metrics``).
        + tuple(f"rule/{name}" for name in getattr(rule_class(config.rule), "row_metrics", ())),
        periodic=tuple(periodic), final=("test_loss", "test_acc"),
        # A cosine at a silent layer or population is 0/0: NaN, the run's result
        # (lab.diagnostics.alignment), which a completeness check must not call a gap.
        undefined=("alignment/",) if config.alignment_every else ())


def _epoch(run: Run, epoch: int, kind: str, life) -> dict:
    config = run.config
    start = time.perf_counter()
    row = {**_train_epoch(run, epoch, kind, life), "val_loss": None, "val_acc": None}
    finite = math.isfinite(row["train_loss"])
    # On the cadence, and at the last epoch too (when the cadence does not divide the
    # epochs), so the final record always holds the trained network's val and alignment.
    last = epoch + 1 == config.epochs
    if finite and config.eval_every and ((epoch + 1) % config.eval_every == 0 or last):
        row["val_loss"], row["val_acc"] = _evaluate(run.model, run.data.val,
                                                    config.eval_batch_size)
    row["rule"] = run.rule.epoch_metrics()
    row["alignment"] = None
    if finite and config.alignment_every and ((epoch + 1) % config.alignment_every == 0
                                              or last):
        probe = run.data.train
        n = min(config.alignment_batch, len(probe.y))
        row["alignment"] = alignment(run.model, run.rule, probe.x[:n], probe.y[:n])
    sync(run.device)
    row["epoch_wall_s"] = time.perf_counter() - start
    return row


def _final(run: Run, rows: list[dict], diverged: bool) -> tuple[dict, dict]:
    """The test split, evaluated once after the last epoch, and the run's bill."""
    config, final = run.config, {}
    if not diverged:
        test_loss, test_acc = _evaluate(run.model, run.data.test, config.eval_batch_size)
        last = rows[-1]
        final = {"test_loss": test_loss, "test_acc": test_acc,
                 "train_loss": last["train_loss"], "train_acc": last["train_acc"],
                 "val_acc": last.get("val_acc")}
        probe = run.data.train
        n = min(config.alignment_batch, len(probe.y))
        diagnostics = run.rule.final_metrics(probe.x[:n], probe.y[:n])
        if diagnostics:
            final["rule"] = diagnostics
    examples = len(rows) * len(run.data.train.y)
    work = {**bill(run.rule, run.model, run.data.train.x.shape[1:], examples),
            "optimizer_steps": len(rows) * run.steps_per_epoch}
    if config.schedule == "onecycle":  # what the schedule used, when a short run moved it
        work["warmup_fraction_used"] = onecycle_warmup(config, config.epochs * run.steps_per_epoch)
    return final, work


# ---------------------------------------------------------------------------
# the experiment, as lab.lifecycle.train drives it


class Conv(Experiment):
    """A conv run: one row per epoch."""

    kind, config_class = ConvConfig.KIND, ConvConfig

    def build(self, config: ConvConfig) -> Run:
        return build_run(config)

    def parts(self, run: Run) -> dict:
        return parts(run)

    def expectation(self, config: ConvConfig) -> Expectation:
        return expectation(config)

    def divergence(self, config: ConvConfig) -> Divergence:
        return Divergence(factor=config.diverge_factor)

    def data_identity(self, run: Run) -> dict:
        return run.data.identity

    def describe(self, config: ConvConfig) -> str:
        return f"{config.rule} seed {config.seed}"

    def prepare(self, run: Run, life) -> None:
        run.rule.prepare(run.data.train.x, run.data.train.y)

    def step(self, run: Run, epoch: int, life) -> dict:
        kind = run.config.augment
        return _epoch(run, epoch, kind if kind != "auto" else run.data.augment, life)

    def postfix(self, row: dict) -> dict:
        return {"loss": f"{row['train_loss']:.3f}", "val_acc": row["val_acc"]}

    def finish(self, run: Run, rows: list[dict], diverged: bool) -> tuple[dict, dict]:
        return _final(run, rows, diverged)


EXPERIMENT = Conv()


@keeps_threads
def train_conv(config: ConvConfig, out_dir: str | Path | None = None, *,
               run_id: str | None = None) -> dict:
    """Train per ``config``; returns the run record with its rows under ``trajectory``.

    With ``out_dir`` the run is recorded there, and a checkpoint left by an
    interrupted run of the same config is picked up where it stopped.
    """
    return train(EXPERIMENT, config, out_dir, run_id=run_id)
