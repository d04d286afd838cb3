"""Fused dequant + matvec, second design: streamed for bandwidth (book ch. 1: decode is a
bandwidth problem). Q4_K, Q5_K, Q6_K, Q8_0 and F16 (F32/BF16 share the F16 path), 1..16
activation rows, over the unchanged repacked fields of engine/weights.py.

Design (per program: BLOCK_N output rows, a loop over K in chunks of SB super-blocks = SB*256
elements; no split-K, so the result is deterministic):

* A chunk is viewed as a [BLOCK_N, S, L] tile: S sub-blocks of L elements, L = the format's
  scale granularity (32 for Q4_K/Q5_K/Q8_0/F16, 16 for Q6_K), S = SB*256 // L. The quant bytes
  of one (row, sub-block) are L contiguous bytes, loaded as one vector (16-byte loads); the
  scale fields (d, dmin, sc, m) are loaded once per (row, sub-block) as [BLOCK_N, S] and
  broadcast over L. Every weight byte comes from DRAM once (a byte that feeds two sub-blocks,
  low and high nibble, is re-read from L1, never from DRAM).
* Integer -> float without I2F: q | 0x4B000000 reinterpreted as f32 is 2^23 + q exactly, and
  one subtraction of 2^23 (or 2^23 + 32 for Q6_K's offset) gives q exactly (|q| < 2^23).
* The decoded weight is formed as ggml forms it, one f32 operation at a time
  (ggml-quants.c dequantize_row_q4_K / q5_K: d1 = d * sc; m1 = min * m; y = d1 * q - m1;
  dequantize_row_q6_K: y = d * sc[is] * q; dequantize_row_q8_0: y = qs * d), with
  enable_fp_fusion=False so no product is contracted into an FMA: bit-identical to
  `QWeight.decode()` (tested through `dequant_v2`, which runs the same tile decoder).
  FMA_DECODE=True forms Q4_K/Q5_K as fma(d1, q, -m1): also bit-identical, because d1 * q is
  exact in f32 (d: 11 significant bits, sc <= 63: 6 bits, q <= 31: 5 bits -> <= 22 bits), so
  the only rounding is the subtraction's either way; it saves one instruction per weight.
* The dot accumulates in f32, either per chunk (ACC_FMA=False: tl.sum of the products into a
  [ROWS, BLOCK_N] accumulator, few registers) or element-wise across the whole loop
  (ACC_FMA=True: tl.fma into a [ROWS, BLOCK_N, S, L] accumulator, reduced once at the end; one
  instruction per product instead of a multiply and an add). Either way f32 accumulation in an
  order that differs from the reference at the ulp level (the exact lane's contract).

Reference beside it: `qmatvec.matvec_ref(w, x) = x @ w.decode().T`.
"""

from __future__ import annotations

import torch

from ...gguf.types import GgmlType as G
from ..weights import FMT_CODE, QWeight
from .qmatvec import MAX_ROWS, _ptrs, _rows_bucket, check_matvec_args

try:  # Triton is optional on the CPU; the CUDA backend requires it.
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAVE_TRITON = False

FORMATS = (G.F32, G.F16, G.BF16, G.Q8_0, G.Q4_K, G.Q5_K, G.Q6_K)

# Tile configuration per row bucket (ROWS = T rounded up to a power of two):
# (BLOCK_N, SB, num_warps, ACC_FMA). One row: a light accumulator leaves registers for the
# loaded bytes in flight; 2..16 rows: compute grows with T, so one fma per product pays.
CONFIGS: dict[int, tuple[int, int, int, bool]] = {
    1: (8, 2, 4, False),
    2: (4, 2, 4, True),
    4: (4, 1, 4, True),
    8: (2, 1, 4, True),
    16: (2, 1, 4, True),
}


def supports(fmt: G) -> bool:
    return fmt in FORMATS


