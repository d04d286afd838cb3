"""K-quant reference quantizers (Q4_K, Q5_K, Q6_K), byte-identical to ggml-quants.c
quantize_row_q{4,5,6}_K_ref (the path llama.cpp's quantizer takes without an importance matrix).

ggml runs its search per sub-block with scalar float32 code; here the same search runs for every
sub-block at once: each scalar becomes a vector over sub-blocks, each data-dependent branch a
mask, each `s += ...` loop a left-to-right sum of vectors (common.seq_sum0). The searches are
stateful (make_qkx2_quants moves `min` between steps and later steps see the new value), and
that state is carried per sub-block exactly.
"""

from __future__ import annotations

import numpy as np

from .common import F32, f16_to_f32, f32_to_f16, nearest_int, seq_sum0

QK_K = 256
GROUP_MAX_EPS = F32(1e-15)  # ggml-quants.c GROUP_MAX_EPS


def make_qkx2_quants(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float,
                     nstep: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml-quants.c make_qkx2_quants (use_mad = false) for S sub-blocks at once.

    x, w: float32 [S, n]. Returns (scale [S], the_min [S] (= -min), L uint8 [S, n]).
    Works on the transposed [n, S] layout so each C loop over i is n vector ops over S."""
    x = np.ascontiguousarray(x.T)  # [n, S]
    w = np.ascontiguousarray(w.T)
    fn = F32(nmax)
    mn = x.min(axis=0)  # [S]
    mx = x.max(axis=0)
    sum_w = seq_sum0(w)
    sum_x = seq_sum0(w * x)  # sum_x = w[0]*x[0], then += w*x in order
    mn = np.where(mn > 0, F32(0), mn).astype(F32)
    flat = mx == mn  # all L = 0, scale 0, the_min = -min
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = (fn / (mx - mn)).astype(F32)
        scale = (F32(1) / iscale).astype(F32)
        l = np.clip(nearest_int(iscale * (x - mn)), 0, nmax)
        L = l.astype(np.uint8)
        diff = scale * l.astype(F32) + mn - x  # (scale*L + min) - x
        best = seq_sum0(w * (diff * diff))
        for step in range(nstep + 1):
            # iscale = (rmin + rdelta*is + nmax)/(max - min), with the *current* min
            num = F32((F32(rmin) + F32(rdelta) * F32(step)) + fn)
            it = (num / (mx - mn)).astype(F32)
            la = np.clip(nearest_int(it * (x - mn)), 0, nmax)
            lf = la.astype(F32)
            wl = w * lf
            sum_l = seq_sum0(wl)
            sum_l2 = seq_sum0(wl * lf)
            sum_xl = seq_sum0(wl * x)
            D = sum_w * sum_l2 - sum_l * sum_l
            ok = D > 0
            this_scale = ((sum_w * sum_xl - sum_x * sum_l) / D).astype(F32)
            this_min = ((sum_l2 * sum_x - sum_l * sum_xl) / D).astype(F32)
            pos = this_min > 0
            this_min = np.where(pos, F32(0), this_min).astype(F32)
            this_scale = np.where(pos, sum_xl / sum_l2, this_scale).astype(F32)
            d2 = this_scale * lf + this_min - x
            cur = seq_sum0(w * (d2 * d2))
            take = ok & (cur < best) & ~flat
            if take.any():
                L = np.where(take, la.astype(np.uint8), L)
                best = np.where(take, cur, best)
                scale = np.where(take, this_scale, scale)
                mn = np.where(take, this_min, mn)
    L = np.where(flat, np.uint8(0), L)
    scale = np.where(flat, F32(0), scale).astype(F32)
    return scale, (-mn).astype(F32), np.ascontiguousarray(L.T)


def _subblock_weights(x: np.ndarray) -> np.ndarray:
    """quantize_row_q{4,5}_K_ref: weights[l] = sqrtf(sum_x2/32) + fabsf(x[l])."""
    sum_x2 = seq_sum0(np.ascontiguousarray((x * x).T))
    av_x = np.sqrt((sum_x2 / F32(32)).astype(F32)).astype(F32)
    return (av_x[:, None] + np.abs(x)).astype(F32)


def _pack_scale_min(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """6-bit sc/m packing of Figure 6.3 (the inverse of get_scale_min_k4). ls, lm: [nb, 8]."""
    out = np.zeros(ls.shape[:-1] + (12,), dtype=np.uint8)
    out[..., 0:4] = ls[..., 0:4] | ((ls[..., 4:8] >> 4) << 6)
    out[..., 4:8] = lm[..., 0:4] | ((lm[..., 4:8] >> 4) << 6)
    out[..., 8:12] = (ls[..., 4:8] & 0xF) | ((lm[..., 4:8] & 0xF) << 4)
    return out


def _q45_k(x: np.ndarray, nmax: int, rmin: float, nstep: int) -> tuple[np.ndarray, ...]:
    """Shared body of Q4_K / Q5_K: x [nb, 256] -> (d bits, dmin bits, packed scales, L [nb, 256])."""
    nb = x.shape[0]
    xs = x.reshape(nb * 8, 32)
    scales, mins, L = make_qkx2_quants(xs, _subblock_weights(xs), nmax, rmin, 0.1, nstep)
    scales = scales.reshape(nb, 8)
    mins = mins.reshape(nb, 8)
    L = L.reshape(nb, 8, 32)
    # max over sub-blocks starting from 0 with strict '>' (negative values never win)
    smax, mmax = scales.max(axis=1), mins.max(axis=1)
    max_scale = np.where(smax > 0, smax, F32(0)).astype(F32)
    max_min = np.where(mmax > 0, mmax, F32(0)).astype(F32)
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, F32(63) / max_scale, F32(0)).astype(F32)
        inv_min = np.where(max_min > 0, F32(63) / max_min, F32(0)).astype(F32)
    # uint8_t ls = nearest_int(...); ls = MIN(63, ls): the int narrows to a byte first
    ls = np.minimum((nearest_int(inv_scale[:, None] * scales) & 0xFF), 63).astype(np.uint8)
    lm = np.minimum((nearest_int(inv_min[:, None] * mins) & 0xFF), 63).astype(np.uint8)
    d_bits = f32_to_f16((max_scale / F32(63)).astype(F32))
    dmin_bits = f32_to_f16((max_min / F32(63)).astype(F32))
    # Re-quantize every sub-block against the stored (rounded) scales:
    # d = fp16(d) * sc; if (!d) keep the search's L; dm = fp16(dmin) * m; l = nearest_int((x + dm)/d)
    d = (f16_to_f32(d_bits)[:, None] * ls.astype(F32)).astype(F32)  # [nb, 8]
    dm = (f16_to_f32(dmin_bits)[:, None] * lm.astype(F32)).astype(F32)
    xr = x.reshape(nb, 8, 32)
    with np.errstate(divide="ignore", invalid="ignore"):
        l2 = np.clip(nearest_int((xr + dm[..., None]) / d[..., None]), 0, nmax).astype(np.uint8)
    L = np.where((d != 0)[..., None], l2, L)
    return d_bits, dmin_bits, _pack_scale_min(ls, lm), L.reshape(nb, QK_K)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q4_K_ref: float32 [nb, 256] -> block_q4_K bytes [nb, 144]."""
    nb = x.shape[0]
    d_bits, dmin_bits, sc, L = _q45_k(x, 15, -1.0, 20)
    Lg = L.reshape(nb, 4, 2, 32)
    qs = (Lg[:, :, 0] | (Lg[:, :, 1] << 4)).reshape(nb, 128)  # q[l] = L[j+l] | L[j+l+32] << 4
    out = np.empty((nb, 144), dtype=np.uint8)
    out[:, 0:2] = d_bits.view(np.uint8).reshape(nb, 2)
    out[:, 2:4] = dmin_bits.view(np.uint8).reshape(nb, 2)
    out[:, 4:16] = sc
    out[:, 16:144] = qs
    return out


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q5_K_ref: float32 [nb, 256] -> block_q5_K bytes [nb, 176]."""
    nb = x.shape[0]
    d_bits, dmin_bits, sc, L = _q45_k(x, 31, -0.5, 15)
    Lg = L.reshape(nb, 4, 2, 32)  # [group n/64, lo/hi half, j]
    lo = Lg & 0xF
    hb = (Lg >> 4) & 1  # l > 15: l -= 16 and set bit (2*group + half) of qh[j]
    shift = np.arange(8, dtype=np.uint8).reshape(1, 4, 2, 1)
    qh = np.bitwise_or.reduce((hb << shift).reshape(nb, 8, 32), axis=1).astype(np.uint8)
    ql = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(nb, 128)
    out = np.empty((nb, 176), dtype=np.uint8)
    out[:, 0:2] = d_bits.view(np.uint8).reshape(nb, 2)
    out[:, 2:4] = dmin_bits.view(np.uint8).reshape(nb, 2)
    out[:, 4:16] = sc
    out[:, 16:48] = qh
    out[:, 48:176] = ql
    return out


def make_qx_quants_rmse1(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml-quants.c make_qx_quants(n, nmax, x, L, rmse_type=1, qw=NULL) for S groups at once.

    x: float32 [S, n]. Returns (scale [S], L uint8 [S, n] holding l + nmax)."""
    S, n = x.shape
    ax = np.abs(x)
    idx = ax.argmax(axis=1)  # first index of the largest |x| (strict '>' scan)
    rows = np.arange(S)
    amax = ax[rows, idx]
    mx = x[rows, idx]  # signed
    zero = amax < GROUP_MAX_EPS
    xt = np.ascontiguousarray(x.T)  # [n, S]
    w = (xt * xt).astype(F32)
    wx = (w * xt).astype(F32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = (F32(-nmax) / mx).astype(F32)

        def pass_(isc):
            l = np.clip(nearest_int(isc * xt), -nmax, nmax - 1)
            lf = l.astype(F32)
            return l, seq_sum0(wx * lf), seq_sum0((w * lf) * lf)  # w*x*l, w*l*l (left to right)

        l, sumlx, suml2 = pass_(iscale)
        L = (l + nmax).astype(np.uint8)
        scale = np.where(suml2 != 0, sumlx / suml2, F32(0)).astype(F32)
        best = (scale * sumlx).astype(F32)
        for step in range(-9, 10):
            if step == 0:
                continue
            isc = (-(F32(nmax) + F32(0.1) * F32(step)) / mx).astype(F32)
            l, slx, sl2 = pass_(isc)
            take = (sl2 > 0) & (slx * slx > best * sl2)
            if take.any():
                L = np.where(take, (l + nmax).astype(np.uint8), L)
                scale = np.where(take, slx / sl2, scale).astype(F32)
                best = np.where(take, scale * slx, best).astype(F32)
    L = np.where(zero, np.uint8(0), L)
    scale = np.where(zero, F32(0), scale).astype(F32)
    return scale, np.ascontiguousarray(L.T)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q6_K_ref: float32 [nb, 256] -> block_q6_K bytes [nb, 210]."""
    nb = x.shape[0]
    scales, L = make_qx_quants_rmse1(x.reshape(nb * 16, 16), 32)
    scales = scales.reshape(nb, 16)
    L = L.reshape(nb, 16, 16)
    a = np.abs(scales)
    j = a.argmax(axis=1)  # first sub-block with the largest |scale|
    max_abs = a[np.arange(nb), j]
    max_scale = scales[np.arange(nb), j]
    zero = max_abs < GROUP_MAX_EPS  # whole block stored as zeros
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = (F32(-128) / max_scale).astype(F32)
        d_bits = f32_to_f16((F32(1) / iscale).astype(F32))
        # int8 store of MIN(127, nearest_int(...)): narrowing keeps the low byte
        sc = (np.minimum(nearest_int(iscale[:, None] * scales), 127) & 0xFF).astype(np.uint8).view(np.int8)
        d = (f16_to_f32(d_bits)[:, None] * sc.astype(F32)).astype(F32)  # fp16(d) * scales[j]
        xr = x.reshape(nb, 16, 16)
        l2 = (np.clip(nearest_int(xr / d[..., None]), -32, 31) + 32).astype(np.uint8)
    L = np.where((d != 0)[..., None], l2, L).reshape(nb, 2, 4, 32)  # [half, plane p, l]
    q1, q2, q3, q4 = L[:, :, 0], L[:, :, 1], L[:, :, 2], L[:, :, 3]
    ql = np.concatenate([(q1 & 0xF) | ((q3 & 0xF) << 4), (q2 & 0xF) | ((q4 & 0xF) << 4)], axis=2)
    qh = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)
    out = np.empty((nb, 210), dtype=np.uint8)
    out[:, 0:128] = ql.reshape(nb, 128)
    out[:, 128:192] = qh.reshape(nb, 64)
    out[:, 192:208] = sc.view(np.uint8)
    out[:, 208:210] = d_bits.view(np.uint8).reshape(nb, 2)
    out[zero] = 0
    return out
