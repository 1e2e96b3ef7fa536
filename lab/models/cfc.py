"""Closed-form continuous-time (CfC) cells and sequences.

Hasani et al. 2022, "Closed-form continuous-time neural networks" (Nature Machine
Intelligence 4, 992-1003). A backbone MLP reads ``[input, state]``; three heads read the
backbone: f1 = tanh(ff1), f2 = tanh(ff2) and the time gate s = sigmoid(t_a * dt + t_b). The
new state is, per mode,

    default:  h' = f1 * (1 - s) + s * f2
    no_gate:  h' = f1 + s * f2
    pure:     h' = A - A * exp(-dt * (|w_tau| + |ff1|)) * ff1      (the direct solution)

with the same parameter names and layout as the reference implementation (ncps,
``ncps.torch.CfC``), so weights load across (see :func:`load_ncps`).

Two additions. *Buckets*: the units may be split into buckets, each with its own range of time
scales tau (log-spaced across the bucket's units); a unit with scale tau sees ``dt / tau``
where the equations say ``dt``, so slow buckets integrate over longer spans. One bucket with
tau = 1 is the paper's cell. *Time spans*: per-example, per-step spans shaped like the input
without its feature axis; each example's span multiplies its own row (ncps 1.0.1 squeezes the
spans to ``(B,)``, which broadcasts along the unit axis instead of the batch axis).

Speed (DESIGN section 7): the input half of the backbone's first product does not depend on the
state, so it is computed for every step at once, outside the time loop, and the four heads are
one fused product. The sequence then runs in one of three implementations, same maths:
``loop`` (per-step torch autograd: the reference), ``function`` (one autograd Function with a
hand-written backward through time, torch ops) and ``numba`` (the same Function with each
direction's whole time loop compiled by numba: element-wise work fused and vectorised, the
per-step products on BLAS, each weight gradient one product over all steps). ``auto`` picks
``numba`` on CPU, ``function`` elsewhere. With one span for every example and step (no
``timespans``, or a number) the fast paths fold the gate's two heads into one
(:func:`fold_gate`). The hand-written backward is checked against autograd with gradcheck, the
fast paths against the step loop and ncps (tests/test_cfc.py).
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

MODES = ("default", "no_gate", "pure")
ACTIVATIONS = ("lecun_tanh", "tanh", "relu", "silu", "gelu")
IMPLS = ("auto", "loop", "function", "numba")

# LeCun et al. 1998 ("Efficient BackProp"), the ncps default backbone activation.
_LECUN_SCALE, _LECUN_SLOPE = 1.7159, 0.666


def activate(z: torch.Tensor, name: str) -> torch.Tensor:
    if name == "lecun_tanh":
        return _LECUN_SCALE * torch.tanh(_LECUN_SLOPE * z)
    if name == "tanh":
        return torch.tanh(z)
    if name == "relu":
        return F.relu(z)
    if name == "silu":
        return F.silu(z)
    return F.gelu(z)


def _activation_grad(z: torch.Tensor, a: torch.Tensor, name: str) -> torch.Tensor:
    """d activation / dz, from the pre-activation z and the activation a."""
    if name == "lecun_tanh":
        t = a / _LECUN_SCALE
        return (_LECUN_SCALE * _LECUN_SLOPE) * (1 - t * t)
    if name == "tanh":
        return 1 - a * a
    if name == "relu":
        return (z > 0).to(z.dtype)
    if name == "silu":
        s = torch.sigmoid(z)
        return s * (1 + z * (1 - s))
    phi = torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
    return 0.5 * (1 + torch.erf(z / math.sqrt(2))) + z * phi


def bucket_rates(buckets: tuple[tuple[int, float, float], ...], dtype=None) -> torch.Tensor:
    """Per-unit 1/tau: each bucket (units, tau_min, tau_max) log-spaces tau over its units;
    formed in float64, then rounded once to ``dtype`` (default: torch's default dtype)."""
    rates = []
    for units, tau_min, tau_max in buckets:
        taus = torch.logspace(math.log10(tau_min), math.log10(tau_max), units, dtype=torch.float64)
        rates.append(1.0 / taus)
    return torch.cat(rates).to(dtype or torch.get_default_dtype())


def check_buckets(buckets, hidden_size: int) -> None:
    for bucket in buckets:
        if (len(bucket) != 3 or int(bucket[0]) != bucket[0] or bucket[0] < 1
                or not 0 < bucket[1] <= bucket[2] < math.inf):
            raise ValueError(f"CfC bucket {bucket!r} is not allowed; each bucket is "
                             "(units >= 1, tau_min, tau_max) with 0 < tau_min <= tau_max")
    total = sum(int(b[0]) for b in buckets)
    if total != hidden_size:
        raise ValueError(f"CfC buckets {buckets!r} hold {total} units but hidden_size is "
                         f"{hidden_size}; the bucket sizes must add up to hidden_size")


class CfCCell(nn.Module):
    """One CfC step: ``h' = cell(x, h, dt)``; parameters as ncps's ``CfCCell``.

    ``backbone`` is a list of Linear layers; the first reads ``[x, h]`` (input columns first).
    ``heads`` is ff1 | ff2 | time_a | time_b fused into one Linear (ff1 only in ``pure`` mode).
    """

    def __init__(self, input_size: int, hidden_size: int, *, mode: str = "default",
                 backbone_units: int = 128, backbone_layers: int = 1,
                 activation: str = "lecun_tanh",
                 buckets: tuple[tuple[int, float, float], ...] | None = None):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"CfC mode={mode!r} is not allowed; choose one of: {MODES}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"CfC activation={activation!r} is not allowed; "
                             f"choose one of: {ACTIVATIONS}")
        if backbone_layers < 1 or backbone_units < 1:
            raise ValueError(f"CfC backbone_layers={backbone_layers}, backbone_units="
                             f"{backbone_units}: both must be >= 1")
        buckets = tuple(buckets) if buckets else ((hidden_size, 1.0, 1.0),)
        check_buckets(buckets, hidden_size)
        self.input_size, self.hidden_size = input_size, hidden_size
        self.mode, self.activation, self.buckets = mode, activation, buckets
        self.backbone = nn.ModuleList(
            [nn.Linear(input_size + hidden_size, backbone_units)]
            + [nn.Linear(backbone_units, backbone_units) for _ in range(backbone_layers - 1)])
        n_heads = 1 if mode == "pure" else 4
        self.heads = nn.Linear(backbone_units, n_heads * hidden_size)
        if mode == "pure":
            # Zeros and ones, not ncps' Xavier draw for these (1, H) rows: the decay starts
            # at the heads' own rate and the target at 1 (equations and load_ncps agree;
            # only a fresh model's starting point differs from ncps').
            self.w_tau = nn.Parameter(torch.zeros(1, hidden_size))
            self.A = nn.Parameter(torch.ones(1, hidden_size))
        self.register_buffer("rate", bucket_rates(buckets))  # (H,) per-unit 1/tau
        # ncps initialises every matrix with Xavier-uniform (biases: torch's default); pure
        # mode's w_tau and A are the exception, above.
        for layer in [*self.backbone, self.heads]:
            nn.init.xavier_uniform_(layer.weight)
        if mode != "pure":
            # Xavier per head, as ncps does with four separate Linear layers.
            for w in self.heads.weight.detach().split(hidden_size):
                nn.init.xavier_uniform_(w)

    def _apply(self, fn, recurse=True):
        # The rates are derived from the buckets: after a cast (``.double()``) form them
        # again in the new dtype, so a float64 model's 1/7 is not float32's rounded 1/7.
        super()._apply(fn, recurse)
        self.rate = bucket_rates(self.buckets, self.rate.dtype).to(self.rate.device)
        return self

    def input_product(self, x: torch.Tensor) -> torch.Tensor:
        """The state-free half of the first backbone product (+ bias), any leading dims."""
        first = self.backbone[0]
        return F.linear(x, first.weight[:, : self.input_size], first.bias)

    def step(self, xin: torch.Tensor, h: torch.Tensor, dt) -> torch.Tensor:
        """One step from the hoisted input product ``xin`` (B, U) and the state h (B, H)."""
        first = self.backbone[0]
        z = xin + h @ first.weight[:, self.input_size:].t()  # (B, U)
        a = activate(z, self.activation)
        for layer in self.backbone[1:]:
            a = activate(layer(a), self.activation)
        heads = self.heads(a)  # (B, 4H) or (B, H)
        rate_dt = dt * self.rate  # (B, H): each example's span, each unit's time scale
        if self.mode == "pure":
            return self.A - self.A * torch.exp(-rate_dt * (self.w_tau.abs() + heads.abs())) * heads
        ff1, ff2, t_a, t_b = heads.chunk(4, dim=-1)
        f1, f2 = torch.tanh(ff1), torch.tanh(ff2)
        s = torch.sigmoid(t_a * rate_dt + t_b)
        if self.mode == "no_gate":
            return f1 + s * f2
        return f1 * (1 - s) + s * f2

    def forward(self, x: torch.Tensor, h: torch.Tensor, dt=1.0) -> torch.Tensor:
        """x (B, C), h (B, H), dt a number or (B,) / (B, 1) spans -> new state (B, H)."""
        if torch.is_tensor(dt) and dt.dim() == 1:
            dt = dt.unsqueeze(-1)
        return self.step(self.input_product(x), h, dt)


