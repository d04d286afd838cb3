"""The projection reference and the Triton tile decoder of the repacked weight fields
(engine/weights.py), plus the argument contract of the row-bucketed matvec kernels (NVFP4's,
kernels/nvfp4.py). The engine's projections on CUDA run kernels/qgemm.py.

The tile decoder forms every product in f32 in ggml's order (`d1 = d * sc; w = d1 * q - m1`)
and the kernel is launched with `enable_fp_fusion=False`, so no multiply-add is contracted
into an FMA: the decoded weight is the reference codec's value bit for bit (tested against
`QWeight.decode`).

Reference: `matvec_ref(w, x) = x @ w.decode().T` (torch, f32).
"""

from __future__ import annotations

import torch

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


def _ptrs(w: QWeight) -> list[torch.Tensor]:
    """The weight's fields in kernel order p0..p5 (weights.FIELDS); unused slots repeat p0 (any
    valid pointer: never dereferenced)."""
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


__all__ = ["HAVE_TRITON", "MAX_ROWS", "QK", "check_matvec_args", "dequant_triton", "launch_dequant", "matvec_ref"]
