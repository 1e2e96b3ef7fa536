"""CUDA forms of the kernels (numba-cuda), zero-copy on anything with ``__cuda_array_interface__``.

The maths is DESIGN section 5 (mixed apical traffic, seed 003), as in ``cpu.py``
and ``reference.py``. This module takes device arrays (torch tensors wrapped by
``cuda.as_cuda_array``, numba device arrays, or numpy arrays under the simulator
``NUMBA_ENABLE_CUDASIM=1``) already flattened: populations ``(B, N)``, per-unit
parameters ``(N,)``. The caller owns the workspace (so torch's caching allocator
serves it) and the stream (torch's current stream).

Determinism without atomics: each block reduces its threads' partial sums in
shared memory by a fixed tree; a second kernel adds the block partials in index
order, one thread per sum. Grids depend on (B, N) only, never on the device, so
the same inputs give the same bits on every run.

``kernels(tpb)`` builds the kernels for ``tpb`` threads per block (a power of
two): 256 on a GPU, fewer under the simulator, which runs every thread as a
Python thread.
"""

from __future__ import annotations

import math
from functools import cache

from numba import cuda, float64

TPB = 256
# Elements per thread and row block: fixes how many blocks share one example's row.
ITEMS = 4
MAX_ROW_BLOCKS = 256
MAX_GRID_Y = 65535
RAW, INNOVATION, MATCHED = 0, 1, 2
# mixed_local's sources of the signals (cpu.py's forms): per-unit affine (the seed's),
# per-unit quadratic (d - q h) h - b, or T and the prediction given per element.
UNIT, QUAD, GIVEN = 0, 1, 2