class CfC(nn.Module):
    """A CfC over a sequence, with torch RNN conventions.

    ``forward(input, hx=None, timespans=None) -> (outputs, h_n)``: input (B, T, C) when
    ``batch_first`` else (T, B, C), or (T, C) unbatched; outputs are every step's state
    (B, T, H) / (T, B, H); h_n (B, H). ``timespans``: None (dt = 1), a number, or per-example
    per-step spans shaped like the input without its feature axis (a trailing 1 is allowed).
    """

    def __init__(self, input_size: int, hidden_size: int, *, batch_first: bool = True,
                 mode: str = "default", backbone_units: int = 128, backbone_layers: int = 1,
                 activation: str = "lecun_tanh",
                 buckets: tuple[tuple[int, float, float], ...] | None = None,
                 impl: str = "auto"):
        super().__init__()
        if impl not in IMPLS:
            raise ValueError(f"CfC impl={impl!r} is not allowed; choose one of: {IMPLS}")
        self.batch_first, self.impl = batch_first, impl
        self.input_size, self.hidden_size = input_size, hidden_size
        self.cell = CfCCell(input_size, hidden_size, mode=mode, backbone_units=backbone_units,
                            backbone_layers=backbone_layers, activation=activation,
                            buckets=buckets)

    def resolve_impl(self, x: torch.Tensor, dt) -> str:
        if self.impl != "auto":
            return self.impl
        fast = len(self.cell.backbone) == 1 and not (torch.is_tensor(dt) and dt.requires_grad)
        if not fast:
            return "loop"
        if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and _HAVE_NUMBA:
            return "numba"
        return "function"

    def forward(self, input: torch.Tensor, hx: torch.Tensor | None = None, timespans=None):
        unbatched = input.dim() == 2
        given = tuple(timespans.shape) if torch.is_tensor(timespans) else None
        if unbatched:
            input = input.unsqueeze(1)  # (T, 1, C)
            if torch.is_tensor(timespans) and timespans.dim() >= 1:
                timespans = timespans.reshape(-1, 1)
        elif self.batch_first:
            input = input.transpose(0, 1)  # (T, B, C): the time loop reads contiguous steps
            if torch.is_tensor(timespans) and timespans.dim() >= 2:
                timespans = timespans.transpose(0, 1)
        T, B, _ = input.shape
        H = self.hidden_size
        h0 = (input.new_zeros(B, H) if hx is None
              else (hx.unsqueeze(0) if unbatched else hx).to(input.dtype))
        dt = _time_spans(timespans, given, T, B, input)  # (T, B, 1) tensor or a float
        impl = self.resolve_impl(input, dt)
        if impl != "loop" and len(self.cell.backbone) != 1:
            raise ValueError(f"CfC impl={impl!r} supports backbone_layers=1 only; "
                             "use impl='loop' (or 'auto') for deeper backbones")
        if impl == "numba" and (input.device.type != "cpu" or not _HAVE_NUMBA):
            raise ValueError(f"CfC impl='numba' runs on CPU tensors with numba installed; got "
                             f"a {input.device.type} input. Use impl='function' (or 'auto')")
        xin = self.cell.input_product(input)  # (T, B, U): hoisted out of the time loop
        if impl == "loop":
            h, outs = h0, []
            for t in range(T):
                h = self.cell.step(xin[t], h, dt[t] if torch.is_tensor(dt) else dt)
                outs.append(h)
            out = torch.stack(outs)  # (T, B, H)
        else:
            out = cfc_sequence(self.cell, xin, h0, dt, impl)
        h_n = out[-1]
        if unbatched:
            return out[:, 0], h_n[0]
        return (out.transpose(0, 1) if self.batch_first else out), h_n


