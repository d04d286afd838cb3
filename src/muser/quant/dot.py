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
weights or llamafile's tinyBLAS a different tiling); here the terms are summed in two fixed
levels (`_chunk_sum`): within each chunk of CHUNK_ELEMS elements from +0.0 one block after
another, then the chunk sums from +0.0 in chunk order. (The chunks let a GPU kernel give each
chunk its own program, so a one-row call has enough programs to keep memory busy; the order is
the same for every row count.)
  - K-quants (256-element blocks): each term in float32, every step rounded once and none fused:
    f32(sumi) * d + f32(summ) * dmin (Q6_K: f32(sumi) * d), the sums in float32. ggml's own
    arithmetic is float32 too; the terms are float32 because the int8 tensor-core tile's
    conversions to and from float64 sat in its loop's dependency chain (bench/NOTES.md, "The
    float64 terms and the split lengths measured").
  - Q8_0, Q4_0, NVFP4 (32- and 16-element blocks): each term f64(scale) * f64(isum), exact, the
    sums in float64, rounded to float32 once.
The difference from ggml is a few float32 ulps of the row sum. The fixed order is the contract of
the engine's integer lane (engine/kernels/qmatmul_i8.py reproduces it bit for bit on CUDA,
whatever the row count or tiling).
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

_CHUNK_BYTES = 64 << 20  # bound on the [T, O, S] integer-sum temporaries of one call

# The integer formats (vec_dot_type Q8_0 or Q8_K) and their fields: the engine's repacked layout
# (engine/weights.py FIELDS), which `_split_raw` also cuts from a tensor's raw GGUF rows.
INT_FORMATS = (G.Q8_0, G.Q4_0, G.NVFP4, G.Q4_K, G.Q5_K, G.Q6_K)


def _int_dots(aq: np.ndarray, wq: np.ndarray) -> np.ndarray:
    """Per-sub-block integer dot products, exact: aq int8 [T, S, k], wq float32 codes [S, k, O]
    -> float32 [S, T, O]. Every partial sum is an integer below 2^24 in magnitude (k <= 32,
    |a| <= 128, |w| <= 127), so float32 BLAS is exact in any order, with or without FMA; one
    2-D GEMM per sub-block keeps both operands in a layout BLAS takes as is."""
    a = np.ascontiguousarray(aq.transpose(1, 0, 2), dtype=F32)  # [S, T, k]
    out = np.empty((wq.shape[0], a.shape[1], wq.shape[2]), dtype=F32)
    for s in range(wq.shape[0]):
        np.matmul(a[s], wq[s], out=out[s])
    return out


def _split_raw(w: np.ndarray, t: G, n_in: int) -> dict[str, np.ndarray]:
    """Raw GGUF rows uint8 [O, row_bytes] -> the repacked fields (engine/weights.py repack moves
    the same bytes; scales as float32, K-quant 6-bit scales/mins unpacked)."""
    O = w.shape[0]
    ti = type_info(t)
    nb = n_in // ti.block_elems
    b = w.reshape(O, nb, ti.block_bytes)
    if t in (G.Q8_0, G.Q4_0):
        qs = b[..., 2:].reshape(O, -1)
        return {"qs": qs.view(np.int8) if t == G.Q8_0 else qs, "d": f16_to_f32(b[..., 0:2])[..., 0]}
    if t == G.NVFP4:
        return {"qs": b[..., 4:].reshape(O, -1), "d": b[..., 0:4].reshape(O, -1)}
    if t in (G.Q4_K, G.Q5_K):
        sc, m = scale_min_k4(b[..., 4:16])  # [O, nb, 8]
        f = {"d": f16_to_f32(b[..., 0:2])[..., 0], "dmin": f16_to_f32(b[..., 2:4])[..., 0],
             "sc": sc.reshape(O, -1), "m": m.reshape(O, -1)}
        if t == G.Q4_K:
            f["qs"] = b[..., 16:144].reshape(O, -1)
        else:
            f["qh"], f["qs"] = b[..., 16:48].reshape(O, -1), b[..., 48:176].reshape(O, -1)
        return f
    if t == G.Q6_K:
        return {"ql": b[..., 0:128].reshape(O, -1), "qh": b[..., 128:192].reshape(O, -1),
                "sc": b[..., 192:208].view(np.int8).reshape(O, -1), "d": f16_to_f32(b[..., 208:210])[..., 0]}
    raise FormatError(f"no integer dot for weight type {t.name}")


