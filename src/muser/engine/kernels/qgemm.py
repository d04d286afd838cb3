"""The CUDA exact lane's one projection kernel: y = x @ W^T for 1..N activation rows over the
quantized weight as stored (engine/weights.py repack fields), on tensor cores, row-invariant.

Row invariance (DESIGN.md "Exactness contract"): each output y[m, n] is reduced in ONE fixed
order over K that does not depend on the row count, on which M tile the row lands in, or on
the N tiling. The M tile is fixed at 16 rows (one m16n8k16 mma height; a 1-row decode is a
16-row tile with 15 idle rows, which costs nothing on a bandwidth-bound step), there is no
shape-dependent split-K, and the per-row sums of x the K-quant mins need come from a separate fixed-shape pass
(`_prep_kernel`), so no reduction's tree depends on the launch shape. Tuning may change the N
tile and num_warps only.

Arithmetic per sub-block j (32 elements; Q6_K: 16) of a weight row, after ggml's block formula
(ggml-quants.c dequantize_row_q4_K: w = d * sc * q - dmin * m; q6_K: w = d * sc * (q - 32)):

    P_j = sum_k x_k q_k                     tl.dot on the integer quant values (exact in bf16)
    acc += (d * sc_j) * P_j - (dmin * m_j) * S_j,   S_j = sum_k x_k   (f32, after each mma)

x is split once into bf16 parts hi + lo + lo2 == x (each part the rounding of the remainder:
24 significant bits, f32's), so every product q * part is exact and the only roundings are the
mma's f32 accumulation and the f32 epilogue: Gate 2 is the bar, not ggml's per-weight order.
Float weights use the same dots: BF16 as stored, F16 as bf16 hi + lo (exact), F32 as three
bf16 parts; Q8_0 / Q4_0 take their 32-block scale d after the mma.

Reference beside it: `qmatvec.matvec_ref(w, x)` (decode, then an f32 matmul) and `gemm_ref`
(the f64 matmul of the decoded weight); tests/engine/test_qgemm.py compares them under the
Triton interpreter, tools/device_kernels.py on the H200.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ...gguf.types import GgmlType as G
from ..weights import FIELDS, FMT_CODE, QWeight

try:  # Triton is optional on the CPU; the CUDA backend requires it.
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAVE_TRITON = False

FORMATS = (G.F32, G.F16, G.BF16, G.Q8_0, G.Q4_0, G.Q4_K, G.Q5_K, G.Q6_K)
BM = 16  # rows per M tile: fixed (see module doc), never tuned
SUB = 32  # elements per row sum of x (the K-quant sub-block)
PREP_BK = 256  # elements of one row per prep program
KC = 2048  # K chunk: each output is the in-order sum of its per-chunk sums (fixed by K alone)


def supports(fmt: G) -> bool:
    return fmt in FORMATS


def gemm_ref(w: QWeight, x: torch.Tensor) -> torch.Tensor:
    """x [M, n_in] f32 -> [M, n_out]: the decoded weight times x in float64, rounded once."""
    return (x.double() @ w.decode().double().T).to(torch.float32)


if HAVE_TRITON:

    @triton.jit
    def _prep_kernel(x, xp, xs, M, K, sx, BK: tl.constexpr):
        """One row's chunk of BK elements: bf16 parts hi, lo, lo2 ([3, M, K]) with
        hi + lo + lo2 == x, and the f32 sums of its 32-element sub-blocks (xs [M, cdiv(K, 32)]).
        The tile shape is fixed, so every row's sums are formed in the same tree."""
        r = tl.program_id(0)
        c = tl.program_id(1)
        k = c * BK + tl.arange(0, BK)
        km = k < K
        v = tl.load(x + r * sx + k, mask=km, other=0.0)  # [BK] f32
        hi = v.to(tl.bfloat16)
        rem = v - hi.to(tl.float32)  # exact: x minus its rounding
        lo = rem.to(tl.bfloat16)
        lo2 = (rem - lo.to(tl.float32)).to(tl.bfloat16)  # exact remainder, rounded to 8 bits
        base = r.to(tl.int64) * K + k
        MK = K.to(tl.int64) * M  # M arrives as constexpr 1 for one row (Triton specializes ints == 1)
        tl.store(xp + base, hi, mask=km)
        tl.store(xp + MK + base, lo, mask=km)
        tl.store(xp + 2 * MK + base, lo2, mask=km)
        s = tl.sum(tl.reshape(v, (BK // 32, 32)), 1)  # [BK/32]
        j = c * (BK // 32) + tl.arange(0, BK // 32)
        tl.store(xs + r * tl.cdiv(K, 32) + j, s, mask=j < tl.cdiv(K, 32))

    @triton.jit
    def _xparts(xp, r, rmask, k0, K, MK, KS: tl.constexpr):
        """The three bf16 parts of x[r, k0:k0+KS] -> [BM, KS] each (zeros past K / M)."""
        k = k0 + tl.arange(0, KS)
        off = r.to(tl.int64)[:, None] * K + k[None, :]
        m2 = rmask[:, None] & (k < K)[None, :]
        hi = tl.load(xp + off, mask=m2, other=0.0)
        lo = tl.load(xp + MK + off, mask=m2, other=0.0)
        lo2 = tl.load(xp + 2 * MK + off, mask=m2, other=0.0)
        return hi, lo, lo2

    @triton.jit
    def _dot(a, b, p, INTERP: tl.constexpr):
        """p + a @ b on bf16 tiles. The interpreter's bf16 dot is wrong (triton 3.6): there the
        exact bf16 values are widened to f32 first (the products are exact either way). Integer
        quant values reach bf16 through f32 (exact; the interpreter's int -> bf16 cast is wrong)."""
        if INTERP:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), p)
        else:
            return tl.dot(a, b, p)

    @triton.jit
    def _mma(xp, r, rmask, k0, K, MK, q, p, KS: tl.constexpr, INTERP: tl.constexpr):
        """p + x[r, k0:k0+KS] . q for q bf16 [BN, KS] (exact values): three chained mmas,
        smallest part first. -> f32 [BM, BN]."""
        hi, lo, lo2 = _xparts(xp, r, rmask, k0, K, MK, KS)
        qt = tl.trans(q)  # [KS, BN]
        p = _dot(lo2, qt, p, INTERP)
        p = _dot(lo, qt, p, INTERP)
        return _dot(hi, qt, p, INTERP)

    @triton.jit
    def _qgemm_kernel(xp, xs, y, p0, p1, p2, p3, p4, p5, M, N, K, sy,
                      FMT: tl.constexpr, BLOCK_M: tl.constexpr, BN: tl.constexpr, KC: tl.constexpr,
                      SPLIT: tl.constexpr, INTERP: tl.constexpr):
        pm = tl.program_id(0)  # M tiles vary fastest: the programs of one N tile share its weights in L2
        pn = tl.program_id(1)
        r = pm * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = r < M
        n = pn * BN + tl.arange(0, BN)
        nmask = n < N
        row = n.to(tl.int64)
        MK = K.to(tl.int64) * M  # M arrives as constexpr 1 for one row (Triton specializes ints == 1)
        NS = tl.cdiv(K, 32)  # row sums per x row
        l32 = tl.arange(0, 32)
        l16 = tl.arange(0, 16)
        zero = tl.zeros([BLOCK_M, BN], dtype=tl.float32)
        total = tl.zeros([BLOCK_M, BN], dtype=tl.float32)
        if SPLIT:  # one K chunk per program (axis 2); _chunk_sum adds the chunks in order
            c0 = tl.program_id(2)
            c1 = c0 + 1
        else:  # every chunk in turn, each summed from zero and added in order (as _chunk_sum)
            c0 = 0
            c1 = tl.cdiv(K, KC)
        for c in range(c0, c1):
            acc = tl.zeros([BLOCK_M, BN], dtype=tl.float32)
            if FMT == 5 or FMT == 6:  # Q4_K / Q5_K: qs [N, nb*128], d, dmin [N, nb], sc, m [N, nb*8], qh [N, nb*32]
                nb = K // 256
                for kb in range(c * (KC // 256), tl.minimum(nb, c * (KC // 256) + KC // 256)):
                    blk = row * nb + kb  # [BN]
                    d = tl.load(p1 + blk, mask=nmask, other=0.0).to(tl.float32)
                    dmin = tl.load(p2 + blk, mask=nmask, other=0.0).to(tl.float32)
                    if FMT == 6:
                        qh = tl.load(p5 + blk[:, None] * 32 + l32[None, :], mask=nmask[:, None], other=0).to(tl.int32)
                    for g in tl.static_range(4):  # 64-element groups: low nibbles, then high nibbles
                        b = tl.load(p0 + blk[:, None] * 128 + g * 32 + l32[None, :], mask=nmask[:, None],
                                    other=0).to(tl.int32)  # [BN, 32]
                        for half in tl.static_range(2):
                            j = 2 * g + half  # sub-block (scale slot)
                            q = (b >> (4 * half)) & 0xF
                            if FMT == 6:
                                q = q | (((qh >> j) & 1) << 4)  # ggml: + (qh & u ? 16 : 0)
                            k0 = kb * 256 + 32 * j
                            pj = _mma(xp, r, rmask, k0, K, MK, q.to(tl.float32).to(tl.bfloat16), zero, 32, INTERP)
                            sc = tl.load(p3 + blk * 8 + j, mask=nmask, other=0).to(tl.float32)
                            mn = tl.load(p4 + blk * 8 + j, mask=nmask, other=0).to(tl.float32)
                            sj = tl.load(xs + r * NS + k0 // 32, mask=rmask, other=0.0)  # [BM]
                            acc = acc + ((d * sc)[None, :] * pj - (dmin * mn)[None, :] * sj[:, None])
            elif FMT == 7:  # Q6_K: ql [N, nb*128], qh [N, nb*64], sc int8 [N, nb*16], d f16 [N, nb]
                nb = K // 256
                for kb in range(c * (KC // 256), tl.minimum(nb, c * (KC // 256) + KC // 256)):
                    blk = row * nb + kb
                    d = tl.load(p3 + blk, mask=nmask, other=0.0).to(tl.float32)
                    for hn in tl.static_range(2):  # 128-element halves
                        for lh in tl.static_range(2):  # l in [16 lh, 16 lh + 16)
                            lo_a = tl.load(p0 + blk[:, None] * 128 + hn * 64 + lh * 16 + l16[None, :],
                                           mask=nmask[:, None], other=0).to(tl.int32)  # ql[l]
                            lo_b = tl.load(p0 + blk[:, None] * 128 + hn * 64 + 32 + lh * 16 + l16[None, :],
                                           mask=nmask[:, None], other=0).to(tl.int32)  # ql[l + 32]
                            hb = tl.load(p1 + blk[:, None] * 64 + hn * 32 + lh * 16 + l16[None, :],
                                         mask=nmask[:, None], other=0).to(tl.int32)
                            for qt in tl.static_range(4):  # quarter: elements hn*128 + 32 qt + l
                                if qt % 2 == 0:
                                    lo = (lo_a >> (4 * (qt // 2))) & 0xF
                                else:
                                    lo = (lo_b >> (4 * (qt // 2))) & 0xF
                                q = (lo | (((hb >> (2 * qt)) & 3) << 4)) - 32
                                k0 = kb * 256 + hn * 128 + 32 * qt + 16 * lh
                                pj = _mma(xp, r, rmask, k0, K, MK, q.to(tl.float32).to(tl.bfloat16), zero, 16, INTERP)
                                sc = tl.load(p2 + blk * 16 + hn * 8 + lh + 2 * qt, mask=nmask, other=0).to(tl.float32)
                                acc = acc + (d * sc)[None, :] * pj  # ggml: y = d * sc[is] * q
            elif FMT == 3:  # Q8_0: qs int8 [N, K], d f16 [N, K/32]
                for kb in range(c * (KC // 32), tl.minimum(K // 32, c * (KC // 32) + KC // 32)):
                    q = tl.load(p0 + row[:, None] * K + kb * 32 + l32[None, :], mask=nmask[:, None], other=0)
                    pj = _mma(xp, r, rmask, kb * 32, K, MK, q.to(tl.float32).to(tl.bfloat16), zero, 32, INTERP)
                    d = tl.load(p1 + row * (K // 32) + kb, mask=nmask, other=0.0).to(tl.float32)
                    acc = acc + d[None, :] * pj  # ggml: y = qs * d
            elif FMT == 4:  # Q4_0: qs u8 [N, K/2] (16 bytes per 32-block: low nibbles 0..15, high 16..31)
                for kb in range(c * (KC // 32), tl.minimum(K // 32, c * (KC // 32) + KC // 32)):
                    b = tl.load(p0 + row[:, None] * (K // 2) + kb * 16 + l16[None, :], mask=nmask[:, None],
                                other=0).to(tl.int32)
                    pj = _mma(xp, r, rmask, kb * 32, K, MK, ((b & 0xF) - 8).to(tl.float32).to(tl.bfloat16), zero, 16, INTERP)
                    pj = _mma(xp, r, rmask, kb * 32 + 16, K, MK, ((b >> 4) - 8).to(tl.float32).to(tl.bfloat16), pj, 16, INTERP)
                    d = tl.load(p1 + row * (K // 32) + kb, mask=nmask, other=0.0).to(tl.float32)
                    acc = acc + d[None, :] * pj  # ggml: y = (q - 8) * d
            else:  # F32 / F16 / BF16: w [N, K], any K (masked tail)
                for kb in range(c * (KC // 32), tl.minimum(tl.cdiv(K, 32), c * (KC // 32) + KC // 32)):
                    k = kb * 32 + l32
                    w = tl.load(p0 + row[:, None] * K + k[None, :], mask=nmask[:, None] & (k < K)[None, :], other=0.0)
                    if FMT == 2:
                        pj = _mma(xp, r, rmask, kb * 32, K, MK, w, zero, 32, INTERP)
                    else:
                        wf = w.to(tl.float32)  # f16 -> f32 exact
                        wh = wf.to(tl.bfloat16)
                        wr = wf - wh.to(tl.float32)
                        wl = wr.to(tl.bfloat16)
                        pj = _mma(xp, r, rmask, kb * 32, K, MK, wh, zero, 32, INTERP)
                        pj = _mma(xp, r, rmask, kb * 32, K, MK, wl, pj, 32, INTERP)  # f16: hi + lo is exact
                        if FMT == 0:
                            pj = _mma(xp, r, rmask, kb * 32, K, MK, (wr - wl.to(tl.float32)).to(tl.bfloat16), pj, 32, INTERP)
                    acc = acc + pj
            total = total + acc
        omask = rmask[:, None] & nmask[None, :]
        if SPLIT:
            tl.store(y + (c0.to(tl.int64) * M + r)[:, None] * N + n[None, :], total, mask=omask)
        else:
            tl.store(y + r.to(tl.int64)[:, None] * sy + n[None, :], total, mask=omask)


    @triton.jit
    def _chunk_sum(part, y, M, N, NC, sy, BLOCK: tl.constexpr):
        """y[m, n] = ((0 + part[0]) + part[1]) + ... over the NC K chunks, in chunk order: the
        additions the unsplit kernel makes (its `total`), so both give the same bits."""
        m = tl.program_id(0)
        n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        nm = n < N
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for c in range(0, NC):
            total = total + tl.load(part + (c * M + m).to(tl.int64) * N + n, mask=nm, other=0.0)
        tl.store(y + m.to(tl.int64) * sy + n, total, mask=nm)


def _interp() -> bool:
    return bool(os.environ.get("TRITON_INTERPRET"))


def _ptrs(w: QWeight) -> list[torch.Tensor]:
    """The weight's fields in kernel order p0..p5 (weights.FIELDS); unused slots repeat p0."""
    p = [w.fields[k] for k in FIELDS[w.fmt]]
    while len(p) < 6:
        p.append(p[0])
    return p


def config(M: int, N: int) -> tuple[int, int]:
    """(BN, num_warps) for an [M, K] x [K, N] launch. Speed only: the K order is the same for
    every choice (module doc)."""
    if M <= BM:
        return 64, 2
    return 64, 4


def prep(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x f32 [M, K] -> (bf16 parts [3, M, K], sub-block sums f32 [M, cdiv(K, 32)])."""
    M, K = x.shape
    xp = torch.empty((3, M, K), dtype=torch.bfloat16, device=x.device)
    xs = torch.empty((M, -(-K // SUB)), dtype=torch.float32, device=x.device)
    _prep_kernel[(M, triton.cdiv(K, PREP_BK))](x, xp, xs, M, K, x.stride(0), BK=PREP_BK, num_warps=4,
                                               enable_fp_fusion=False)
    return xp, xs


def gemm(w: QWeight, x: torch.Tensor, out: torch.Tensor | None = None, bn: int | None = None,
         num_warps: int | None = None, split: bool | None = None, block_m: int = BM) -> torch.Tensor:
    """x [M, n_in] f32 (rows contiguous) -> [M, n_out] f32. `bn`, `num_warps` override config();
    `split` runs the K chunks as parallel programs plus an in-order sum (default: for launches of
    <= 16 rows with more than one chunk) instead of in turn: the same bits either way. `block_m`
    other than 16 exists only for the device script's probe."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed")
    if not supports(w.fmt):
        raise ValueError(f"qgemm: tensor {w.name!r}: no kernel for {w.fmt.name}")
    M, K = x.shape
    assert K == w.n_in, f"qgemm: x has {K} columns, weight {w.name} has n_in {w.n_in}"
    assert M >= 1 and x.dtype == torch.float32 and x.stride(1) == 1, "qgemm: x must be f32 [M >= 1, K], unit stride"
    if out is None:
        out = torch.empty((M, w.n_out), dtype=torch.float32, device=x.device)
    assert out.shape == (M, w.n_out) and out.stride(1) == 1 and out.dtype == torch.float32
    xp, xs = prep(x)
    b, nw = config(M, w.n_out)
    b, nw = bn or b, num_warps or nw
    nc = -(-K // KC)
    if split is None:
        split = M <= BM and nc > 1
    N = w.n_out
    args = dict(FMT=FMT_CODE[w.fmt], BLOCK_M=block_m, BN=b, KC=KC, SPLIT=split, INTERP=_interp(), num_warps=nw,
                enable_fp_fusion=False)
    if not split:
        _qgemm_kernel[(triton.cdiv(M, block_m), triton.cdiv(N, b))](xp, xs, out, *_ptrs(w), M, N, K, out.stride(0),
                                                                    **args)
        return out
    part = torch.empty((nc, M, N), dtype=torch.float32, device=x.device)
    _qgemm_kernel[(triton.cdiv(M, block_m), triton.cdiv(N, b), nc)](xp, xs, part, *_ptrs(w), M, N, K, N, **args)
    _chunk_sum[(M, triton.cdiv(N, 1024))](part, out, M, N, nc, out.stride(0), BLOCK=1024, num_warps=4,
                                           enable_fp_fusion=False)
    return out


@dataclass
class Stack:
    """Weights that read the same input as one matrix (rows stacked in order): one launch
    instead of several. Each member's fields become row views of the stack's (no second copy);
    every output is the same reduction as its own matrix's (rows are independent)."""

    w: QWeight
    bounds: tuple[tuple[int, int], ...]  # [n0, n1) of each member

    def split(self, y: torch.Tensor) -> list[torch.Tensor]:
        """y [T, sum n_out] -> the members' outputs [T, n_out_i] (column views)."""
        return [y[:, a:b] for a, b in self.bounds]


def stack(ws: list[QWeight]) -> Stack | None:
    """One Stack over weights of one served format and row length; None when they differ."""
    if not ws or any(not supports(w.fmt) for w in ws):
        return None
    f0 = ws[0]
    if any(w.fmt != f0.fmt or w.n_in != f0.n_in for w in ws):
        return None
    fields = {k: torch.cat([w.fields[k] for w in ws], 0).contiguous() for k in f0.fields}
    n, bounds = 0, []
    for w in ws:
        bounds.append((n, n + w.n_out))
        n += w.n_out
    for w, (a, b) in zip(ws, bounds):
        w.fields = {k: v[a:b] for k, v in fields.items()}
    return Stack(QWeight("+".join(w.name for w in ws), f0.fmt, n, f0.n_in, fields), tuple(bounds))


__all__ = ["BM", "FORMATS", "HAVE_TRITON", "Stack", "config", "gemm", "gemm_ref", "prep", "stack", "supports"]