def _time_spans(timespans, given, T: int, B: int, ref: torch.Tensor):
    """Spans as a float or a (T, B, 1) tensor (time-major, as the loop reads them)."""
    if timespans is None:
        return 1.0
    if not torch.is_tensor(timespans):
        return float(timespans)
    dt = timespans.to(ref.dtype)
    if dt.dim() == 3 and dt.shape[-1] == 1:
        dt = dt[..., 0]
    if dt.shape != (T, B):
        raise ValueError(f"CfC timespans of shape {given} do not match the "
                         f"input: expected (batch, time) = ({B}, {T}) with batch_first, "
                         "(time, batch) without, optionally with a trailing 1")
    return dt.unsqueeze(-1)


# ---------------------------------------------------------------------------
# the sequence as one autograd Function: hand-written backward through time


def _params(cell: CfCCell):
    first = cell.backbone[0]
    w_h = first.weight[:, cell.input_size:]  # (U, H)
    extra = (cell.w_tau, cell.A) if cell.mode == "pure" else ()
    return (w_h, cell.heads.weight, cell.heads.bias, *extra)


def cfc_sequence(cell: CfCCell, xin, h0, dt, impl: str) -> torch.Tensor:
    """All states (T, B, H) from the hoisted input products xin (T, B, U) and h0 (B, H)."""
    T, B, _ = xin.shape
    w_h, w_heads, b_heads, *pure = _params(cell)
    if not torch.is_tensor(dt) and cell.mode != "pure":
        # One span for every example and step: the gate's input t_a * r + t_b is then one
        # linear head, weights W_a * r + W_b (r per unit), so the heads are 3H wide, not 4H.
        w_heads, b_heads = fold_gate(w_heads, b_heads, dt * cell.rate)
        rate_dt = xin.new_ones(1, 1, 1)  # unused by the folded heads
    else:
        if not torch.is_tensor(dt):
            dt = xin.new_full((T, B, 1), dt)
        rate_dt = (dt * cell.rate).contiguous()  # (T, B, H)
    return _CfCSequence.apply(xin.contiguous(), h0.contiguous(), rate_dt,
                              cell.mode, cell.activation, impl, w_h, w_heads, b_heads, *pure)