if HAVE_TRITON:

    @triton.jit
    def _decode(FMT: tl.constexpr, p0, p1, p2, p3, p4, p5, row, nmask, c, K,
                SB: tl.constexpr, S: tl.constexpr, L: tl.constexpr, FMA_DECODE: tl.constexpr):
        """Chunk c (SB*256 elements from c*SB*256) of rows `row` (int64 [BN]) -> f32 [BN, S, L]
        and the chunk's column indices k [S, L] (element of sub-block s, lane i: s*L + i)."""
        s = tl.arange(0, S)
        i = tl.arange(0, L)
        k = c * (SB * 256) + s[:, None] * L + i[None, :]  # [S, L]
        km = k < K
        m3 = nmask[:, None, None] & km[None, :, :]  # [BN, S, L]
        if FMT <= 2:  # F32 / F16 / BF16: w [N, K]; f16/bf16 -> f32 is exact
            w = tl.load(p0 + row[:, None, None] * K + k[None, :, :], mask=m3, other=0.0).to(tl.float32)
        elif FMT == 3:  # Q8_0: qs int8 [N, K], d f16 [N, K/32]; sub-block = one 32-block
            m2 = nmask[:, None] & (s < (K // 32 - c * (SB * 8)))[None, :]
            q = tl.load(p0 + row[:, None, None] * K + k[None, :, :], mask=m3, other=0).to(tl.int32)
            qf = (q + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0  # 2^23 + 128 + q - (2^23 + 128)
            d = tl.load(p1 + row[:, None] * (K // 32) + (c * (SB * 8) + s)[None, :], mask=m2, other=0.0)
            w = qf * d.to(tl.float32)[:, :, None]  # ggml dequantize_row_q8_0: y = qs * d
        elif FMT <= 6:  # Q4_K / Q5_K: qs [N, nb*128], d, dmin [N, nb], sc, m [N, nb*8], (qh [N, nb*32])
            nb = K // 256
            j = s % 8  # sub-block (scale slot) inside its super-block
            blk = row[:, None] * nb + (c * SB + s // 8)[None, :]  # [BN, S] int64
            m2 = nmask[:, None] & (c * SB + s // 8 < nb)[None, :]
            # ggml: sub-block j takes the low (j even) or high (j odd) nibble of qs[32 (j/2) + i]
            b = tl.load(p0 + (blk * 128 + (j // 2 * 32)[None, :])[:, :, None] + i[None, None, :],
                        mask=m3, other=0).to(tl.int32)
            q = (b >> (4 * (j % 2))[None, :, None]) & 0xF
            if FMT == 6:  # ggml q5_K: + 16 if bit j of qh[i] is set
                h = tl.load(p5 + (blk * 32)[:, :, None] + i[None, None, :], mask=m3, other=0).to(tl.int32)
                q = q | (((h >> j[None, :, None]) & 1) << 4)
            qf = (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0  # exactly q
            sc = tl.load(p3 + blk * 8 + j[None, :], mask=m2, other=0).to(tl.float32)
            mn = tl.load(p4 + blk * 8 + j[None, :], mask=m2, other=0).to(tl.float32)
            d = tl.load(p1 + blk, mask=m2, other=0.0).to(tl.float32)
            dmin = tl.load(p2 + blk, mask=m2, other=0.0).to(tl.float32)
            d1 = d * sc  # ggml: d1 = d * sc  [BN, S]
            m1 = dmin * mn  # ggml: m1 = min * m
            if FMA_DECODE:  # d1 * q is exact in f32: one rounding either way (module doc)
                # -1.0 * m1, not -m1 (which Triton forms as 0 - m1): keeps the sign of a zero m1
                w = tl.fma(d1[:, :, None], qf, -1.0 * m1[:, :, None])
            else:
                w = d1[:, :, None] * qf - m1[:, :, None]  # ggml: y = d1 * q - m1, two roundings
        else:  # Q6_K: ql [N, nb*128], qh [N, nb*64], sc int8 [N, nb*16], d f16 [N, nb]; L = 16
            nb = K // 256
            u = s % 16  # 16-element sub-block = scale slot sc[u] (ggml: is = 8 n + l/16 + 2 quarter)
            hh = u // 8  # 128-half n
            qt = (u % 8) // 2  # quarter
            odd = u % 2  # l / 16
            blk = row[:, None] * nb + (c * SB + s // 16)[None, :]  # [BN, S] int64
            m2 = nmask[:, None] & (c * SB + s // 16 < nb)[None, :]
            lo_off = 64 * hh + 16 * odd + 32 * (qt % 2)  # ggml: ql[l (+32)] of half n
            hi_off = 32 * hh + 16 * odd  # ggml: qh[l] of half n
            lb = tl.load(p0 + (blk * 128 + lo_off[None, :])[:, :, None] + i[None, None, :],
                         mask=m3, other=0).to(tl.int32)
            hb = tl.load(p1 + (blk * 64 + hi_off[None, :])[:, :, None] + i[None, None, :],
                         mask=m3, other=0).to(tl.int32)
            q = ((lb >> (4 * (qt // 2))[None, :, None]) & 0xF) | (((hb >> (2 * qt)[None, :, None]) & 3) << 4)
            qf = (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388640.0  # exactly q - 32
            sc = tl.load(p2 + blk * 16 + u[None, :], mask=m2, other=0).to(tl.float32)
            d = tl.load(p3 + blk, mask=m2, other=0.0).to(tl.float32)
            w = (d * sc)[:, :, None] * qf  # ggml: y = d * sc[is] * q
        return w, k

    @triton.jit
    def _dequant_v2_kernel(out, p0, p1, p2, p3, p4, p5, N, K, FMT: tl.constexpr, BLOCK_N: tl.constexpr,
                           SB: tl.constexpr, S: tl.constexpr, L: tl.constexpr, FMA_DECODE: tl.constexpr):
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < N
        row = n.to(tl.int64)
        c = tl.program_id(1)
        w, k = _decode(FMT, p0, p1, p2, p3, p4, p5, row, nmask, c, K, SB, S, L, FMA_DECODE)
        tl.store(out + row[:, None, None] * K + k[None, :, :], w, mask=nmask[:, None, None] & (k < K)[None, :, :])

    @triton.jit(do_not_specialize=["T"])  # one binary per (format, row bucket, config), whatever T
    def _matvec_v2_kernel(x, y, p0, p1, p2, p3, p4, p5, N, K, sx, sy, T,
                          FMT: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, SB: tl.constexpr,
                          S: tl.constexpr, L: tl.constexpr, FMA_DECODE: tl.constexpr, ACC_FMA: tl.constexpr):
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < N
        row = n.to(tl.int64)
        r = tl.arange(0, ROWS)
        rmask = r < T
        n_chunks = (K + SB * 256 - 1) // (SB * 256)
        if ACC_FMA:
            acc4 = tl.zeros([ROWS, BLOCK_N, S, L], dtype=tl.float32)
        else:
            acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        for c in range(0, n_chunks):
            w, k = _decode(FMT, p0, p1, p2, p3, p4, p5, row, nmask, c, K, SB, S, L, FMA_DECODE)  # [BN, S, L]
            xv = tl.load(x + r[:, None, None] * sx + k[None, :, :],
                         mask=rmask[:, None, None] & (k < K)[None, :, :], other=0.0)  # [ROWS, S, L]
            if ACC_FMA:
                acc4 = tl.fma(w[None, :, :, :], xv[:, None, :, :], acc4)  # f32, one rounding per product-add
            else:
                acc += tl.sum(tl.sum(w[None, :, :, :] * xv[:, None, :, :], axis=3), axis=2)  # f32
        if ACC_FMA:
            acc = tl.sum(tl.sum(acc4, axis=3), axis=2)
        tl.store(y + r[:, None] * sy + n[None, :], acc, mask=rmask[:, None] & nmask[None, :])


def _geometry(fmt: G, sb: int) -> tuple[int, int]:
    """(S, L) of a chunk of `sb` super-blocks: L = the format's scale granularity."""
    L = 16 if fmt == G.Q6_K else 32
    return sb * 256 // L, L


def dequant_v2(w: QWeight, block_n: int = 2, sb: int = 1, fma_decode: bool = False) -> torch.Tensor:
    """The v2 tile decoder over the whole weight: f32 [n_out, n_in] (tests hold it bit-exact
    with `w.decode()`)."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed")
    if not supports(w.fmt):
        raise ValueError(f"matvec_v2: no v2 decoder for {w.fmt.name}")
    S, L = _geometry(w.fmt, sb)
    out = torch.empty((w.n_out, w.n_in), dtype=torch.float32, device=w.device)
    grid = (triton.cdiv(w.n_out, block_n), triton.cdiv(w.n_in, sb * 256))
    _dequant_v2_kernel[grid](out, *_ptrs(w), w.n_out, w.n_in, FMT=FMT_CODE[w.fmt], BLOCK_N=block_n, SB=sb,
                             S=S, L=L, FMA_DECODE=fma_decode, enable_fp_fusion=False)
    return out


def matvec_v2(w: QWeight, x: torch.Tensor, out: torch.Tensor | None = None,
              config: tuple[int, int, int, bool] | None = None, fma_decode: bool = False) -> torch.Tensor:
    """x [T, n_in] f32 (T <= 16, unit column stride) -> [T, n_out] f32, weights decoded in-kernel.
    `config` = (BLOCK_N, SB, num_warps, ACC_FMA) overrides CONFIGS (device sweeps)."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed")
    if not supports(w.fmt):
        raise ValueError(f"matvec_v2: no v2 kernel for {w.fmt.name}")
    out = check_matvec_args(w, x, out)
    T = x.shape[0]
    rows = _rows_bucket(T)
    block_n, sb, num_warps, acc_fma = config if config is not None else CONFIGS[rows]
    S, L = _geometry(w.fmt, sb)
    grid = (triton.cdiv(w.n_out, block_n),)
    _matvec_v2_kernel[grid](x, out, *_ptrs(w), w.n_out, w.n_in, x.stride(0), out.stride(0), T,
                            FMT=FMT_CODE[w.fmt], ROWS=rows, BLOCK_N=block_n, SB=sb, S=S, L=L,
                            FMA_DECODE=fma_decode, ACC_FMA=acc_fma, num_warps=num_warps,
                            enable_fp_fusion=False)
    return out


__all__ = ["CONFIGS", "FORMATS", "HAVE_TRITON", "MAX_ROWS", "dequant_v2", "matvec_v2", "supports"]
