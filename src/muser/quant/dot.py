"""Reference dot products of ggml-cpu (numpy, vectorized over output rows and tokens).

`matmul_ggml(weight_bytes, t, x)` computes y = x @ W^T the way the pinned ggml-cpu does for a
weight of type t: the f32 activations are first converted to the type's vec_dot_type with the
converters of activation.py, then every block contributes (float scale) x (integer block sum),
exactly as ggml_vec_dot_<t>_<vec_dot_type> (ggml-cpu/arch/x86/quants.c) forms it.

Exact (bit-identical to ggml):
  - the activation rounding points: Q8_K / Q8_0 quantization, f16 / bf16 rounding;
  - every integer sum (per 32-value sub-block for Q4_K/Q5_K, per 16 for Q6_K and NVFP4, per 32
    for Q8_0/Q4_0, the Q4_K/Q5_K min corrections from the Q8_K bsums): integers, no rounding;
  - every float scale factor, formed in float32 as ggml forms it: Q*_K d = y.d * fp16(x.d),
    dmin = -y.d * fp16(x.dmin); Q8_0/Q4_0 d = fp16(x.d) * fp16(y.d); NVFP4 ue4m3(x.d[s]) * fp16(y.d);
  - every f16 x f16 and bf16 x bf16 product (exact in float32).
May differ from ggml by float reassociation only: ggml accumulates scale * int into eight
float32 FMA lanes and reduces them with hadd (the SIMD accumulation order, and for repacked
weights or llamafile's tinyBLAS a different tiling); here each block's term is formed in float64
(float32 scale x integer, exact; the K-quants' two products added once) and the terms are summed
in float64 one block after another from +0.0, in block order (`_block_sum`), then rounded to
float32 once. The difference from ggml is a few float32 ulps of the row sum. The fixed order is
the contract of the engine's integer lane (engine/kernels/qmatmul_i8.py reproduces it bit for
bit on CUDA, whatever the row count or tiling).
"""

from __future__ import annotations

import numpy as np

from ..errors import FormatError
from ..gguf.types import GgmlType as G
from ..gguf.types import type_info
from .activation import Q8_0Activation, Q8KActivation, quantize_q8_0, quantize_q8_K
from .common import F32, bf16_round, check_finite, f16_round, f16_to_f32
from .dequant import dequantize, scale_min_k4
from .fp4 import E2M1_Q1, UE4M3_HALF_VALUES

F64 = np.float64

# ggml-cpu.c type_traits_cpu[t].vec_dot_type for every weight type Muse Glimmer uses.
VEC_DOT_TYPE = {
    G.F32: G.F32, G.F16: G.F16, G.BF16: G.BF16,
    G.Q8_0: G.Q8_0, G.Q4_0: G.Q8_0, G.NVFP4: G.Q8_0,
    G.Q4_K: G.Q8_K, G.Q5_K: G.Q8_K, G.Q6_K: G.Q8_K,
}

_CHUNK_BYTES = 64 << 20  # bound on the [T, O, S] float64 integer-sum temporaries


def _int_dots(aq: np.ndarray, wq: np.ndarray) -> np.ndarray:
    """Per-sub-block integer dot products, exact: aq [T, S, k], wq [O, S, k] (small ints) ->
    float64 [T, O, S]. Each sum is an integer far below 2^53, so float64 BLAS is exact."""
    a = np.ascontiguousarray(aq.transpose(1, 0, 2), dtype=F64)  # [S, T, k]
    w = np.ascontiguousarray(wq.transpose(1, 2, 0), dtype=F64)  # [S, k, O]
    return np.matmul(a, w).transpose(1, 2, 0)  # [T, O, S]


