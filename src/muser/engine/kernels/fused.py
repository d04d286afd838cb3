"""Fused element-wise tails of the decode step on CUDA: each replaces 5-15 small torch kernels
(a decode step on the full geometry launched ~4,000 of them: ~4.5 ms of GPU time and ~5 ms of
gaps inside the captured graph, bench/NOTES.md "where a step goes").

Every kernel forms each value with the op order of the torch reference beside it in
engine/forward.py (rms_norm, rope, sigmoid, silu; ggml's order, book 12 / 9.7 / 9.8), one rounding
per op (enable_fp_fusion=False), IEEE division and square root (div_rn, sqrt_rn) and the
accurate expf (libdevice, what torch calls); only the mean's summation order differs (ulp level,
the exact lane's contract). Tests hold them to the torch ops (tests/engine/test_fused.py).

  norm_mul(x, w, eps, res=None)      rows of x -> [res +] (x * (1 / sqrt(mean(x^2) + eps))) * w
  norm2(x, w, eps, res, w2, eps2)    h = res + norm(x) * w and norm(h) * w2 in one pass (a sandwich
                                     tail and the next pre-norm)
  qk_norm_rope(y, ...)               q and k heads of the stacked projection -> per-head norm * w,
                                     RoPE on sliding layers, written contiguous
  gate_mul(a, g)                     a * (1 / (1 + exp(-g)))            (attention gate, book 9.8)
  silu_mul(g, u)                     (g / (1 + exp(-g))) * u            (SwiGLU)

Every tail but qk_norm_rope may also write its output as the integer lane's activations (`act`:
an empty qmatmul_i8.Act in the consuming projection's vec_dot_type): the same kernel quantizes
each row's blocks right after forming them, through qmatmul_i8.store_act, the very code of
`quantize_act`'s own kernel, so the codes and scales are the bits a separate quantize launch
would give (ggml's quantize_row_q8_K / _q8_0). That takes one launch and one read of the row off
each of the integer lane's projections.
"""

from __future__ import annotations

import os

import torch

from . import gdc

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    HAVE_TRITON = True
except ImportError:  # pragma: no cover
    HAVE_TRITON = False


def _lib() -> bool:
    """libdevice where compiled; the interpreter (numpy) takes tl.exp, already accurate there."""
    return not os.environ.get("TRITON_INTERPRET")


