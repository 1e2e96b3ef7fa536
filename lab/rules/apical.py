"""The mixed apical compartment shared by ``kp_traffic`` and ``sdil`` (DESIGN section 5).

Pyramidal neurons receive the top-down teaching signal in their apical
dendrites, where it mixes with other traffic, e.g. soma-coupled activity
(Guerguiev, Lillicrap & Richards 2017; Payeur et al. 2021). At every
population h (B, *U) with instruction I (d loss / dh), per unit:

- traffic model (``LinearTraffic``): T = g C h, C = exp(0.25 N(0, 1)) fixed per
  unit, g per population, calibrated once so that RMS(T) / RMS(I) =
  ``traffic_ratio`` on the first ``traffic_calibration_examples`` examples;
- predictor (``UnitAffine``): P h + b per unit, learned by normalised LMS from
  instruction-off observations (h, T) of its own unit only:
  r = T - P h - b; P += eta mean_b(centred r centred h) / (var_b(h) + 1e-12);
  b += eta mean_b(r);
- signals, in the seed's descent convention d = -I (``numba_kernels/reference.py``
  is the spec, top to bottom): R_d = d + s T (s = +1 ``hebbian``, the seed's: on an
  active unit the traffic pushes the drive up; s = -1 ``anti_hebbian``: the traffic
  is added to the gradient), N_d = R_d - s (P h + b), M_d = R_d ||N_d|| / ||R_d||
  per example; the optimizer is handed minus the one ``traffic_rule`` picks
  (``none``: the instruction, the clean reference of the MT-1 study).

The fused kernels (``numba_kernels``) compute the signals with the sums of squares
the epoch log needs. A new traffic model or predictor (MT-2) is a class with the
same narrow interface: ``ensure(i, h)``, ``__call__(i, h)`` / ``update(i, h, T, eta)``,
``state()`` / ``load(state)``.
"""

from __future__ import annotations

import math

import torch

import numba_kernels
from numba_kernels.reference import RULES, SIGNS

from ..config import ConfigError
from .common import derive_seed

TRAFFIC_RULES = ("none", *RULES)
TRAFFIC_SIGNS = tuple(SIGNS)
# Above 1e4 the instruction is below a thousandth of the traffic's float32 rounding-free
# part (eps 1.2e-7 x 1e4 ~ 1e-3 of I).
TRAFFIC_RATIO_MAX = 1e4
SIGNALS = ("used", "instruction", "raw", "innovation", "traffic")


def _cloned(tensors: list) -> list:
    return [None if t is None else t.clone() for t in tensors]


class LinearTraffic:
    """T = g C h per population (the seed's traffic model)."""

    def __init__(self, n: int, seed: int, stream: str, traffic_seed: int):
        self.coefficients: list[torch.Tensor | None] = [None] * n  # C per unit
        self.gains = [0.0] * n
        self._seed = (seed, stream, traffic_seed)

    def ensure(self, i: int, h: torch.Tensor) -> None:
        if self.coefficients[i] is None:
            # C = exp(0.25 N(0, 1)) per unit, fixed by the run seed and traffic_seed.
            generator = torch.Generator().manual_seed(derive_seed(*self._seed, i))
            self.coefficients[i] = torch.exp(0.25 * torch.randn(
                h.shape[1:], generator=generator, dtype=torch.float64)).to(h)

    def __call__(self, i: int, h: torch.Tensor) -> torch.Tensor:
        return (self.coefficients[i] * self.gains[i]) * h

    def unit_squares(self, hs) -> list[float]:
        """Per population, the sum of squares of C h (the traffic at unit gain), float64."""
        return [float((self.coefficients[i].double() * h.double()).square().sum())
                for i, h in enumerate(hs)]

    def calibrate(self, rule: str, ratio: float, ss_i: list, ss_ch: list, dtype) -> None:
        """g_l = ratio x RMS(I_l) / RMS(C_l h_l) from the sums of squares of the
        instructions and of ``unit_squares`` over the same examples."""
        self.gains = calibrated_gains(rule, ratio, ss_i, ss_ch, dtype)

    def state(self) -> dict:
        return {"gains": list(self.gains), "coefficients": _cloned(self.coefficients)}

    def load(self, state: dict) -> None:
        self.gains = list(state["gains"])
        self.coefficients = _cloned(state["coefficients"])


class UnitAffine:
    """P h + b per unit, learned by normalised LMS (``numba_kernels.predictor_update``)."""

    def __init__(self, n: int):
        self.P: list[torch.Tensor | None] = [None] * n
        self.b: list[torch.Tensor | None] = [None] * n

    def ensure(self, i: int, h: torch.Tensor) -> None:
        if self.P[i] is None:
            self.P[i] = torch.zeros(h.shape[1:], dtype=h.dtype, device=h.device)
            self.b[i] = torch.zeros(h.shape[1:], dtype=h.dtype, device=h.device)

    def __call__(self, i: int, h: torch.Tensor) -> torch.Tensor:
        return self.P[i] * h + self.b[i]

    def update(self, i: int, h: torch.Tensor, T: torch.Tensor, eta: float) -> None:
        numba_kernels.predictor_update(h.contiguous(), T.contiguous(), self.P[i], self.b[i],
                                       eta)

    @property
    def units(self) -> int:
        return sum(p.numel() for p in self.P if p is not None)

    def state(self) -> dict:
        return {"P": _cloned(self.P), "b": _cloned(self.b)}

    def load(self, state: dict) -> None:
        self.P, self.b = _cloned(state["P"]), _cloned(state["b"])


def _delegate(part: str, name: str) -> property:
    return property(lambda self: getattr(getattr(self, part), name),
                    lambda self, value: setattr(getattr(self, part), name, list(value)))


