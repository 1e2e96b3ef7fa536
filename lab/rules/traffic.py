"""Kolen-Pollack with a mixed apical compartment (``kp_traffic``; DESIGN section 5, MT-1).

Pyramidal neurons receive the top-down teaching signal in their apical
dendrites, where it mixes with other traffic, e.g. soma-coupled activity
(Guerguiev, Lillicrap & Richards 2017, "Towards deep learning with segregated
dendrites"; Payeur et al. 2021, "Burst-dependent synaptic plasticity can
coordinate learning in hierarchical circuits"). This rule asks what such
traffic does to Kolen-Pollack learning (Akrout et al. 2019), and whether a
local predictor of the traffic can remove it. At every population h with KP
instruction I (d sum-loss / dh through the feedback tensors B):

- traffic T = g C h, with fixed per-unit C = exp(0.25 N(0, 1)) and a
  per-population gain g calibrated once so that RMS(T) / RMS(I) =
  ``traffic_ratio`` on the first ``traffic_calibration_examples`` examples;
- raw R = I + T; innovation N = R - (P h + b) with a per-unit affine
  predictor (P, b); matched M = R ||N|| / ||R|| per example;
- ``traffic_rule`` picks the signal U that drives plasticity: the weight
  correlation of the layer that produced h, its norm's parameters, and (KP)
  the feedback update, so W and B still receive equal updates. ``none`` is
  the clean reference of the MT-1 study: the traffic is formed, calibrated,
  predicted and logged exactly as for the others, but plasticity takes the
  instruction, so the run is clean KP (tested: the same updates to rounding).

Transport is clean: the backward pass carries I, unchanged, to the lower
populations; U enters only the local plasticity. It costs no extra
multiply-accumulates and no extra memory passes. At each population the rule
takes over the backward step from h to the output o of the layer that made it
(a ``torch.autograd.Function`` standing in for h on the tap): one fused kernel
(``numba_kernels.mixed_local``) reads I, h and o twice, as autograd's ReLU,
residual-scale and batch-norm backward would for I alone, and writes the
instruction's gradient at o (passed on to the layer's input-gradient product
through B, and to the shortcut as the ReLU's masked I) together with the used
signal's (the layer's weight-gradient product, computed once from it with the
conv weights out of autograd for the step, and the norm's parameter
gradients), forming the signals' sums of squares on the way. With no traffic
U = I exactly and the updates are clean KP's to rounding (the norm's backward
is the kernel's, not ATen's).

The predictor learns only from instruction-off observations of its own unit,
i.e. (h, T) pairs, by normalised LMS (``numba_kernels.predictor_update``):
``predictor_warmup_steps`` forward passes before training (batches drawn by
the rule's own generator, so the training data order is untouched; BN
running statistics untouched), then every ``predictor_every`` steps.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import numba_kernels

from ..config import SEED_MAX, ConfigError, bounded, choice, configclass, validate
from ..models.resnet import ResNet
from ..models.state import preserved_norm_stats
from .base import StepResult, check_example_needs
from .common import derive_seed, parameters_frozen
from .feedback import KolenPollack
from .registry import register

TRAFFIC_RATIO_MAX = 1e4

SIGNALS = ("used", "instruction", "raw", "innovation", "traffic")


@configclass
class TrafficParams:
    feedback_scale: float = bounded(1.0, 0.0, lo_open=True)  # ||B|| / ||W|| at initialisation
    feedback_seed: int = bounded(0, 0, SEED_MAX)
    traffic_rule: str = choice("innovation", ("none", *numba_kernels.RULES))
    # RMS(T) / RMS(I) after calibration; above 1e4 the instruction is below a thousandth
    # of the traffic's float32 rounding-free part (eps 1.2e-7 x 1e4 ~ 1e-3 of I)
    traffic_ratio: float = bounded(4.0, 0.0, TRAFFIC_RATIO_MAX)
    traffic_seed: int = bounded(0, 0, SEED_MAX)
    traffic_calibration_examples: int = bounded(512, 1)
    predictor_lr: float = bounded(0.5, 0.0, 1.0, lo_open=True)  # eta_P of the NLMS step
    # Steps between predictor updates. T = g C h is an exact per-unit linear map, so
    # the warm-up already finds it; later updates only follow numerical drift.
    predictor_every: int = bounded(10, 1)
    predictor_warmup_steps: int = bounded(100, 0)
    predictor_batch: int = bounded(128, 1)  # examples per warm-up pass

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


def _save_stats(step: _Step):
    """A forward hook keeping the batch mean and inverse std a BatchNorm normalised with."""
    def hook(norm, inputs, output):
        node = output.grad_fn
        if node is not None and type(node).__name__ == "NativeBatchNormBackward0":
            step.stats[id(norm)] = (node._saved_result1, node._saved_result2)
        else:  # no graph here (the stem's input needs no gradient): the same kernel again
            with torch.no_grad():
                _, mean, invstd = torch.native_batch_norm(
                    inputs[0], norm.weight, norm.bias, None, None, True, 0.0, norm.eps)
            step.stats[id(norm)] = (mean, invstd)
    return hook


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
        n = len(self.producers)
        # Per-unit tensors, one entry per element of a population's per-example shape;
        # that shape depends on the data, so they are made when a population is first seen.
        self.coefficients: list[torch.Tensor | None] = [None] * n
        self.P: list[torch.Tensor | None] = [None] * n
        self.b: list[torch.Tensor | None] = [None] * n
        self.gains = [0.0] * n
        self.predictor_generator = torch.Generator().manual_seed(
            derive_seed(seed, "predictor", self.params.traffic_seed))
        self.warmup = {"first_ratio": math.nan, "last_ratio": math.nan}
        self.calibration_examples = 0
        self.predictor_updates = 0
        self.predictor_examples = 0  # examples the predictor updates saw (the bill)
        self.last_h: dict[int, torch.Tensor] = {}
        self._anchors: dict[torch.device, torch.Tensor] = {}  # see _PopulationStep
        self._reset_sums()

    # -- shapes, taps, hooks --------------------------------------------------

    def _ensure_shapes(self, step: _Step) -> None:
        """Size the per-unit tensors to the data's populations the first time they are seen."""
        for i, h in step.h.items():
            shape = tuple(h.shape[1:])
            if self.P[i] is not None and tuple(self.P[i].shape) != shape:
                raise ValueError(f"kp_traffic: population {i} has per-example shape {shape}, "
                                 f"but the rule's per-unit tensors have {tuple(self.P[i].shape)}")
            if self.P[i] is None:
                # C = exp(0.25 N(0, 1)) per unit, fixed by the run seed and traffic_seed.
                generator = torch.Generator().manual_seed(
                    derive_seed(self.seed, "traffic", self.params.traffic_seed, i))
                self.coefficients[i] = torch.exp(0.25 * torch.randn(
                    shape, generator=generator, dtype=torch.float64)).to(h)
                self.P[i] = torch.zeros(shape, dtype=h.dtype, device=h.device)
                self.b[i] = torch.zeros(shape, dtype=h.dtype, device=h.device)

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
            if p.batchnorm is not None:
                handles.append(p.norm.register_forward_hook(_save_stats(step)))
            frozen += [t for t in (p.conv.weight, p.conv.bias)
                       if t is not None and t.requires_grad]
        for t in frozen:
            t.requires_grad_(False)
        try:
            yield
        finally:
            for t in frozen:
                t.requires_grad_(True)
            for handle in handles:
                handle.remove()

    # -- the step ---------------------------------------------------------------

    def _reset_sums(self):
        n = len(self.producers)
        self.sums = {s: [0.0] * n for s in SIGNALS}
        self.numels = [0] * n
        self.summed_steps = 0

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
                self._ensure_shapes(rec)
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
                self.predict(rec.h)
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
        # The kernel works in the gradient's own (batch-mean) units: traffic and
        # predictor scaled by 1 / B.
        gain, P, b = self.gains[index] / batch, self.P[index] / batch, self.b[index] / batch
        rule = self.params.traffic_rule
        stats = {}
        if p.batchnorm is not None:
            mean, invstd = rec.stats[id(p.norm)]
            weight = p.norm.weight  # None for a norm without affine parameters
            stats = dict(mean=mean, invstd=invstd,
                         gamma=None if weight is None else weight.detach())
        res = numba_kernels.mixed_local(
            g, h, rec.outputs[index].detach(), self.coefficients[index], gain, P, b, rule,
            scale=p.scale, instruction=needs[1] and rule != "none", masked=needs[4], **stats)
        if rec.logged:
            for name in SIGNALS:  # back to d sum-loss / dh units
                self.sums[name][index] += float(getattr(res, f"ss_{name}")) * batch ** 2
            self.numels[index] += h.numel()
        grad_w, grad_b = _conv_weight_grad(p.conv, res.grad, rec.inputs[index])
        p.conv.weight.grad = grad_w
        if p.conv.bias is not None:
            p.conv.bias.grad = grad_b
        clean = res.grad if rule == "none" else res.instruction_grad
        return (clean if needs[1] else None, res.dgamma if needs[2] else None,
                res.dbeta if needs[3] else None, res.masked)

    def predict(self, hs: dict[int, torch.Tensor]) -> None:
        """One predictor step on instruction-off observations (h, T = g C h) of each unit."""
        for i, h in hs.items():
            traffic = (self.coefficients[i] * self.gains[i]) * h
            numba_kernels.predictor_update(h, traffic, self.P[i], self.b[i],
                                           self.params.predictor_lr)
        self.predictor_updates += 1
        self.predictor_examples += len(next(iter(hs.values())))

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
        self._ensure_shapes(rec)
        return [rec.h[i] for i in sorted(rec.h)], [teaching[i] for i in sorted(teaching)]

    def calibrate(self, x, y, batch_size: int = 256) -> None:
        """g_l = traffic_ratio x RMS(I_l) / RMS(C_l h_l) over the calibration examples."""
        self.refresh()
        n = len(self.producers)
        ss_i, ss_ch = [0.0] * n, [0.0] * n
        self.model.train()
        for start in range(0, len(y), batch_size):
            hs, ins = self.instructions(x[start:start + batch_size], y[start:start + batch_size])
            for i in range(n):
                ss_i[i] += float(ins[i].double().square().sum())
                ss_ch[i] += float((self.coefficients[i].double() * hs[i].double()).square().sum())
        self.gains = calibrated_gains(self.name, self.params.traffic_ratio, ss_i, ss_ch,
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
                self._ensure_shapes(rec)
                ratios.append(self.residual_ratio(rec.h))
                self.predict(rec.h)
        if ratios:
            self.warmup = {"first_ratio": ratios[0], "last_ratio": ratios[-1]}

    def residual_ratio(self, hs: dict[int, torch.Tensor]) -> float:
        """RMS of the predictor's residual T - (P h + b) over RMS(T), all populations
        (NaN when no population carries any traffic: every unit silent)."""
        ss_r = ss_t = 0.0
        for i, h in hs.items():
            t = (self.coefficients[i] * self.gains[i]) * h
            ss_r += float((t - (self.P[i] * h + self.b[i])).double().square().sum())
            ss_t += float(t.double().square().sum())
        return math.sqrt(ss_r / ss_t) if ss_t > 0 else math.nan

    # -- diagnostics, state, bill ---------------------------------------------------

    def epoch_metrics(self):
        apical = apical_rms(self.model.population_names, self.sums, self.numels)
        self._reset_sums()
        return {**super().epoch_metrics(), "apical": apical}

    def final_metrics(self, x, y) -> dict:
        """Predictor residual ratio and each signal's alignment with the true gradient."""
        from ..diagnostics.alignment import backprop_reference, cosine_per_example

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
            signals = {rule: numba_kernels.mixed_apical(
                ins_i, h, self.coefficients[i], self.gains[i], self.P[i], self.b[i],
                rule).used for rule in ("raw", "innovation", "matched")}
            signals["instruction"] = ins_i
            signals["used"] = signals[self.params.traffic_rule if self.params.traffic_rule
                                      != "none" else "instruction"]
            for s, value in signals.items():
                cos[s][names[i]] = cosine_per_example(value, true[i])
        # A population whose layer above fell silent receives no instruction: its cosine
        # is undefined (NaN) and left out of the mean, and the silent ones are counted.
        alignment = {s: {**c, "mean": _nanmean(c.values())} for s, c in cos.items()}
        return {"predictor_residual_ratio": self.residual_ratio(dict(enumerate(hs))),
                "silent_populations": sum(int(h.abs().max() == 0) for h in hs),
                "warmup": dict(self.warmup), "gains": list(self.gains),
                "signal_alignment": alignment}

    def state_dict(self):
        return {**super().state_dict(), "gains": list(self.gains),
                "coefficients": _cloned(self.coefficients), "P": _cloned(self.P),
                "b": _cloned(self.b),
                "predictor_generator": self.predictor_generator.get_state(),
                "warmup": dict(self.warmup), "calibration_examples": self.calibration_examples,
                "predictor_updates": self.predictor_updates,
                "predictor_examples": self.predictor_examples,
                "sums": {k: list(v) for k, v in self.sums.items()},
                "numels": list(self.numels), "summed_steps": self.summed_steps}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.gains = list(state["gains"])
        self.coefficients = _cloned(state["coefficients"])
        self.P, self.b = _cloned(state["P"]), _cloned(state["b"])
        self.predictor_generator.set_state(state["predictor_generator"])
        self.warmup = dict(state["warmup"])
        self.calibration_examples = state["calibration_examples"]
        self.predictor_updates = state["predictor_updates"]
        self.predictor_examples = state["predictor_examples"]
        self.sums = {k: list(v) for k, v in state["sums"].items()}
        self.numels = list(state["numels"])
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
        return out

    def elementwise(self, examples):
        units = sum(p.numel() for p in self.P if p is not None)
        if self.params.traffic_rule == "none":  # signals and sums of squares only
            apical = {"mixed_apical": 12 * units * examples}
        else:
            # Beyond the clean step (mask, xhat, the norm's sums and write, as autograd
            # would do for I): traffic, raw, innovation, the used signal, its masked
            # sums and write, and four sums of squares, over both passes.
            apical = {"mixed_local": 30 * units * examples}
        updates = self.predictor_examples * 8 * units  # warm-up and training batches
        return {**super().elementwise(examples), **apical, "predictor": updates}


def calibrated_gains(rule: str, ratio: float, ss_i: list, ss_ch: list, dtype) -> list:
    """g_l = ratio x RMS(I_l) / RMS(C_l h_l) from the sums of squares over the calibration
    examples (0 where C h is all zero); ConfigError if a gain leaves ``dtype``'s range."""
    gains = [ratio * math.sqrt(si / sc) if sc > 0 else 0.0 for si, sc in zip(ss_i, ss_ch)]
    largest = torch.finfo(dtype).max
    for i, g in enumerate(gains):
        if not g < largest:  # also NaN
            raise ConfigError(
                f"{rule}: rule_params.traffic_ratio={ratio} calibrates population {i}'s gain "
                f"to {g:.3g} (RMS(I) / RMS(C h) = {math.sqrt(ss_i[i] / ss_ch[i]):.3g}), beyond "
                f"{dtype}'s range; use a smaller traffic_ratio")
    return gains


def check_calibrated(rule, examples: int) -> None:
    """Refuse a step before ``prepare`` calibrated the traffic gains.

    Uncalibrated, every gain is 0: no traffic at all, and the step would be clean
    KP while ``traffic_ratio`` asks for traffic (and the logged RMS would say 0).
    ``examples``: how many examples the gains were calibrated on (0: never). Gains
    set by hand (any non-zero) are taken as they are.
    """
    ratio = rule.params.traffic_ratio
    if examples == 0 and ratio > 0 and not any(rule.gains):
        raise RuntimeError(
            f"{rule.name}: the traffic gains are not calibrated (all 0, so no traffic would "
            f"mix in although rule_params.traffic_ratio={ratio}): call rule.prepare(x, y) "
            f"with training examples and their labels before the first step (lab's "
            f"trainers do; a resumed run restores the gains through load_state_dict)")


def apical_rms(names: list[str], sums: dict, numels: list[int]) -> dict:
    """Per signal, the RMS at each population over the summed steps, and their mean."""
    apical = {}
    for s in SIGNALS:
        per = {names[i]: math.sqrt(sums[s][i] / numels[i]) if numels[i] else math.nan
               for i in range(len(names))}
        apical[f"rms_{s}"] = {**per, "mean": sum(per.values()) / len(per)}
    return apical


def _nanmean(values) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else math.nan


def _cloned(tensors: list) -> list:
    return [None if t is None else t.clone() for t in tensors]