def _weight_codes(w: np.ndarray, t: G, n_in: int) -> dict[str, np.ndarray]:
    """Unpack weight rows into integer codes and scale fields (per type)."""
    O = w.shape[0]
    ti = type_info(t)
    nb = n_in // ti.block_elems
    b = w.reshape(O, nb, ti.block_bytes)
    if t == G.Q8_0:
        return {"d": f16_to_f32(b[..., 0:2])[..., 0], "q": b[..., 2:].view(np.int8).reshape(O, nb, 32)}
    if t == G.Q4_0:
        qs = b[..., 2:]
        q = np.concatenate([qs & 0xF, qs >> 4], axis=-1).astype(np.int8) - 8
        return {"d": f16_to_f32(b[..., 0:2])[..., 0], "q": q}
    if t == G.NVFP4:
        qs = b[..., 4:].reshape(O, nb, 4, 8)
        q = np.concatenate([E2M1_Q1[qs & 0xF], E2M1_Q1[qs >> 4]], axis=-1)  # [O, nb, 4, 16]
        return {"d": UE4M3_HALF_VALUES[b[..., 0:4]], "q": q.reshape(O, nb * 4, 16)}
    if t in (G.Q4_K, G.Q5_K):
        sc, m = scale_min_k4(b[..., 4:16])  # [O, nb, 8]
        if t == G.Q4_K:
            qs = b[..., 16:144].reshape(O, nb, 4, 1, 32)
            q = np.concatenate([qs & 0xF, qs >> 4], axis=3)  # [O, nb, 4, 2, 32]
        else:
            qh = b[..., 16:48].reshape(O, nb, 1, 1, 32)
            qs = b[..., 48:176].reshape(O, nb, 4, 1, 32)
            bit = np.arange(8, dtype=np.uint8).reshape(1, 1, 4, 2, 1)
            q = np.concatenate([qs & 0xF, qs >> 4], axis=3) + (((qh >> bit) & 1) << 4)
        return {"d": f16_to_f32(b[..., 0:2])[..., 0], "dmin": f16_to_f32(b[..., 2:4])[..., 0],
                "sc": sc, "m": m, "q": q.reshape(O, nb * 8, 32)}
    if t == G.Q6_K:
        ql = b[..., 0:128].reshape(O, nb, 2, 2, 32)
        qh = b[..., 128:192].reshape(O, nb, 2, 32)
        q1 = (ql[:, :, :, 0] & 0xF) | ((qh & 3) << 4)
        q2 = (ql[:, :, :, 1] & 0xF) | (((qh >> 2) & 3) << 4)
        q3 = (ql[:, :, :, 0] >> 4) | (((qh >> 4) & 3) << 4)
        q4 = (ql[:, :, :, 1] >> 4) | (((qh >> 6) & 3) << 4)
        q = np.stack([q1, q2, q3, q4], axis=3).astype(np.int16) - 32  # [O, nb, 2, 4, 32]
        return {"d": f16_to_f32(b[..., 208:210])[..., 0],
                "sc": b[..., 192:208].view(np.int8).reshape(O, nb, 16), "q": q.reshape(O, nb * 16, 16)}
    raise FormatError(f"no integer dot for weight type {t.name}")


def _block_sum(terms: np.ndarray) -> np.ndarray:
    """float64 [T, O, nb] -> [T, O]: acc = +0.0, then acc + term of block 0, 1, ... in order
    (one fixed order, so a kernel that adds the same terms the same way gets the same bits)."""
    acc = np.zeros(terms.shape[:2], dtype=F64)
    for b in range(terms.shape[2]):
        acc = acc + terms[:, :, b]
    return acc