class Apical:
    """The compartment at every population of one rule: traffic, predictor, signals, log.

    ``params`` carries ``traffic_rule``, ``traffic_sign``, ``traffic_seed`` and
    ``predictor_lr``; ``stream`` names the rule's random stream for C.
    """

    def __init__(self, rule: str, n: int, params, seed: int, stream: str):
        self.rule_name, self.params = rule, params
        self.traffic = LinearTraffic(n, seed, stream, params.traffic_seed)
        self.predictor = UnitAffine(n)
        self.predictor_updates = 0
        self.predictor_examples = 0  # examples the predictor updates saw (the bill)
        self.reset_sums()

    # Shorthands for the per-population tensors and gains (tests and diagnostics use them).
    coefficients = _delegate("traffic", "coefficients")
    gains = _delegate("traffic", "gains")
    P = _delegate("predictor", "P")
    b = _delegate("predictor", "b")

    def ensure(self, hs) -> None:
        """Size the per-unit tensors to the populations the first time they are seen."""
        for i, h in (hs.items() if isinstance(hs, dict) else enumerate(hs)):
            have = self.P[i]
            if have is not None and tuple(have.shape) != tuple(h.shape[1:]):
                raise ValueError(f"{self.rule_name}: population {i} has per-example shape "
                                 f"{tuple(h.shape[1:])}, but the rule's per-unit tensors have "
                                 f"{tuple(have.shape)}")
            self.traffic.ensure(i, h)
            self.predictor.ensure(i, h)

    # -- the signals ------------------------------------------------------------------

    def _units(self, i: int, batch: int) -> dict:
        # The kernels work in the gradient's own batch-mean units: traffic and predictor
        # scaled by 1 / B, as the instruction is.
        return dict(C=self.coefficients[i], gain=self.gains[i] / batch, P=self.P[i] / batch,
                    b=self.b[i] / batch, sign=self.params.traffic_sign)

    def signals(self, i: int, I: torch.Tensor, h: torch.Tensor, batch: int = 1,  # noqa: E741
                rule: str | None = None) -> numba_kernels.MixedApical:
        """``rule``'s used signal (default: the rule's own; ``none`` gives innovation's) and
        the sums of squares, for I in d(sum loss)/dh units divided by ``batch``."""
        rule = rule or self.params.traffic_rule
        return numba_kernels.mixed_apical(I, h, **self._units(i, batch),
                                          rule="innovation" if rule == "none" else rule)

    def local(self, i: int, g: torch.Tensor, h: torch.Tensor, o: torch.Tensor, batch: int,
              **kw) -> numba_kernels.MixedLocal:
        """Population i's fused backward step (``numba_kernels.mixed_local``), g = I / B."""
        return numba_kernels.mixed_local(g, h, o, **self._units(i, batch),
                                         rule=self.params.traffic_rule, **kw)

    def log(self, i: int, sums: dict, batch: int, numel: int) -> None:
        """Add one step's sums of squares (batch-mean units, so scaled by B^2) at population i."""
        for name in SIGNALS:
            self.sums[name][i] += float(sums[name]) * batch ** 2
        self.numels[i] += numel

    def reset_sums(self) -> None:
        n = len(self.gains)
        self.sums = {s: [0.0] * n for s in SIGNALS}
        self.numels = [0] * n

    def epoch_rms(self, names: list[str]) -> dict:
        """Per signal, the RMS at each population since the last call, and their mean."""
        out = apical_rms(names, self.sums, self.numels)
        self.reset_sums()
        return out

    # -- the predictor ------------------------------------------------------------------

    def predict(self, hs) -> None:
        """One NLMS step of each unit's predictor on instruction-off (h, T = g C h)."""
        items = list(hs.items() if isinstance(hs, dict) else enumerate(hs))
        for i, h in items:
            self.predictor.update(i, h, self.traffic(i, h), self.params.predictor_lr)
        self.predictor_updates += 1
        self.predictor_examples += len(items[0][1])

    def residual_ratio(self, hs) -> float:
        """RMS of T - (P h + b) over RMS(T), all populations (NaN without any traffic)."""
        ss_r = ss_t = 0.0
        for i, h in (hs.items() if isinstance(hs, dict) else enumerate(hs)):
            t = self.traffic(i, h)
            ss_r += float((t - self.predictor(i, h)).double().square().sum())
            ss_t += float(t.double().square().sum())
        return math.sqrt(ss_r / ss_t) if ss_t > 0 else math.nan

    # -- state and bill -------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {**self.traffic.state(), **self.predictor.state(),
                "predictor_updates": self.predictor_updates,
                "predictor_examples": self.predictor_examples,
                "sums": {k: list(v) for k, v in self.sums.items()}, "numels": list(self.numels)}

    def load_state_dict(self, state: dict) -> None:
        self.traffic.load(state)
        self.predictor.load(state)
        self.predictor_updates = state["predictor_updates"]
        self.predictor_examples = state["predictor_examples"]
        self.sums = {k: list(v) for k, v in state["sums"].items()}
        self.numels = list(state["numels"])

    def predictor_elementwise(self) -> int:
        return self.predictor_examples * 8 * self.predictor.units  # warm-up and training


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
    """Refuse a training step before ``prepare`` calibrated the traffic gains.

    Uncalibrated, every gain is 0: the step would be clean KP while ``traffic_ratio``
    asks for traffic. ``examples``: how many examples the gains were calibrated on
    (0: never). Gains set by hand (any non-zero) are taken as they are.
    """
    ratio = rule.params.traffic_ratio
    if examples == 0 and ratio > 0 and not any(rule.apical.gains):
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