def row_blocks(N: int, tpb: int = TPB) -> int:
    """Blocks per example row of the mixed-apical kernels (a function of N only)."""
    return max(1, min(MAX_ROW_BLOCKS, -(-N // (tpb * ITEMS))))


def unit_blocks(N: int, tpb: int = TPB) -> int:
    """Blocks of the predictor kernel: one thread per unit."""
    return max(1, min(MAX_ROW_BLOCKS * 16, -(-N // tpb)))


@cache
def kernels(tpb: int = TPB) -> dict:
    """The CUDA kernels for ``tpb`` threads per block, by name."""
    if tpb & (tpb - 1):
        raise ValueError(f"threads per block must be a power of two for the tree sums, got {tpb}")

    @cuda.jit
    def mixed_rows(I, h, gC, P, b, rule, out, part):
        """Pass 1: signals, ``out`` for raw/innovation, block sums of squares.

        Grid (row_blocks(N), min(B, 65535)), ``tpb`` threads; block (x, y) covers
        units x*tpb + tx, stepping by gridDim.x*tpb, of rows y, y + gridDim.y, ...
        Reads I, h (B, N), gC, P, b (N,); writes out (B, N) (not for matched) and
        part (B, nbx, 4) float64. Bytes per element: 3 * itemsize (2 for matched).
        """
        tx = cuda.threadIdx.x
        bx = cuda.blockIdx.x
        sh = cuda.shared.array((4, tpb), float64)
        B, N = I.shape
        for e in range(cuda.blockIdx.y, B, cuda.gridDim.y):
            s_i = s_t = s_r = s_n = 0.0
            for j in range(bx * tpb + tx, N, cuda.gridDim.x * tpb):
                i = I[e, j]
                hv = h[e, j]
                t = gC[j] * hv
                r = i + t
                n = i + ((gC[j] - P[j]) * hv - b[j])  # exact when P == gC, b == 0
                if rule == RAW:
                    out[e, j] = r
                elif rule == INNOVATION:
                    out[e, j] = n
                s_i += float64(i) * float64(i)
                s_t += float64(t) * float64(t)
                s_r += float64(r) * float64(r)
                s_n += float64(n) * float64(n)
            sh[0, tx] = s_i
            sh[1, tx] = s_t
            sh[2, tx] = s_r
            sh[3, tx] = s_n
            # Fixed-order tree over the block: sh[q, 0] ends with the block's sum. (Inline:
            # a device function would need a live GPU to compile for compile_ptx.)
            cuda.syncthreads()
            stride = tpb // 2
            while stride > 0:
                if tx < stride:
                    for q in range(4):
                        sh[q, tx] += sh[q, tx + stride]
                cuda.syncthreads()
                stride //= 2
            if tx == 0:
                for q in range(4):
                    part[e, bx, q] = sh[q, 0]
            cuda.syncthreads()  # sh is reused by the next row

    @cuda.jit
    def mixed_finish(part, rule, rows, scales, tot):
        """Second pass: per-row sums, matched's scales, population totals.

        One block of ``tpb`` threads. Row e's sums add part[e, :, q] in block order
        (threads take rows e = tx, tx + tpb, ...); then thread q < 5 adds the rows in
        row order. Writes rows (B, 4) float64, scales (B,) in the input dtype
        (||N_e|| / ||R_e||, zero where raw is zero) and tot (5,) float64:
        [instruction, traffic, raw, innovation, used].
        """
        tx = cuda.threadIdx.x
        B = part.shape[0]
        for e in range(tx, B, tpb):
            for q in range(4):
                s = 0.0
                for k in range(part.shape[1]):
                    s += part[e, k, q]
                rows[e, q] = s
            r, n = rows[e, 2], rows[e, 3]  # NaN where a norm is not finite, as on the CPU
            scales[e] = (math.sqrt(n / r) if r > 0.0 else 0.0) + (r - r) + (n - n)
        cuda.syncthreads()
        if tx < 5:
            s = 0.0
            for e in range(B):
                if tx < 4:
                    s += rows[e, tx]
                elif rule == RAW:
                    s += rows[e, 2]
                elif rule == INNOVATION:
                    s += rows[e, 3]
                else:
                    # matched: ||M_e|| = ||N_e|| in real arithmetic; zero where raw is
                    # zero; NaN where a norm is not finite (the row is NaN)
                    r, n = rows[e, 2], rows[e, 3]
                    s += (n if r != 0.0 else 0.0) + (r - r) + (n - n)
            tot[tx] = s

    @cuda.jit
    def matched_scale(I, h, gC, scales, out):
        """Pass 2 of matched: out = (I + gC*h) * scales[e], raw recomputed from I and h.

        Grid and block as ``mixed_rows``. Reads I, h (B, N), gC (N,), scales (B,);
        writes out (B, N). Bytes per element: 3 * itemsize, so matched moves
        5 * itemsize per element in all (two reads of I and h, one write).
        """
        tx = cuda.threadIdx.x
        B, N = I.shape
        for e in range(cuda.blockIdx.y, B, cuda.gridDim.y):
            s = scales[e]
            for j in range(cuda.blockIdx.x * tpb + tx, N, cuda.gridDim.x * tpb):
                out[e, j] = (I[e, j] + gC[j] * h[e, j]) * s

    @cuda.jit
    def predictor(h, T, P, b, eta, part):
        """Normalised-LMS step, one thread per unit, in place on P and b.

        Grid unit_blocks(N), ``tpb`` threads; thread (x, tx) owns units x*tpb + tx,
        stepping by gridDim.x*tpb, and walks the batch twice (means; centred
        covariance and variance), in float64. Reads h, T (B, N) twice (coalesced
        across a warp: neighbouring threads read neighbouring units), reads and
        writes P, b (N,) in place; part (nbx, 2) float64 gets the block's sums of
        squares of the residual (before the update) and of T.
        """
        tx = cuda.threadIdx.x
        sh = cuda.shared.array((2, tpb), float64)
        B, N = h.shape
        s_r = s_t = 0.0
        for j in range(cuda.blockIdx.x * tpb + tx, N, cuda.gridDim.x * tpb):
            p = float64(P[j])
            c = float64(b[j])
            sum_h = sum_r = 0.0
            for e in range(B):
                hv = float64(h[e, j])
                sum_h += hv
                sum_r += float64(T[e, j]) - (p * hv + c)
            mean_h = sum_h / B
            mean_r = sum_r / B
            cov = var = 0.0
            for e in range(B):
                hv = float64(h[e, j])
                tv = float64(T[e, j])
                r = tv - (p * hv + c)
                hc = hv - mean_h
                cov += (r - mean_r) * hc
                var += hc * hc
                s_r += r * r
                s_t += tv * tv
            P[j] = p + eta * (cov / B) / (var / B + 1e-12)
            b[j] = c + eta * mean_r  # the same residual as P's step
        sh[0, tx] = s_r
        sh[1, tx] = s_t
        cuda.syncthreads()
        stride = tpb // 2
        while stride > 0:  # the same fixed-order tree as mixed_rows
            if tx < stride:
                sh[0, tx] += sh[0, tx + stride]
                sh[1, tx] += sh[1, tx + stride]
            cuda.syncthreads()
            stride //= 2
        if tx == 0:
            part[cuda.blockIdx.x, 0] = sh[0, 0]
            part[cuda.blockIdx.x, 1] = sh[1, 0]

    @cuda.jit
    def quadratic(h, T, P, P2, b, eta, part):
        """MT-2's quadratic predictor step (reference.quadratic_predictor_update_reference),
        one thread per unit, in place on P, P2 and b; grid, passes and ``part`` as
        ``predictor``'s."""
        tx = cuda.threadIdx.x
        sh = cuda.shared.array((2, tpb), float64)
        B, N = h.shape
        s_r = s_t = 0.0
        for j in range(cuda.blockIdx.x * tpb + tx, N, cuda.gridDim.x * tpb):
            p = float64(P[j])
            p2 = float64(P2[j])
            c0 = float64(b[j])
            sum_h = sum_q = sum_r = 0.0
            for e in range(B):
                hv = float64(h[e, j])
                qv = hv * hv
                sum_h += hv
                sum_q += qv
                sum_r += float64(T[e, j]) - (p * hv + p2 * qv + c0)
            mh, mq, mr = sum_h / B, sum_q / B, sum_r / B
            a = c = d = u = v = 0.0
            for e in range(B):
                hv = float64(h[e, j])
                tv = float64(T[e, j])
                qv = hv * hv
                r = tv - (p * hv + p2 * qv + c0)
                hc = hv - mh
                qc = qv - mq
                rc = r - mr
                a += hc * hc
                c += hc * qc
                d += qc * qc
                u += rc * hc
                v += rc * qc
                s_r += r * r
                s_t += tv * tv
            a = a / B + 1e-12
            c = c / B
            d = d / B + 1e-12
            u = u / B
            v = v / B
            det = a * d - c * c
            if not det > 1e-24 * a * d:  # a degenerate unit: no step
                det = math.inf
            P[j] = p + eta * (d * u - c * v) / det
            P2[j] = p2 + eta * (a * v - c * u) / det
            b[j] = c0 + eta * mr
        sh[0, tx] = s_r
        sh[1, tx] = s_t
        cuda.syncthreads()
        stride = tpb // 2
        while stride > 0:  # the same fixed-order tree as mixed_rows
            if tx < stride:
                sh[0, tx] += sh[0, tx + stride]
                sh[1, tx] += sh[1, tx + stride]
            cuda.syncthreads()
            stride //= 2
        if tx == 0:
            part[cuda.blockIdx.x, 0] = sh[0, 0]
            part[cuda.blockIdx.x, 1] = sh[1, 0]

    @cuda.jit
    def sum_part(part, tot):
        """Adds part[:, q] in block order into tot[q]; one block, thread q per column."""
        q = cuda.threadIdx.x
        if q < part.shape[1]:
            s = 0.0
            for k in range(part.shape[0]):
                s += part[k, q]
            tot[q] = s

    @cuda.jit
    def add(dst, src):
        """dst += src on flat arrays, grid-stride. Reads src and dst, writes dst in place:
        3 * itemsize bytes per element. Any grid works; no reduction, so nothing to order."""
        for i in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
            dst[i] += src[i]

    @cuda.jit
    def local_rows(I, h, gC, d, b, p2, gt, gp, sg, form, rows, fac):
        """Matched's first pass for ``mixed_local``: per example ||R_e||^2, ||N_e||^2, scale.

        Grid min(B, 65535) blocks (grid-stride over examples), ``tpb`` threads; block e
        reduces its row (B, M) by the fixed tree. Reads I, h (B, M), gC, d, b (M,) (QUAD:
        p2 (M,); GIVEN: gt, gp (B, M) instead of gC, d, b); writes rows (B, 2) float64 and
        fac (B,) in the input dtype (zero where raw is zero). Bytes per element:
        2 * itemsize (GIVEN: 4).
        """
        tx = cuda.threadIdx.x
        sh = cuda.shared.array((2, tpb), float64)
        B, M = I.shape
        for e in range(cuda.blockIdx.x, B, cuda.gridDim.x):
            s_r = s_n = 0.0
            for j in range(tx, M, tpb):
                i = I[e, j]
                hv = h[e, j]
                if form == GIVEN:
                    r = i + sg * gt[e, j]
                    n = i + sg * (gt[e, j] - gp[e, j])
                elif form == QUAD:
                    r = i + gC[j] * hv
                    n = i + ((d[j] - p2[j] * hv) * hv - b[j])
                else:
                    r = i + gC[j] * hv
                    n = i + (d[j] * hv - b[j])
                s_r += float64(r) * float64(r)
                s_n += float64(n) * float64(n)
            sh[0, tx] = s_r
            sh[1, tx] = s_n
            cuda.syncthreads()
            stride = tpb // 2
            while stride > 0:
                if tx < stride:
                    sh[0, tx] += sh[0, tx + stride]
                    sh[1, tx] += sh[1, tx + stride]
                cuda.syncthreads()
                stride //= 2
            if tx == 0:
                rows[e, 0] = sh[0, 0]
                rows[e, 1] = sh[1, 0]
                r, n = sh[0, 0], sh[1, 0]  # NaN where a norm is not finite
                fac[e] = (math.sqrt(n / r) if r > 0.0 else 0.0) + (r - r) + (n - n)
            cuda.syncthreads()

    @cuda.jit
    def local_sums(I, h, o, gC, d, b, p2, gt, gp, sg, form, fac, rule, scale, mean, istd,
                   has_norm, part):
        """``mixed_local`` pass 1: per (example, channel) slab, the eight sums.

        Grid (Ch, min(B, 65535)), ``tpb`` threads; block (c, y) reduces the slabs (e, c)
        for e = y, y + gridDim.y, ... by the fixed tree into part (B, Ch, 8) float64:
        squares of I, T, R, N, then sum m, sum m * xhat for the masked used signal
        m = scale * U where h > 0, and sum q, sum q * xhat for the masked instruction
        q = scale * I where h > 0. Reads I, h, o (B, Ch, S), gC, d, b (Ch, S) (QUAD: p2
        (Ch, S); GIVEN: gt, gp (B, Ch, S) instead). Bytes per element: 3 * itemsize
        (GIVEN: 5).
        """
        tx = cuda.threadIdx.x
        ch = cuda.blockIdx.x
        sh = cuda.shared.array((8, tpb), float64)
        B, S = I.shape[0], I.shape[2]
        mu = float64(mean[ch]) if has_norm else 0.0
        sd = float64(istd[ch]) if has_norm else 0.0
        for e in range(cuda.blockIdx.y, B, cuda.gridDim.y):
            acc = cuda.local.array(8, float64)
            for q in range(8):
                acc[q] = 0.0
            f = fac[e]
            for j in range(tx, S, tpb):
                i = I[e, ch, j]
                hv = h[e, ch, j]
                if form == GIVEN:
                    t = sg * gt[e, ch, j]
                    n = i + sg * (gt[e, ch, j] - gp[e, ch, j])
                elif form == QUAD:
                    t = gC[ch, j] * hv
                    n = i + ((d[ch, j] - p2[ch, j] * hv) * hv - b[ch, j])
                else:
                    t = gC[ch, j] * hv
                    n = i + (d[ch, j] * hv - b[ch, j])
                r = i + t
                u = i  # rule NONE: the clean reference
                if rule == RAW:
                    u = r
                elif rule == INNOVATION:
                    u = n
                elif rule == MATCHED:
                    u = f * r
                m = float64(scale * u) if hv > 0 else 0.0
                qv = float64(scale * i) if hv > 0 else 0.0
                xh = (float64(o[e, ch, j]) - mu) * sd
                acc[0] += float64(i) * float64(i)
                acc[1] += float64(t) * float64(t)
                acc[2] += float64(r) * float64(r)
                acc[3] += float64(n) * float64(n)
                acc[4] += m
                acc[5] += m * xh
                acc[6] += qv
                acc[7] += qv * xh
            for q in range(8):
                sh[q, tx] = acc[q]
            cuda.syncthreads()
            stride = tpb // 2
            while stride > 0:
                if tx < stride:
                    for q in range(8):
                        sh[q, tx] += sh[q, tx + stride]
                cuda.syncthreads()
                stride //= 2
            if tx == 0:
                for q in range(8):
                    part[e, ch, q] = sh[q, 0]
            cuda.syncthreads()

    @cuda.jit
    def local_combine(part, gamma, istd, has_norm, count, chan, kac):
        """Per channel (one thread each): the examples' sums in example order, then the
        norm's k = gamma * invstd and the means of m, m xhat, q, q xhat in the input
        dtype (kac (Ch, 5); count = B * S elements per channel). One block of ``tpb``
        threads, channels c = tx, tx + tpb, ..."""
        B, Ch = part.shape[0], part.shape[1]
        for ch in range(cuda.threadIdx.x, Ch, tpb):
            for q in range(8):
                acc = 0.0
                for e in range(B):
                    acc += part[e, ch, q]
                chan[ch, q] = acc
            if has_norm:
                kac[ch, 0] = gamma[ch] * istd[ch]
                for q in range(1, 5):
                    kac[ch, q] = chan[ch, 3 + q] / count
            else:
                kac[ch, 0] = 1.0
                for q in range(1, 5):
                    kac[ch, q] = 0.0

    @cuda.jit
    def local_write(I, h, o, out, inst, masked, want_inst, want_masked, gC, d, b, p2, gt, gp,
                    sg, form, fac, rule, scale, mean, istd, kac, has_norm):
        """``mixed_local`` pass 2: out = k * (m - mean(m) - xhat * mean(m xhat)); with
        ``want_inst`` inst the same for q, with ``want_masked`` masked = I where h > 0.

        Grid-stride over the B * Ch * S elements (any grid). Reads I, h, o (B, Ch, S);
        writes out, and inst and masked when wanted (not in place). Bytes per element:
        (4 + wanted outputs) * itemsize (GIVEN: + 2, gt and gp).
        """
        B, Ch, S = I.shape
        for k in range(cuda.grid(1), B * Ch * S, cuda.gridsize(1)):
            e = k // (Ch * S)
            ch = (k // S) % Ch
            j = k % S
            i = I[e, ch, j]
            hv = h[e, ch, j]
            if form == GIVEN:
                t = sg * gt[e, ch, j]
                n = i + sg * (gt[e, ch, j] - gp[e, ch, j])
            elif form == QUAD:
                t = gC[ch, j] * hv
                n = i + ((d[ch, j] - p2[ch, j] * hv) * hv - b[ch, j])
            else:
                t = gC[ch, j] * hv
                n = i + (d[ch, j] * hv - b[ch, j])
            r = i + t
            u = i  # rule NONE: the clean reference
            if rule == RAW:
                u = r
            elif rule == INNOVATION:
                u = n
            elif rule == MATCHED:
                u = fac[e] * r
            on = hv > 0
            zero = scale - scale
            m = scale * u if on else zero
            xh = (o[e, ch, j] - mean[ch]) * istd[ch] if has_norm else zero
            out[e, ch, j] = kac[ch, 0] * (m - kac[ch, 1] - xh * kac[ch, 2])
            if want_inst:
                qv = scale * i if on else zero
                inst[e, ch, j] = kac[ch, 0] * (qv - kac[ch, 3] - xh * kac[ch, 4])
            if want_masked:
                masked[e, ch, j] = i if on else zero

    return dict(mixed_rows=mixed_rows, mixed_finish=mixed_finish, matched_scale=matched_scale,
                predictor=predictor, quadratic=quadratic, sum_part=sum_part, add=add,
                local_rows=local_rows, local_sums=local_sums, local_combine=local_combine,
                local_write=local_write)


def mixed_workspace_shapes(B: int, N: int, tpb: int = TPB) -> dict:
    """Shapes of the float64 scratch arrays ``mixed_apical`` needs (scales: input dtype)."""
    return dict(part=(B, row_blocks(N, tpb), 4), rows=(B, 4), scales=(B,), tot=(5,))


def mixed_apical(I, h, gC, P, b, rule, out, part, rows, scales, tot, stream=0, tpb=TPB):
    """Launches the fused mixed-apical pass (and matched's second pass); fills ``tot``."""
    k = kernels(tpb)
    B, N = I.shape
    grid = (row_blocks(N, tpb), min(B, MAX_GRID_Y))
    k["mixed_rows"][grid, tpb, stream](I, h, gC, P, b, rule, out, part)
    k["mixed_finish"][1, tpb, stream](part, rule, rows, scales, tot)
    if rule == MATCHED:
        k["matched_scale"][grid, tpb, stream](I, h, gC, scales, out)


def mixed_local(I, h, o, out, inst, masked, want_inst, want_masked, gC, d, b, fac, rule,
                scale, mean, istd, gamma, has_norm, chan, rows, part, kac, q=None, tx=None,
                px=None, sg=1.0, form=UNIT, stream=0, tpb=TPB):
    """Launches ``mixed_local``: matched's row pass, the slab sums, the per-channel combine,
    the writes. Populations (B, Ch, S); inst, masked (B, Ch, S), or any (1, 1, 1) array
    when not wanted; gC (the gain times C, rounded as the reference does), d = gC - P,
    b (Ch, S); fac (B,) ones unless matched (filled here); mean, istd, gamma (Ch,) (any
    length-1 arrays without a norm); workspaces: rows (B, 2), part (B, Ch, 8), chan
    (Ch, 8) float64, kac (Ch, 5) in the input dtype. ``form`` QUAD: q (Ch, S) the
    quadratic term (sign folded in as for P); GIVEN: tx, px (B, Ch, S) the traffic and
    the prediction in the reference's units, sg = -sign (gC, d, b then any (1, 1))."""
    k = kernels(tpb)
    B, Ch, S = I.shape
    q = gC if q is None else q
    tx = I if tx is None else tx
    px = I if px is None else px
    if rule == MATCHED:
        flat = [t.reshape(t.shape[0], t.size // t.shape[0]) for t in (tx, px)]
        k["local_rows"][min(B, MAX_GRID_Y), tpb, stream](
            I.reshape(B, Ch * S), h.reshape(B, Ch * S),
            *(t.reshape(t.size) for t in (gC, d, b, q)), *flat, sg, form, rows, fac)
    k["local_sums"][(Ch, min(B, MAX_GRID_Y)), tpb, stream](I, h, o, gC, d, b, q, tx, px, sg,
                                                           form, fac, rule, scale, mean, istd,
                                                           has_norm, part)
    k["local_combine"][1, tpb, stream](part, gamma, istd, has_norm, float(B * S), chan, kac)
    blocks = max(1, min(4096, -(-(B * Ch * S) // tpb)))
    k["local_write"][blocks, tpb, stream](I, h, o, out, inst, masked, want_inst, want_masked,
                                          gC, d, b, q, tx, px, sg, form, fac, rule, scale, mean,
                                          istd, kac, has_norm)


def predictor_workspace_shapes(N: int, tpb: int = TPB) -> dict:
    """Shapes of the float64 scratch arrays ``predictor_update`` needs."""
    return dict(part=(unit_blocks(N, tpb), 2), tot=(2,))


def predictor_update(h, T, P, b, eta, part, tot, stream=0, tpb=TPB):
    """Launches the predictor step (in place on P, b); fills tot = [ss residual, ss T]."""
    k = kernels(tpb)
    k["predictor"][part.shape[0], tpb, stream](h, T, P, b, float(eta), part)
    k["sum_part"][1, 32, stream](part, tot)


def quadratic_predictor_update(h, T, P, P2, b, eta, part, tot, stream=0, tpb=TPB):
    """Launches MT-2's quadratic predictor step (in place on P, P2, b); fills tot =
    [ss residual, ss T]. Workspaces as ``predictor_update``'s."""
    k = kernels(tpb)
    k["quadratic"][part.shape[0], tpb, stream](h, T, P, P2, b, float(eta), part)
    k["sum_part"][1, 32, stream](part, tot)


def aux_add(dst, src, stream=0, tpb=TPB):
    """Launches dst += src (flat arrays)."""
    blocks = max(1, min(4096, -(-dst.size // tpb)))
    kernels(tpb)["add"][blocks, tpb, stream](dst, src)


def ptx_signatures(dtype: str) -> dict:
    """Argument types of every kernel for ``cuda.compile_ptx``, for one float dtype."""
    from numba import types

    f = getattr(types, dtype)
    pop, unit, f64 = f[:, ::1], f[::1], types.float64
    cube = f[:, :, ::1]
    return dict(
        mixed_rows=(pop, pop, unit, unit, unit, types.int64, pop, f64[:, :, ::1]),
        mixed_finish=(f64[:, :, ::1], types.int64, f64[:, ::1], unit, f64[::1]),
        matched_scale=(pop, pop, unit, unit, pop),
        predictor=(pop, pop, unit, unit, f64, f64[:, ::1]),
        quadratic=(pop, pop, unit, unit, unit, f64, f64[:, ::1]),
        sum_part=(f64[:, ::1], f64[::1]),
        add=(unit, unit),
        local_rows=(pop, pop, unit, unit, unit, unit, pop, pop, f, types.int64, f64[:, ::1],
                    unit),
        local_sums=(cube, cube, cube, pop, pop, pop, pop, cube, cube, f, types.int64, unit,
                    types.int64, f, unit, unit, types.boolean, f64[:, :, ::1]),
        local_combine=(f64[:, :, ::1], unit, unit, types.boolean, f64, f64[:, ::1], pop),
        local_write=(cube, cube, cube, cube, cube, cube, types.boolean, types.boolean, pop, pop,
                     pop, pop, cube, cube, f, types.int64, unit, types.int64, f, unit, unit, pop,
                     types.boolean),
    )