if HAVE_TRITON:
    from .gdc import after_prior
    from .qmatmul_i8 import store_act

    @triton.jit
    def _exp(x, LIB: tl.constexpr):
        if LIB:
            return libdevice.exp(x)
        else:
            return tl.exp(x)

    @triton.jit
    def _norm_mul_kernel(x, w, res, out, aq, ad, ab, N, sx, sr, so, eps, HAS_RES: tl.constexpr,
                         BLOCK: tl.constexpr, KIND: tl.constexpr, PDL: tl.constexpr):
        after_prior(PDL)  # gdc.py: the previous kernel done before the first read
        r = tl.program_id(0)
        i = tl.arange(0, BLOCK)
        m = i < N
        v = tl.load(x + r * sx + i, mask=m, other=0.0)  # [BLOCK] f32
        ms = tl.div_rn(tl.sum(v * v, 0), N.to(tl.float32))  # mean(x^2)
        scale = tl.div_rn(1.0, tl.sqrt_rn(ms + eps))  # ggml: 1.0f / sqrtf(mean + eps)
        y = (v * scale) * tl.load(w + i, mask=m, other=0.0)
        if HAS_RES:
            y = y + tl.load(res + r * sr + i, mask=m, other=0.0)
        tl.store(out + r * so + i, y, mask=m)
        store_act(y, aq, ad, ab, r.to(tl.int64), 0, N, KIND)  # y is 0 past N: those blocks are not stored

    @triton.jit
    def _norm2_kernel(x, w, res, w2, out, out2, aq, ad, ab, N, sx, sr, so, so2, eps, eps2, BLOCK: tl.constexpr,
                      KIND: tl.constexpr, PDL: tl.constexpr):
        """out = res + rms_norm(x) * w; out2 = rms_norm(out) * w2 (one row per program), out2
        also quantized for the integer lane when KIND is not 0 (store_act)."""
        after_prior(PDL)  # gdc.py: the previous kernel done before the first read
        r = tl.program_id(0)
        i = tl.arange(0, BLOCK)
        m = i < N
        v = tl.load(x + r * sx + i, mask=m, other=0.0)
        ms = tl.div_rn(tl.sum(v * v, 0), N.to(tl.float32))
        scale = tl.div_rn(1.0, tl.sqrt_rn(ms + eps))
        y = (v * scale) * tl.load(w + i, mask=m, other=0.0) + tl.load(res + r * sr + i, mask=m, other=0.0)
        tl.store(out + r * so + i, y, mask=m)
        ms2 = tl.div_rn(tl.sum(y * y, 0), N.to(tl.float32))
        scale2 = tl.div_rn(1.0, tl.sqrt_rn(ms2 + eps2))
        y2 = (y * scale2) * tl.load(w2 + i, mask=m, other=0.0)
        tl.store(out2 + r * so2 + i, y2, mask=m)
        store_act(y2, aq, ad, ab, r.to(tl.int64), 0, N, KIND)

    @triton.jit
    def _qk_norm_rope_kernel(y, sy, q_off, k_off, qn, kn, cos, sin, q_out, k_out, H, eps,
                             ROPE: tl.constexpr, D: tl.constexpr, PDL: tl.constexpr):
        after_prior(PDL)  # gdc.py: the previous kernel done before the first read
        t = tl.program_id(0)
        h = tl.program_id(1)  # q heads 0..H-1, then k heads
        is_q = h < H
        off = tl.where(is_q, q_off + h * D, k_off + (h - H) * D)
        i = tl.arange(0, D // 2)
        base = y + t * sy + off
        x0 = tl.load(base + 2 * i)  # [D/2] dims 2i (NORM pairing, book 9.7)
        x1 = tl.load(base + 2 * i + 1)
        ms = tl.div_rn(tl.sum(x0 * x0, 0) + tl.sum(x1 * x1, 0), D * 1.0)
        scale = tl.div_rn(1.0, tl.sqrt_rn(ms + eps))
        wp = tl.where(is_q, qn, kn)
        y0 = (x0 * scale) * tl.load(wp + 2 * i)
        y1 = (x1 * scale) * tl.load(wp + 2 * i + 1)
        if ROPE:
            c = tl.load(cos + t * (D // 2) + i)
            s = tl.load(sin + t * (D // 2) + i)
            o0 = y0 * c - y1 * s
            o1 = y0 * s + y1 * c
        else:
            o0 = y0
            o1 = y1
        dst = tl.where(is_q, q_out + (t * H + h) * D, k_out + (t * (tl.num_programs(1) - H) + (h - H)) * D)
        tl.store(dst + 2 * i, o0)
        tl.store(dst + 2 * i + 1, o1)

    @triton.jit
    def _gate_kernel(a, g, out, aq, ad, ab, N, sa, sg, so, SILU: tl.constexpr, LIB: tl.constexpr,
                     BLOCK: tl.constexpr, KIND: tl.constexpr, PDL: tl.constexpr):
        after_prior(PDL)  # gdc.py: the previous kernel done before the first read
        r = tl.program_id(0)
        i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = i < N
        av = tl.load(a + r * sa + i, mask=m, other=0.0)
        gv = tl.load(g + r * sg + i, mask=m, other=0.0)
        if SILU:  # ggml_silu_f32: x / (1 + expf(-x)), then * up
            y = tl.div_rn(gv, 1.0 + _exp(-gv, LIB)) * av
        else:  # ggml_vec_sigmoid_f32: 1 / (1 + expf(-x)); a * sigmoid(g)
            y = av * tl.div_rn(1.0, 1.0 + _exp(-gv, LIB))
        tl.store(out + r * so + i, y, mask=m)
        store_act(y, aq, ad, ab, r.to(tl.int64), tl.program_id(1) * BLOCK, N, KIND)


def norm_warps(n: int) -> int:
    """Warps of a row-norm program: a decode step's norms are one program each, so a row's
    latency is the step's; 16 warps keep a 6,656-wide row's loads in flight at once (the warp
    count fixes the sum's tree, the same for every row count: row invariance holds)."""
    return 16 if n >= 4096 else 4


def _rows(x: torch.Tensor) -> torch.Tensor:
    assert x.dim() == 2 and x.dtype == torch.float32 and x.stride(1) == 1, "fused: f32 [rows, n] with unit stride"
    return x


def _act(act, R: int, N: int, like: torch.Tensor) -> tuple[tuple, int]:
    """A tail launch's act operands (codes, scales, 32-sums) and its KIND: the Act's, or (no act)
    placeholders never read and KIND 0. ValueError when the Act is not [R, N] of a kind store_act
    writes."""
    if act is None:
        return (like, like, like), 0
    from .qmatmul_i8 import ACT_KIND

    if act.kind not in ACT_KIND or tuple(act.qs.shape) != (R, N) or not act.qs.is_contiguous() \
            or act.qs.device != like.device:
        raise ValueError(f"fused: act {act.kind!r} {list(act.qs.shape)} on {act.qs.device} cannot take "
                         f"[{R}, {N}] rows on {like.device}")
    return (act.qs, act.d, act.bsum32 if act.bsum32 is not None else act.d), ACT_KIND[act.kind]


def norm_mul(x: torch.Tensor, w: torch.Tensor, eps: float, res: torch.Tensor | None = None, act=None) -> torch.Tensor:
    """x [R, N] f32, w [N] -> [R, N]: [res +] rms_norm(x, eps) * w (and, given `act`, the same
    rows quantized into it)."""
    _rows(x)
    R, N = x.shape
    assert w.shape == (N,) and w.dtype == torch.float32 and w.is_contiguous()
    out = torch.empty((R, N), dtype=torch.float32, device=x.device)
    if res is not None:
        _rows(res)
        assert res.shape == (R, N)
    ops, kind = _act(act, R, N, x)
    _norm_mul_kernel[(R,)](x, w, res if res is not None else x, out, *ops, N, x.stride(0),
                           res.stride(0) if res is not None else 0, out.stride(0), float(eps),
                           HAS_RES=res is not None, BLOCK=triton.next_power_of_2(N), KIND=kind,
                           num_warps=norm_warps(N), enable_fp_fusion=False, **gdc.kwargs(x))
    return out


def norm2(x: torch.Tensor, w: torch.Tensor, eps: float, res: torch.Tensor, w2: torch.Tensor,
          eps2: float, act=None) -> tuple[torch.Tensor, torch.Tensor]:
    """A sandwich tail and the next pre-norm in one pass: h = res + rms_norm(x, eps) * w, then
    rms_norm(h, eps2) * w2. x, res [R, N] f32; w, w2 [N] -> (h, normed h); given `act`, the normed
    h is also quantized into it."""
    _rows(x)
    _rows(res)
    R, N = x.shape
    assert res.shape == (R, N) and w.shape == (N,) and w2.shape == (N,) and w.is_contiguous() and w2.is_contiguous()
    out = torch.empty((R, N), dtype=torch.float32, device=x.device)
    out2 = torch.empty((R, N), dtype=torch.float32, device=x.device)
    ops, kind = _act(act, R, N, x)
    _norm2_kernel[(R,)](x, w, res, w2, out, out2, *ops, N, x.stride(0), res.stride(0), out.stride(0), out2.stride(0),
                        float(eps), float(eps2), BLOCK=triton.next_power_of_2(N), KIND=kind, num_warps=norm_warps(N),
                        enable_fp_fusion=False, **gdc.kwargs(x))
    return out, out2


def qk_norm_rope(y: torch.Tensor, q_off: int, k_off: int, H: int, KV: int, D: int, qn: torch.Tensor,
                 kn: torch.Tensor, eps: float, cos: torch.Tensor | None, sin: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """y [T, n] (the stacked projection's output; q heads at columns q_off.., k heads at k_off..)
    -> q [T, H, D], k [T, KV, D] contiguous: per-head rms_norm * q_norm / k_norm, then RoPE
    (cos, sin [T, D/2]) when given."""
    _rows(y)
    T = y.shape[0]
    assert qn.shape == (D,) and kn.shape == (D,) and D % 2 == 0 and (D & (D - 1)) == 0
    q = torch.empty((T, H, D), dtype=torch.float32, device=y.device)
    k = torch.empty((T, KV, D), dtype=torch.float32, device=y.device)
    rope = cos is not None
    if rope:
        assert cos.shape == (T, D // 2) and sin.shape == (T, D // 2) and cos.is_contiguous() and sin.is_contiguous()
    _qk_norm_rope_kernel[(T, H + KV)](y, y.stride(0), q_off, k_off, qn, kn, cos if rope else qn,
                                      sin if rope else qn, q, k, H, float(eps), ROPE=rope, D=D, num_warps=1,
                                      enable_fp_fusion=False, **gdc.kwargs(y))
    return q, k


def _gate(a: torch.Tensor, g: torch.Tensor, silu: bool, act) -> torch.Tensor:
    _rows(a)
    _rows(g)
    assert a.shape == g.shape
    R, N = a.shape
    out = torch.empty((R, N), dtype=torch.float32, device=a.device)
    B = 1024  # a multiple of both activation blocks (256, 32): a program quantizes whole blocks
    ops, kind = _act(act, R, N, a)
    _gate_kernel[(R, triton.cdiv(N, B))](a, g, out, *ops, N, a.stride(0), g.stride(0), out.stride(0), SILU=silu,
                                         LIB=_lib(), BLOCK=B, KIND=kind, num_warps=4, enable_fp_fusion=False,
                                         **gdc.kwargs(a))
    return out


def gate_mul(a: torch.Tensor, g: torch.Tensor, act=None) -> torch.Tensor:
    """a * sigmoid(g), both [R, N] f32 (and, given `act`, quantized into it)."""
    return _gate(a, g, False, act)


def silu_mul(g: torch.Tensor, u: torch.Tensor, act=None) -> torch.Tensor:
    """silu(g) * u, both [R, N] f32 (and, given `act`, quantized into it)."""
    return _gate(u, g, True, act)


__all__ = ["HAVE_TRITON", "gate_mul", "norm2", "norm_mul", "qk_norm_rope", "silu_mul"]
