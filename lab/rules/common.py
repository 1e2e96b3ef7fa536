"""Pieces shared by the learning rules: seeds, feedback scales, population taps.

Two ways a rule produces its teaching signals, both through the model's
``tap`` hook (see ``lab.models.resnet``):

- *Recording*: autograd runs end to end (backprop and the FA family, whose
  layers transport feedback tensors); a hook on each population stores the
  gradient arriving there.
- *Local segments*: the tap cuts the graph at every population, so the
  backward pass from a population reaches only the layer (and its norm) that
  produced it; the rule then injects its own signal at each population
  (DFA's projected error, node perturbation's estimate) and autograd computes
  the local weight correlation through the true local derivative.
"""

from __future__ import annotations

import contextlib
import inspect

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import ConfigError
from ..models.layers import local_layers

MODEL_CONTRACT = ("forward(x, tap=None) that calls h = tap(i, h) on each hidden population "
                  "in forward order, with its Conv/Linear layers from lab.models.layers (torch's "
                  "own have no feedback slot; see lab.models.mlp.MLP)")


def derive_seed(seed: int, *tags: int | str) -> int:
    """An independent 63-bit seed for (run seed, purpose): one run seed fixes everything."""
    words = [seed] + [t if isinstance(t, int) else int.from_bytes(t.encode(), "little")
                      for t in tags]
    return int(np.random.SeedSequence(words).generate_state(1, dtype=np.uint64)[0] >> 1)


def initial_scale(weight: torch.Tensor) -> float:
    """The root-mean-square entry of a forward weight: its scale, whatever its initialiser.

    Feedback tensors are drawn at this scale (times ``feedback_scale``) rather
    than at a textbook std such as Kaiming's sqrt(2 / fan_in): the lab layers
    use different initialisers (Kaiming fan-out for convolutions, torch's
    uniform default for Linear), and a fan-in std made ||B|| / ||W|| about 4
    at a 1-channel stem and 2.45 at the read-out. Matching each layer's own
    weight gives ||B|| / ||W|| = ``feedback_scale`` in expectation, so at
    initialisation a feedback rule transports signals of backprop's magnitude.
    """
    return float(weight.detach().double().pow(2).mean().sqrt())


def feedback_layer_names(model) -> list[str]:
    """Names of the Conv/Linear layers whose input gradient a rule must carry.

    The first layer in forward order reads the data, which needs no gradient:
    nothing below it learns. It gets no feedback tensor, no feedback tracking
    and no bill for an input-gradient pass.
    """
    return [name for name, _ in local_layers(model)[1:]]


@contextlib.contextmanager
def parameters_frozen(model):
    """The model's parameters out of autograd inside: for a pass that wants only the
    gradients at its populations (a calibration's teaching signals). With them in,
    every layer's backward also forms its weight-gradient product, which the pass
    throws away: work done and not billed (DESIGN: a product computed and thrown away
    is a defect to fix, not a cost to bill). A population the pass differentiates must
    then require grad itself (its tap returns ``h.detach().requires_grad_()`` where the
    layers below it carry no parameter that does)."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


@contextlib.contextmanager
def full_fp32():
    """Convolutions and matmuls in full float32 inside (no TF32 on Ampere+ GPUs).

    cuDNN's default TF32 convolutions keep a 10-bit mantissa; a finite
    difference of losses at a small probe (node perturbation, sigma = 1e-3)
    then has a relative error near 30%. No effect on the CPU.
    """
    conv, matmul = torch.backends.cudnn.conv, torch.backends.cuda.matmul
    saved = conv.fp32_precision, matmul.fp32_precision
    conv.fp32_precision = matmul.fp32_precision = "ieee"
    try:
        yield
    finally:
        conv.fp32_precision, matmul.fp32_precision = saved


class Recorder:
    """A tap that stores d(sum loss)/dh at every population during backward."""

    def __init__(self, batch: int):
        self.batch = batch
        self.grads: dict[int, torch.Tensor] = {}

    def __call__(self, index: int, h: torch.Tensor) -> torch.Tensor:
        if h.requires_grad:
            h.register_hook(lambda g, i=index: self.grads.__setitem__(i, g.detach() * self.batch))
        return h

    def teaching(self) -> list[torch.Tensor]:
        return [self.grads[i] for i in sorted(self.grads)]


class Segments:
    """A tap that cuts the graph at each population, keeping both sides.

    ``outputs[i]`` is the population as its own layer computed it (its graph
    reaches back only to the previous cut); the next layer reads a plain
    detached copy. No gradient crosses between segments, and none is computed
    for the copy either: a copy that required grad would make every layer
    compute an input-gradient convolution nobody reads (about one extra
    reverse pass of wall time).
    """

    def __init__(self):
        self.outputs: list[torch.Tensor] = []

    def __call__(self, index: int, h: torch.Tensor) -> torch.Tensor:
        self.outputs.append(h)
        return h.detach()

    def inject(self, signals: list[torch.Tensor], batch: int) -> None:
        """Backward each population's signal (d sum-loss/dh) into its own segment."""
        pairs = [(h, s / batch) for h, s in zip(self.outputs, signals) if h.requires_grad]
        if pairs:
            torch.autograd.backward([h for h, _ in pairs], [s for _, s in pairs])


