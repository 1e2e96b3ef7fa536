"""Kolen-Pollack with a mixed apical compartment (``kp_traffic``; DESIGN section 5, MT-1).

This rule asks what soma-coupled traffic in the apical compartment (``apical.py``:
T = g C h, the raw / innovation / matched signals, the per-unit predictor, in the
seed's descent convention with ``traffic_sign``) does to Kolen-Pollack learning
(Akrout et al. 2019), and whether the local predictor can remove it. At every
population h the instruction I is KP's (d loss / dh through the feedback tensors
B); ``traffic_rule`` picks the signal U that drives plasticity: the weight
correlation of the layer that produced h, its norm's parameters, and (KP) the
feedback update, so W and B still receive equal updates. ``none`` is the clean
reference of the MT-1 study: the traffic is formed, calibrated, predicted and
logged as for the others, but plasticity takes the instruction.

Transport is clean: the backward pass carries I, unchanged, to the lower
populations; U enters only the local plasticity, at no extra multiply-accumulates
or memory passes. At each population the rule takes over the backward step from h
to the output o of the layer that made it (a ``torch.autograd.Function`` standing
in for h on the tap): one fused kernel (``numba_kernels.mixed_local``) reads I, h
and o twice, as autograd's ReLU, residual-scale and batch-norm backward would for
I alone, and writes the instruction's gradient at o (passed on through B, and to
the shortcut as the ReLU's masked I) together with the used signal's (the layer's
weight-gradient product, computed once from it, and the norm's parameter
gradients). With no traffic U = I and the updates are clean KP's to rounding.

The predictor learns only from instruction-off observations (h, T):
``predictor_warmup_steps`` forward passes before training (batches drawn by the
rule's own generator, so the training data order is untouched; BN running
statistics untouched), then every ``predictor_every`` steps.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import SEED_MAX, ConfigError, bounded, choice, configclass, validate
from ..models.resnet import ResNet
from ..models.state import preserved_norm_stats
from .apical import (
    PREDICTORS,
    SIGNALS,
    TRAFFIC_MODELS,
    TRAFFIC_RATIO_MAX,
    TRAFFIC_RULES,
    TRAFFIC_SIGNS,
    Apical,
    check_calibrated,
)
from .base import StepResult, check_example_needs
from .common import backprop_reference, cosine_per_example, derive_seed, parameters_frozen
from .feedback import KolenPollack
from .registry import register


@configclass
class TrafficParams:
    feedback_scale: float = bounded(1.0, 0.0, lo_open=True)  # ||B|| / ||W|| at initialisation
    feedback_seed: int = bounded(0, 0, SEED_MAX)
    traffic_rule: str = choice("innovation", TRAFFIC_RULES)
    traffic_ratio: float = bounded(4.0, 0.0, TRAFFIC_RATIO_MAX)
    traffic_seed: int = bounded(0, 0, SEED_MAX)
    traffic_calibration_examples: int = bounded(512, 1)
    predictor_lr: float = bounded(0.5, 0.0, 1.0, lo_open=True)  # eta_P of the NLMS step
    # Steps between predictor updates. T = g C h is an exact per-unit linear map, so
    # the warm-up already finds it; later updates only follow numerical drift.
    predictor_every: int = bounded(10, 1)
    predictor_warmup_steps: int = bounded(100, 0)
    predictor_batch: int = bounded(128, 1)  # examples per warm-up pass
    # hebbian: the traffic is added to the descent direction (the seed's); anti_hebbian:
    # to the gradient (what runs made before this parameter existed did).
    traffic_sign: str = choice("hebbian", TRAFFIC_SIGNS)
    # MT-2: what the traffic is (apical.TRAFFIC_MODELS) and what predicts it.
    traffic_model: str = choice("linear", TRAFFIC_MODELS)
    mixing: float = bounded(0.5, 0.0, 1.0)  # traffic_model=mixing: M's energy off the diagonal
    noise: float = bounded(0.0, 0.0)  # traffic_model=noisy: noise RMS / the traffic's
    predictor: str = choice("unit_affine", PREDICTORS)

    def __post_init__(self):
        validate(self)


@dataclass
class _Producer:
    """The layer that produced a population, and the element-wise path from its output."""

    conv: nn.Module
    norm: nn.Module  # BatchNorm or Identity
    scale: float  # residual scale on the norm's output (outer populations)
    block: nn.Module | None  # the block whose shortcut is added (outer populations)

    @property
    def batchnorm(self) -> nn.Module | None:
        """The norm when it is a BatchNorm (batch statistics to carry), else None."""
        return self.norm if isinstance(self.norm, nn.modules.batchnorm._BatchNorm) else None


def _producers(model: ResNet) -> list[_Producer]:
    out = [_Producer(model.stem, model.stem_norm, 1.0, None)]
    for block in model.blocks:
        out.append(_Producer(block.conv1, block.norm1, 1.0, None))
        out.append(_Producer(block.conv2, block.norm2, block.residual_scale, block))
    return out


@contextlib.contextmanager
def _keeping_stats(norm: nn.Module, stats: dict):
    """The norm's training-mode forward as ``nn.BatchNorm`` runs it, keeping the batch mean
    and inverse std it normalised with (the fused backward needs them)."""
    def forward(x):
        factor = 0.0 if norm.momentum is None else norm.momentum
        track = norm.track_running_stats  # off inside preserved_norm_stats
        if track and norm.num_batches_tracked is not None:
            norm.num_batches_tracked.add_(1)
            if norm.momentum is None:  # a cumulative moving average
                factor = 1.0 / float(norm.num_batches_tracked)
        out, mean, invstd = torch.native_batch_norm(
            x, norm.weight, norm.bias, norm.running_mean if track else None,
            norm.running_var if track else None, True, factor, norm.eps)
        stats[id(norm)] = (mean.detach(), invstd.detach())
        return out

    norm.forward = forward  # an instance attribute, over the class's method
    try:
        yield
    finally:
        del norm.forward


def _conv_weight_grad(conv, signal: torch.Tensor, x: torch.Tensor):
    """The weight (and bias) gradient of ``conv`` for output gradient ``signal``: one product."""
    has_bias = conv.bias is not None
    ones, zeros = [1] * conv.dims, [0] * conv.dims
    _, grad_w, grad_b = torch.ops.aten.convolution_backward(
        signal, x, conv.weight, [conv.out_channels] if has_bias else None, list(conv.stride),
        list(conv.padding), ones, False, zeros, 1, [False, True, has_bias])
    return grad_w, grad_b


class _Step:
    """What one pass records: layer inputs and outputs, norm statistics, populations."""

    def __init__(self):
        self.inputs: dict[int, torch.Tensor] = {}  # population -> its conv's input (detached)
        self.outputs: dict[int, torch.Tensor] = {}  # population -> its conv's output o
        self.stats: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(norm) -> mean, invstd
        self.h: dict[int, torch.Tensor] = {}  # population index -> h (detached)
        self.tapped: dict[int, torch.Tensor] = {}  # population -> what the tap handed on
        self.batch, self.logged = 0, False


class _PopulationStep(torch.autograd.Function):
    """Identity on h forward; backward, the population's local step (module docstring).

    Inputs: h (detached), the layer's output o (with its graph), the norm's gamma
    and beta, the block's shortcut tensor (outer populations), an empty anchor
    that requires grad (so the stem's step runs even with nothing else to
    differentiate), and the rule with what it needs. Autograd's own graph from o
    to h (norm, scale, add, ReLU) is left unused, so it is not run.
    """

    @staticmethod
    def forward(ctx, h, o, gamma, beta, shortcut, anchor, step):
        ctx.step = step
        return h.view_as(h)

    @staticmethod
    def backward(ctx, g):
        rule, index, rec, teaching = ctx.step
        ctx.step = None  # rec -> tapped output -> this node -> rec: break the cycle
        return (None, *rule._local_step(index, g.detach(), rec, teaching, ctx.needs_input_grad),
                None, None)


@register
class KolenPollackTraffic(KolenPollack):
    """KP + mixed apical traffic and its predictor; see the module docstring."""

    name = "kp_traffic"
    Params = TrafficParams
    row_metrics = ("feedback/mean_cos", "apical/rms_used/mean", "apical/rms_instruction/mean",
                   "apical/rms_raw/mean", "apical/rms_innovation/mean",
                   "apical/rms_traffic/mean")

    @staticmethod
    def example_needs(params) -> dict[str, int]:
        needs = {"traffic_calibration_examples": params.traffic_calibration_examples}
        if params.predictor_warmup_steps:
            needs["predictor_batch"] = params.predictor_batch
        return needs

    def __init__(self, model, params=None, *, seed=0):
        super().__init__(model, params, seed=seed)
        if not isinstance(model, ResNet):
            raise ConfigError(f"rule 'kp_traffic' needs a lab.models.ResNet (its populations "
                              f"are known by layer), got {type(model).__name__}")
        self.producers = _producers(model)
        self.apical = Apical(self.name, len(self.producers), self.params, seed, "traffic")
        self.predictor_generator = torch.Generator().manual_seed(
            derive_seed(seed, "predictor", self.params.traffic_seed))
        self.warmup = {"first_ratio": math.nan, "last_ratio": math.nan}
        self.calibration_examples = 0
        self.summed_steps = 0
        self.last_h: dict[int, torch.Tensor] = {}
        self._anchors: dict[torch.device, torch.Tensor] = {}  # see _PopulationStep

    # -- taps and hooks ----------------------------------------------------------------

    @contextlib.contextmanager
    def _recording(self, step: _Step):
        """Forward hooks saving what the local steps need; conv weights out of autograd.

        The conv weights and biases leave autograd for the pass, so the reverse
        pass computes their input gradients only (through B); each conv's weight
        gradient is computed once, from the used signal, in its population's
        local step. The norms' parameters receive the used signal's gradients
        from the local steps.
        """
        handles, frozen = [], []
        for index, p in enumerate(self.producers):
            def save(module, inputs, output, index=index):
                step.inputs[index] = inputs[0].detach()
                step.outputs[index] = output
            handles.append(p.conv.register_forward_hook(save))
            frozen += [t for t in (p.conv.weight, p.conv.bias)
                       if t is not None and t.requires_grad]
        for t in frozen:
            t.requires_grad_(False)
        try:
            with contextlib.ExitStack() as norms:
                for p in self.producers:
                    if p.batchnorm is not None:
                        norms.enter_context(_keeping_stats(p.norm, step.stats))
                yield
        finally:
            for t in frozen:
                t.requires_grad_(True)
            for handle in handles:
                handle.remove()

    # -- the step ---------------------------------------------------------------

    def compute_gradients(self, x, y, step, record=False):
        if step is not None:  # a training step (a diagnostic call may probe shapes first)
            check_calibrated(self, self.calibration_examples)
        if not self.model.training and any(p.batchnorm is not None for p in self.producers):
            raise RuntimeError(
                "kp_traffic: the model is in eval mode; its fused local step is the backward "
                "of batch normalisation with the batch's own statistics, which eval mode does "
                "not compute (it normalises with the running ones): call model.train() "
                "before compute_gradients")
        self.refresh()
        rec = _Step()
        teaching: dict[int, torch.Tensor] | None = {} if record else None
        batch = len(y)
        rec.batch, rec.logged = batch, step is not None

        def tap(index, h):
            rec.h[index] = h.detach()
            p = self.producers[index]
            norm = p.batchnorm
            # Outer populations: the block's shortcut of its input (the tap two back).
            shortcut = None if p.block is None else p.block.shortcut(rec.tapped[index - 2])
            out = _PopulationStep.apply(
                h.detach(), rec.outputs[index], None if norm is None else norm.weight,
                None if norm is None else norm.bias, shortcut, self._anchor(h.device),
                (self, index, rec, teaching))
            rec.tapped[index] = out
            return out

        try:
            with self._recording(rec):
                logits = self.model(x, tap=tap)  # (B, n_classes)
                self.apical.ensure(rec.h)
                loss = F.cross_entropy(logits, y)
                loss.backward()
        finally:
            rec.tapped.clear()  # no record -> output -> graph -> record cycle outlives the step
        for (_, module), b in zip(self.layers, self.feedback):
            b.grad = module.weight.grad.clone()  # KP: B gets W's (mixed-signal) update
        if step is not None:
            self.steps += 1
            self.summed_steps += 1
            if self.steps % self.params.predictor_every == 0:
                self.apical.predict(rec.h)
        self.last_h = rec.h  # the populations of this step (diagnostics and tests)
        out = [teaching[i] for i in sorted(teaching)] if record else None
        return StepResult(loss.detach(), logits.detach(), out)

    def _anchor(self, device: torch.device) -> torch.Tensor:
        """An empty tensor that requires grad, on the population's device."""
        if device not in self._anchors:
            self._anchors[device] = torch.empty(0, device=device, requires_grad=True)
        return self._anchors[device]

    def _local_step(self, index, g, rec: _Step, teaching, needs):
        """Population ``index``'s backward step: g = I / B = d mean-loss / dh.

        One fused kernel gives the used signal's gradient at the layer's output o
        (its weight-gradient product and the norm's parameter gradients take it)
        and the instruction's (handed back to autograd for o, so transport stays
        clean), plus the ReLU's masked I for the shortcut. ``needs`` are autograd's
        flags for (h, o, gamma, beta, shortcut, ...).
        """
        p, h, batch = self.producers[index], rec.h[index], rec.batch
        if teaching is not None:
            teaching[index] = g * batch  # (B, *U) the instruction, d sum-loss / dh
        rule = self.params.traffic_rule
        stats = {}
        if p.batchnorm is not None:
            mean, invstd = rec.stats[id(p.norm)]
            weight = p.norm.weight  # None for a norm without affine parameters
            stats = dict(mean=mean, invstd=invstd,
                         gamma=None if weight is None else weight.detach())
        res = self.apical.local(index, g, h, rec.outputs[index].detach(), batch, scale=p.scale,
                                instruction=needs[1] and rule != "none", masked=needs[4],
                                **stats)
        if rec.logged:
            self.apical.log(index, {name: getattr(res, f"ss_{name}") for name in SIGNALS},
                            batch, h.numel())
        grad_w, grad_b = _conv_weight_grad(p.conv, res.grad, rec.inputs[index])
        p.conv.weight.grad = grad_w
        if p.conv.bias is not None:
            p.conv.bias.grad = grad_b
        clean = res.grad if rule == "none" else res.instruction_grad
        return (clean if needs[1] else None, res.dgamma if needs[2] else None,
                res.dbeta if needs[3] else None, res.masked)

    # -- before training: calibration and predictor warm-up -----------------------

    def prepare(self, x, y=None):
        """Calibrate the gains on the first examples, then warm the predictor up."""
        n_cal = self.params.traffic_calibration_examples
        if y is None:
            raise ValueError("kp_traffic.prepare needs the labels: the gain is calibrated "
                             "against the KP instruction, which needs the output error")
        check_example_needs(self.name, self.example_needs(self.params), len(x))
        self.calibrate(x[:n_cal], y[:n_cal])
        self.warm_up(x)

    def instructions(self, x, y) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(h, I) per population for one batch: KP's clean instruction, no state change."""
        rec, teaching = _Step(), {}

        def tap(index, h):
            rec.h[index] = h.detach()
            if not h.requires_grad:
                h = h.detach().requires_grad_(True)
            h.register_hook(lambda g, i=index: teaching.__setitem__(i, g.detach() * len(y)))
            return h

        # Parameters out of autograd: the pass wants the teaching signals only, so no
        # weight-gradient product is formed (and no .grad written) to be thrown away.
        with preserved_norm_stats(self.model), parameters_frozen(self.model):
            loss = F.cross_entropy(self.model(x, tap=tap), y)
            loss.backward()
        self.apical.ensure(rec.h)
        return [rec.h[i] for i in sorted(rec.h)], [teaching[i] for i in sorted(teaching)]

    def calibrate(self, x, y, batch_size: int = 256) -> None:
        """g_l = traffic_ratio x RMS(I_l) / RMS(C_l h_l) over the calibration examples."""
        self.refresh()
        n = len(self.producers)
        ss_i, ss_ch = [0.0] * n, [0.0] * n
        self.model.train()
        for start in range(0, len(y), batch_size):
            hs, ins = self.instructions(x[start:start + batch_size], y[start:start + batch_size])
            for i, (t, ch) in enumerate(zip(ins, self.apical.traffic.unit_squares(hs))):
                ss_i[i] += float(t.double().square().sum())
                ss_ch[i] += ch
        self.apical.traffic.calibrate(self.name, self.params.traffic_ratio, ss_i, ss_ch,
                                      next(self.model.parameters()).dtype)
        self.calibration_examples = len(y)

    @torch.no_grad()
    def warm_up(self, x) -> None:
        """Instruction-off passes: the predictor learns T from h before training starts."""
        steps, size = self.params.predictor_warmup_steps, self.params.predictor_batch
        ratios = []
        with preserved_norm_stats(self.model):
            for _ in range(steps):
                pick = torch.randperm(len(x), generator=self.predictor_generator)[:size]
                rec = _Step()
                self.model(x[pick.to(x.device)],
                           tap=lambda i, h, r=rec: r.h.__setitem__(i, h.detach()) or h)
                self.apical.ensure(rec.h)
                ratios.append(self.apical.residual_ratio(rec.h))
                self.apical.predict(rec.h)
        if ratios:
            self.warmup = {"first_ratio": ratios[0], "last_ratio": ratios[-1]}

    # -- diagnostics, state, bill ---------------------------------------------------

    def epoch_metrics(self):
        self.summed_steps = 0
        return {**super().epoch_metrics(),
                "apical": self.apical.epoch_rms(self.model.population_names)}

    def final_metrics(self, x, y) -> dict:
        """Predictor residual ratio and each signal's alignment with the true gradient."""
        names = self.model.population_names
        with preserved_norm_stats(self.model):
            self.model.train()
            hs, ins = self.instructions(x, y)
            feedback = [(m, m.feedback) for _, m in self.layers]
            saved = [p.grad for p in self.model.parameters()]
            true, _ = backprop_reference(self.model, x, y)
            for p, g in zip(self.model.parameters(), saved):
                p.grad = g
            for m, b in feedback:
                m.feedback = b
        cos = {s: {} for s in ("instruction", "raw", "innovation", "matched", "used")}
        for i, (h, ins_i) in enumerate(zip(hs, ins)):
            signals = {rule: self.apical.signals(i, ins_i, h, rule=rule).used
                       for rule in ("raw", "innovation", "matched")}
            signals["instruction"] = ins_i
            signals["used"] = signals[self.params.traffic_rule if self.params.traffic_rule
                                      != "none" else "instruction"]
            for s, value in signals.items():
                cos[s][names[i]] = cosine_per_example(value, true[i])
        # A population whose layer above fell silent receives no instruction: its cosine
        # is undefined (NaN) and left out of the mean, and the silent ones are counted.
        alignment = {s: {**c, "mean": _nanmean(c.values())} for s, c in cos.items()}
        return {"predictor_residual_ratio": self.apical.residual_ratio(hs),
                "silent_populations": sum(int(h.abs().max() == 0) for h in hs),
                "warmup": dict(self.warmup), "gains": list(self.apical.gains),
                "signal_alignment": alignment}

    def state_dict(self):
        return {**super().state_dict(), **self.apical.state_dict(),
                "predictor_generator": self.predictor_generator.get_state(),
                "warmup": dict(self.warmup), "calibration_examples": self.calibration_examples,
                "summed_steps": self.summed_steps}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.apical.load_state_dict(state)
        self.predictor_generator.set_state(state["predictor_generator"])
        self.warmup = dict(state["warmup"])
        self.calibration_examples = state["calibration_examples"]
        self.summed_steps = state["summed_steps"]

    def work(self, layer_macs, examples):
        forward = sum(layer_macs.values())
        out = dict(super().work(layer_macs, examples))
        # Calibration: forward + KP's reverse pass (input gradients through B) per example.
        out["calibration"] = self.calibration_examples * (forward + self.feedback_macs(layer_macs))
        # The warm-up runs in prepare, right after the calibration: billed once it ran.
        warmed = self.calibration_examples > 0
        out["predictor_warmup"] = (self.params.predictor_warmup_steps
                                   * self.params.predictor_batch * forward) if warmed else 0
        # MT-2's channel map (the per-unit predictors have none: element-wise work only).
        predictor = self.apical.predictor_macs(examples)
        if predictor:
            out["predictor"] = predictor
        return out

    def elementwise(self, examples):
        units = self.apical.predictor.units
        if self.params.traffic_rule == "none":  # signals and sums of squares only
            apical = {"mixed_apical": 12 * units * examples}
        else:
            # Beyond the clean step (mask, xhat, the norm's sums and write, as autograd
            # would do for I): traffic, raw, innovation, the used signal, its masked
            # sums and write, and four sums of squares, over both passes.
            apical = {"mixed_local": 30 * units * examples}
        return {**super().elementwise(examples), **apical,
                "predictor": self.apical.predictor_elementwise(examples)}


def _nanmean(values) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else math.nan
