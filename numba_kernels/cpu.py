"""CPU forms of the kernels: ``numba.njit(parallel=True)`` on numpy views of torch tensors.

The maths is DESIGN section 5 (mixed apical traffic, seed 003), written once more
for the CPU; ``reference.py`` states it in plain torch and the tests hold the two
together. All arrays arrive contiguous and flattened by the dispatcher:
populations as ``(B, N)`` (batch, units), per-unit parameters as ``(N,)``.

Determinism without atomics: every sum of squares is formed per example row, in
chunks of ``CHUNK`` units whose partial sums are added to the row's float64 total
in chunk order; the population total adds the rows in row order. A task is one
example row; which thread runs a task never changes the arithmetic, so results
are equal bit for bit run to run and for any ``NUMBA_NUM_THREADS``, for the same
aliasing of ``out``: an ``out`` that is I or h itself (allowed: each element is read
before it is written) makes LLVM's overlap check take the loop's scalar version,
whose sums of squares add in another order (they then differ in the last digits).

Speed: inside a chunk the squares are summed in the input dtype (float32 lanes
vectorise twice as wide as float64) with ``fastmath={"reassoc", "contract"}``, so
the reductions vectorise and each ``acc += x * x`` is one FMA; the order is fixed
at compile time. ``_signals`` (traffic, raw, innovation) carries no fastmath flag
of its own, but once inlined LLVM may contract its ``d*h - b`` into one FMA too
(it does on x86-64): results stay within float rounding of the reference, and
the exact-predictor property below survives either way. (A float32 value above about
1.8e19 overflows its square here, where the CUDA kernels, squaring in float64, do not;
either way a matched row whose norms are not finite is NaN, as in the reference.)
Innovation is formed as ``I + ((g*C - P)*h - b)``, equal to ``R - (P*h + b)`` in
real arithmetic, so an exact predictor (``P == g*C``, ``b == 0``) gives a correction of exactly zero
(``0*h - 0``, fused or not) and innovation == instruction bit for bit (on the GPU
too).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .cachedir import ensure_cache_dir

ensure_cache_dir(__file__)  # before the first cache=True function below

# Units per chunk of a row. Chunk partials in the input dtype then float64: a
# float32 partial sums at most CHUNK squares spread over the vector lanes
# (relative error around 1e-7), the row total is float64.
CHUNK = 4096
RAW, INNOVATION, MATCHED = 0, 1, 2
RULE_CODES = {"raw": RAW, "innovation": INNOVATION, "matched": MATCHED}
# Columns of the per-row sums of squares: instruction, traffic, raw, innovation.
SS_I, SS_T, SS_R, SS_N = 0, 1, 2, 3
# Below this many elements a parallel launch costs more than it saves.
SERIAL_BELOW = 1 << 15


@njit(cache=True)
def _signals(i, hv, gc, d, bb):
    # (traffic, raw, innovation) for one element, in the documented order; d = gC - P.
    # An exact predictor (d == 0, b == 0) makes the correction exactly zero.
    t = gc * hv
    r = i + t
    n = i + (d * hv - bb)  # = R - (P h + b)
    return t, r, n


# MT-2's forms of the signals in ``mixed_local`` (a literal per compiled kernel):
# UNIT, the seed's per-unit affine predictor above; QUAD, the per-unit quadratic one
# (P h + P2 h^2 + b); GIVEN, any traffic model and predictor, their T and prediction
# formed beforehand (in torch) and read per element.
UNIT, QUAD, GIVEN = 0, 1, 2
FORM_CODES = {"unit": UNIT, "quadratic": QUAD, "given": GIVEN}


@njit(cache=True, inline="always")
def _quadratic(i, hv, gc, d, q, bb):
    # d = gC - P, q = P2: the correction ((gC - P) - P2 h) h - b, as the reference forms it
    # (exactly zero under an exact predictor, as in _signals).
    t = gc * hv
    return t, i + t, i + ((d - q * hv) * hv - bb)


@njit(cache=True, inline="always")
def _given(i, tx, px, sg):
    # T and the prediction given, in the reference's units; sg = -s turns them into the
    # gradient convention (negation is exact: the reference's bits).
    t = sg * tx
    return t, i + t, i + sg * (tx - px)


def _make_chunk(rule):
    # One chunk of one example row (1-D slices): writes the row's ``out`` (innovation N,
    # or raw R, which matched rescales in a second pass) and returns the row's sums of
    # squares in the input dtype. One compiled loop per rule with no branch inside, 1-D
    # slices, a plain range loop and the store after every load: that is what lets LLVM
    # vectorise the four reductions. ``contract`` makes each ``acc += x * x`` one FMA
    # (see the module docstring for what else it may fuse).
    @njit(cache=True, fastmath={"reassoc", "contract"})
    def chunk(I, h, o, gC, d, b, zero):
        a_i = a_t = a_r = a_n = zero
        for j in range(I.size):
            i = I[j]
            t, r, n = _signals(i, h[j], gC[j], d[j], b[j])
            a_i += i * i
            a_t += t * t
            a_r += r * r
            a_n += n * n
            o[j] = n if rule == INNOVATION else r
        return a_i, a_t, a_r, a_n

    return chunk


_chunk_raw, _chunk_innovation = _make_chunk(RAW), _make_chunk(INNOVATION)


@njit(cache=True)
def _rescale(o, rows, scales, e):
    """Matched's second pass over row e, still in cache (L2): R * ||N_e|| / ||R_e||.

    The scale is rounded to the input dtype (stored in ``scales``); an all-zero raw row
    has no direction, so it is sent as zero; a row whose norms overflow has no matched
    signal: x - x adds NaN exactly when x is infinite (or NaN). No fastmath here.
    """
    r, n = rows[e, SS_R], rows[e, SS_N]
    scales[e] = (math.sqrt(n / r) if r > 0.0 else 0.0) + (r - r) + (n - n)
    f = scales[e]
    for j in range(o.size):
        o[j] *= f


@njit(cache=True)
def _totals(rows, rule):
    # Rows added in row order: [instruction, traffic, raw, innovation, used].
    tot = np.zeros(5)
    for e in range(rows.shape[0]):
        for q in range(4):
            tot[q] += rows[e, q]
        if rule == RAW:
            tot[4] += rows[e, SS_R]
        elif rule == INNOVATION:
            tot[4] += rows[e, SS_N]
        else:
            # ||M_e|| = ||N_e|| exactly in real arithmetic; zero where raw is zero; NaN
            # where a norm is not finite (the row is NaN, as in the reference).
            r, n = rows[e, SS_R], rows[e, SS_N]
            tot[4] += (n if r != 0.0 else 0.0) + (r - r) + (n - n)
    return tot


@njit(cache=True)
def _units(C, g, P):
    # Once per call: g*C in the input dtype (as torch rounds C * g) and d = gC - P, the
    # per-unit factor of the innovation's correction; both stay cache-resident.
    gC = C * g
    return gC, gC - P


def _make_mixed(parallel: bool):
    # The same body compiled twice. ``rows_of`` must be a variable of the closure, not
    # only the decorator's flag: numba's cache keys a closure by its code and its
    # closure's values, so two compilations that differ only in the flag would share
    # one cache entry (the serial kernel came back parallel from the cache). The row
    # loop sits in the prange body itself (an earlier version called a per-row
    # function with its arguments packed in tuples: 5-8 % slower from memory); the
    # chunk loops are the shared compiled functions above, so the serial and parallel
    # kernels do the same arithmetic.
    rows_of = prange if parallel else range

    @njit(cache=True, parallel=parallel)
    def mixed(I, h, C, g, P, b, rule, out):
        B, N = I.shape
        gC, d = _units(C, g, P)  # (N,) each
        zero = g - g  # g is finite: zero in the input dtype
        rows = np.empty((B, 4))  # per-row sums of squares, float64
        scales = np.zeros(B, dtype=I.dtype)  # matched's ||N_e|| / ||R_e||
        for e in rows_of(B):
            s_i = s_t = s_r = s_n = 0.0
            for j0 in range(0, N, CHUNK):
                j1 = min(j0 + CHUNK, N)
                if rule == INNOVATION:
                    x = _chunk_innovation(I[e, j0:j1], h[e, j0:j1], out[e, j0:j1],
                                          gC[j0:j1], d[j0:j1], b[j0:j1], zero)
                else:  # raw, and matched's first pass
                    x = _chunk_raw(I[e, j0:j1], h[e, j0:j1], out[e, j0:j1],
                                   gC[j0:j1], d[j0:j1], b[j0:j1], zero)
                # chunk partials into the row's float64 sums, in chunk order
                s_i += np.float64(x[SS_I])
                s_t += np.float64(x[SS_T])
                s_r += np.float64(x[SS_R])
                s_n += np.float64(x[SS_N])
            rows[e, SS_I] = s_i
            rows[e, SS_T] = s_t
            rows[e, SS_R] = s_r
            rows[e, SS_N] = s_n
            if rule == MATCHED:
                _rescale(out[e], rows, scales, e)
        return _totals(rows, rule)

    return mixed


_mixed_parallel, _mixed_serial = _make_mixed(True), _make_mixed(False)


def mixed_apical(I, h, C, g, P, b, rule: int, out):
    """Fused mixed-apical pass on numpy arrays; returns float64 totals (5,).

    I, h, out: (B, N); C, P, b: (N,); g: the gain as a scalar of the input dtype
    (``I.dtype.type(gain)``), so g*C is rounded as torch's ``C * gain``.

    Launch: ``prange`` over the B example rows (numba gives each thread a contiguous
    block of rows, so each thread streams its part of I, h and out front to back:
    three streams per thread, as in an add); serial below ``SERIAL_BELOW`` elements.
    (Pairs of rows sharing each load of the per-unit factors were faster with the
    population in cache, but six streams per thread lose a quarter of the streaming
    bandwidth; see ``benchmarks/bench_kernels.py``.) Memory contract: reads I, h
    (B, N) and C, P, b (N,) (once, to form g*C and g*C - P, which stay cache-resident
    and are read once per row); writes ``out`` (B, N) (not in place); no other
    writes but per-call workspaces of (N,) and (B, 4). Bytes per element:
    3 * itemsize (read I, h; write used) plus 3 * itemsize per unit. Matched makes
    two passes inside one task: the first writes raw and forms the row's sums of
    squares (hence ||N_e||, ||R_e||), the second rescales the row in place while it
    is still in cache (L2) to R * ||N_e|| / ||R_e||; from main memory it still moves
    3 * itemsize per element (plus 2 * itemsize read and written in cache).
    Totals: [ss instruction, ss traffic, ss raw, ss innovation, ss used] (float64).
    """
    kernel = _mixed_serial if I.size < SERIAL_BELOW else _mixed_parallel
    return kernel(I, h, C, g, P, b, rule, out)


# ---- predictor update: per-unit reductions over the batch -------------------------------

# Units per task of the predictor update; each task walks its units down the batch.
UNIT_CHUNK = 512


@njit(cache=True)
def _predictor_rows_1(he, te, p, q, sh, sr):
    # Pass 1 over one example's slice: per-unit sums of h and of r = T - (P h + b).
    for k in range(he.size):
        hv = np.float64(he[k])
        sh[k] += hv
        sr[k] += np.float64(te[k]) - (p[k] * hv + q[k])


@njit(cache=True)
def _predictor_rows_2(he, te, p, q, mh, mr, cov, var, ssr, sst):
    # Pass 2 over one example's slice: centred products and squares, per unit.
    for k in range(he.size):
        hv = np.float64(he[k])
        tv = np.float64(te[k])
        r = tv - (p[k] * hv + q[k])
        hc = hv - mh[k]
        cov[k] += (r - mr[k]) * hc
        var[k] += hc * hc
        ssr[k] += r * r
        sst[k] += tv * tv


@njit(cache=True)
def _predictor_chunk(h, T, P, b, eta, j0, j1, part, c):
    # Units j0:j1, every example. Per-unit accumulators (float64, one per unit, each
    # summed down the batch in example order) make every inner loop element-wise
    # over contiguous units: vectorised without reassociating any sum.
    B = h.shape[0]
    W = j1 - j0
    p = P[j0:j1].astype(np.float64)
    q = b[j0:j1].astype(np.float64)
    sh = np.zeros(W)
    sr = np.zeros(W)
    for e in range(B):
        _predictor_rows_1(h[e, j0:j1], T[e, j0:j1], p, q, sh, sr)
    mh = sh / B
    mr = sr / B
    cov = np.zeros(W)
    var = np.zeros(W)
    ssr = np.zeros(W)
    sst = np.zeros(W)
    # Two passes (means, then centred sums): no cancellation when a mean >> its spread.
    for e in range(B):
        _predictor_rows_2(h[e, j0:j1], T[e, j0:j1], p, q, mh, mr, cov, var, ssr, sst)
    # Both updates use the same residual (the one before this update).
    for k in range(W):
        P[j0 + k] = p[k] + eta * (cov[k] / B) / (var[k] / B + 1e-12)
        b[j0 + k] = q[k] + eta * mr[k]
    s_r = 0.0
    s_t = 0.0
    for k in range(W):  # unit order: fixed
        s_r += ssr[k]
        s_t += sst[k]
    part[c, 0] = s_r
    part[c, 1] = s_t


@njit(cache=True, parallel=True)
def _predictor_parallel(h, T, P, b, eta, part):
    N = h.shape[1]
    for c in prange(part.shape[0]):
        _predictor_chunk(h, T, P, b, eta, c * UNIT_CHUNK, min(N, (c + 1) * UNIT_CHUNK), part, c)


@njit(cache=True)
def _predictor_serial(h, T, P, b, eta, part):
    N = h.shape[1]
    for c in range(part.shape[0]):
        _predictor_chunk(h, T, P, b, eta, c * UNIT_CHUNK, min(N, (c + 1) * UNIT_CHUNK), part, c)


@njit(cache=True)
def _sum_rows(part):
    tot = np.zeros(part.shape[1])
    for c in range(part.shape[0]):
        for q in range(part.shape[1]):
            tot[q] += part[c, q]
    return tot


def predictor_update(h, T, P, b, eta: float):
    """Normalised-LMS step of the per-unit predictor, in place on P and b (numpy arrays).

    Launch: ``prange`` over chunks of ``UNIT_CHUNK`` units; each task walks its
    units down the batch twice (means, then centred covariance/variance), all in
    float64. Memory contract: reads h, T (B, N) twice (the chunk's second read
    hits cache), reads and writes P, b (N,) in place; bytes per element
    2 * itemsize (+ 4 * itemsize per unit). Returns float64 [ss residual, ss
    traffic] over the population, residual taken before the update.
    """
    n_chunks = max(1, -(-h.shape[1] // UNIT_CHUNK))
    part = np.empty((n_chunks, 2))
    kernel = _predictor_serial if h.size < SERIAL_BELOW else _predictor_parallel
    kernel(h, T, P, b, float(eta), part)
    return _sum_rows(part)


@njit(cache=True)
def _quadratic_chunk(h, T, P, P2, b, eta, j0, j1, part, c):
    # The quadratic predictor's step on units j0:j1 (reference.quadratic_predictor_update_
    # reference): per-unit float64 accumulators down the batch, as _predictor_chunk, in
    # the reference's order of operations.
    B = h.shape[0]
    W = j1 - j0
    p = P[j0:j1].astype(np.float64)
    p2 = P2[j0:j1].astype(np.float64)
    q0 = b[j0:j1].astype(np.float64)
    sh = np.zeros(W)
    sq = np.zeros(W)
    sr = np.zeros(W)
    for e in range(B):
        for k in range(W):
            hv = np.float64(h[e, j0 + k])
            qv = hv * hv
            sh[k] += hv
            sq[k] += qv
            sr[k] += np.float64(T[e, j0 + k]) - (p[k] * hv + p2[k] * qv + q0[k])
    mh, mq, mr = sh / B, sq / B, sr / B
    a = np.zeros(W)
    cc = np.zeros(W)
    d = np.zeros(W)
    u = np.zeros(W)
    v = np.zeros(W)
    ssr = np.zeros(W)
    sst = np.zeros(W)
    for e in range(B):
        for k in range(W):
            hv = np.float64(h[e, j0 + k])
            tv = np.float64(T[e, j0 + k])
            qv = hv * hv
            r = tv - (p[k] * hv + p2[k] * qv + q0[k])
            hc, qc, rc = hv - mh[k], qv - mq[k], r - mr[k]
            a[k] += hc * hc
            cc[k] += hc * qc
            d[k] += qc * qc
            u[k] += rc * hc
            v[k] += rc * qc
            ssr[k] += r * r
            sst[k] += tv * tv
    for k in range(W):
        ak, ck, dk = a[k] / B + 1e-12, cc[k] / B, d[k] / B + 1e-12
        uk, vk = u[k] / B, v[k] / B
        det = ak * dk - ck * ck
        if not det > 1e-24 * ak * dk:  # a degenerate unit: no step (NaN too)
            det = np.inf
        P[j0 + k] = p[k] + eta * (dk * uk - ck * vk) / det
        P2[j0 + k] = p2[k] + eta * (ak * vk - ck * uk) / det
        b[j0 + k] = q0[k] + eta * mr[k]
    s_r = 0.0
    s_t = 0.0
    for k in range(W):  # unit order: fixed
        s_r += ssr[k]
        s_t += sst[k]
    part[c, 0] = s_r
    part[c, 1] = s_t


@njit(cache=True, parallel=True)
def _quadratic_parallel(h, T, P, P2, b, eta, part):
    N = h.shape[1]
    for c in prange(part.shape[0]):
        _quadratic_chunk(h, T, P, P2, b, eta, c * UNIT_CHUNK, min(N, (c + 1) * UNIT_CHUNK),
                         part, c)


@njit(cache=True)
def _quadratic_serial(h, T, P, P2, b, eta, part):
    N = h.shape[1]
    for c in range(part.shape[0]):
        _quadratic_chunk(h, T, P, P2, b, eta, c * UNIT_CHUNK, min(N, (c + 1) * UNIT_CHUNK),
                         part, c)


def quadratic_predictor_update(h, T, P, P2, b, eta: float):
    """MT-2's quadratic predictor step, in place on P, P2 and b (numpy arrays): launch and
    memory contract as ``predictor_update`` (+ P2 read and written per unit)."""
    n_chunks = max(1, -(-h.shape[1] // UNIT_CHUNK))
    part = np.empty((n_chunks, 2))
    kernel = _quadratic_serial if h.size < SERIAL_BELOW else _quadratic_parallel
    kernel(h, T, P, P2, b, float(eta), part)
    return _sum_rows(part)


# ---- aux add --------------------------------------------------------------------------------


@njit(cache=True, parallel=True)
def _add_parallel(dst, src):
    for i in prange(dst.size):
        dst[i] += src[i]


@njit(cache=True)
def _add_serial(dst, src):
    for i in range(dst.size):
        dst[i] += src[i]


def aux_add(dst, src):
    """``dst += src`` in place on flat numpy arrays of one dtype.

    Launch: ``prange`` over the elements (numba splits them into one contiguous
    range per thread); serial below ``SERIAL_BELOW`` elements. Memory contract:
    reads src, reads and writes dst in place; 3 * itemsize bytes per element.
    """
    (_add_serial if dst.size < SERIAL_BELOW else _add_parallel)(dst, src)


# ---- mixed local: a population's backward step to the layer that made it ------------------

# The clean reference of the mixed-traffic study: the used signal is the instruction.
NONE = 3
LOCAL_CODES = {"none": NONE, **RULE_CODES}
# Per-channel sums of the local kernel: instruction, traffic, raw, innovation (squares),
# then the norm's backward reductions of the masked used signal m (sum m, sum m * xhat)
# and of the masked instruction q (sum q, sum q * xhat).
L_M, L_MX, L_Q, L_QX = 4, 5, 6, 7
L_SUMS = 8


# Numba's cache keys a closure by its code and the pickled values of its closure
# cells, and a dispatcher pickles with a uuid drawn per process: a closure that holds
# another compiled function misses the cache in every new process (recompiling for
# tens of seconds, and adding an entry to the index each time). So every function
# here is a module function, and the kernels' only closure value is the loop kind.
# The rule reaches the per-example functions and the slab loops as a literal (the
# kernels branch on it once per example), and the output flags too, so numba
# compiles one instance of each slab loop per rule and set of outputs and prunes
# the other branches: no branch is left inside a loop (what lets it vectorise), and
# the serial and parallel kernels call the same compiled functions (two compilations
# of one reassociated loop may vectorise it differently).
@njit(cache=True, inline="always")
def _used(i, t, r, n, f, rule):
    if rule == RAW:
        return r
    if rule == INNOVATION:
        return n
    if rule == MATCHED:
        return f * r  # R * ||N_e|| / ||R_e||, as mixed_apical rounds it
    return i


@njit(cache=True, inline="always")
def _element(I, H, O, GC, D, Bb, Q, TX, PX, sg, e, ch, j, f, scale, mu, istd, zero, rule,
             form):
    # One element of slab (e, ch) as both passes see it: the instruction, the signals,
    # the ReLU mask, the masked scaled used signal m and the normalised layer output
    # xhat. A slab is one example's slice of one channel, contiguous, length S. The
    # loops take the whole (B, Ch, S) arrays and the slab's (e, ch), not slices: at
    # S = 64 (a ResNet-20's last stage) building ten views per slab cost more than
    # the slab's arithmetic. Inlined in numba's IR, so the loop's fastmath flags
    # (``reassoc``, ``contract``, as in mixed_apical's chunk loops) apply to it.
    # ``form`` (a literal) picks the signals' source; the others' arrays are never read.
    i, hv = I[e, ch, j], H[e, ch, j]
    if form == GIVEN:
        t, r, n = _given(i, TX[e, ch, j], PX[e, ch, j], sg)
    elif form == QUAD:
        t, r, n = _quadratic(i, hv, GC[ch, j], D[ch, j], Q[ch, j], Bb[ch, j])
    else:
        t, r, n = _signals(i, hv, GC[ch, j], D[ch, j], Bb[ch, j])
    on = hv > zero
    m = scale * _used(i, t, r, n, f, rule) if on else zero
    xh = (O[e, ch, j] - mu) * istd
    return i, t, r, n, on, m, xh


@njit(cache=True, fastmath={"reassoc", "contract"})
def _slab_sums(I, H, O, GC, D, Bb, Q, TX, PX, sg, e, ch, f, scale, mu, istd, zero, rule, form):
    # Pass 1 over slab (e, ch): the norm's reductions of the masked used signal m and
    # instruction q.
    s_m = s_mx = s_q = s_qx = zero
    for j in range(I.shape[2]):
        i, t, r, n, on, m, xh = _element(I, H, O, GC, D, Bb, Q, TX, PX, sg, e, ch, j, f,
                                         scale, mu, istd, zero, rule, form)
        q = scale * i if on else zero
        s_m += m
        s_mx += m * xh
        s_q += q
        s_qx += q * xh
    return s_m, s_mx, s_q, s_qx


@njit(cache=True, fastmath={"reassoc", "contract"})
def _slab_write(I, H, O, OUT, INST, MASKED, GC, D, Bb, Q, TX, PX, sg, e, ch, f, scale, mu,
                istd, kac, zero, rule, want_inst, want_masked, form):
    # Pass 2 over slab (e, ch), with the signals' sums of squares: this pass waits on
    # its stores, pass 1 on its reductions, so the squares ride here nearly free.
    # out = k (m - mean m - xhat mean(m xhat)); inst the same for q; masked = I where
    # h > 0. Without a norm k = 1, the means are 0 and mu = istd = 0, so out = m
    # exactly.
    k, a, c, aq, cq = kac[ch, 0], kac[ch, 1], kac[ch, 2], kac[ch, 3], kac[ch, 4]
    s_i = s_t = s_r = s_n = zero
    for j in range(I.shape[2]):
        i, t, r, n, on, m, xh = _element(I, H, O, GC, D, Bb, Q, TX, PX, sg, e, ch, j, f,
                                         scale, mu, istd, zero, rule, form)
        OUT[e, ch, j] = k * (m - a - xh * c)
        if want_inst:
            q = scale * i if on else zero
            INST[e, ch, j] = k * (q - aq - xh * cq)
        if want_masked:
            MASKED[e, ch, j] = i if on else zero
        s_i += i * i
        s_t += t * t
        s_r += r * r
        s_n += n * n
    return s_i, s_t, s_r, s_n


@njit(cache=True)
def _example_write(I, h, o, out, inst, masked, gC, d, b, p2, tx, px, sg, fac, scale, mean, istd,
                   kac, has_norm, e, part, zero, rule, form):
    # Example e, channels in memory order: writes, and the slabs' sums of squares into
    # part[e] (float64).
    f = fac[e]
    for ch in range(I.shape[1]):
        mu = mean[ch] if has_norm else zero
        sd = istd[ch] if has_norm else zero
        # the set of outputs (an absent one has S = 0) picks the compiled loop
        if inst.shape[2] and masked.shape[2]:
            x = _slab_write(I, h, o, out, inst, masked, gC, d, b, p2, tx, px, sg, e, ch, f,
                            scale, mu, sd, kac, zero, rule, True, True, form)
        elif inst.shape[2]:
            x = _slab_write(I, h, o, out, inst, masked, gC, d, b, p2, tx, px, sg, e, ch, f,
                            scale, mu, sd, kac, zero, rule, True, False, form)
        elif masked.shape[2]:
            x = _slab_write(I, h, o, out, inst, masked, gC, d, b, p2, tx, px, sg, e, ch, f,
                            scale, mu, sd, kac, zero, rule, False, True, form)
        else:
            x = _slab_write(I, h, o, out, inst, masked, gC, d, b, p2, tx, px, sg, e, ch, f,
                            scale, mu, sd, kac, zero, rule, False, False, form)
        for q in range(4):
            part[e, ch, q] = x[q]


@njit(cache=True)
def _example_sums(I, h, o, gC, d, b, p2, tx, px, sg, fac, scale, mean, istd, has_norm, e, part,
                  zero, rule, form):
    # Example e, channels in memory order: its per-channel slab sums (input dtype) into
    # part[e] (float64). A task per example, in memory order: streaming reads.
    for ch in range(I.shape[1]):
        mu = mean[ch] if has_norm else zero
        sd = istd[ch] if has_norm else zero
        x = _slab_sums(I, h, o, gC, d, b, p2, tx, px, sg, e, ch, fac[e], scale, mu, sd, zero,
                       rule, form)
        for q in range(4):
            part[e, ch, L_M + q] = x[q]


@njit(cache=True)
def _combine(part, q0, q1, chan):
    # Channel sums of columns q0:q1: examples added in example order (float64), walking
    # part in memory order. Compiled apart, without fastmath: the order is the contract.
    for ch in range(part.shape[1]):
        for q in range(q0, q1):
            chan[ch, q] = 0.0
    for e in range(part.shape[0]):
        for ch in range(part.shape[1]):
            for q in range(q0, q1):
                chan[ch, q] += part[e, ch, q]


@njit(cache=True)
def _factors(chan, gamma, istd, has_norm, count, kac):
    # Per channel the norm's k = gamma * invstd and the means of m, m xhat, q, q xhat,
    # rounded to the input dtype.
    for ch in range(chan.shape[0]):
        if has_norm:
            kac[ch, 0] = gamma[ch] * istd[ch]
            for q in range(4):
                kac[ch, 1 + q] = chan[ch, L_M + q] / count
        else:
            kac[ch, 0] = 1.0
            for q in range(1, 5):
                kac[ch, q] = 0.0


@njit(cache=True)
def _sums_by_rule(I, h, o, gC, d, b, q, tx, px, sg, fac, scale, mean, istd, has_norm, e, part,
                  zero, rule, form):
    # The rule, a runtime code in the kernels, as a literal for the compiled loops:
    # one branch per example. (``form`` arrives as a literal already: see _make_local.)
    if rule == RAW:
        _example_sums(I, h, o, gC, d, b, q, tx, px, sg, fac, scale, mean, istd, has_norm, e,
                      part, zero, RAW, form)
    elif rule == INNOVATION:
        _example_sums(I, h, o, gC, d, b, q, tx, px, sg, fac, scale, mean, istd, has_norm, e,
                      part, zero, INNOVATION, form)
    elif rule == MATCHED:
        _example_sums(I, h, o, gC, d, b, q, tx, px, sg, fac, scale, mean, istd, has_norm, e,
                      part, zero, MATCHED, form)
    else:
        _example_sums(I, h, o, gC, d, b, q, tx, px, sg, fac, scale, mean, istd, has_norm, e,
                      part, zero, NONE, form)


@njit(cache=True)
def _write_by_rule(I, h, o, out, inst, masked, gC, d, b, q, tx, px, sg, fac, scale, mean, istd,
                   kac, has_norm, e, part, zero, rule, form):
    if rule == RAW:
        _example_write(I, h, o, out, inst, masked, gC, d, b, q, tx, px, sg, fac, scale, mean,
                       istd, kac, has_norm, e, part, zero, RAW, form)
    elif rule == INNOVATION:
        _example_write(I, h, o, out, inst, masked, gC, d, b, q, tx, px, sg, fac, scale, mean,
                       istd, kac, has_norm, e, part, zero, INNOVATION, form)
    elif rule == MATCHED:
        _example_write(I, h, o, out, inst, masked, gC, d, b, q, tx, px, sg, fac, scale, mean,
                       istd, kac, has_norm, e, part, zero, MATCHED, form)
    else:
        _example_write(I, h, o, out, inst, masked, gC, d, b, q, tx, px, sg, fac, scale, mean,
                       istd, kac, has_norm, e, part, zero, NONE, form)


def _make_local(rows_of, parallel, form):
    # The serial and the parallel kernel of one form: one body, every rule (a branch per
    # example, not per element). The per-example functions are compiled apart, once per
    # rule and form, and shared by the two kernels: numba compiles them once (about 20 s
    # on 2 slow cores for the four rules of a form, on its first call), the parallel
    # kernel's parfor shell in about 10 more. ``rows_of`` and ``form`` are closure
    # values, not only the decorator's flag, so each kernel has its own cache entry (see
    # _make_mixed), and ``form`` reaches the callees as a literal.
    @njit(cache=True, parallel=parallel)
    def kernel(I, h, o, out, inst, masked, gC, d, b, q, tx, px, sg, fac, scale, mean, istd,
               gamma, has_norm, chan, zero, rule):
        B, Ch = I.shape[0], I.shape[1]
        part = np.empty((B, Ch, L_SUMS))
        # e as int64 in both kernels: prange's index is unsigned, and the callees would
        # be compiled a second time for it
        for e in rows_of(B):
            _sums_by_rule(I, h, o, gC, d, b, q, tx, px, sg, fac, scale, mean, istd, has_norm,
                          np.int64(e), part, zero, rule, form)
        _combine(part, L_M, L_SUMS, chan)
        kac = np.empty((Ch, 5), dtype=I.dtype)
        _factors(chan, gamma, istd, has_norm, B * I.shape[2], kac)
        for e in rows_of(B):
            _write_by_rule(I, h, o, out, inst, masked, gC, d, b, q, tx, px, sg, fac, scale,
                           mean, istd, kac, has_norm, np.int64(e), part, zero, rule, form)
        _combine(part, 0, L_M, chan)
    return kernel


# _LOCAL[form] = (serial, parallel)
_LOCAL = tuple((_make_local(range, False, f), _make_local(prange, True, f))
               for f in (UNIT, QUAD, GIVEN))


@njit(cache=True, fastmath={"reassoc", "contract"})
def _norm_row(i_, h_, gC, d, b, q, tx, px, sg, zero, form):
    # One example's sums of squares of raw and innovation (matched's first pass).
    s_r = s_n = zero
    for j in range(i_.size):
        if form == GIVEN:
            t, r, n = _given(i_[j], tx[j], px[j], sg)
        elif form == QUAD:
            t, r, n = _quadratic(i_[j], h_[j], gC[j], d[j], q[j], b[j])
        else:
            t, r, n = _signals(i_[j], h_[j], gC[j], d[j], b[j])
        s_r += r * r
        s_n += n * n
    return s_r, s_n


@njit(cache=True)
def _norm_chunk(I, h, gC, d, b, q, tx, px, sg, e, j0, j1, zero, form):
    # The form, a runtime code here, as a literal for the compiled loop.
    if form == GIVEN:
        return _norm_row(I[e, j0:j1], h[e, j0:j1], gC, d, b, q, tx[e, j0:j1], px[e, j0:j1], sg,
                         zero, GIVEN)
    if form == QUAD:
        return _norm_row(I[e, j0:j1], h[e, j0:j1], gC[j0:j1], d[j0:j1], b[j0:j1], q[j0:j1],
                         tx[e, 0:0], px[e, 0:0], sg, zero, QUAD)
    return _norm_row(I[e, j0:j1], h[e, j0:j1], gC[j0:j1], d[j0:j1], b[j0:j1], q, tx[e, 0:0],
                     px[e, 0:0], sg, zero, UNIT)


@njit(cache=True, parallel=True)
def _matched_rows(I, h, gC, d, b, q, tx, px, sg, rows, fac, zero, form):
    # Per example: ||R_e||^2 and ||N_e||^2 (chunks of CHUNK in order, float64), the scale.
    B, N = I.shape
    for e in prange(B):
        s_r = s_n = 0.0
        for j0 in range(0, N, CHUNK):
            j1 = min(j0 + CHUNK, N)
            x = _norm_chunk(I, h, gC, d, b, q, tx, px, sg, np.int64(e), j0, j1, zero, form)
            s_r += np.float64(x[0])
            s_n += np.float64(x[1])
        rows[e, 0] = s_r
        rows[e, 1] = s_n
        # rounded to the input dtype; NaN where a norm is not finite, as in _row
        fac[e] = (math.sqrt(s_n / s_r) if s_r > 0.0 else 0.0) + (s_r - s_r) + (s_n - s_n)


def mixed_local(I, h, o, out, inst, masked, C, g, P, b, rule: int, scale, mean, istd,
                gamma, P2=None, T=None, prediction=None, sg=None):
    """A population's backward step to the output o of the layer that made it (numpy).

    I, h, o, out: (B, Ch, S); ``inst``, ``masked``: (B, Ch, S), or (B, Ch, 0) when not
    wanted; C, P, b: (Ch, S); mean, istd, gamma: (Ch,) or None (no norm); g, scale:
    scalars of the input dtype. out = L(used), inst = L(I), masked = I where h > 0,
    with L the ReLU mask, ``scale`` and the norm's backward. MT-2: ``P2`` (Ch, S), the
    quadratic predictor's term (form QUAD); or ``T`` and ``prediction`` (B, Ch, S) given
    in the reference's units with ``sg`` = -sign (form GIVEN; C, g, P, b unused).

    Launch: ``prange`` over examples for the norm's per-channel slab sums (each task
    reads its example in memory order), a serial per-channel combine (examples
    added in example order, float64), then ``prange`` over examples for the writes,
    which form the sums of squares on the way (combined the same way); matched first
    runs a ``prange`` over examples for the per-example norms. Memory contract:
    reads I, h, o twice (GIVEN: T and the prediction too); writes out, and inst and
    masked when wanted (not in place): (7 + wanted outputs) * itemsize bytes per
    element (GIVEN: + 4), +2 for matched's first pass (GIVEN: + 4); C, P, b (P2) read
    once per slab. Returns float64 (Ch, 8) per-channel sums [ss I, ss T, ss R, ss N,
    sum m, sum m xhat, sum q, sum q xhat] and, for matched, the per-example rows (B, 2)
    [ss R, ss N], else None.
    """
    B, Ch, S = I.shape
    dt = I.dtype
    # Made here, not taken from _units: a float32 scalar returned to Python comes back
    # as a Python float, and a float64 zero would turn every loop into float64 arithmetic.
    zero = dt.type(0)
    none_unit, none_pop = np.empty((Ch, 0), dtype=dt), np.empty((B, Ch, 0), dtype=dt)
    if T is not None:
        form, gC = GIVEN, none_unit
        d = b = q = gC
        tx, px, sgn = T, prediction, dt.type(sg)
    else:
        form = UNIT if P2 is None else QUAD
        gC, d = _units(C, g, P)
        gC, d = gC.reshape(Ch, S), d.reshape(Ch, S)
        q = none_unit if P2 is None else P2
        tx = px = none_pop
        sgn = zero
    rows = None
    fac = np.ones(B, dtype=dt)
    if rule == MATCHED:
        rows = np.empty((B, 2))
        _matched_rows(I.reshape(B, -1), h.reshape(B, -1), gC.reshape(-1), d.reshape(-1),
                      b.reshape(-1), q.reshape(-1), tx.reshape(B, -1), px.reshape(B, -1), sgn,
                      rows, fac, zero, form)
    has_norm = mean is not None
    if not has_norm:
        mean = istd = gamma = np.zeros(1, dtype=dt)
        o = h
    chan = np.empty((Ch, L_SUMS))
    kernel = _LOCAL[form][0 if I.size < SERIAL_BELOW else 1]
    kernel(I, h, o, out, inst, masked, gC, d, b, q, tx, px, sgn, fac, scale, mean, istd, gamma,
           has_norm, chan, zero, rule)
    return chan, rows
