"""Fused dequant + matvec for 1..16 activation rows (decode and the speculative verify shape),
reading the repacked weight fields of engine/weights.py, and a dequant-only kernel that shares
the same tile decoder (so the decoder is tested bit-exact on its own).

The tile decoder forms every product in f32 in ggml's order (`d1 = d * sc; w = d1 * q - m1`)
and the kernels are launched with `enable_fp_fusion=False`, so no multiply-add is contracted
into an FMA: the decoded weight is the reference codec's value bit for bit. The dot itself
accumulates in f32 (the exact lane's contract: f32 activations and accumulation; summation
order differs from the oracle only at the ulp level, which Gate 2 bounds) in lanes combined by
one fixed tree (`_lane_tree`), so an output's bits do not depend on the row count.

Reference beside it: `matvec_ref(w, x) = x @ w.decode().T` (torch, f32).
"""

from __future__ import annotations

import torch

from ...errors import LaneError
from ..nvfp4 import NVFP4_FORMATS
from ..weights import FMT_CODE, QK, QWeight

try:  # Triton is optional on the CPU; the CUDA backend requires it.
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAVE_TRITON = False

MAX_ROWS = 16


def matvec_ref(w: QWeight, x: torch.Tensor) -> torch.Tensor:
    """x [T, n_in] f32 -> [T, n_out] f32 with the torch decoder (the reference)."""
    return x @ w.decode().T


