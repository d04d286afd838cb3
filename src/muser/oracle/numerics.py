"""The oracle's numeric rules: one function per op of the Muse Glimmer graph, each written in
float32 the way the pinned ggml CPU backend evaluates it, plus the two arithmetic modes.

Continuous ops (norms, RoPE, softmax, activations, logit tail) follow ggml-cpu's expression
order in both modes. Transcendentals (exp, cos, sin, tanh) are evaluated in float64 and rounded
once to float32, i.e. correctly rounded like glibc's expf/cosf/sinf/tanhf; ggml's own SIMD
ggml_v_expf (vec.h, max error ~1.5 ulp) can differ from that by an ulp, which is part of the
fixture's noise floor, never a discrete rounding point.

Dot products accumulate in float64 and round once to float32: the correctly rounded dot, which
does not depend on BLAS blocking or on how many rows a chunk holds (chunk-size invariance), and
sits within ggml's own f32 accumulation error of every ggml kernel (vec_dot, llamafile sgemm,
repack gemm/gemv, tiled).

Discrete rounding points (arithmetic "ggml-cpu" only), each cited to the function that makes it:
- activations entering a matmul are converted to the weight type's vec_dot_type
  (ggml-cpu.c ggml_compute_forward_mul_mat: `from_float = type_traits_cpu[vec_dot_type].from_float`):
  F16 -> f16 (ggml_cpu_fp32_to_fp16, _mm256_cvtps_ph round-to-nearest-even),
  BF16 -> bf16 (ggml_cpu_fp32_to_bf16 -> ggml_compute_fp32_to_bf16, RNE on the bits),
  Q8_0/Q4_0 -> Q8_0 (arch/x86/quants.c quantize_row_q8_0, AVX2: d = amax/127 stored f16,
  q = round-half-even(x * (127/amax)); repack's ggml_quantize_mat_q8_0_4x8 is the same),
  Q4_K/Q5_K/Q6_K -> Q8_K (quantize_row_q8_K -> ggml-quants.c quantize_row_q8_K_ref:
  iscale = -127/max, q = nearest_int(iscale*x), d = 1/iscale in f32; the Q4_K repack path's
  arch/x86/repack.cpp ggml_quantize_mat_q8_K_4x8 gives the same d*q products);
- K and V are stored in the KV type by muser.kv (llama-kv-cache cpy_k/cpy_v -> ggml_set_rows ->
  ggml_cpu_fp32_to_fp16);
- with an f16 KV cache the non-flash attention path (llama-graph.cpp build_attn_mha) runs two
  more mul_mats against f16 src0: Q is converted to f16 before K·Q and the softmax
  probabilities are converted to f16 before V·P (vec_dot_type of F16 is F16).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import LaneError
from ..gguf.types import GgmlType as G

F32 = np.float32
F64 = np.float64

ARITHMETICS = ("f32", "ggml-cpu")

# vec_dot_type of each weight type (ggml-cpu.c type_traits_cpu[].vec_dot_type).
VEC_DOT_TYPE: dict[G, G] = {
    G.F32: G.F32,
    G.F16: G.F16,
    G.BF16: G.BF16,
    G.Q8_0: G.Q8_0,
    G.Q4_0: G.Q8_0,
    G.Q4_K: G.Q8_K,
    G.Q5_K: G.Q8_K,
    G.Q6_K: G.Q8_K,
    G.NVFP4: G.Q8_0,
}


# --- rounding-point primitives (the codecs live in muser.quant) ---------------------------------


def f16_round(x: np.ndarray) -> np.ndarray:
    """f32 -> f16 -> f32, round-to-nearest-even (ggml_cpu_fp32_to_fp16)."""
    from ..quant.common import f16_round as r

    return r(x)


def bf16_round(x: np.ndarray) -> np.ndarray:
    """f32 -> bf16 -> f32 (ggml_compute_fp32_to_bf16: RNE on the bits, NaN kept quiet)."""
    from ..quant.common import bf16_round as r

    return r(x)


def q8_0_round(x: np.ndarray) -> np.ndarray:
    """Activation rows -> the Q8_0 values the x86 vec_dot multiplies, fp16(d) * q per 32-block
    (arch/x86/quants.c quantize_row_q8_0), exact in float64."""
    from ..quant.activation import quantize_q8_0

    a = quantize_q8_0(np.ascontiguousarray(x, dtype=F32))
    T, nb = a.d_bits.shape
    return (a.d.astype(F64)[..., None] * a.qs.astype(F64)).reshape(T, nb * 32)


def q8_k_round(x: np.ndarray) -> np.ndarray:
    """Activation rows -> the Q8_K values d * q per 256-block (quantize_row_q8_K_ref), exact
    in float64."""
    from ..quant.activation import quantize_q8_K

    a = quantize_q8_K(np.ascontiguousarray(x, dtype=F32))
    T, nb = a.d.shape
    return (a.d.astype(F64)[..., None] * a.qs.astype(F64)).reshape(T, nb * 256)


_ACT_ROUND = {G.F16: f16_round, G.BF16: bf16_round, G.Q8_0: q8_0_round, G.Q8_K: q8_k_round}


# --- continuous ops, ggml-cpu expression order -------------------------------------------------


# Legitimate f32 reduction orders of a dot product (the spread between them is part of the noise
# floor, DESIGN.md "Exactness contract"): "f64" accumulates in float64 and rounds once (the
# oracle's own, correctly rounded); "f32-block32" rounds each 32-element block's partial to f32
# and accumulates the blocks in f32 one after another (ggml-cpu quants.c vec_dot: sumf += d*sumi
# per block); "f32-seq" rounds every product and accumulates element by element in f32 (a
# scalar loop, ggml_vec_dot_f32's leftover path).
REDUCTIONS = ("f64", "f32-block32", "f32-seq")
_BLOCK = {"f32-block32": 32, "f32-seq": 1}


def dot(a: np.ndarray, b: np.ndarray, reduction: str = "f64") -> np.ndarray:
    """a [..., K] @ b [K, N] -> [..., N] f32 in the given reduction order (see REDUCTIONS)."""
    a64, b64 = np.asarray(a, dtype=F64), np.asarray(b, dtype=F64)
    if reduction == "f64":
        return (a64 @ b64).astype(F32)
    blk = _BLOCK.get(reduction)
    if blk is None:
        raise LaneError(f"reduction {reduction!r} is not one of {', '.join(REDUCTIONS)}")
    K = a64.shape[-1]
    acc = np.zeros(np.broadcast_shapes(a64.shape[:-1] + (1,), b64.shape[:-2] + (1, b64.shape[-1])), dtype=F32)
    if blk == 1:
        a32, b32 = a64.astype(F32), b64.astype(F32)
        if np.array_equal(a32, a64) and np.array_equal(b32, b64):
            # f32 inputs: numpy's f32 multiply is the correctly rounded product, in place
            tmp = np.empty_like(acc)
            for k in range(K):
                np.multiply(a32[..., k:k + 1], b32[..., k:k + 1, :], out=tmp)
                acc += tmp
            return acc
    for s in range(0, K, blk):
        acc += (a64[..., s:s + blk] @ b64[..., s:s + blk, :]).astype(F32)  # partial rounded, f32 add
    return acc


def matmul(x: np.ndarray, w64: np.ndarray, reduction: str = "f64") -> np.ndarray:
    """x [T, n_in] (f32, or the exact float64 values of quantized activations) @ W^T
    (W [n_out, n_in] as float64) -> [T, n_out] f32: float64 accumulation and one rounding, or
    another legitimate f32 order (dot)."""
    return dot(x, w64.T, reduction)


def rms_norm(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    """ops.cpp ggml_compute_forward_rms_norm_f32 (+ the fused MUL of ggml_cpu_try_fuse_ops):
    sum += (ggml_float)(x*x) in double, mean = (float)(sum/n), scale = 1.0f/sqrtf(mean + eps),
    y = x*scale*w left to right in float."""
    x = np.asarray(x, dtype=F32)
    n = x.shape[-1]
    s = np.sum((x * x).astype(F64), axis=-1, keepdims=True)  # f32 squares, double sum
    mean = (s / n).astype(F32)
    scale = F32(1.0) / np.sqrt(mean + F32(eps))  # f32 add, correctly rounded sqrtf, f32 divide
    y = x * scale
    if w is not None:
        y = y * w
    return y


def rope_theta_scale(base: float, n_dims: int) -> F32:
    """ops.cpp ggml_compute_forward_rope_flt: theta_scale = powf(freq_base, -2.0f/n_dims)."""
    e = F32(-2.0) / F32(n_dims)
    return F32(np.power(F64(F32(base)), F64(e)))


def rope_cache(positions: np.ndarray, base: float, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [T, head_dim/2] as ggml_rope_cache_init builds them: theta starts at (float)p and
    is multiplied by theta_scale in float once per pair (not pow per pair); ext_factor 0 and
    attn_factor 1 (llama-context.cpp defaults without YaRN) leave cosf/sinf untouched."""
    ts = rope_theta_scale(base, head_dim)
    half = head_dim // 2
    theta = np.empty((len(positions), half), dtype=F32)
    t = np.asarray(positions, dtype=F32)
    for i in range(half):
        theta[:, i] = t
        t = t * ts
    th = theta.astype(F64)
    return np.cos(th).astype(F32), np.sin(th).astype(F32)


