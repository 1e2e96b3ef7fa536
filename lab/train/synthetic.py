"""A trainer with no learning maths: it exercises the shared run lifecycle alone.

Noisy gradient descent on a quadratic, ``w <- w - lr * (w + noise)``, logged
per step with ``n_metrics`` derived values. It is deterministic (one seed
fixes the noise), checkpoints a model-like part and a generator, and can be
told to blow up at a given step, so tests and ``benchmarks/bench_records.py``
can check resume, kills, row stores and divergence in milliseconds per step.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..config import bounded, choice, configclass
from ..lifecycle import Divergence, Expectation, Lifecycle


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


def expectation(config: SyntheticConfig) -> Expectation:
    periodic = (("val_loss", config.eval_every * config.stride, 0),) if config.eval_every else ()
    return Expectation(axis="step", count=config.steps, stride=config.stride,
                       metrics=("train_loss", "m/"), periodic=periodic, final=("final_loss",))


def _row(config: SyntheticConfig, weights: _Weights, generator: torch.Generator,
         position: int) -> dict:
    for _ in range(config.stride):
        noise = torch.randn(config.dim, generator=generator, dtype=torch.float64)
        weights.w -= config.lr * (weights.w + 0.1 * noise)
    loss = 0.5 * float(weights.w.square().sum())
    row = {"train_loss": loss,
           "m": {f"{i}": loss * (i + 1) for i in range(config.n_metrics - 1)}}
    if config.eval_every and position % config.eval_every == 0:
        row["val_loss"] = 1.1 * loss
    if position == config.blow_up_at:
        row[config.blow_up_key] = config.blow_up_value
    return row


def train_synthetic(config: SyntheticConfig, out_dir: str | Path | None = None, *,
                    run_id: str | None = None, divergence: Divergence | None = None) -> dict:
    generator = torch.Generator().manual_seed(config.seed)
    weights = _Weights(config.dim, generator)
    life = Lifecycle(kind="synthetic", config=config, expect=expectation(config),
                     parts={"weights": weights, "generator": generator}, out_dir=out_dir,
                     run_id=run_id, checkpoint_every=config.checkpoint_every,
                     divergence=divergence or Divergence(), progress=config.progress)
    with life:
        if life.start() == 0:
            life.baseline(0.5 * float(weights.w.square().sum()))
        if life.finished:
            return life.result()
        for position in life.rows():
            if not life.log(_row(config, weights, generator, position)):
                break
        return life.finish({"final_loss": 0.5 * float(weights.w.square().sum())})
