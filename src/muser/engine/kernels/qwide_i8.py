"""The integer lane's wide GEMM for Q4_K and Q5_K weights (Triton): prefill chunks of many rows,
`muser.quant.dot.matmul_ggml` bit for bit, the sub-block scales inside the int8 dots' weight
operand instead of eight dots of K = 32 a 256-block and their CUDA-core scale combines.

Why: the lane's K-quant scale is per 32-element sub-block, so `qmatmul_i8` and the int8 tile
(`qtile_i8`) run one K = 32 tensor-core product a sub-block and fold each into the block sum with
the sub-block's scale on the CUDA cores; at 512 rows that folding and the per-16-row weight
unpack, not the tensor cores, set their pace (bench/NOTES.md). Here the scale goes into the weight
operand instead, in two digits that keep it int8:

  sc = 8 sh + sl (sh, sl in 0..7, sc a 6-bit scale): sum_j sc_j sum_k q_k a_k
     = sum_k (q_k sl_j) a_k + 8 sum_k (q_k sh_j) a_k          (|q sl|, |q sh| <= 112: int8)

Q4_K codes are q in 0..15. Q5_K codes (0..31) would not fit, so they enter as q - 16 in -16..15
and the offset comes back through the activations' 32-sums: + 16 sum_j sc_j bsum32_j. The mins
term sum_j m_j bsum32_j and that correction are small dots (K = 8, padded to 32) whose
activation side, |bsum32| <= 4064, enters as two int8 digits: bsum32 = 64 bh + bl (bl in 0..63,
bh in -64..63). Every integer is exact in int32 (|sumi| < 2^26), so the float steps see the
integers `qmatmul_i8` sees, and they are its steps: per 256-block, in float32,
f32(sumi) * f32(y.d * x.d) + f32(summ) * f32(-y.d * x.dmin), each conversion, product and the
addition rounded once (enable_fp_fusion off), summed in float32 from +0.0 per 1,024-element chunk
in block order and the chunks from +0.0 in chunk order. So a row's bits are the lane's at every row count and
tiling (row invariance by construction), and the tests hold them to matmul_ggml.

Layout read (weights.repack fields): qs u8 [N, nb*128] (byte 32c + i: element 64c + i in its low
nibble, 64c + 32 + i in its high one), sc / m u8 [N, nb*8], d / dmin f16 [N, nb], Q5_K qh u8
[N, nb*32] (element e's fifth bit: bit e // 32 of qh[e % 32]).

Which calls take it: the shapes whose 64-row bucket (calls of more than 16 rows) the integer
lane's tuning table routes here (qtile_i8.TUNED, "path": "wide"), written from a device sweep that
timed it beside the tile (tools/device_kernels.py --lane fast); other shapes keep the tile.
"""

from __future__ import annotations

import functools

import torch

from ...errors import LaneError
from ...gguf.types import GgmlType as G
from ...quant.dot import CHUNK_ELEMS
from ..weights import FIELDS, QWeight

try:  # Triton is optional on the CPU; the CUDA backend requires it.
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAVE_TRITON = False

FORMATS = (G.Q4_K, G.Q5_K)
_CODE = {G.Q4_K: 2, G.Q5_K: 3}
# (BM, BN, num_warps, num_stages): activation rows and weight rows a program. A block walked as
# four K = 64 slices keeps every operand at [64, BN] (one whole block at K = 256 held [256, BN] of
# int32 codes, scales and products: 255 registers and 72-304 bytes of stack at (64, 64, 8, 1) and
# (128, 32, 8, 2)). Compiled for sm_90 (tools/triton_aot_check.py; bench/reports/
# triton-aot-sm90-20261207/): (64, 64, 8, 2) 234 registers for Q4_K and 250 for Q5_K, no stack, the
# activation and code loads as cp.async one block ahead; (128, 32, 8, 2) 254-255, no stack. Not yet
# timed on a GPU: the device sweep (tools/device_kernels.py) times both beside the tile at 64 and
# 512 rows.
CONFIG = (64, 64, 8, 2)


def supports(fmt: G) -> bool:
    return fmt in FORMATS


def check_config(config) -> tuple[int, int, int, int]:
    """(BM, BN, num_warps, num_stages), checked as the reference's tilings are (ValueError naming it)."""
    from .qmatmul_i8 import check_config as check

    return check(config)