def fold_gate(w_heads, b_heads, r):
    """ff1 | ff2 | time_a | time_b heads -> ff1 | ff2 | gate, gate = time_a * r + time_b."""
    ff, t_a, t_b = w_heads.tensor_split((2 * len(r), 3 * len(r)))
    bf, bt_a, bt_b = b_heads.tensor_split((2 * len(r), 3 * len(r)))
    return torch.cat([ff, t_a * r[:, None] + t_b]), torch.cat([bf, bt_a * r + bt_b])


class _CfCSequence(torch.autograd.Function):
    """States of a one-layer-backbone CfC; backward through time written out.

    Heads: ff1 (pure) or ff1 | ff2 | time_a | time_b with the spans in ``rate_dt`` (T, B, H),
    or ff1 | ff2 | gate already folded (:func:`fold_gate`; ``rate_dt`` then unused).
    Saved per step: the state entering it, the backbone pre-activation z and activation a,
    and the head outputs needed by the backward (f1, f2, s; ff1 and the decay in pure mode).
    Weight gradients are one product over all steps, after the reverse loop.
    """

    @staticmethod
    def forward(ctx, xin, h0, rate_dt, mode, activation, impl, w_h, w_heads, b_heads, *pure):
        run = _forward_numba if impl == "numba" else _forward_torch
        with torch.no_grad():
            hs, z, a, g = run(xin, h0, rate_dt, mode, activation, w_h, w_heads, b_heads, *pure)
        ctx.conf = (mode, activation, impl)
        ctx.save_for_backward(hs, z, a, g, rate_dt, w_h, w_heads, *pure)
        return hs[1:]

    @staticmethod
    def backward(ctx, grad_out):
        mode, activation, impl = ctx.conf
        hs, z, a, g, rate_dt, w_h, w_heads, *pure = ctx.saved_tensors
        run = _backward_numba if impl == "numba" else _backward_torch
        with torch.no_grad():
            dz, dh0, d_w_h, d_w_heads, d_b_heads, dpure = run(
                grad_out.contiguous(), hs, z, a, g, rate_dt, mode, activation, w_h, w_heads,
                *pure)
        return (dz, dh0, None, None, None, None, d_w_h, d_w_heads, d_b_heads, *dpure)


def _split_heads(heads, mode):
    if mode == "pure":
        return heads, None, None, None
    return heads.chunk(4, dim=-1)