if HAVE_TRITON:

    @triton.jit
    def _lane_tree(x, R: tl.constexpr, L: tl.constexpr):
        """x f32 [R, L] (L a power of two, 2..256) -> [R]: lanes summed in adjacent pairs, level by
        level (((l0 + l1) + (l2 + l3)) + ...). A sum of two is the same bits in either order, so
        the result does not depend on the register layout Triton gives the accumulator (a plain
        tl.sum reduces in a layout-dependent order)."""
        x = tl.sum(tl.reshape(x, (R, L // 2, 2)), 2)
        if L >= 4:
            x = tl.sum(tl.reshape(x, (R, L // 4, 2)), 2)
        if L >= 8:
            x = tl.sum(tl.reshape(x, (R, L // 8, 2)), 2)
        if L >= 16:
            x = tl.sum(tl.reshape(x, (R, L // 16, 2)), 2)
        if L >= 32:
            x = tl.sum(tl.reshape(x, (R, L // 32, 2)), 2)
        if L >= 64:
            x = tl.sum(tl.reshape(x, (R, L // 64, 2)), 2)
        if L >= 128:
            x = tl.sum(tl.reshape(x, (R, L // 128, 2)), 2)
        if L >= 256:
            x = tl.sum(tl.reshape(x, (R, L // 256, 2)), 2)
        return tl.reshape(x, (R,))

    @triton.jit
    def _tile(FMT: tl.constexpr, p0, p1, p2, p3, p4, p5, n, nmask, kb, K):
        """Decode tile kb (256 elements) of rows n [BLOCK_N] -> f32 [BLOCK_N, 256]."""
        e = tl.arange(0, 256)
        row = n.to(tl.int64)
        k = kb * 256 + e
        if FMT <= 2:  # F32 / F16 / BF16: w [N, K]
            m2 = nmask[:, None] & (k[None, :] < K)
            w = tl.load(p0 + row[:, None] * K + k[None, :], mask=m2, other=0.0).to(tl.float32)
        elif FMT == 3:  # Q8_0: qs int8 [N, K], d f16 [N, K/32]; y = q * d
            m2 = nmask[:, None] & (k[None, :] < K)
            q = tl.load(p0 + row[:, None] * K + k[None, :], mask=m2, other=0).to(tl.float32)
            d = tl.load(p1 + row[:, None] * (K // 32) + (k // 32)[None, :], mask=m2, other=0.0)
            w = q * d.to(tl.float32)
        elif FMT == 4:  # Q4_0: qs u8 [N, K/2] (16 bytes per 32-block), d f16 [N, K/32]
            m2 = nmask[:, None] & (k[None, :] < K)
            j = k % 32
            byte = (k // 32) * 16 + j % 16
            b = tl.load(p0 + row[:, None] * (K // 2) + byte[None, :], mask=m2, other=0).to(tl.int32)
            q = ((b >> (4 * (j // 16))[None, :]) & 0xF) - 8
            d = tl.load(p1 + row[:, None] * (K // 32) + (k // 32)[None, :], mask=m2, other=0.0)
            w = q.to(tl.float32) * d.to(tl.float32)
        elif FMT <= 6:  # Q4_K / Q5_K: qs [N, nb*128], d, dmin [N, nb], sc, m [N, nb*8], (qh [N, nb*32])
            nb = K // 256
            blk = row * nb + kb
            m2 = nmask[:, None] & (e[None, :] < 256)
            g = e // 64
            half = (e // 32) % 2
            l = e % 32
            b = tl.load(p0 + blk[:, None] * 128 + (g * 32 + l)[None, :], mask=m2, other=0).to(tl.int32)
            q = (b >> (4 * half)[None, :]) & 0xF
            if FMT == 6:
                h = tl.load(p5 + blk[:, None] * 32 + l[None, :], mask=m2, other=0).to(tl.int32)
                q = q + (((h >> (2 * g + half)[None, :]) & 1) << 4)
            sub = e // 32
            sc = tl.load(p3 + blk[:, None] * 8 + sub[None, :], mask=m2, other=0).to(tl.float32)
            mn = tl.load(p4 + blk[:, None] * 8 + sub[None, :], mask=m2, other=0).to(tl.float32)
            d = tl.load(p1 + blk, mask=nmask, other=0.0).to(tl.float32)
            dmin = tl.load(p2 + blk, mask=nmask, other=0.0).to(tl.float32)
            d1 = d[:, None] * sc  # ggml: d1 = d * sc
            m1 = dmin[:, None] * mn  # ggml: m1 = min * m
            w = d1 * q.to(tl.float32) - m1
        else:  # Q6_K: ql [N, nb*128], qh [N, nb*64], sc int8 [N, nb*16], d f16 [N, nb]
            nb = K // 256
            blk = row * nb + kb
            m2 = nmask[:, None] & (e[None, :] < 256)
            hn = e // 128
            quarter = (e % 128) // 32
            l = e % 32
            lb = tl.load(p0 + blk[:, None] * 128 + (hn * 64 + l + 32 * (quarter % 2))[None, :],
                         mask=m2, other=0).to(tl.int32)
            hb = tl.load(p1 + blk[:, None] * 64 + (hn * 32 + l)[None, :], mask=m2, other=0).to(tl.int32)
            lo = (lb >> (4 * (quarter // 2))[None, :]) & 0xF
            hi = (hb >> (2 * quarter)[None, :]) & 3
            q = (lo | (hi << 4)) - 32
            sc = tl.load(p2 + blk[:, None] * 16 + (hn * 8 + l // 16 + 2 * quarter)[None, :],
                         mask=m2, other=0).to(tl.float32)
            d = tl.load(p3 + blk, mask=nmask, other=0.0).to(tl.float32)
            w = (d[:, None] * sc) * q.to(tl.float32)  # ggml: y = d * sc[is] * q
        return w

    @triton.jit
    def _dequant_kernel(out, p0, p1, p2, p3, p4, p5, N, K, FMT: tl.constexpr, BLOCK_N: tl.constexpr):
        pid_n = tl.program_id(0)
        kb = tl.program_id(1)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < N
        w = _tile(FMT, p0, p1, p2, p3, p4, p5, n, nmask, kb, K)
        k = kb * 256 + tl.arange(0, 256)
        tl.store(out + n.to(tl.int64)[:, None] * K + k[None, :], w, mask=nmask[:, None] & (k[None, :] < K))

    @triton.jit(do_not_specialize=["T"])  # one binary per (format, row bucket), whatever T
    def _matvec_kernel(x, y, p0, p1, p2, p3, p4, p5, N, K, sx, sy, T,
                       FMT: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
        pid = tl.program_id(0)
        n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < N
        r = tl.arange(0, ROWS)
        rmask = r < T
        # 256 lanes per output (lane e takes element 256 kb + e, in kb order), combined by one fixed
        # tree at the end: the same sum for every row bucket (row invariance)
        acc = tl.zeros([ROWS, BLOCK_N, 256], dtype=tl.float32)
        for kb in range(0, (K + 255) // 256):
            w = _tile(FMT, p0, p1, p2, p3, p4, p5, n, nmask, kb, K)  # [BLOCK_N, 256]
            k = kb * 256 + tl.arange(0, 256)
            xv = tl.load(x + r[:, None] * sx + k[None, :], mask=rmask[:, None] & (k[None, :] < K), other=0.0)
            acc = tl.fma(w[None, :, :], xv[:, None, :], acc)  # f32
        res = tl.reshape(_lane_tree(tl.reshape(acc, (ROWS * BLOCK_N, 256)), ROWS * BLOCK_N, 256), (ROWS, BLOCK_N))
        tl.store(y + r[:, None] * sy + n[None, :], res, mask=rmask[:, None] & nmask[None, :])


def _ptrs(w: QWeight) -> list[torch.Tensor]:
    """The weight's fields in kernel order p0..p5 (weights.FIELDS); unused slots repeat p0 (any
    valid pointer: never dereferenced). Shared by the v1 and v2 kernels."""
    p = list(w.pointers())
    while len(p) < 6:
        p.append(p[0])
    return p


def _rows_bucket(t: int) -> int:
    r = 1
    while r < t:
        r *= 2
    return r


def check_matvec_args(w: QWeight, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """Shape/dtype/stride contract of every matvec kernel; returns `out` (allocated if None)."""
    T, K = x.shape
    assert K == w.n_in, f"matvec: x has {K} columns, weight {w.name} has n_in {w.n_in}"
    assert 1 <= T <= MAX_ROWS, f"matvec: {T} rows (1..{MAX_ROWS})"
    assert x.dtype == torch.float32 and x.stride(1) == 1, "matvec: x must be f32 with unit column stride"
    if out is None:
        out = torch.empty((T, w.n_out), dtype=torch.float32, device=x.device)
    assert out.shape == (T, w.n_out) and out.stride(1) == 1 and out.dtype == torch.float32
    return out


def launch_dequant(kernel, ptrs, w: QWeight, block_n: int) -> torch.Tensor:
    """A tile decoder `kernel` over the whole weight (fields `ptrs` in kernel order): f32
    [n_out, n_in]; shared by this module's formats and NVFP4 (kernels/nvfp4.py)."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed")
    out = torch.empty((w.n_out, w.n_in), dtype=torch.float32, device=w.device)
    grid = (triton.cdiv(w.n_out, block_n), w.n_tiles)
    kernel[grid](out, *ptrs, w.n_out, w.n_in, FMT=FMT_CODE[w.fmt], BLOCK_N=block_n, enable_fp_fusion=False)
    return out


def dequant_triton(w: QWeight, block_n: int = 4) -> torch.Tensor:
    """The Triton tile decoder over the whole weight: f32 [n_out, n_in] (tests compare it
    bit-exact with `w.decode()`)."""
    return launch_dequant(_dequant_kernel, _ptrs(w), w, block_n)


def matvec(w: QWeight, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The engine's decode-shaped projection on CUDA: x [T, n_in] f32 (T <= 16) -> [T, n_out]: the
    packed-layout kernel (qmatvec_v3) where the weight carries that layout (K-quants and NVFP4
    matrices, packed at load), NVFP4's tile decoder for an unpacked NVFP4 weight, else this
    module's kernel. Every one is row-invariant."""
    if w.packed is not None:
        from . import qgemm_split, qmatvec_v3

        if isinstance(w.packed, qgemm_split.SplitPacked):
            return qgemm_split.matmul(w.packed, x, out)

        return qmatvec_v3.matvec_v3(w.packed, x, out)
    if w.fmt in NVFP4_FORMATS:
        from .nvfp4 import matvec_nvfp4

        return matvec_nvfp4(w, x, out)
    if not w.fields:
        raise LaneError(f"tensor {w.name!r}: neither its fields nor a packed layout are resident")
    return matvec_triton(w, x, out)


def matvec_triton(w: QWeight, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, n_in] f32 (T <= 16, rows contiguous) -> [T, n_out] f32, weights decoded in-kernel."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed")
    return launch_matvec(_matvec_kernel, _ptrs(w), w, x, out)


def launch_matvec(kernel, ptrs, w: QWeight, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """One launch of a 256-tile matvec kernel (this module's, or NVFP4's) over x [T, n_in], T <= 16;
    shared by both, as `launch_dequant` is for their decoders."""
    out = check_matvec_args(w, x, out)
    T = x.shape[0]
    rows = _rows_bucket(T)
    block_n = max(1, 16 // rows)  # keep the [ROWS, BLOCK_N, 256] product tile at 4K elements
    grid = (triton.cdiv(w.n_out, block_n),)
    kernel[grid](x, out, *ptrs, w.n_out, w.n_in, x.stride(0), out.stride(0), T,
                 FMT=FMT_CODE[w.fmt], ROWS=rows, BLOCK_N=block_n, num_warps=4, enable_fp_fusion=False)
    return out


__all__ = ["HAVE_TRITON", "MAX_ROWS", "QK", "matvec", "matvec_ref", "matvec_triton", "dequant_triton"]