if HAVE_TRITON:

    @triton.jit
    def _digits_dot(bs, wv, BM: tl.constexpr, BN: tl.constexpr):
        """sum_j bs[:, j] * wv[j, :] exactly, bs int32 [BM, 32] (|bs| <= 4064), wv int8 [32, BN]:
        bs = 64 bh + bl with bl in 0..63 and bh in -64..63, two int8 dots."""
        bl = (bs & 63).to(tl.int8)
        bh = (bs >> 6).to(tl.int8)  # arithmetic shift: floor(bs / 64)
        hi = tl.dot(bh, wv, out_dtype=tl.int32)
        return tl.dot(bl, wv, acc=hi * 64, out_dtype=tl.int32)

    @triton.jit
    def _half_block(a, wb, hb, sc0, sc1, k, j0, FMT: tl.constexpr):
        """Two sub-blocks (j0, j0 + 1) of a 256-block, K = 64: a int8 [BM, 64] (their activations,
        one contiguous run), wb u8 [64, BN] (their shared 32 code bytes, each loaded for both:
        operand k < 32 the low nibble, k >= 32 the high one), hb u8 [64, BN] (Q5_K's qh bytes of
        the same element), sc0 / sc1 [BN] their 6-bit scales. Returns (sum_k a q sh, sum_k a q sl)
        int32 [BM, BN], the scale's two digits (sc = 8 sh + sl) in the weight operand."""
        hi = (k >= 32)[:, None]  # [64, 1]: the second sub-block of the pair
        q = (wb.to(tl.int32) >> tl.where(hi, 4, 0)) & 15
        if FMT == 3:  # Q5_K: the fifth bit is bit j of qh[i] (j the sub-block, i its element), then q - 16
            q = q + 16 * ((hb.to(tl.int32) >> tl.where(hi, j0 + 1, j0)) & 1) - 16
        sh = tl.where(hi, (sc1 >> 3)[None, :], (sc0 >> 3)[None, :])  # [64, BN]: the scale's digits
        sl = tl.where(hi, (sc1 & 7)[None, :], (sc0 & 7)[None, :])
        s_h = tl.dot(a, (q * sh).to(tl.int8), out_dtype=tl.int32)
        s_l = tl.dot(a, (q * sl).to(tl.int8), out_dtype=tl.int32)
        return s_h, s_l

    @triton.jit(do_not_specialize=["T"])
    def _qwide_kernel(aq, ad, ab, y, qs, wd, wdm, wsc, wm, wqh, N, K, T, sy,
                      FMT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, CB: tl.constexpr):
        """y [T, N] f32: program (i, j) takes activation rows i*BM.. and weight rows j*BN.. and
        walks the 256-blocks in order, folding each chunk of CB blocks into the total at its end.
        A block is four K = 64 slices (sub-blocks 2c, 2c + 1: one contiguous run of activations and
        the same 32 code bytes), so no operand is wider than [64, BN] and every load is a
        contiguous run of each row (32 code bytes, 64 activation bytes)."""
        m = tl.program_id(0) * BM + tl.arange(0, BM)  # activation rows: the fastest grid axis, so
        n = tl.program_id(1) * BN + tl.arange(0, BN)  # a weight tile's readers run together (L2)
        mmask = m < T
        nmask = n < N
        tok = m.to(tl.int64)
        row = n.to(tl.int64)
        nb = K // 256
        k = tl.arange(0, 64)  # operand k of a slice: element 64c + k of the block
        kb = k % 32  # its code byte within the slice's 32 (and its qh byte)
        j32 = tl.arange(0, 32)  # the small dots' K: sub-blocks 0..7, then zeros
        jm = j32 < 8
        a_p = aq + tok[:, None] * K + k[None, :]  # [BM, 64]
        w_p = qs + row[None, :] * (nb * 128) + kb[:, None]  # [64, BN]
        h_p = wqh + row[None, :] * (nb * 32) + kb[:, None]  # [64, BN] (Q5_K)
        s_p = wsc + row * (nb * 8)  # [BN]
        amask = mmask[:, None]
        wmask = nmask[None, :]
        tot = tl.zeros([BM, BN], dtype=tl.float32)
        acc = tl.zeros([BM, BN], dtype=tl.float32)  # +0.0 (dot._chunk_sum)
        for b in range(0, nb):
            if FMT == 3:
                hb = tl.load(h_p + b * 32, mask=wmask, other=0)
            else:
                hb = 0
            s_h = tl.zeros([BM, BN], dtype=tl.int32)
            s_l = tl.zeros([BM, BN], dtype=tl.int32)
            for c in range(4):
                a = tl.load(a_p + (b * 256 + 64 * c), mask=amask, other=0)
                wb = tl.load(w_p + (b * 128 + 32 * c), mask=wmask, other=0)
                sc0 = tl.load(s_p + (b * 8 + 2 * c), mask=nmask, other=0).to(tl.int32)
                sc1 = tl.load(s_p + (b * 8 + 2 * c + 1), mask=nmask, other=0).to(tl.int32)
                h, lo = _half_block(a, wb, hb, sc0, sc1, k, 2 * c, FMT)
                s_h += h
                s_l += lo
            s = s_h * 8 + s_l  # sum_j sc_j sum_k q a (|s| < 2^26: exact)
            bs = tl.load(ab + tok[:, None] * (K // 32) + b * 8 + j32[None, :], mask=amask & jm[None, :],
                         other=0)  # [BM, 32] int32: bsum32 of sub-blocks 0..7
            mv = tl.load(wm + row[None, :] * (nb * 8) + b * 8 + j32[:, None], mask=wmask & jm[:, None],
                         other=0).to(tl.int8)  # [32, BN]: the mins (6 bits)
            summ = _digits_dot(bs, mv, BM, BN)
            if FMT == 3:  # the codes' offset: + 16 sum_j sc_j bsum32_j
                s8 = tl.load(wsc + row[None, :] * (nb * 8) + b * 8 + j32[:, None], mask=wmask & jm[:, None],
                             other=0).to(tl.int8)
                s = s + 16 * _digits_dot(bs, s8, BM, BN)
            a_d = tl.load(ad + tok * nb + b, mask=mmask, other=0.0)
            d = tl.load(wd + row * nb + b, mask=nmask, other=0.0).to(tl.float32)
            dm = tl.load(wdm + row * nb + b, mask=nmask, other=0.0).to(tl.float32)
            dd = a_d[:, None] * d[None, :]  # f32: y.d * fp16(x.d)
            mm = (-a_d)[:, None] * dm[None, :]  # f32: -y.d * fp16(x.dmin)
            acc = acc + (s.to(tl.float32) * dd + summ.to(tl.float32) * mm)
            if b % CB == CB - 1:  # a chunk's last block: its sum into the total, the next from +0.0
                tot = tot + acc
                acc = tl.zeros([BM, BN], dtype=tl.float32)
        if nb % CB != 0:  # the last chunk, shorter (a full one was folded by its last block)
            tot = tot + acc
        tl.store(y + tok[:, None] * sy + n[None, :], tot, mask=amask & wmask)


def matmul_wide(w: QWeight, act, out: torch.Tensor | None = None, config=None) -> torch.Tensor:
    """Q8_K activations (qmatmul_i8.Act) [T, K] x Q4_K / Q5_K weight [N, K] -> f32 [T, N], bitwise
    matmul_ggml. `out` may be a column slice of a wider output (unit column stride); `config` =
    (BM, BN, num_warps, num_stages) overrides CONFIG (speed only)."""
    from . import qmatmul_i8

    if w.fmt not in FORMATS:
        raise LaneError(f"tensor {w.name!r}: {G(w.fmt).name} has no wide integer GEMM (served: "
                        f"{', '.join(f.name for f in FORMATS)})")
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed")
    out = qmatmul_i8.check_call(w, act, out)
    T, N = act.rows, w.n_out
    bm, bn, nw, ns = check_config(config) if config is not None else CONFIG
    f = w.fields
    ptrs = [f[k] for k in FIELDS[w.fmt]]  # qs, d, dmin, sc, m[, qh]
    if len(ptrs) == 5:
        ptrs.append(ptrs[0])  # Q4_K: no qh (never read)
    grid = (triton.cdiv(T, bm), triton.cdiv(N, bn))
    _qwide_kernel[grid](act.qs, act.d, act.bsum32, out, *ptrs, N, w.n_in, T, out.stride(0), FMT=_CODE[w.fmt],
                        BM=bm, BN=bn, CB=CHUNK_ELEMS // 256, num_warps=nw, num_stages=ns, enable_fp_fusion=False)
    return out


@functools.lru_cache(maxsize=None)
def self_check(device: str) -> None:
    """The wide GEMM against its reference (qmatmul_i8.check_against_reference) on this device,
    once a process, before the lane routes a call to it: each format at 1, 17 and 70 rows;
    LaneError on any differing bit."""
    from . import qmatmul_i8

    qmatmul_i8.check_against_reference("wide integer GEMM", FORMATS, (1, 17, 70), matmul_wide, device)


__all__ = ["CONFIG", "FORMATS", "HAVE_TRITON", "check_config", "matmul_wide", "self_check", "supports"]
