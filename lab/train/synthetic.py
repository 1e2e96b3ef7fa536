"""A trainer with no learning maths: it exercises the shared run lifecycle alone.

Noisy gradient descent on a quadratic, ``w <- w - lr * (w + noise)``, logged
per step with ``n_metrics`` derived values. It is deterministic (one seed
fixes the noise), checkpoints a model-like part and a generator, and can be
told to blow up at a given step, so tests and ``benchmarks/bench_records.py``
can check resume, kills, row stores and divergence in milliseconds per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import bounded, choice, configclass
from ..experiment import Divergence, Expectation, Experiment
from ..lifecycle import train


@configclass
class SyntheticConfig:
    steps: int = bounded(100, 1)
    stride: int = bounded(1, 1)  # a row every ``stride`` optimisation steps
    n_metrics: int = bounded(10, 1)
    dim: int = bounded(8, 1)
    lr: float = bounded(0.05, 0.0, lo_open=True)
    eval_every: int = bounded(0, 0)  # rows between "val_loss" entries; 0 = never
    blow_up_at: int = bounded(-1, -1)  # row at which the loss becomes ``blow_up_value``
    blow_up_value: float = math.inf
    blow_up_key: str = choice("train_loss", ("train_loss", "val_loss"))
    checkpoint_every: int = bounded(10, 0)
    seed: int = bounded(0, 0)
    progress: bool = False


class _Weights:
    """A part with a state dict, as a model would be."""

    def __init__(self, dim: int, generator: torch.Generator):
        self.w = torch.randn(dim, generator=generator, dtype=torch.float64)

    def state_dict(self) -> dict:
        return {"w": self.w.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.w = state["w"].clone()


def _loss(weights: _Weights) -> float:
    return 0.5 * float(weights.w.square().sum())


def expectation(config: SyntheticConfig) -> Expectation:
    periodic = (("val_loss", config.eval_every * config.stride, 0),) if config.eval_every else ()
    return Expectation(axis="step", count=config.steps, stride=config.stride,
                       metrics=("train_loss", "m/"), periodic=periodic, final=("final_loss",))


def _row(config: SyntheticConfig, weights: _Weights, generator: torch.Generator,
         position: int) -> dict:
    for _ in range(config.stride):
        noise = torch.randn(config.dim, generator=generator, dtype=torch.float64)
        weights.w -= config.lr * (weights.w + 0.1 * noise)
    loss = _loss(weights)
    row = {"train_loss": loss,
           "m": {f"{i}": loss * (i + 1) for i in range(config.n_metrics - 1)}}
    if config.eval_every and position % config.eval_every == 0:
        row["val_loss"] = 1.1 * loss
    if position == config.blow_up_at:
        row[config.blow_up_key] = config.blow_up_value
    return row


@dataclass
class _Run:
    config: SyntheticConfig
    weights: _Weights
    generator: torch.Generator


@dataclass
class Synthetic(Experiment):
    """The synthetic run: it checks no config or directory, and names no device or data."""

    divergence_policy: Divergence = field(default_factory=Divergence)
    kind = "synthetic"

    def build(self, config: SyntheticConfig) -> _Run:
        generator = torch.Generator().manual_seed(config.seed)
        return _Run(config, _Weights(config.dim, generator), generator)

    def parts(self, run: _Run) -> dict:
        return {"weights": run.weights, "generator": run.generator}

    def expectation(self, config: SyntheticConfig) -> Expectation:
        return expectation(config)

    def divergence(self, config: SyntheticConfig) -> Divergence:
        return self.divergence_policy

    def device(self, run: _Run) -> None:
        return None

    def prepare(self, run: _Run, life) -> None:
        life.baseline(_loss(run.weights))

    def step(self, run: _Run, position: int, life) -> dict:
        return _row(run.config, run.weights, run.generator, position)

    def finish(self, run: _Run, rows: list[dict], diverged: bool) -> tuple[dict, None]:
        return {"final_loss": _loss(run.weights)}, None


def train_synthetic(config: SyntheticConfig, out_dir: str | Path | None = None, *,
                    run_id: str | None = None, divergence: Divergence | None = None) -> dict:
    return train(Synthetic(divergence or Divergence()), config, out_dir, run_id=run_id)