def rope_norm(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """NORM (interleaved adjacent-pair) rotation, ops.cpp rotate_pairs with scale 1 (book 14.4):
    x0' = x0*cos - x1*sin, x1' = x0*sin + x1*cos. x [T, n_heads, head_dim], cos/sin [T, hd/2]."""
    x0 = x[..., 0::2]
    x1 = x[..., 1::2]
    c = cos[:, None, :]
    s = sin[:, None, :]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * c - x1 * s
    out[..., 1::2] = x0 * s + x1 * c
    return out


def expf(x: np.ndarray) -> np.ndarray:
    return np.exp(np.asarray(x, dtype=F64)).astype(F32)


def softmax_rows(scores: np.ndarray, scale: float, mask: np.ndarray) -> np.ndarray:
    """ops.cpp ggml_compute_forward_soft_max_f32 on f32 KQ rows: wp = x*scale + mask (0/-inf),
    max, e = exp(wp - max) (vec.cpp ggml_vec_soft_max_f32, float), sum in ggml_float (double),
    p = e * (float)(1.0/sum)."""
    wp = scores * F32(scale)
    wp = np.where(mask, wp, F32(-np.inf))
    m = wp.max(axis=-1, keepdims=True)
    e = expf(wp - m)  # exp(-inf) = 0 on masked keys
    total = e.astype(F64).sum(axis=-1, keepdims=True)
    inv = (1.0 / total).astype(F32)
    return e * inv


def sigmoid(x: np.ndarray) -> np.ndarray:
    """unary-ops.cpp op_sigmoid: 1.f / (1.f + expf(-x))."""
    return F32(1.0) / (F32(1.0) + expf(-x))


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """vec.cpp ggml_vec_swiglu_f32: silu(g) * u with silu(g) = g / (1 + exp(-g)) (ggml_v_silu)."""
    return (gate / (F32(1.0) + expf(-gate))) * up


def logit_tail(logits: np.ndarray, logit_scale: float, softcap: float) -> np.ndarray:
    """muse-glimmer.cpp: ggml_scale(logit_scale), then ggml_scale(1.0f/softcap), ggml_tanh
    (unary-ops.cpp op_tanh = tanhf), ggml_scale(softcap) (book 9.10: scale first, cap second)."""
    y = logits * F32(logit_scale)
    if softcap:
        inv = F32(1.0) / F32(softcap)
        y = np.tanh((y * inv).astype(F64)).astype(F32) * F32(softcap)
    return y


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64 (the quantity every parity figure compares)."""
    z = np.asarray(logits, dtype=F64)
    m = z.max(axis=-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(axis=-1, keepdims=True))


# --- arithmetic modes ---------------------------------------------------------------------------


@dataclass
class Arithmetic:
    """Which rounding points a forward applies, and the optional 1-ulp jitter of noise_floor()."""

    mode: str  # "f32" | "ggml-cpu"
    kv: str  # "f16" | "f32": the KV cache element type
    jitter: "str | np.random.Generator | None" = field(default=None, repr=False)  # "up" | "down" | rng
    reduction: str = "f64"  # dot-product order (REDUCTIONS); noise_floor() runs the others

    def __post_init__(self) -> None:
        if self.reduction not in REDUCTIONS:
            raise LaneError(f"reduction {self.reduction!r} is not one of {', '.join(REDUCTIONS)}")
        if self.mode not in ARITHMETICS:
            raise LaneError(f"arithmetic {self.mode!r} is not one of {', '.join(ARITHMETICS)}")
        if self.kv not in ("f16", "f32"):
            raise LaneError(f"kv {self.kv!r} is not one of f16, f32")

    @property
    def rounds(self) -> bool:
        return self.mode == "ggml-cpu"

    def site(self, x: np.ndarray) -> np.ndarray:
        """A perturbation site (norm outputs and every rounding point's input): identity, or
        1 f32 ulp per element under noise_floor(): all up, all down, or a random sign each."""
        j = self.jitter
        if j is None:
            return x
        up, down = np.nextafter(x, F32(np.inf)), np.nextafter(x, F32(-np.inf))
        if isinstance(j, str):
            return (up if j == "up" else down).astype(F32)
        return np.where(j.integers(0, 2, size=x.shape).astype(bool), up, down).astype(F32)

    def activation(self, x: np.ndarray, weight_type: G) -> np.ndarray:
        """The values a matmul against a `weight_type` weight really multiplies."""
        if not self.rounds:
            return x
        vdt = VEC_DOT_TYPE.get(weight_type)
        if vdt is None:
            raise LaneError(f"arithmetic ggml-cpu: the pinned llama.cpp has no CPU matmul for {weight_type.name}")
        fn = _ACT_ROUND.get(vdt)
        if fn is None or not np.all(np.isfinite(x)):
            return x  # a non-finite activation propagates to the logits (refused there, 10.9)
        return fn(x)

    def attn_query(self, q: np.ndarray) -> np.ndarray:
        """Q entering K·Q: converted to f16 when K is f16 (ggml-cpu mode only)."""
        return f16_round(q) if (self.rounds and self.kv == "f16") else q

    def attn_probs(self, p: np.ndarray) -> np.ndarray:
        """Softmax probabilities entering V·P: converted to f16 when V is f16 (ggml-cpu only)."""
        return f16_round(p) if (self.rounds and self.kv == "f16") else p