def _forward_torch(xin, h0, rate_dt, mode, activation, w_h, w_heads, b_heads, *pure):
    T, B, U = xin.shape
    H = h0.shape[1]
    hs = xin.new_empty(T + 1, B, H)
    hs[0] = h0
    z = torch.empty_like(xin)
    a = torch.empty_like(xin)
    g = xin.new_empty(T, B, 3 * H)  # default/no_gate: f1 | f2 | s; pure: ff1 | decay | unused
    w_h_t, w_heads_t = w_h.t(), w_heads.t()
    for t in range(T):
        torch.addmm(xin[t], hs[t], w_h_t, out=z[t])
        a[t] = activate(z[t], activation)
        heads = torch.addmm(b_heads, a[t], w_heads_t)
        if mode == "pure":
            w_tau, A = pure
            decay = torch.exp(-rate_dt[t] * (w_tau.abs() + heads.abs()))
            g[t, :, :H], g[t, :, H:2 * H] = heads, decay
            hs[t + 1] = A - A * decay * heads
            continue
        if heads.shape[-1] == 3 * H:  # folded gate
            ff1, ff2, gate = heads.chunk(3, dim=-1)
        else:
            ff1, ff2, t_a, t_b = heads.chunk(4, dim=-1)
            gate = t_a * rate_dt[t] + t_b
        f1, f2 = torch.tanh(ff1), torch.tanh(ff2)
        s = torch.sigmoid(gate)
        g[t, :, :H], g[t, :, H:2 * H], g[t, :, 2 * H:] = f1, f2, s
        hs[t + 1] = f1 + s * f2 if mode == "no_gate" else f1 + s * (f2 - f1)
    return hs, z, a, g


def _backward_torch(grad_out, hs, z, a, g, rate_dt, mode, activation, w_h, w_heads, *pure):
    T, B, H = grad_out.shape
    dz = torch.empty_like(z)
    dheads = z.new_empty(T, B, w_heads.shape[0])
    dh = torch.zeros_like(hs[0])
    dpure = [torch.zeros_like(p) for p in pure]
    folded = w_heads.shape[0] == 3 * H
    for t in reversed(range(T)):
        dh = dh + grad_out[t]
        if mode == "pure":
            w_tau, A = pure
            ff1, decay = g[t, :, :H], g[t, :, H:2 * H]
            r = rate_dt[t]
            # h = A - A e ff1, e = exp(-r (|w_tau| + |ff1|))
            dheads[t] = -dh * A * decay * (1 - r * ff1.abs())
            dpure[0] += (dh * A * ff1 * decay * r).sum(0, keepdim=True) * torch.sign(w_tau)
            dpure[1] += (dh * (1 - decay * ff1)).sum(0, keepdim=True)
        else:
            f1, f2, s = g[t, :, :H], g[t, :, H:2 * H], g[t, :, 2 * H:]
            if mode == "no_gate":
                d_f1, d_f2, d_s = dh, dh * s, dh * f2
            else:
                d_f1, d_f2, d_s = dh * (1 - s), dh * s, dh * (f2 - f1)
            d_tb = d_s * s * (1 - s)
            d_gate = [d_tb] if folded else [d_tb * rate_dt[t], d_tb]
            torch.cat([d_f1 * (1 - f1 * f1), d_f2 * (1 - f2 * f2), *d_gate],
                      dim=-1, out=dheads[t])
        dz[t] = (dheads[t] @ w_heads) * _activation_grad(z[t], a[t], activation)
        dh = dz[t] @ w_h
    U = w_h.shape[0]
    # One product over every step (and example) for each weight.
    d_w_h = dz.reshape(-1, U).t() @ hs[:-1].reshape(-1, H)
    d_w_heads = dheads.reshape(-1, dheads.shape[-1]).t() @ a.reshape(-1, U)
    return dz, dh, d_w_h, d_w_heads, dheads.sum((0, 1)), dpure


# ---------------------------------------------------------------------------
# numba: each direction's whole time loop compiled; products on BLAS via np.dot

try:
    import numba

    from numba_kernels.cachedir import ensure_cache_dir

    ensure_cache_dir(__file__)  # a read-only install: cached elsewhere, not refused
    _HAVE_NUMBA = True
except ImportError:  # pragma: no cover - numba is a dependency; kept for a lean install
    _HAVE_NUMBA = False

_MODE_CODE = {m: i for i, m in enumerate(MODES)}
_ACT_CODE = {a: i for i, a in enumerate(ACTIVATIONS)}


def _njit(fn):
    return numba.njit(cache=True, fastmath=True, error_model="numpy")(fn) if _HAVE_NUMBA else fn