def check_model(model, rule: str) -> None:
    """A model a rule can train: an nn.Module whose forward takes the ``tap`` hook.

    A plain ``nn.Sequential`` was accepted and failed inside torch at the first step
    ("forward() got an unexpected keyword argument 'tap'")."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"rule {rule!r}: model must be a torch nn.Module with "
                        f"{MODEL_CONTRACT}; got {type(model).__name__}")
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):  # no signature to read: let the first call say
        return
    if not any(p.name == "tap" or p.kind is p.VAR_KEYWORD for p in params):
        raise ValueError(f"rule {rule!r} cannot train {type(model).__name__}: its forward"
                         f"{inspect.signature(model.forward)} takes no tap; the rules need "
                         f"{MODEL_CONTRACT}")


def check_no_feedback(model, rule: str) -> None:
    """ConfigError if a layer still holds another rule's feedback tensor: ``rule`` would
    transport through it (bp would silently be that rule, and a second feedback rule
    would replace the first one's tensors while the first still reported its own)."""
    held = [n for n, m in local_layers(model) if getattr(m, "feedback", None) is not None]
    if held:
        raise ConfigError(f"rule {rule!r}: the model's layers {', '.join(held[:3])}"
                          f"{' ...' if len(held) > 3 else ''} hold another rule's feedback "
                          "tensors (a model trains under one rule at a time); call that "
                          "rule's detach() first, or give this rule a fresh model")


@contextlib.contextmanager
def forward_order(model):
    """Yields the list, filled during the block, of the Conv/Linear layers' names in the
    order forward first calls them."""
    order: list[str] = []

    def seen(name):
        if name not in order:
            order.append(name)

    hooks = [m.register_forward_pre_hook(lambda mod, args, n=name: seen(n))
             for name, m in local_layers(model)]
    try:
        yield order
    finally:
        for hook in hooks:
            hook.remove()


def check_first_layer(model, order: list[str], rule: str) -> None:
    """The first registered Conv/Linear must be the first forward calls: the rules take it
    as the layer that reads the data and give it no feedback tensor. A model whose read-out
    was registered first got exact backprop below it from fa and kp, silently."""
    first = local_layers(model)[0][0]
    if order and order[0] != first:
        raise ValueError(f"rule {rule!r}: {type(model).__name__}.forward calls layer "
                         f"{order[0]!r} first, but {first!r} is registered first; the rules "
                         "take the first registered Conv/Linear as the layer that reads the "
                         f"data (it carries no feedback), so {first!r} would pass backprop's "
                         "exact error to the layers below it. Define the layers in __init__ "
                         "in the order forward uses them")


def check_targets(y: torch.Tensor, logits: torch.Tensor) -> None:
    """Class indices, one per example: every rule's loss is the batch-mean cross-entropy.
    Float targets (a regression's) were read as soft labels by some rules and failed
    deep inside others."""
    if not isinstance(y, torch.Tensor) or y.dtype != torch.int64 \
            or tuple(y.shape) != tuple(logits.shape[:1]):
        got = (f"{y.dtype} of shape {tuple(y.shape)}" if isinstance(y, torch.Tensor)
               else type(y).__name__)
        raise ValueError(f"targets y must be class indices: an int64 tensor of shape "
                         f"({logits.shape[0]},), one per example; got {got}. The rules' loss "
                         "is the batch-mean cross-entropy of the logits (float targets, MSE "
                         "or soft labels are not supported)")


def output_error(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """e = softmax(logits) - onehot(y): d(sum cross-entropy)/d logits. (B, K)"""
    check_targets(y, logits)
    return torch.softmax(logits, dim=1) - F.one_hot(y, logits.shape[1]).to(logits.dtype)


def backprop_reference(model, x, y):
    """Autograd's d(sum loss)/dh per population and weight gradients, feedback slots off.

    Writes ``.grad`` and clears the feedback slots: the caller restores both.
    """
    layers = local_layers(model)
    for _, m in layers:
        m.feedback = None
    for p in model.parameters():
        p.grad = None
    recorder = Recorder(len(y))
    F.cross_entropy(model(x, tap=recorder), y).backward()
    return recorder.teaching(), {name: m.weight.grad.detach().clone() for name, m in layers}


def cosine_per_example(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over examples of cos(a_i, b_i), over the examples where both are non-zero.

    A confidently classified example can have an exactly zero gradient (the
    float32 softmax saturates); its cosine is undefined, not zero, so it is left
    out rather than turned into a NaN or a fake 0. NaN only if no example is left.
    """
    a, b = a.flatten(1).double(), b.flatten(1).double()  # (B, units)
    norms = a.norm(dim=1) * b.norm(dim=1)
    keep = norms > 0
    if not keep.any():
        return float("nan")
    return float(((a * b).sum(1)[keep] / norms[keep]).mean())