def codes_from_fields(t: G, fields: dict[str, np.ndarray], n_in: int) -> dict[str, np.ndarray]:
    """The engine's repacked fields of a weight (numpy views of engine/weights.py QWeight.fields,
    rows = outputs) -> the integer codes and scales `matmul_codes` reads: "q" float32 [S, k, O]
    (sub-block codes, S sub-blocks of k values), "d" (and "dmin") float32 [O, nb], "sc"/"m"."""
    t = G(t)
    if t not in INT_FORMATS:
        raise FormatError(f"no integer dot for weight type {t.name}")
    f = fields
    O = f["qs" if "qs" in f else "ql"].shape[0]
    d = np.asarray(f["d"]).astype(F32)  # f16 -> f32 is exact
    if t == G.Q8_0:
        q = np.asarray(f["qs"]).view(np.int8).reshape(O, n_in // 32, 32)
        wc = {"d": d}
    elif t == G.Q4_0:
        qs = np.asarray(f["qs"]).reshape(O, n_in // 32, 16)  # low nibble element i, high 16 + i
        q = np.concatenate([qs & 0xF, qs >> 4], axis=-1).astype(np.int8) - 8
        wc = {"d": d}
    elif t == G.NVFP4:
        nb = n_in // 64
        qs = np.asarray(f["qs"]).reshape(O, nb * 4, 8)  # per 16: low nibble j, high j + 8
        q = E2M1_Q1[np.concatenate([qs & 0xF, qs >> 4], axis=-1)]  # [O, nb*4, 16]
        wc = {"d": UE4M3_HALF_VALUES[np.asarray(f["d"]).reshape(O, nb, 4)]}
    elif t in (G.Q4_K, G.Q5_K):
        nb = n_in // 256
        qs = np.asarray(f["qs"]).reshape(O, nb, 4, 1, 32)
        q = np.concatenate([qs & 0xF, qs >> 4], axis=3)  # [O, nb, 4, 2, 32]: sub-block 2c, 2c+1
        if t == G.Q5_K:
            qh = np.asarray(f["qh"]).reshape(O, nb, 1, 1, 32)
            bit = np.arange(8, dtype=np.uint8).reshape(1, 1, 4, 2, 1)
            q = q + (((qh >> bit) & 1) << 4)
        wc = {"d": d.reshape(O, nb), "dmin": np.asarray(f["dmin"]).astype(F32).reshape(O, nb),
              "sc": np.asarray(f["sc"]).reshape(O, nb, 8), "m": np.asarray(f["m"]).reshape(O, nb, 8)}
        q = q.reshape(O, nb * 8, 32)
    else:  # Q6_K
        nb = n_in // 256
        ql = np.asarray(f["ql"]).reshape(O, nb, 2, 2, 32)
        qh = np.asarray(f["qh"]).reshape(O, nb, 2, 32)
        q1 = (ql[:, :, :, 0] & 0xF) | ((qh & 3) << 4)
        q2 = (ql[:, :, :, 1] & 0xF) | (((qh >> 2) & 3) << 4)
        q3 = (ql[:, :, :, 0] >> 4) | (((qh >> 4) & 3) << 4)
        q4 = (ql[:, :, :, 1] >> 4) | (((qh >> 6) & 3) << 4)
        q = np.stack([q1, q2, q3, q4], axis=3).astype(np.int16) - 32  # [O, nb, 2, 4, 32]
        q = q.reshape(O, nb * 16, 16)
        wc = {"d": d.reshape(O, nb), "sc": np.asarray(f["sc"]).view(np.int8).reshape(O, nb, 16)}
    wc["q"] = np.ascontiguousarray(q.transpose(1, 2, 0), dtype=F32)  # [S, k, O], BLAS-ready
    return wc


def codes_nbytes(t: G, n_out: int, n_in: int) -> int:
    """Resident bytes of codes_from_fields' result: 4 per weight plus the scales (bound)."""
    return 4 * n_out * n_in + 8 * n_out * (n_in // 16)


# Elements per chunk of the two-level sum (module docstring; kernels/qmatmul_i8.py).
CHUNK_ELEMS = 1024


def _chunk_sum(term, nb: int, block_elems: int, shape, dtype=F64) -> np.ndarray:
    """`dtype` [T, O] from the terms of blocks 0 .. nb-1 (term(b) -> `dtype` [T, O]): per chunk of
    CHUNK_ELEMS // block_elems blocks, part = +0.0 then part + term(b) in block order; then
    acc = +0.0 and acc + part for the chunks in order (one fixed order, so a kernel that adds the
    same terms the same way gets the same bits)."""
    per = CHUNK_ELEMS // block_elems
    acc = np.zeros(shape, dtype=dtype)
    for c0 in range(0, nb, per):
        part = np.zeros(shape, dtype=dtype)
        for b in range(c0, min(nb, c0 + per)):
            part = part + term(b)
        acc = acc + part
    return acc


def _block_sum(scale: np.ndarray, isum: np.ndarray, block_elems: int) -> np.ndarray:
    """float32 scales [nb, T, O] x exact integer sums [nb, T, O] -> float64 [T, O]: the terms
    f64(scale_b) * f64(isum_b) summed by `_chunk_sum`."""
    return _chunk_sum(lambda b: scale[b].astype(F64) * isum[b], isum.shape[0], block_elems, isum.shape[1:])


def _dot_q8_0(wc: dict, a: Q8_0Activation, t: G) -> np.ndarray:
    T, nb = a.d_bits.shape
    O = wc["d"].shape[0]
    ad = a.d  # [T, nb]
    if t == G.NVFP4:
        # 16-value sub-block j (of 64-value weight block j // 4) meets q8_0 block j // 2
        isum = _int_dots(a.qs.reshape(T, nb * 2, 16), wc["q"])  # [nb*2, T, O]
        ad16 = ad[:, np.arange(nb * 2) // 2].T  # [nb*2, T]
        wd16 = wc["d"].reshape(O, nb * 2).T  # [nb*2, O]
        s = (wd16[:, None, :] * ad16[:, :, None]).astype(F32)  # ue4m3(x.d[s]) * fp16(y.d)
        return _block_sum(s, isum, 16)  # 16-blocks in order
    isum = _int_dots(a.qs, wc["q"])  # [nb, T, O]
    s = (wc["d"].T[:, None, :] * ad.T[:, :, None]).astype(F32)  # fp16(x.d) * fp16(y.d)  [nb, T, O]
    return _block_sum(s, isum, 32)


def _dot_q8_K(wc: dict, a: Q8KActivation, t: G) -> np.ndarray:
    T, nb = a.d.shape
    O = wc["d"].shape[0]
    d = (a.d.T[:, :, None] * wc["d"].T[:, None, :]).astype(F32)  # y.d * fp16(x.d)   [nb, T, O]
    sc = wc["sc"].transpose(1, 2, 0).astype(F64)  # [nb, j, O]
    if t == G.Q6_K:
        isum = _int_dots(a.qs.reshape(T, nb * 16, 16), wc["q"]).reshape(nb, 16, T, O)
        sumi = (isum * sc[:, :, None, :]).sum(axis=1).astype(F32)  # exact integers, rounded once  [nb, T, O]
        return _chunk_sum(lambda b: sumi[b] * d[b], nb, 256, (T, O), F32)
    isum = _int_dots(a.qs.reshape(T, nb * 8, 32), wc["q"]).reshape(nb, 8, T, O)
    sumi = (isum * sc[:, :, None, :]).sum(axis=1).astype(F32)  # exact integers, rounded once
    bs = a.bsums.reshape(T, nb, 8, 2).astype(np.int64).sum(axis=3)  # per 32: bsums[2j] + bsums[2j+1]
    m = wc["m"].transpose(1, 2, 0).astype(F64)  # [nb, j, O]
    summ = np.matmul(bs.transpose(1, 0, 2).astype(F64), m).astype(F32)  # [nb, T, O]: integers, rounded once
    dmin = ((-a.d).T[:, :, None] * wc["dmin"].T[:, None, :]).astype(F32)  # -y.d * fp16(x.dmin)
    # float32 numpy arithmetic: each product and the one addition rounded once, nothing fused
    return _chunk_sum(lambda b: sumi[b] * d[b] + summ[b] * dmin[b], nb, 256, (T, O), F32)


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
    out = np.empty((T, O), dtype=F32)
    step = _row_step(T, n_in)
    for o0 in range(0, O, step):
        out[:, o0 : o0 + step] = matmul_codes(codes_from_fields(t, _split_raw(w[o0 : o0 + step], t, n_in), n_in), t, x)
    return out


def _row_step(T: int, n_in: int) -> int:
    """Output rows per chunk so the [T, O, S] temporaries stay within _CHUNK_BYTES."""
    return max(8, _CHUNK_BYTES // max(1, T * (n_in // 16) * 8 * 3))


def matmul_codes(wc: dict[str, np.ndarray], t: G, x: np.ndarray) -> np.ndarray:
    """y = x @ W^T for integer codes of `codes_from_fields`: x float32 [T, n_in] is converted to
    the vec_dot_type (Q8_K or Q8_0) and every block's term is summed as the module doc says.
    Returns float32 [T, n_out]; each output row depends on its own x row only."""
    t = G(t)
    if VEC_DOT_TYPE[t] == G.Q8_K:
        a, fn = quantize_q8_K(x), _dot_q8_K
    else:
        a, fn = quantize_q8_0(x), _dot_q8_0
    O = wc["d"].shape[0]
    out = np.empty((x.shape[0], O), dtype=F32)
    step = _row_step(x.shape[0], x.shape[1])
    for o0 in range(0, O, step):
        o1 = min(O, o0 + step)
        part = {k: (v[:, :, o0:o1] if k == "q" else v[o0:o1]) for k, v in wc.items()}
        out[:, o0:o1] = fn(part, a, t).astype(F32)
    return out