# exp(x) = 2^k e^r, x = k ln2 + r, |r| <= ln2 / 2: Cody and Waite's reduction (ln2 split in
# two so k ln2 is exact), e^r by its Taylor series to r^13 (truncation < 1e-17 relative),
# 2^k written into a float64's exponent bits. Written out so the loop compiles to vector
# instructions (numba's math.exp is one scalar call per element); to a few ulp in float64.
_LOG2E = 1.4426950408889634
_LN2_HI, _LN2_LO = 6.93147180369123816490e-01, 1.90821492927058770002e-10
_EXP_MAX = 708.0  # 2^k stays a normal float64; saturates what would over/underflow anyway
_C = tuple(1.0 / math.factorial(i) for i in range(14))


def _njit_exact(fn):
    # fastmath without reassociation, which would undo the split of ln2 (13 ulp at |x| = 80)
    return numba.njit(cache=True, fastmath={"contract"}, error_model="numpy")(fn) \
        if _HAVE_NUMBA else fn


@_njit_exact
def _exp_inplace(x, p, bits):
    """x <- exp(x) over a 1-D array; p (float64) and bits (int64) are scratch, len >= x's."""
    n = x.shape[0]
    for i in range(n):
        v = min(max(np.float64(x[i]), -_EXP_MAX), _EXP_MAX)
        k = np.floor(v * _LOG2E + 0.5)
        r = (v - k * _LN2_HI) - k * _LN2_LO
        q = _C[13]
        for c in range(12, -1, -1):
            q = q * r + _C[c]
        p[i] = q
        bits[i] = (np.int64(k) + 1023) << 52
    scale = bits[:n].view(np.float64)
    for i in range(n):
        x[i] = p[i] * scale[i]


@_njit
def _act_block(z, out, code, p, bits):
    """out <- activation(z), 1-D; tanh as 1 - 2 / (exp(2x) + 1), silu's sigmoid likewise."""
    n = z.shape[0]
    if code == 2:
        for i in range(n):
            out[i] = z[i] if z[i] > 0 else 0.0 * z[i]
        return
    if code == 4:
        for i in range(n):
            out[i] = 0.5 * z[i] * (1.0 + math.erf(z[i] / math.sqrt(2.0)))
        return
    k = 2.0 * _LECUN_SLOPE if code == 0 else (2.0 if code == 1 else -1.0)
    for i in range(n):
        out[i] = k * z[i]
    _exp_inplace(out, p, bits)
    for i in range(n):
        if code == 0:
            out[i] = _LECUN_SCALE * (1.0 - 2.0 / (out[i] + 1.0))
        elif code == 1:
            out[i] = 1.0 - 2.0 / (out[i] + 1.0)
        else:
            out[i] = z[i] / (1.0 + out[i])


@_njit
def _act_grad_block(z, a, da, out, code):
    """out <- da * activation'(z), 1-D, from z and a = activation(z)."""
    n = z.shape[0]
    if code == 0:
        for i in range(n):
            t = a[i] / _LECUN_SCALE
            out[i] = da[i] * (_LECUN_SCALE * _LECUN_SLOPE) * (1.0 - t * t)
    elif code == 1:
        for i in range(n):
            out[i] = da[i] * (1.0 - a[i] * a[i])
    elif code == 2:
        for i in range(n):
            out[i] = da[i] if z[i] > 0 else 0.0 * da[i]
    elif code == 3:
        for i in range(n):
            s = 1.0 / (1.0 + math.exp(-z[i]))
            out[i] = da[i] * s * (1.0 + z[i] * (1.0 - s))
    else:
        for i in range(n):
            out[i] = da[i] * (0.5 * (1.0 + math.erf(z[i] / math.sqrt(2.0)))
                              + z[i] * math.exp(-0.5 * z[i] * z[i]) / math.sqrt(2.0 * math.pi))


