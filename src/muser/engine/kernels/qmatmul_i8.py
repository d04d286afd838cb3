"""Integer-lane GEMM on CUDA (Triton): y = x @ W^T exactly as `muser.quant.dot.matmul_ggml` forms
it, bit for bit, for Q8_0, Q4_0, Q4_K, Q5_K and Q6_K weights and any number of activation rows.

Arithmetic (the integer lane's contract, ggml-cpu's vec_dot with one fixed float order):
1. `quantize_act` converts the f32 activations to the weight type's vec_dot_type (dot.VEC_DOT_TYPE):
   Q8_K per 256 (first-index signed max, iscale = -127/max, q = min(127, nearest_int(iscale * x)),
   d = 1/iscale, bsums) or Q8_0 per 32 (d = f16(amax/127), id = 127/amax, q = clip(rint(x * id))).
   Every division is IEEE round-to-nearest (`tl.div_rn`; a plain f32 `/` may be approximate on
   CUDA) and rounding to an integer is the 1.5 * 2^23 add (ggml-quants.c nearest_int), which is
   round-half-even for these magnitudes both compiled and under the interpreter. `store_act` is
   the one quantizer: `quantize_act`'s kernel calls it, and so do the engine's tail kernels that
   write a projection's input (kernels/fused.py), which saves the integer lane a launch per input.
2. Per 32-element (Q6_K: 16-element) sub-block the integer sum of weight code x activation code
   is one int8 `tl.dot` with an int32 result: exact. Q6_K's two 16-element halves of a 32-group
   are two dots against the activations with the other half zeroed (the zeros add nothing).
   Codes become int8 operands by byte-wise logic only (and/or/xor stay packed four to a
   register; a per-byte shift costs ~3 instructions a weight): a high nibble h is read as
   16h - 128, a low one as lo - 16 or lo - 32 (a constant or-ed above it), Q6_K's high bits
   in place (4^q h2); the offsets and scales come back by integer identities, the activation
   sums they need from one more dot against ones (all exact, in int32).
   The K-quant scale combine (sum_j sc_j * isum_j, the mins against the Q8_K bsums) stays in int32
   (Q4_K/Q5_K |sumi| < 2^27, Q6_K < 2^28).
3. Each block's term is formed as dot.py forms it: Q8_0/Q4_0 f64(f32(wd * ad)) * isum per
   32-block, in float64; Q4_K/Q5_K f32(sumi) * f32(ad * wd) + f32(summ) * f32(-ad * dmin) per
   256-block, Q6_K f32(sumi) * f32(ad * wd), in float32 (each conversion, product and the one
   addition rounded once).
4. The terms are summed in their type (ACC: float64 for Q8_0/Q4_0, float32 for the K-quants) in
   two fixed levels (dot._chunk_sum): per chunk of dot.CHUNK_ELEMS elements, +0.0 then + term
   block by block; then +0.0 and + each chunk's sum in chunk order; rounded to f32 at the store
   (float64 sums). Calls of <= SPLIT_ROWS rows give every chunk
   its own program (a one-row call has N / BN x chunks programs) and add the chunk sums in
   `_chunk_reduce_kernel`; wider calls walk the chunks in one program.
   Kernels launch with enable_fp_fusion=False, so no step contracts into an FMA.
5. One-row launches of the activation quantizers and the chunk reduce take programmatic dependent
   launch on sm_90 (gdc.py: each waits for the kernel before it as its first step), as the exact
   lane's one-row kernels do; the GEMM kernel does not (it stages its constant operand in shared
   memory before any wait, which the PTX order check refuses). Launch timing only: same values.

Why every row's bits are independent of the batch (row invariance by construction): an output
(t, n) depends only on activation row t and weight row n; its integer sums are exact whatever
the tile shape, and its float steps (one rounding per scale product, per term product and per
addition, in block order) are the same for every BM/BN/num_warps/num_stages and every row count.
So a one-row decode, a 16-row verify and a 500-row prefill chunk give a row the same bits, and
configs change speed only.

Layout read (weights.repack fields; rows may be a row slice of fields stacked along rows):
  Q8_0 qs int8 [N, K], d f16 [N, K/32]
  Q4_0 qs u8 [N, K/2] (per 32-block: byte i low nibble = element i, high nibble = element 16 + i),
       d f16 [N, K/32]
  Q4_K qs u8 [N, nb*128] (per 64-chunk c of a 256-block: byte 32c + i low nibble = element
       64c + i, high nibble = element 64c + 32 + i), sc/m u8 [N, nb*8], d/dmin f16 [N, nb]
  Q5_K + qh u8 [N, nb*32] (element 64c + i: bit 2c of qh[i]; 64c + 32 + i: bit 2c + 1)
  Q6_K ql u8 [N, nb*128], qh u8 [N, nb*64], sc int8 [N, nb*16], d f16 [N, nb]
       (element 128h + 32q + l: low 4 bits from ql[64h + 32(q % 2) + l] (q < 2 low nibble,
       else high), high 2 bits from qh[32h + l] at 2q; scale sc[8h + 2q + l // 16])
Each weight tile is read as [32, BN] bytes, contiguous along K per output row (32 bytes a row
per sub-block), decoded to int8 codes in registers and fed to the tensor cores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import LaneError
from ...gguf.types import GgmlType as G
from ...quant.dot import CHUNK_ELEMS, VEC_DOT_TYPE
from ..weights import FIELDS, QWeight
from . import gdc

try:  # Triton is optional on the CPU; the CUDA backend requires it.
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAVE_TRITON = False

FORMATS = (G.Q8_0, G.Q4_0, G.Q4_K, G.Q5_K, G.Q6_K)
KINDS = (G.Q8_K, G.Q8_0)
_BLOCK = {G.Q8_K: 256, G.Q8_0: 32}  # activation block per kind
# the FMT constexpr
_CODE = {G.Q8_0: 0, G.Q4_0: 1, G.Q4_K: 2, G.Q5_K: 3, G.Q6_K: 4}
# columns a quantization program takes (one Q8_K block; eight Q8_0 blocks)
_QUANT_COLS = {G.Q8_K: 256, G.Q8_0: 256}
# store_act's KIND constexpr (0: no activations written)
ACT_KIND = {G.Q8_K: 1, G.Q8_0: 2}

# (BM, BN, num_warps, num_stages) per row bucket (16: T <= 16, 64: wider), from the H200 sweep of
# 2026-12-02 on every full-geometry shape (20261202T051859Z-kernels-cuda.json; each tiling bitwise
# equal to the default). BM 16: a one-row call is a 16-row tile with 15 idle rows. One warp per
# program: two warps cost 2.2-3.5x at one row on every projection shape. At one row 16 x 32 with
# 2 stages was fastest on 7 of 8 shapes (Q4_K 39936 x 6656: 124 us against 176 for 16 x 16 x 4
# stages); at 512 rows 16 x 32 x 1 warp was within 2% of the best on the Q4_K shapes, Q5_K's LM
# head keeps 16 x 16 (24.9 ms against 31.0) and Q6_K takes 32 x 32 x 2 warps (2.69 ms against 3.87
# on 6656 x 19968). Device sweeps override through `config`; the bits never depend on it.
CONFIGS: dict[int, tuple[int, int, int, int]] = {
    16: (16, 32, 1, 2),
    64: (16, 32, 1, 4),
}
WIDE_BY_FORMAT: dict[G, tuple[int, int, int, int]] = {G.Q5_K: (16, 16, 1, 4), G.Q6_K: (32, 32, 2, 3)}
# Calls of at most this many rows give each chunk of the two-level sum (dot.CHUNK_ELEMS) its own
# program and add the chunk sums in a second launch; wider calls walk the chunks in one program.
# The additions and their order are the same either way (the bits never depend on it).
SPLIT_ROWS = 16


def supports(fmt: G) -> bool:
    return fmt in FORMATS


def _bucket(t: int) -> int:
    return 16 if t <= 16 else 64


def check_config(config) -> tuple[int, int, int, int]:
    """(BM, BN, num_warps, num_stages) or ValueError naming it: BM and BN powers of two from 16
    (tl.dot's smallest tile; BM to 128, BN to 256), num_warps a power of two to 16, 1..8 stages."""
    try:
        bm, bn, nw, ns = (int(v) for v in config)
    except (TypeError, ValueError):
        raise ValueError(f"config {config!r}: expected (BM, BN, num_warps, num_stages)") from None

    def pow2(v: int, lo: int, hi: int) -> bool:
        return lo <= v <= hi and v & (v - 1) == 0

    if not (pow2(bm, 16, 128) and pow2(bn, 16, 256) and pow2(nw, 1, 16) and 1 <= ns <= 8):
        raise ValueError(f"config {list(config)!r}: BM in 16..128 and BN in 16..256 powers of two, "
                         f"num_warps a power of two <= 16, num_stages 1..8")
    return bm, bn, nw, ns


def config_for(rows: int, fmt: G | None = None) -> tuple[int, int, int, int]:
    """The tiling of a `rows`-row call on weights of type `fmt` (CONFIGS, WIDE_BY_FORMAT)."""
    b = _bucket(rows)
    if b == 64 and fmt in WIDE_BY_FORMAT:
        return WIDE_BY_FORMAT[fmt]
    return CONFIGS[b]


@dataclass(frozen=True)
class Act:
    """Activations in a weight type's vec_dot_type (dot.VEC_DOT_TYPE), on the device.
    Q8_K: d per 256, bsum32 = bsums[2j] + bsums[2j+1] per 32; Q8_0: d per 32 (the f16 value as
    f32), bsum32 None."""

    kind: G
    qs: torch.Tensor  # int8 [T, K]
    d: torch.Tensor  # f32 [T, K / block]
    bsum32: torch.Tensor | None  # int32 [T, K/32] (Q8_K only)

    @classmethod
    def empty(cls, kind: G, T: int, K: int, device) -> "Act":
        """Uninitialized activations of T rows of K in `kind`, for a kernel to write (store_act)."""
        kind = G(kind)
        if kind not in KINDS or K % _BLOCK[kind]:
            raise ValueError(f"Act.empty: {K} columns of {kind.name} (kinds {[k.name for k in KINDS]}, "
                             f"K a multiple of the block)")
        qs = torch.empty((T, K), dtype=torch.int8, device=device)
        d = torch.empty((T, K // _BLOCK[kind]), dtype=torch.float32, device=device)
        bs = torch.empty((T, K // 32), dtype=torch.int32, device=device) if kind == G.Q8_K else None
        return cls(kind, qs, d, bs)

    @property
    def rows(self) -> int:
        return int(self.qs.shape[0])

    @property
    def n_in(self) -> int:
        return int(self.qs.shape[1])


if HAVE_TRITON:

    @triton.jit
    def _round_int(p):
        """ggml-quants.c nearest_int: add 1.5 * 2^23 in f32, read the low mantissa bits (int32)."""
        r = (p + 12582912.0).to(tl.int32, bitcast=True)
        return (r & 0x007FFFFF) - 0x00400000

    from .gdc import after_prior

    @triton.jit
    def _first_max(a0, i0, v0, a1, i1, v1):
        """Combine of (|x|, index, x): the larger |x|, of equal ones the smaller index (ggml's
        `if (ax > amax)` scan keeps the first); associative and commutative, so the reduction's
        tree does not matter."""
        take = (a1 > a0) | ((a1 == a0) & (i1 < i0))
        return tl.where(take, a1, a0), tl.where(take, i1, i0), tl.where(take, v1, v0)

    @triton.jit
    def _q8_K_blocks(v):
        """v f32 [NB, 256] -> (codes int32 [NB, 256], d f32 [NB], bsum32 int32 [NB, 8]): ggml's
        quantize_row_q8_K_ref per block (first-index signed max, iscale = -127 / max, codes
        min(127, nearest_int(iscale * x)), d = 1 / iscale, the 16-sums paired per 32)."""
        NB: tl.constexpr = v.shape[0]
        e = tl.zeros([NB, 256], dtype=tl.int32) + tl.arange(0, 256)[None, :]
        # one reduction: the largest |x| and, of equal ones, the first index's signed value
        amax, _, mx = tl.reduce((tl.abs(v), e, v), 1, _first_max)  # [NB] each
        nz = amax != 0.0
        iscale = tl.div_rn(-127.0, tl.where(nz, mx, 1.0))
        q = tl.minimum(_round_int(iscale[:, None] * v), 127)  # [NB, 256] int32
        q = tl.where(nz[:, None], q, 0)
        dv = tl.where(nz, tl.div_rn(1.0, iscale), 0.0)
        s32 = tl.sum(tl.reshape(q, (NB, 8, 32)), 2)  # [NB, 8]: bsums[2j] + bsums[2j + 1]
        return q, dv, s32

    @triton.jit
    def _q8_0_blocks(v):
        """v f32 [NB, 32] -> (codes int32 [NB, 32], d f32 [NB]): quantize_row_q8_0 per block,
        d = f16(amax / 127), id = 127 / amax (the AVX2 path), codes rint(x * id) saturated."""
        amax = tl.max(tl.abs(v), 1)  # [NB]
        dh = tl.div_rn(amax, 127.0).to(tl.float16).to(tl.float32)
        nz = amax != 0.0
        idv = tl.where(nz, tl.div_rn(127.0, tl.where(nz, amax, 1.0)), 0.0)
        q = tl.minimum(tl.maximum(_round_int(v * idv[:, None]), -128), 127)  # half-to-even, saturated
        return q, dh

    @triton.jit
    def store_act(v, qs, d, bs, t, c0, K, KIND: tl.constexpr):
        """Quantize v f32 [B] (columns c0 .. c0 + B - 1 of row t; B a multiple of the kind's block,
        c0 of B) into an Act's tensors: qs int8 [T, K], d f32 [T, K / blk], bs int32 [T, K / 32].
        KIND 0: nothing, 1: Q8_K, 2: Q8_0. Blocks at or past K are not stored. The one quantizer
        of the integer lane: `quantize_act`'s kernel and the fused tails that write activations
        (kernels/fused.py) both call it, so their codes and scales are the same bits."""
        B: tl.constexpr = v.shape[0]
        if KIND == 1:
            NK: tl.constexpr = B // 256
            blk = c0 // 256 + tl.arange(0, NK)  # [NK]
            ok = blk < K // 256
            q, dv, s32 = _q8_K_blocks(tl.reshape(v, (NK, 256)))
            e = blk[:, None] * 256 + tl.arange(0, 256)[None, :]
            tl.store(qs + t * K + e, q.to(tl.int8), mask=ok[:, None])
            tl.store(d + t * (K // 256) + blk, dv, mask=ok)
            tl.store(bs + t * (K // 32) + blk[:, None] * 8 + tl.arange(0, 8)[None, :], s32, mask=ok[:, None])
        elif KIND == 2:
            N0: tl.constexpr = B // 32
            blk = c0 // 32 + tl.arange(0, N0)  # [N0]
            ok = blk < K // 32
            q, dh = _q8_0_blocks(tl.reshape(v, (N0, 32)))
            e = blk[:, None] * 32 + tl.arange(0, 32)[None, :]
            tl.store(qs + t * K + e, q.to(tl.int8), mask=ok[:, None])
            tl.store(d + t * (K // 32) + blk, dh, mask=ok)

    @triton.jit
    def _quant_kernel(x, qs, d, bs, K, sx, KIND: tl.constexpr, B: tl.constexpr, PDL: tl.constexpr):
        """Row t's columns [B * j, B * (j + 1)) of x -> the Act's codes and scales (store_act)."""
        after_prior(PDL)  # gdc.py: the previous kernel done before the first read
        t = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * B + tl.arange(0, B)
        v = tl.load(x + t * sx + c, mask=c < K, other=0.0)  # [B] f32
        store_act(v, qs, d, bs, t, tl.program_id(1) * B, K, KIND)

    @triton.jit
    def _act_tile(aq, tok, mmask, K, e0):
        """Activation codes [BM, 32] int8 of elements e0 .. e0 + 31 (idle rows 0)."""
        k = tl.arange(0, 32)
        return tl.load(aq + tok[:, None] * K + e0 + k[None, :], mask=mmask[:, None], other=0)

    @triton.jit
    def _byte_tile(p, row, width, nmask, at):
        """Weight bytes [32, BN] u8: byte at + i of each row (contiguous along K)."""
        k = tl.arange(0, 32)
        return tl.load(p + row[None, :] * width + at + k[:, None], mask=nmask[None, :], other=0)

    @triton.jit
    def _term(FMT: tl.constexpr, b, aq, ad, ab, w0, w1, w2, w3, w4, w5, row, tok, nmask, mmask, K,
              BM: tl.constexpr, BN: tl.constexpr):
        """The term [BM, BN] of weight block b (Q8_0/Q4_0: a 32-block, float64; K-quants: a
        256-block, float32), formed as dot.py forms it."""
        k = tl.arange(0, 32)
        if FMT <= 1:  # Q8_0 / Q4_0: w0 qs, w1 d; one 32-block per step
            nb = K // 32
            ones = tl.full([32, BN], 1, tl.int8)
            if FMT == 0:
                xq = _act_tile(aq, tok, mmask, K, b * 32)  # [BM, 32] int8
                wq = tl.load(w0 + row[None, :] * K + b * 32 + k[:, None], mask=nmask[None, :], other=0)
                isum = tl.dot(xq, wq, out_dtype=tl.int32)  # [BM, BN] exact
            else:
                # byte k % 16 on both halves; element i < 16 is its low nibble, read as lo - 16
                # (0xF0 or-ed on), element 16 + i its high nibble, read as 16 hi - 128, against
                # activations with the other half loaded as zeros (no per-byte select or shift):
                # 16 isum = 16 (D_lo + 8 S_lo) + D_hi, S_lo from a dot with ones
                wb = tl.load(w0 + row[None, :] * (K // 2) + b * 16 + (k % 16)[:, None], mask=nmask[None, :],
                             other=0)
                lop = ((wb & 0x0F) | 0xF0).to(tl.int8, bitcast=True)
                hop = ((wb & 0xF0) ^ 0x80).to(tl.int8, bitcast=True)
                xp = aq + tok[:, None] * K + b * 32 + k[None, :]
                xa = tl.load(xp, mask=mmask[:, None] & (k < 16)[None, :], other=0)
                xb = tl.load(xp, mask=mmask[:, None] & (k >= 16)[None, :], other=0)
                t = tl.dot(xa, lop, acc=tl.dot(xa, ones, out_dtype=tl.int32) << 3, out_dtype=tl.int32)
                isum = tl.dot(xb, hop, acc=t << 4, out_dtype=tl.int32) >> 4  # exact
            wd = tl.load(w1 + row * nb + b, mask=nmask, other=0.0).to(tl.float32)
            a_d = tl.load(ad + tok * nb + b, mask=mmask, other=0.0)
            s = wd[None, :] * a_d[:, None]  # f32: fp16(x.d) * fp16(y.d)
            term = s.to(tl.float64) * isum.to(tl.float64)
        elif FMT <= 3:  # Q4_K / Q5_K: w0 qs, w1 d, w2 dmin, w3 sc, w4 m, w5 qh
            nb = K // 256
            j8 = tl.arange(0, 8)
            ones = tl.full([32, BN], 1, tl.int8)
            if FMT == 3:
                qh = _byte_tile(w5, row, nb * 32, nmask, b * 32)
            sumi = tl.zeros([BM, BN], dtype=tl.int32)  # 16 x sum_j sc_j * isum_j
            for c in tl.static_range(4):
                wb = _byte_tile(w0, row, nb * 128, nmask, b * 128 + 32 * c)  # [32, BN] u8
                for h in tl.static_range(2):
                    j = 2 * c + h  # sub-block
                    sc = tl.load(w3 + row * (nb * 8) + b * 8 + j, mask=nmask, other=0).to(tl.int32)
                    xq = _act_tile(aq, tok, mmask, K, b * 256 + 32 * j)
                    if FMT == 3:  # the 5th bit in place: (qh & 2^j) is 2^j hb (j = 7: -128 hb)
                        th = tl.dot(xq, (qh & (1 << j)).to(tl.uint8).to(tl.int8, bitcast=True), out_dtype=tl.int32)
                    if h == 0:  # low nibble lo: isum = D_lo (+ 16 sum x hb)
                        lop = (wb & 0x0F).to(tl.int8, bitcast=True)
                        if FMT == 3:
                            if j <= 4:
                                t = th << (4 - j)
                            else:
                                t = th >> (j - 4)  # exact: th is a multiple of 2^j
                            isum = tl.dot(xq, lop, acc=t, out_dtype=tl.int32)
                        else:
                            isum = tl.dot(xq, lop, out_dtype=tl.int32)
                        sc = sc * 16
                    else:  # high nibble hi as 16 hi - 128: 16 isum = D_hi + 128 S (+ 256 sum x hb)
                        hop = ((wb & 0xF0) ^ 0x80).to(tl.int8, bitcast=True)
                        t = tl.dot(xq, ones, out_dtype=tl.int32) << 7
                        if FMT == 3:
                            if j == 7:
                                t = t - 2 * th
                            else:
                                t = t + (th << (8 - j))
                        isum = tl.dot(xq, hop, acc=t, out_dtype=tl.int32)
                    sumi = sumi + isum * sc[None, :]
            # mins against the activations' per-32 sums: summ = sum_j m_j * bsum32_j
            bsv = tl.load(ab + tok[:, None] * (K // 32) + b * 8 + j8[None, :], mask=mmask[:, None], other=0)
            mv = tl.load(w4 + row[None, :] * (nb * 8) + b * 8 + j8[:, None], mask=nmask[None, :],
                         other=0).to(tl.int32)  # [8, BN]
            summ = tl.sum(bsv[:, :, None] * mv[None, :, :], 1)  # [BM, BN]
            sumi = sumi >> 4  # exact: every term is a multiple of 16 (|16 sumi| < 2^30)
            a_d = tl.load(ad + tok * nb + b, mask=mmask, other=0.0)
            wd = tl.load(w1 + row * nb + b, mask=nmask, other=0.0).to(tl.float32)
            wm = tl.load(w2 + row * nb + b, mask=nmask, other=0.0).to(tl.float32)
            dd = a_d[:, None] * wd[None, :]  # f32: y.d * fp16(x.d)
            dm = (-a_d)[:, None] * wm[None, :]  # f32: -y.d * fp16(x.dmin)
            term = sumi.to(tl.float32) * dd + summ.to(tl.float32) * dm
        else:  # Q6_K: w0 ql, w1 qh, w2 sc, w3 d
            nb = K // 256
            ones = tl.full([32, BN], 1, tl.int8)
            sumi = tl.zeros([BM, BN], dtype=tl.int32)
            for hh in tl.static_range(2):  # 128-element halves
                qh = _byte_tile(w1, row, nb * 64, nmask, b * 64 + 32 * hh)
                for g in tl.static_range(2):
                    ql = _byte_tile(w0, row, nb * 128, nmask, b * 128 + 64 * hh + 32 * g)
                    for hi in tl.static_range(2):
                        qq = g + 2 * hi  # quarter: elements 128hh + 32qq + l, q = lo4 + 16 h2
                        # operands by byte-wise logic alone (a per-byte shift costs ~3 instructions
                        # a weight); each isum is an exact integer identity over the half's codes:
                        # qq < 2: L = lo4 - 32 (or 0xE0 onto the low nibble), H = 4^qq h2:
                        #         isum = D_L + 4^(2-qq) D_H
                        # qq = 2: L = 16 lo4 - 128, H = 16 h2: 16 isum = D_L + 16 (D_H - 24 S)
                        # qq = 3: L = 16 lo4 - 128, H = 64 h2 - 128: 16 isum = D_L + 4 (D_H + 32 S)
                        # with S the half's activation sum (a dot with ones)
                        if hi == 0:
                            lop = ((ql & 0x0F) | 0xE0).to(tl.int8, bitcast=True)
                        else:
                            lop = ((ql & 0xF0) ^ 0x80).to(tl.int8, bitcast=True)
                        if qq == 3:
                            hop = ((qh & 0xC0) ^ 0x80).to(tl.int8, bitcast=True)
                        else:
                            hop = (qh & (3 << (2 * qq))).to(tl.int8)
                        e0 = b * 256 + 128 * hh + 32 * qq
                        s = b * 16 + 8 * hh + 2 * qq
                        for half in tl.static_range(2):  # elements l < 16, then l >= 16
                            # the other half's codes read as zeros (masked loads: no per-byte select)
                            xh = tl.load(aq + tok[:, None] * K + e0 + k[None, :],
                                         mask=mmask[:, None] & ((k // 16) == half)[None, :], other=0)
                            if qq < 2:
                                t = tl.dot(xh, hop, out_dtype=tl.int32) << (4 - 2 * qq)
                                isum = tl.dot(xh, lop, acc=t, out_dtype=tl.int32)
                            else:
                                s1 = tl.dot(xh, ones, out_dtype=tl.int32)
                                if qq == 2:
                                    t = tl.dot(xh, hop, acc=s1 * -24, out_dtype=tl.int32) << 4
                                else:
                                    t = tl.dot(xh, hop, acc=s1 << 5, out_dtype=tl.int32) << 2
                                isum = tl.dot(xh, lop, acc=t, out_dtype=tl.int32) >> 4  # exact
                            sc = tl.load(w2 + row * (nb * 16) + s + half, mask=nmask, other=0).to(tl.int32)
                            sumi = sumi + isum * sc[None, :]
            a_d = tl.load(ad + tok * nb + b, mask=mmask, other=0.0)
            wd = tl.load(w3 + row * nb + b, mask=nmask, other=0.0).to(tl.float32)
            dd = a_d[:, None] * wd[None, :]  # f32: y.d * fp16(x.d)
            term = sumi.to(tl.float32) * dd
        return term

    @triton.jit(do_not_specialize=["T"])
    def _qmatmul_i8_kernel(aq, ad, ab, y, part, w0, w1, w2, w3, w4, w5, N, K, T, sy,
                           FMT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, CB: tl.constexpr,
                           SPLIT: tl.constexpr, ACC: tl.constexpr):
        """y [T, N] (or, SPLIT over several chunks, the chunk sums part [n_chunks, T, N] in ACC):
        chunks of CB blocks (dot.CHUNK_ELEMS elements), each summed from +0.0 in block order,
        then the chunks from +0.0 in chunk order (dot._chunk_sum). SPLIT: program_id(2) is the
        chunk (a one-row call gets N / BN x n_chunks programs); otherwise each program walks the
        chunks itself. Same additions in the same order either way."""
        n = tl.program_id(0) * BN + tl.arange(0, BN)  # [BN] output columns (weight rows)
        m = tl.program_id(1) * BM + tl.arange(0, BM)  # [BM] activation rows
        nmask = n < N
        mmask = m < T
        row = n.to(tl.int64)
        tok = m.to(tl.int64)
        nb = K // 32 if FMT <= 1 else K // 256
        nch = (nb + CB - 1) // CB
        omask = mmask[:, None] & nmask[None, :]
        if SPLIT:
            c = tl.program_id(2)
            acc = tl.zeros([BM, BN], dtype=ACC)  # +0.0 (dot._chunk_sum)
            for b in range(c * CB, tl.minimum(nb, c * CB + CB)):
                acc = acc + _term(FMT, b, aq, ad, ab, w0, w1, w2, w3, w4, w5, row, tok, nmask, mmask, K, BM, BN)
            if nch == 1:  # +0.0 + acc is acc (acc is never -0.0: it starts at +0.0)
                tl.store(y + tok[:, None] * sy + n[None, :], acc.to(tl.float32), mask=omask)
            else:
                tl.store(part + (c * T + tok[:, None]) * N + n[None, :], acc, mask=omask)
        else:
            tot = tl.zeros([BM, BN], dtype=ACC)
            for c in range(0, nch):
                acc = tl.zeros([BM, BN], dtype=ACC)
                for b in range(c * CB, tl.minimum(nb, c * CB + CB)):
                    acc = acc + _term(FMT, b, aq, ad, ab, w0, w1, w2, w3, w4, w5, row, tok, nmask, mmask, K,
                                      BM, BN)
                tot = tot + acc
            tl.store(y + tok[:, None] * sy + n[None, :], tot.to(tl.float32), mask=omask)

    @triton.jit(do_not_specialize=["T"])
    def _chunk_reduce_kernel(part, y, N, T, sy, NCH: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """y[t, n] = f32(+0.0 + part[0, t, n] + part[1, t, n] + ...), chunks in order. The chunk
        loop is unrolled (NCH a constexpr), so every chunk's load is in flight before the first
        addition waits: the chain of additions no longer waits out one L2 round trip a chunk."""
        after_prior(PDL)  # gdc.py: the previous kernel done before the first read
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < T * N
        t = i // N
        n = i % N
        acc = tl.zeros([BLOCK], dtype=part.dtype.element_ty)
        for c in tl.static_range(NCH):
            acc = acc + tl.load(part + c * T * N + i, mask=ok, other=0.0)
        tl.store(y + t * sy + n, acc.to(tl.float32), mask=ok)


def _need_triton() -> None:
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed")


def quantize_act(x: torch.Tensor, kind: G) -> Act:
    """f32 [T, K] -> Act in `kind` (Q8_K or Q8_0), bitwise ggml's quantize_row_q8_K /
    quantize_row_q8_0 (activation.quantize_q8_K / quantize_q8_0)."""
    _need_triton()
    if kind not in KINDS:
        raise ValueError(f"quantize_act: kind {kind!r} is not one of {[k.name for k in KINDS]}")
    kind = G(kind)
    blk = _BLOCK[kind]
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.dim() != 2:
        what = f"{x.dtype} {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"quantize_act takes float32 [T, K], got {what}")
    T, K = x.shape
    if T < 1 or K < blk or K % blk or x.stride(1) != 1:
        raise ValueError(f"quantize_act: x {list(x.shape)} (stride {list(x.stride())}) needs T >= 1, "
                         f"K a multiple of {blk} and unit column stride for {kind.name}")
    act = Act.empty(kind, T, K, x.device)
    B = _QUANT_COLS[kind]
    _quant_kernel[(T, triton.cdiv(K, B))](x, act.qs, act.d, act.bsum32 if act.bsum32 is not None else act.d, K,
                                          x.stride(0), KIND=ACT_KIND[kind], B=B, num_warps=4,
                                          enable_fp_fusion=False, **gdc.kwargs(x))
    return act


def _check_weight(w: QWeight) -> None:
    if w.fmt not in FORMATS:
        raise LaneError(f"tensor {w.name!r}: {G(w.fmt).name} has no integer-lane kernel "
                        f"(served: {', '.join(f.name for f in FORMATS)})")
    for k in FIELDS[w.fmt]:
        t = w.fields.get(k)
        if t is None or t.dim() != 2 or t.shape[0] != w.n_out or not t.is_contiguous():
            got = "absent" if t is None else f"{list(t.shape)} (stride {list(t.stride())})"
            raise ValueError(f"tensor {w.name!r}: field {k!r} is {got}; need contiguous [{w.n_out}, ...]")


def check_call(w: QWeight, act: Act, out: torch.Tensor | None) -> torch.Tensor:
    """The integer GEMMs' arguments checked before any launch (ValueError naming the value): the
    weight's fields, activations in its vec_dot_type and width, `out` f32 [T, N] with unit column
    stride (a column slice of a wider output allowed). Returns `out`, allocated when None."""
    _check_weight(w)
    want = VEC_DOT_TYPE[w.fmt]
    if act.kind != want or act.n_in != w.n_in:
        raise ValueError(f"tensor {w.name!r} ({G(w.fmt).name}, n_in {w.n_in}) reads {want.name} activations "
                         f"of {w.n_in} columns, got {G(act.kind).name} [{act.rows}, {act.n_in}]")
    T, N = act.rows, w.n_out
    if out is None:
        return torch.empty((T, N), dtype=torch.float32, device=act.qs.device)
    if out.dtype != torch.float32 or tuple(out.shape) != (T, N) or out.stride(1) != 1:
        raise ValueError(f"out {out.dtype} {list(out.shape)} (stride {list(out.stride())}): "
                         f"need float32 [{T}, {N}] with unit column stride")
    return out


def sum_dtype(fmt: G) -> torch.dtype:
    """The type a format's block terms and sums are formed in (dot.py): float32 for the K-quants'
    256-blocks, float64 for the 32-block formats."""
    return torch.float64 if G(fmt) in (G.Q8_0, G.Q4_0) else torch.float32


def matmul_i8_act(w: QWeight, act: Act, out: torch.Tensor | None = None, config=None) -> torch.Tensor:
    """Quantized activations [T, K] x weight [N, K] -> f32 [T, N] (y = x @ W^T), bitwise
    matmul_ggml. `out` may be a column slice of a wider output (unit column stride);
    `config` = (BM, BN, num_warps, num_stages) overrides the table (speed only)."""
    _need_triton()
    out = check_call(w, act, out)
    T, N = act.rows, w.n_out
    bm, bn, nw, ns = check_config(config) if config is not None else config_for(T, G(w.fmt))
    f = w.fields
    ptrs = [f[k] for k in FIELDS[w.fmt]]
    ptrs += [ptrs[0]] * (6 - len(ptrs))  # absent slots repeat the first field (never read)
    bs = act.bsum32 if act.bsum32 is not None else act.qs  # Q8_0: never read
    blk = 32 if w.fmt in (G.Q8_0, G.Q4_0) else 256
    cb = CHUNK_ELEMS // blk  # blocks per chunk of the two-level sum
    nch = triton.cdiv(w.n_in // blk, cb)
    split = T <= SPLIT_ROWS  # decode and verify: one program per chunk (enough programs for one row)
    part = out  # never read unless split over several chunks
    acc = sum_dtype(w.fmt)
    if split and nch > 1:
        part = torch.empty((nch, T, N), dtype=acc, device=out.device)
    grid = (triton.cdiv(N, bn), triton.cdiv(T, bm), nch if split else 1)
    _qmatmul_i8_kernel[grid](act.qs, act.d, bs, out, part, *ptrs, N, w.n_in, T, out.stride(0),
                             FMT=_CODE[w.fmt], BM=bm, BN=bn, CB=cb, SPLIT=split,
                             ACC=tl.float64 if acc == torch.float64 else tl.float32, num_warps=nw, num_stages=ns,
                             enable_fp_fusion=False)
    if split and nch > 1:
        reduce_chunks(part, out)
    return out


def reduce_chunks(part: torch.Tensor, out: torch.Tensor) -> None:
    """out[t, n] = f32(+0.0 + part[0, t, n] + part[1, t, n] + ...): the chunk sums [n_chunks, T, N]
    of a split call (in `sum_dtype` of the weight's format) added in chunk order, in their type
    (dot._chunk_sum's second level)."""
    nch, T, N = part.shape
    rb = 256  # two sums a thread and chunk: a 20-chunk sum keeps its 40 loads in flight in registers
    _chunk_reduce_kernel[(triton.cdiv(T * N, rb),)](part, out, N, T, out.stride(0), NCH=nch, BLOCK=rb, num_warps=4,
                                                     enable_fp_fusion=False, **gdc.kwargs(out))


def check_against_reference(what: str, formats, rows, kernel, device: str, shape: tuple[int, int] = (72, 1280)) -> None:
    """A Q8_K kernel of the integer lane (`kernel(w, act)`, e.g. the int8 tile) against this
    module's kernel, the same contract, on `device`, before the lane routes calls to it: every
    format of `formats` at each row count of `rows`, on a weight of `shape` (by default 72 x 1,280:
    5 blocks, chunks of 4 and 1; partial tiles). LaneError naming the kernel, format, rows and
    first differing output if a bit differs (the lane refuses rather than compute with a kernel
    this device or compiler gets wrong)."""
    from ..weights import random_bytes, repack

    g = torch.Generator(device="cpu").manual_seed(7)
    n_out, n_in = shape
    for fmt in formats:
        raw = torch.from_numpy(random_bytes(fmt, n_out, n_in, 11).copy()).to(device)
        w = repack("selfcheck", fmt, n_out, n_in, raw)
        for T in rows:
            act = quantize_act(torch.randn(T, n_in, generator=g).to(device), G.Q8_K)
            ref = matmul_i8_act(w, act).view(torch.int32)
            got = kernel(w, act).view(torch.int32)
            if not torch.equal(got, ref):
                t, n = (got != ref).nonzero()[0].tolist()
                raise LaneError(f"lane 'fast' on {device}: the {what}'s {G(fmt).name} output [{t}, {n}] of a {T}-row "
                                f"call differs from its reference (bits {got[t, n].item():#x} against "
                                f"{ref[t, n].item():#x}); refusing it on this device")


def matmul_i8(w: QWeight, x: torch.Tensor, out: torch.Tensor | None = None, config=None) -> torch.Tensor:
    """x f32 [T, K] -> f32 [T, N]: x quantized to the weight's vec_dot_type, then matmul_i8_act."""
    _check_weight(w)
    return matmul_i8_act(w, quantize_act(x, VEC_DOT_TYPE[w.fmt]), out, config)


__all__ = ["Act", "CONFIGS", "FORMATS", "HAVE_TRITON", "KINDS", "check_against_reference", "check_call", "check_config",
           "config_for", "matmul_i8",
           "matmul_i8_act", "quantize_act", "reduce_chunks", "supports", "WIDE_BY_FORMAT"]
