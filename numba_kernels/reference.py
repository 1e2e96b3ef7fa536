"""Plain-torch forms of the kernels: the definitions the CPU and CUDA kernels are tested against.

DESIGN section 5 (mixed apical traffic, seed 003), written the natural torch way
(every intermediate allocated). Operation order follows the kernels where
rounding could tell them apart: traffic is ``(g*C) * h`` with ``g*C`` formed once
in the input dtype; innovation is ``I + ((g*C - P)*h - b)``, which is
``R - (P*h + b)`` in real arithmetic and gives the instruction back bit for bit
under an exact predictor (P == g*C, b == 0) even where a compiler fuses
multiply-adds; sums of squares are accumulated in float64. The predictor
update's reductions run in float64 and the result is rounded to the parameters'
dtype once, as the kernels do.
"""

from __future__ import annotations

import torch

from .results import MixedApical, MixedLocal, PredictorStats


def _ss(x: torch.Tensor) -> torch.Tensor:
    return x.square().sum(dtype=torch.float64)


def mixed_apical_reference(I, h, C, gain, P, b, rule: str) -> MixedApical:  # noqa: E741
    """Traffic, raw, innovation and matched for one population, in plain torch.

    Takes tensors as they come (the dispatcher checks them); only the rule is checked
    here, so a mistyped one is an error rather than matched."""
    if rule not in ("raw", "innovation", "matched"):
        raise ValueError(f"rule={rule!r}; allowed: raw, matched, innovation")
    gC = C * gain  # (*U)
    T = gC * h  # (B, *U)
    R = I + T
    N = I + ((gC - P) * h - b)
    if rule == "raw":
        used = R
    elif rule == "innovation":
        used = N
    else:
        dims = tuple(range(1, I.dim()))
        ss_r = R.square().sum(dim=dims, dtype=torch.float64)  # (B,)
        ss_n = N.square().sum(dim=dims, dtype=torch.float64)
        # An all-zero raw row has no direction: its matched signal is zero. A row whose
        # norms overflow (or hold a NaN) has none: NaN (x - x is NaN for x = inf or NaN).
        scale = (torch.where(ss_r > 0, (ss_n / ss_r.clamp_min(1e-300)).sqrt(), 0.0)
                 + (ss_r - ss_r) + (ss_n - ss_n))
        used = R * scale.to(I.dtype).view(-1, *([1] * (I.dim() - 1)))
    return MixedApical(used, torch.stack([_ss(I), _ss(T), _ss(R), _ss(N), _ss(used)]))


def predictor_update_reference(h, T, P, b, eta: float) -> PredictorStats:
    """Normalised-LMS step on P and b in place; statistics of the residual before it."""
    h64, T64 = h.double(), T.double()
    r = T64 - (P.double() * h64 + b.double())  # (B, *U)
    hc = h64 - h64.mean(0)
    rc = r - r.mean(0)
    var = hc.square().mean(0)  # biased: mean of centred squares
    P.copy_(P.double() + eta * (rc * hc).mean(0) / (var + 1e-12))
    b.copy_(b.double() + eta * r.mean(0))  # the same residual as P's step
    return PredictorStats(_ss(r), _ss(T64))  # squares in float64, as the kernels square them


def aux_add_reference(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst += src`` in place."""
    return dst.add_(src)


def mixed_local_reference(I, h, o, C, gain, P, b, rule: str, mean=None,  # noqa: E741
                          invstd=None, gamma=None, scale: float = 1.0, instruction: bool = False,
                          masked: bool = False) -> MixedLocal:
    """One population's backward step to the output o of the layer that made it.

    h = relu(scale * norm(o) + shortcut) (no norm: relu(scale * o + shortcut)).
    For a signal X at h, L(X) = norm backward of m = scale * X * (h > 0), with the
    batch statistics (per channel, dim 1, over the batch and the spatial dims):
    gamma*invstd * (m - mean(m) - xhat*mean(m*xhat)), xhat = (o - mean)*invstd;
    without a norm L(X) = m. ``.grad`` = L(used), ``.instruction_grad`` = L(I),
    ``.masked`` = I * (h > 0) (what the shortcut receives); ``.dgamma``, ``.dbeta``
    the used signal's norm parameter gradients. Rule ``none``: used = I. Norm sums
    in float64.
    """
    if rule not in ("none", "raw", "innovation", "matched"):
        raise ValueError(f"rule={rule!r}; allowed: none, raw, matched, innovation")
    mixed = mixed_apical_reference(I, h, C, gain, P, b,
                                   "innovation" if rule == "none" else rule)
    used = I if rule == "none" else mixed.used
    sums = (mixed.ss_instruction if rule == "none" else mixed.ss_used, mixed.ss_instruction,
            mixed.ss_raw, mixed.ss_innovation, mixed.ss_traffic)
    on = h > 0
    zero = torch.zeros((), dtype=I.dtype)
    shape = (1, -1) + (1,) * (I.dim() - 2)
    dims = tuple(d for d in range(I.dim()) if d != 1)
    count = I.numel() // I.shape[1]

    def local(signal):
        m = torch.where(on, scale * signal, zero)
        if mean is None:
            return m, None, None
        xhat = (o.double() - mean.double().view(shape)) * invstd.double().view(shape)
        s_m = m.double().sum(dims)  # (channels,)
        s_mx = (m.double() * xhat).sum(dims)
        k = invstd.double() * (1.0 if gamma is None else gamma.double())
        v = k.view(shape) * (m.double() - (s_m / count).view(shape)
                             - xhat * (s_mx / count).view(shape))
        return v.to(I.dtype), s_mx.to(I.dtype), s_m.to(I.dtype)

    grad, dgamma, dbeta = local(used)
    return MixedLocal(grad, local(I)[0] if instruction else None,
                      torch.where(on, I, zero) if masked else None, dgamma, dbeta, *sums)