@_njit
def _forward_nb(xin, h0, rate_dt, mode, act, w_h_t, w_heads_t, b_heads, w_tau, A,
                hs, z, a, g):
    T, B, U = xin.shape
    H = h0.shape[1]
    folded = w_heads_t.shape[1] == 3 * H
    keep = 0.0 if mode == 1 else 1.0  # default: h = f1 + s (f2 - f1); no_gate: f1 + s f2
    n = B * max(U, 3 * H)
    p, bits = np.empty(n), np.empty(n, np.int64)  # scratch of _exp_inplace
    e = np.empty((B, 3 * H), xin.dtype)  # the exponentials' arguments, then their values
    flat = e.reshape(B * 3 * H)
    hs[0] = h0
    for t in range(T):
        zt = z[t]
        zt[:] = np.dot(hs[t], w_h_t)  # (B, U)
        zt += xin[t]
        _act_block(zt.reshape(B * U), a[t].reshape(B * U), act, p, bits)
        heads = np.dot(a[t], w_heads_t)  # (B, 4H), (B, 3H) folded, or (B, H)
        heads += b_heads
        if mode == 2:  # the decay exp(-r (|w_tau| + |ff1|)), (B, H) in the first B * H
            for b in range(B):
                for j in range(H):
                    flat[b * H + j] = -rate_dt[t, b, j] * (abs(w_tau[0, j]) + abs(heads[b, j]))
            _exp_inplace(flat[:B * H], p, bits)
            for b in range(B):
                for j in range(H):
                    ff1, decay = heads[b, j], flat[b * H + j]
                    g[t, b, j] = ff1
                    g[t, b, H + j] = decay
                    hs[t + 1, b, j] = A[0, j] - A[0, j] * decay * ff1
            continue
        # tanh(x) = 1 - 2 / (exp(2x) + 1), sigmoid(x) = 1 / (1 + exp(-x))
        for b in range(B):
            for j in range(2 * H):
                e[b, j] = 2.0 * heads[b, j]
        if folded:
            for b in range(B):
                for j in range(H):
                    e[b, 2 * H + j] = -heads[b, 2 * H + j]
        else:
            for b in range(B):
                for j in range(H):
                    e[b, 2 * H + j] = -(heads[b, 2 * H + j] * rate_dt[t, b, j]
                                        + heads[b, 3 * H + j])
        _exp_inplace(flat, p, bits)
        # One store per loop over a row: few enough pointers for the vectoriser's checks.
        for b in range(B):
            eb, gb, hb = e[b], g[t, b], hs[t + 1, b]
            for j in range(2 * H):  # f1 | f2
                gb[j] = 1.0 - 2.0 / (eb[j] + 1.0)
            for j in range(2 * H, 3 * H):  # s
                gb[j] = 1.0 / (1.0 + eb[j])
            for j in range(H):
                hb[j] = gb[j] + gb[2 * H + j] * (gb[H + j] - keep * gb[j])


@_njit
def _backward_nb(grad_out, hs, z, a, g, rate_dt, mode, act, w_h, w_heads, w_tau, A,
                 dz, dheads, dh, dpure, d_w_h, d_w_heads, d_b_heads):
    T, B, H = grad_out.shape
    U = z.shape[2]
    folded = w_heads.shape[0] == 3 * H
    keep = 0.0 if mode == 1 else 1.0  # as in the forward
    for t in range(T - 1, -1, -1):
        dh += grad_out[t]  # d loss / d h_t: from this step's output and from step t + 1
        if mode == 2:
            for b in range(B):
                for j in range(H):
                    d, r = dh[b, j], rate_dt[t, b, j]
                    ff1 = g[t, b, j]
                    decay = g[t, b, H + j]
                    dheads[t, b, j] = -d * A[0, j] * decay * (1.0 - r * abs(ff1))
                    sgn = 1.0 if w_tau[0, j] > 0 else (-1.0 if w_tau[0, j] < 0 else 0.0)
                    dpure[0, j] += d * A[0, j] * ff1 * decay * r * sgn
                    dpure[1, j] += d * (1.0 - decay * ff1)
        else:
            for b in range(B):  # one store per loop, as in the forward
                d, gb, db = dh[b], g[t, b], dheads[t, b]  # gb: f1 | f2 | s
                for j in range(H):
                    db[j] = d[j] * (1.0 - keep * gb[2 * H + j]) * (1.0 - gb[j] * gb[j])
                for j in range(H):
                    db[H + j] = d[j] * gb[2 * H + j] * (1.0 - gb[H + j] * gb[H + j])
                for j in range(H):
                    s = gb[2 * H + j]
                    db[2 * H + j] = d[j] * (gb[H + j] - keep * gb[j]) * s * (1.0 - s)
            if not folded:  # the gate's input is time_a * r + time_b
                for b in range(B):
                    for j in range(H):
                        d_gate = dheads[t, b, 2 * H + j]
                        dheads[t, b, 2 * H + j] = d_gate * rate_dt[t, b, j]
                        dheads[t, b, 3 * H + j] = d_gate
        da = np.dot(dheads[t], w_heads)  # (B, U)
        _act_grad_block(z[t].reshape(B * U), a[t].reshape(B * U), da.reshape(B * U),
                        dz[t].reshape(B * U), act)
        dh[:] = np.dot(dz[t], w_h)  # (B, H): into the previous step
    # One product over every step (and example) for each weight.
    dz2 = dz.reshape(T * B, U)
    dheads2 = dheads.reshape(T * B, dheads.shape[2])
    d_w_h[:] = np.dot(dz2.T, hs[:T].reshape(T * B, H))
    d_w_heads[:] = np.dot(dheads2.T, a.reshape(T * B, U))
    d_b_heads[:] = 0.0
    for i in range(T * B):
        d_b_heads += dheads2[i]