def _dot_q8_0(wc: dict, a: Q8_0Activation, t: G) -> np.ndarray:
    T, nb = a.d_bits.shape
    ad = a.d  # [T, nb]
    if t == G.NVFP4:
        # 64-value weight block b, sub-block s (16 values) meets q8_0 block 2b + s//2.
        aq = a.qs.reshape(T, nb * 2, 16)
        isum = _int_dots(aq, wc["q"]).reshape(T, -1, nb // 2, 4)  # [T, O, nb64, 4]
        ady = ad.reshape(T, nb // 2, 2)[:, :, [0, 0, 1, 1]]  # [T, nb64, 4]
        s = (wc["d"][None] * ady[:, None]).astype(F32)  # ue4m3(x.d[s]) * fp16(y.d)
        return _block_sum((s.astype(F64) * isum).reshape(T, isum.shape[1], -1))  # 16-blocks in order
    isum = _int_dots(a.qs, wc["q"])  # [T, O, nb]
    s = (wc["d"][None] * ad[:, None]).astype(F32)  # fp16(x.d) * fp16(y.d)
    return _block_sum(s.astype(F64) * isum)


def _dot_q8_K(wc: dict, a: Q8KActivation, t: G) -> np.ndarray:
    T, nb = a.d.shape
    O = wc["q"].shape[0]
    d = (a.d[:, None, :] * wc["d"][None]).astype(F32)  # y.d * fp16(x.d)   [T, O, nb]
    if t == G.Q6_K:
        isum = _int_dots(a.qs.reshape(T, nb * 16, 16), wc["q"]).reshape(T, O, nb, 16)
        sumi = (isum * wc["sc"][None].astype(F64)).sum(axis=3)  # exact integers
        return _block_sum(d.astype(F64) * sumi)
    isum = _int_dots(a.qs.reshape(T, nb * 8, 32), wc["q"]).reshape(T, O, nb, 8)
    sumi = (isum * wc["sc"][None].astype(F64)).sum(axis=3)
    bs = a.bsums.reshape(T, nb, 8, 2).astype(np.int64).sum(axis=3)  # per 32: bsums[2j] + bsums[2j+1]
    summ = (bs[:, None].astype(F64) * wc["m"][None].astype(F64)).sum(axis=3)
    dmin = ((-a.d)[:, None, :] * wc["dmin"][None]).astype(F32)  # -y.d * fp16(x.dmin)
    return _block_sum(d.astype(F64) * sumi + dmin.astype(F64) * summ)


def matmul_ggml(weight_bytes: np.ndarray, t: G, x: np.ndarray) -> np.ndarray:
    """y = x @ W^T as ggml-cpu computes it. weight_bytes: uint8 [n_out, row_bytes] (a GGUF
    tensor's raw rows; F32/F16/BF16 typed arrays are accepted as bytes); x: float32 [T, n_in].
    Returns float32 [T, n_out]. See the module docstring for what is exact."""
    t = G(t)
    if t not in VEC_DOT_TYPE:
        raise FormatError(f"matmul_ggml: no ggml-cpu dot for weight type {t.name}")
    x = np.asarray(x)
    if x.dtype != np.float32 or x.ndim != 2:
        raise FormatError(f"matmul_ggml takes float32 activations [T, n_in], got {x.dtype} {list(x.shape)}")
    check_finite(x, "matmul_ggml activations")
    w = np.ascontiguousarray(weight_bytes).view(np.uint8)
    O = w.shape[0]
    T, n_in = x.shape
    ti = type_info(t)
    if n_in % ti.block_elems or w.ndim != 2 or w.shape[1] != ti.nbytes(n_in):
        raise FormatError(
            f"matmul_ggml: {t.name} weight bytes {list(w.shape)} do not fit n_in {n_in} "
            f"({ti.nbytes(n_in) if n_in % ti.block_elems == 0 else '?'} bytes per row)"
        )
    if t in (G.F32, G.F16, G.BF16):
        W = dequantize(w.reshape(-1), t, O * n_in).reshape(O, n_in).astype(F64)
        xa = {G.F32: x, G.F16: f16_round(x), G.BF16: bf16_round(x)}[t]  # from_float rounding
        return (xa.astype(F64) @ W.T).astype(F32)
    if VEC_DOT_TYPE[t] == G.Q8_K:
        a, fn = quantize_q8_K(x), _dot_q8_K
    else:
        a, fn = quantize_q8_0(x), _dot_q8_0
    out = np.empty((T, O), dtype=F32)
    per_row = max(1, T * (n_in // 16) * 8 * 3)
    step = max(8, _CHUNK_BYTES // per_row)
    for o0 in range(0, O, step):
        wc = _weight_codes(w[o0 : o0 + step], t, n_in)
        out[:, o0 : o0 + step] = fn(wc, a, t).astype(F32)
    return out