_BLAS = []  # the process's BLAS thread pools, found once numba's BLAS is loaded


def _one_blas_thread():
    """Run numba's per-step products (scipy's OpenBLAS) on one thread.

    They are tiny (32 x 64 x 128 at the benchmark size): extra BLAS threads only add spinning,
    and on a shared machine that spinning costs several times the work.
    """
    if not _BLAS:
        try:
            import scipy.linalg.cython_blas  # noqa: F401  (the BLAS numba's np.dot calls)
            from threadpoolctl import ThreadpoolController

            _BLAS.append(ThreadpoolController())
        except ImportError:  # pragma: no cover
            _BLAS.append(None)
    if _BLAS[0] is None:  # pragma: no cover
        return contextlib.nullcontext()
    return _BLAS[0].limit(limits=1, user_api="blas")


def _np(x: torch.Tensor) -> np.ndarray:
    return x.detach().contiguous().numpy()


def _pure_args(pure, like):
    if pure:
        return _np(pure[0]), _np(pure[1])
    dummy = np.zeros((1, 1), dtype=_np(like).dtype)
    return dummy, dummy


def _forward_numba(xin, h0, rate_dt, mode, activation, w_h, w_heads, b_heads, *pure):
    T, B, U = xin.shape
    H = h0.shape[1]
    hs = xin.new_empty(T + 1, B, H)
    z, a = torch.empty_like(xin), torch.empty_like(xin)
    g = xin.new_empty(T, B, 3 * H)
    w_tau, A = _pure_args(pure, xin)
    with _one_blas_thread():
        _forward_nb(_np(xin), _np(h0), _np(rate_dt), _MODE_CODE[mode], _ACT_CODE[activation],
                    np.ascontiguousarray(_np(w_h).T), np.ascontiguousarray(_np(w_heads).T),
                    _np(b_heads), w_tau, A, hs.numpy(), z.numpy(), a.numpy(), g.numpy())
    return hs, z, a, g


def _backward_numba(grad_out, hs, z, a, g, rate_dt, mode, activation, w_h, w_heads, *pure):
    T, B, H = grad_out.shape
    dz = torch.empty_like(z)
    dheads = z.new_empty(T, B, w_heads.shape[0])
    dh = hs.new_zeros(B, H)
    dpure = hs.new_zeros(2, H)
    d_w_h, d_w_heads = torch.empty_like(w_h), torch.empty_like(w_heads)
    d_b_heads = w_heads.new_empty(w_heads.shape[0])
    w_tau, A = _pure_args(pure, z)
    with _one_blas_thread():
        _backward_nb(_np(grad_out), _np(hs), _np(z), _np(a), _np(g), _np(rate_dt),
                     _MODE_CODE[mode], _ACT_CODE[activation], _np(w_h), _np(w_heads), w_tau, A,
                     dz.numpy(), dheads.numpy(), dh.numpy(), dpure.numpy(), d_w_h.numpy(),
                     d_w_heads.numpy(), d_b_heads.numpy())
    grads = [dpure[0:1], dpure[1:2]] if pure else []
    return dz, dh, d_w_h, d_w_heads, d_b_heads, grads


# ---------------------------------------------------------------------------


@torch.no_grad()
def load_ncps(ours: CfC, theirs) -> None:
    """Copy the weights of an ``ncps.torch.CfC`` (not wired, no mixed memory) into ``ours``."""
    cell, other = ours.cell, theirs.rnn_cell
    layers = [m for m in other.backbone if isinstance(m, nn.Linear)]
    if len(layers) != len(cell.backbone):
        raise ValueError(f"ncps CfC has {len(layers)} backbone layers, ours "
                         f"{len(cell.backbone)}; build ours with the same backbone_layers")
    for mine, src in zip(cell.backbone, layers):
        mine.weight.copy_(src.weight)
        mine.bias.copy_(src.bias)
    names = ["ff1"] if cell.mode == "pure" else ["ff1", "ff2", "time_a", "time_b"]
    cell.heads.weight.copy_(torch.cat([getattr(other, n).weight for n in names]))
    cell.heads.bias.copy_(torch.cat([getattr(other, n).bias for n in names]))
    if cell.mode == "pure":
        cell.w_tau.copy_(other.w_tau)
        cell.A.copy_(other.A)
