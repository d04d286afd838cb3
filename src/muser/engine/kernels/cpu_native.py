"""The CPU exact lane's kernels (kernels/cpu.c, built by the package install) behind ctypes.

Why a C library: the torch/MKL GEMMs and reductions the CPU lane used pick their summation order
by shape (a token's logits changed with how it was batched), and a decode step of the micro model
is a few hundred small ops where per-op dispatch, not arithmetic, is the cost. Every kernel here
reduces each output in one fixed order (cpu.c's header) independent of the row count, the thread
count and the ISA, so the lane is row-invariant by construction.

  gemm(mat, x)                   x [T, n_in] f32 -> [T, n_out] = x . W^T   (W: CpuMat)
  attend(q, k, v, plane ...)     T rows over one KV plane plus themselves  (attention.attend_ref)
  norm_mul / norm2 / qk_norm_rope / gate_mul / silu_mul   the tails, fused.py's signatures
  softcap(l, scale, cap)         * scale, then cap * tanh(l / cap)         (forward.softcap_logits)

Each kernel's reference is the torch op beside it in engine/forward.py or kernels/attention.py;
tests/engine/test_cpu_native.py compares them (stated tolerances) and checks the fixed order
bit for bit against a scalar reference (`dot_ref`).
"""

from __future__ import annotations

import ctypes
import importlib.util
from dataclasses import dataclass

import numpy as np
import torch

from ...errors import FormatError, LaneError
from ...gguf.types import GgmlType as G

_P = ctypes.c_void_p
_I = ctypes.c_int64
_F = ctypes.c_float


def _load() -> ctypes.CDLL:
    spec = importlib.util.find_spec("muser.engine.kernels._cpu")
    if spec is None or not spec.origin:
        raise LaneError("the CPU kernel library muser/engine/kernels/_cpu is not built; "
                        "install the package (`pip install -e .`) to compile kernels/cpu.c")
    lib = ctypes.CDLL(spec.origin)
    sig = {
        "mu_set_threads": (ctypes.c_int, [ctypes.c_int]),
        "mu_get_threads": (ctypes.c_int, []),
        "mu_dot_ref": (_F, [_P, _P, _I]),
        "mu_exp": (_F, [_F]),
        "mu_tanh": (_F, [_F]),
        "mu_gemm": (ctypes.c_int, [ctypes.c_int, _P, _P, _P, _I, _I, _P, _I, _I, _P, _I]),
        "mu_norm_mul": (None, [_P, _I, _P, _P, _I, _P, _I, _I, _I, _F]),
        "mu_norm2": (None, [_P, _I, _P, _F, _P, _I, _P, _F, _P, _I, _P, _I, _I, _I]),
        "mu_qk_norm_rope": (None, [_P, _I, _I, _I, _I, _I, _I, _I, _P, _P, _F, _P, _P, _P, _P]),
        "mu_gate": (None, [_P, _I, _P, _I, _P, _I, _I, _I, ctypes.c_int]),
        "mu_softcap": (None, [_P, _I, _F, _F, _F]),
        "mu_attend": (ctypes.c_int, [_P, _I, _I, _I, _I, _P, _P, _P, _P, _I, _I, ctypes.c_int, ctypes.c_int,
                                     _I, _I, _I, _I, _I, _I, _F, _P]),
        "mu_init": (None, []),
        "mu_gemm_baseline": (None, [ctypes.c_int]),
        "mu_nvfp4_scales": (None, [ctypes.c_int, _P]),
        "mu_gemm_i8": (ctypes.c_int64, [_P, _P, _I, _I, _P, _I, _I, _P, _P, _P, _I]),
    }
    for name, (res, args) in sig.items():
        f = getattr(lib, name)
        f.restype, f.argtypes = res, args
    lib.mu_init()
    return lib


_lib = _load()
_threads = [1]


def set_threads(n: int) -> None:
    """Threads the kernels split output rows over (results do not depend on it)."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= 64:
        raise LaneError(f"CPU kernel threads must be an integer in [1, 64], got {n!r}")
    if _lib.mu_set_threads(int(n)) != 0:
        raise LaneError(f"could not start {n} CPU kernel threads")
    _threads[0] = int(n)


def follow_torch_threads() -> None:
    """One thread knob for the CPU lane: torch's (torch.set_num_threads, `--threads`)."""
    n = min(64, max(1, torch.get_num_threads()))
    if n != _threads[0]:
        set_threads(n)


def get_threads() -> int:
    return int(_lib.mu_get_threads())


def _f32rows(x: torch.Tensor, what: str) -> torch.Tensor:
    assert x.dim() == 2 and x.dtype == torch.float32 and x.stride(1) == 1 and x.device.type == "cpu", \
        f"{what}: f32 [rows, n] on the CPU with unit stride, got {x.dtype} {tuple(x.shape)} {x.stride()}"
    return x


def _vec(w: torch.Tensor, n: int, what: str) -> torch.Tensor:
    assert w.shape == (n,) and w.dtype == torch.float32 and w.is_contiguous(), f"{what}: f32 [{n}]"
    return w


# ---------------------------------------------------------------------------------------------
# weights


FMT_F32, FMT_Q8_0, FMT_NVFP4, FMT_NVFP4_GGML = 0, 1, 2, 3  # cpu.c's fmt
FMTS_NVFP4 = (FMT_NVFP4, FMT_NVFP4_GGML)  # scale bytes E4M3FN x 0.5 (companion) | UE4M3 half (type 40)


@dataclass
class CpuMat:
    """A weight in the form the GEMM reads: Q8_0 as stored (int8 quants + f32 block scales, each
    scale the exact f32 of its f16); both NVFP4 forms as stored, 4.5 bits a weight: E2M1 codes
    two a byte in ggml's block_nvfp4 order (the companion form's bytes re-paired at load) + the
    per-16 scale bytes (fmt says which decoder) [+ the companion's f32 scale2 a row]. cpu.c turns a code into
    kvalues_fp4 and a byte into its f32 in registers, so w = (q * d) * s is the NVFP4 decoder's
    value; anything else as its exact f32 decode."""

    fmt: int
    w: torch.Tensor  # f32 [n_out, n_in] | Q8_0 int8 [n_out, n_in] | NVFP4 uint8 [n_out, n_in / 2]
    d: torch.Tensor | None  # Q8_0: f32 [n_out, n_in / 32]; NVFP4: uint8 [n_out, n_in / 16]
    n_out: int
    n_in: int
    s: torch.Tensor | None = None  # companion NVFP4: f32 [n_out] scale2 (type 40 has none)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w, self.d, self.s) if t is not None)

    @staticmethod
    def native(w) -> bool:
        """The GEMM reads this QWeight's stored blocks directly (else its f32 decode)."""
        if w.fmt == G.Q8_0:
            return "qs" in w.fields
        return w.fmt in (G.NVFP4_E2M1, G.NVFP4) and "qs" in w.fields and w.n_in % 32 == 0

    @classmethod
    def resident_bytes(cls, w) -> int:
        """The bytes `of(w)` will hold, known before building it (the cache's budget check)."""
        n, k = w.n_out, w.n_in
        if not cls.native(w):
            return n * k * 4
        if w.fmt == G.Q8_0:
            return n * k + n * (k // 32) * 4
        s2 = n * 4 if w.fmt == G.NVFP4_E2M1 else 0
        return n * (k // 2) + n * (k // 16) + s2  # codes, per-16 scale bytes, scale2 a row

    @classmethod
    def of(cls, w) -> "CpuMat":
        """From an engine QWeight (engine/weights.py)."""
        if cls.native(w):
            if w.fmt == G.Q8_0:
                return cls(FMT_Q8_0, w.fields["qs"].contiguous(), w.fields["d"].to(torch.float32).contiguous(),
                           w.n_out, w.n_in)
            return cls(*_nvfp4_resident(w), w.n_out, w.n_in, _nvfp4_scale2(w))
        return cls(FMT_F32, w.decode().to(torch.float32).contiguous(), None, w.n_out, w.n_in)

    @classmethod
    def cat(cls, mats: list["CpuMat"]) -> "CpuMat":
        """Rows stacked in order (one GEMM for projections that read one input); formats that
        differ are all taken as f32 (the same values, so the same outputs)."""
        n_out = sum(m.n_out for m in mats)
        fmt = mats[0].fmt
        if fmt != FMT_F32 and all(m.fmt == fmt for m in mats):
            s = torch.cat([m.s for m in mats], 0) if fmt == FMT_NVFP4 else None
            return cls(fmt, torch.cat([m.w for m in mats], 0), torch.cat([m.d for m in mats], 0),
                       n_out, mats[0].n_in, s)
        return cls(FMT_F32, torch.cat([m.decode() for m in mats], 0), None, n_out, mats[0].n_in)

    def decode(self) -> torch.Tensor:
        """f32 [n_out, n_in]: ggml dequantize_row_q8_0 q * d; NVFP4 (q * d) * s (cpu.c's order)."""
        if self.fmt == FMT_F32:
            return self.w
        assert self.d is not None
        if self.fmt == FMT_Q8_0:
            return (self.w.to(torch.float32).view(self.n_out, -1, 32) * self.d.unsqueeze(-1)).view(self.n_out, -1)
        from ..nvfp4 import _tables

        t = _tables("cpu")
        q = self.w.view(self.n_out, -1, 8)
        codes = torch.cat([q & 0xF, q >> 4], -1).long()  # [r, g, 16]: low nibble j, high j + 8
        d = t["e4m3"][self.d.long()] * 0.5 if self.fmt == FMT_NVFP4 else t["ue4m3"][self.d.long()]
        w = t["q1"][codes] * d.unsqueeze(-1)
        if self.s is not None:
            w = w * self.s.view(-1, 1, 1)
        return w.view(self.n_out, self.n_in)


def _nvfp4_resident(w) -> tuple[int, torch.Tensor, torch.Tensor]:
    """An NVFP4 QWeight's resident fields (engine/nvfp4.py) -> (fmt, codes uint8 [r, n_in/2] in
    ggml's order, scale bytes uint8 [r, n_in/16]): the stored bytes, none added. Why ggml's order
    (per 16 values: low nibbles elements 0..7, high nibbles 8..15): one mask and one shift give
    the GEMM's two 8-lane groups; the companion's pairs (2i, 2i+1) are re-paired here once."""
    qs, r, n_in = w.fields["qs"], w.n_out, w.n_in
    if w.fmt == G.NVFP4:
        return FMT_NVFP4_GGML, qs.contiguous(), w.fields["d"].contiguous()
    codes = torch.stack([qs & 0xF, qs >> 4], -1).view(r, n_in // 16, 2, 8)  # low nibble = even index
    return FMT_NVFP4, (codes[:, :, 0] | (codes[:, :, 1] << 4)).view(r, n_in // 2), w.fields["sc"].contiguous()


def nvfp4_scale_table(fmt: int) -> torch.Tensor:
    """cpu.c's scale byte -> f32 table of an NVFP4 fmt: f32 [256] (tests hold it to engine/nvfp4.py)."""
    assert fmt in FMTS_NVFP4, fmt
    out = torch.empty(256, dtype=torch.float32)
    _lib.mu_nvfp4_scales(fmt - FMT_NVFP4, out.data_ptr())
    return out


def _nvfp4_scale2(w) -> torch.Tensor | None:
    return w.fields["s2"].to(torch.float32).contiguous() if w.fmt == G.NVFP4_E2M1 else None


@dataclass
class CpuStack:
    """Projections that read one input as one CpuMat (qmatvec_v3.Stack's interface)."""

    mat: CpuMat
    bounds: tuple[tuple[int, int], ...]  # [n0, n1) of each member

    def split(self, y: torch.Tensor) -> list[torch.Tensor]:
        return [y[:, a:b] for a, b in self.bounds]


def stack(ws) -> CpuStack:
    mats = [CpuMat.of(w) for w in ws]
    n, bounds = 0, []
    for m in mats:
        bounds.append((n, n + m.n_out))
        n += m.n_out
    return CpuStack(CpuMat.cat(mats), tuple(bounds))


def gemm(m: CpuMat, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x f32 [T, n_in] (unit column stride) -> out [T, n_out] (a fresh tensor, or `out`: any
    row stride, unit column stride)."""
    _f32rows(x, "gemm x")
    T = x.shape[0]
    assert x.shape[1] == m.n_in, f"gemm: x has {x.shape[1]} columns, the weight {m.n_in}"
    if out is None:
        out = torch.empty((T, m.n_out), dtype=torch.float32)
    else:
        assert out.shape == (T, m.n_out) and out.dtype == torch.float32 and out.stride(1) == 1
    rc = _lib.mu_gemm(m.fmt, m.w.data_ptr(), m.d.data_ptr() if m.d is not None else None,
                      m.s.data_ptr() if m.s is not None else None, m.n_out, m.n_in,
                      x.data_ptr(), x.stride(0), T, out.data_ptr(), out.stride(0))
    if rc:
        raise LaneError(f"CPU gemm refused fmt {m.fmt} with n_in {m.n_in}")
    return out


I8_FORMATS = (G.Q8_0, G.Q4_0)  # weight types whose integer-lane dot reads Q8_0 activations as int8 codes


def i8_codes(fmt: G, qs: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 or Q4_0 weight's repacked fields (engine/weights.py) -> (int8 codes [N, K], f32
    scales [N, K / 32]) for gemm_i8: Q8_0's qs as stored; Q4_0's nibbles - 8 (per 32-block byte
    i: element i low, element 16 + i high), the values ggml's vec_dot_q4_0_q8_0 multiplies."""
    if fmt == G.Q8_0:
        wq = qs.contiguous()
    elif fmt == G.Q4_0:
        b = qs.contiguous().view(torch.uint8).reshape(qs.shape[0], -1, 16)  # [N, K / 32, 16]
        wq = (torch.cat([b & 0x0F, b >> 4], dim=2).to(torch.int16) - 8).to(torch.int8).reshape(qs.shape[0], -1)
    else:
        raise LaneError(f"gemm_i8 takes Q8_0 or Q4_0 weights, not {G(fmt).name}")
    return wq, d.to(torch.float32).contiguous()


def gemm_i8(wq: torch.Tensor, wd: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The integer lane over Q8_0 activations (cpu.c mu_gemm_i8; muser.quant.dot.matmul_ggml's
    bits): x f32 [T, K] (unit column stride) -> out f32 [T, N] (fresh, or `out`: any row stride,
    unit column stride). wq, wd: i8_codes'."""
    _f32rows(x, "gemm_i8 x")
    T, K = x.shape
    N = wq.shape[0]
    assert wq.dtype == torch.int8 and wq.shape == (N, K) and wq.is_contiguous(), f"gemm_i8: codes {wq.shape}"
    assert wd.dtype == torch.float32 and wd.shape == (N, K // 32) and wd.is_contiguous()
    if out is None:
        out = torch.empty((T, N), dtype=torch.float32)
    else:
        assert out.shape == (T, N) and out.dtype == torch.float32 and out.stride(1) == 1
    aq = torch.empty((T, K), dtype=torch.int8)
    ad = torch.empty((T, K // 32), dtype=torch.float32)
    rc = _lib.mu_gemm_i8(wq.data_ptr(), wd.data_ptr(), N, K, x.data_ptr(), x.stride(0), T, aq.data_ptr(),
                         ad.data_ptr(), out.data_ptr(), out.stride(0))
    if rc < 0:
        raise LaneError(f"CPU gemm_i8 refused n_in {K} (a multiple of 32 is needed)")
    if rc > 0:  # Q8_0 quantization of a NaN or inf has no value (matmul_ggml refuses it too)
        i = rc - 1
        raise FormatError(f"integer-lane activations: non-finite value {float(x[i // K, i % K])!r} "
                          f"at row {i // K}, column {i % K}")
    return out


def gemm_baseline(on: bool) -> None:
    """Tests: run the GEMM's baseline-ISA instantiation even where AVX2 is present."""
    _lib.mu_gemm_baseline(int(bool(on)))


def dot_ref(x: torch.Tensor, w: torch.Tensor) -> float:
    """The fixed reduction order, scalar (cpu.c mu_dot_ref): x, w f32 [n] contiguous."""
    assert x.dtype == w.dtype == torch.float32 and x.is_contiguous() and w.is_contiguous() and x.shape == w.shape
    return float(_lib.mu_dot_ref(x.data_ptr(), w.data_ptr(), x.numel()))


def exp(x: float) -> float:
    return float(_lib.mu_exp(x))


def tanh(x: float) -> float:
    return float(_lib.mu_tanh(x))


# ---------------------------------------------------------------------------------------------
# tails (kernels/fused.py's signatures; references: forward.rms_norm, rope, sigmoid, silu)


def _no_act(act) -> None:
    """The CPU tails write f32 only: the CPU's integer lane quantizes inside its GEMM."""
    if act is not None:
        raise ValueError("the CPU tails write no integer-lane activations (act must be None)")


def norm_mul(x: torch.Tensor, w: torch.Tensor, eps: float, res: torch.Tensor | None = None, act=None) -> torch.Tensor:
    """x [R, N] f32, w [N] -> [R, N]: [res +] rms_norm(x, eps) * w."""
    _no_act(act)
    _f32rows(x, "norm_mul x")
    R, N = x.shape
    _vec(w, N, "norm_mul w")
    if res is not None:
        _f32rows(res, "norm_mul res")
        assert res.shape == (R, N)
    out = torch.empty((R, N), dtype=torch.float32)
    _lib.mu_norm_mul(x.data_ptr(), x.stride(0), w.data_ptr(), res.data_ptr() if res is not None else None,
                     res.stride(0) if res is not None else 0, out.data_ptr(), N, R, N, eps)
    return out


def norm2(x: torch.Tensor, w: torch.Tensor, eps: float, res: torch.Tensor, w2: torch.Tensor,
          eps2: float, act=None) -> tuple[torch.Tensor, torch.Tensor]:
    """h = res + rms_norm(x, eps) * w, then rms_norm(h, eps2) * w2. x, res [R, N]; w, w2 [N]."""
    _no_act(act)
    _f32rows(x, "norm2 x")
    _f32rows(res, "norm2 res")
    R, N = x.shape
    assert res.shape == (R, N)
    _vec(w, N, "norm2 w")
    _vec(w2, N, "norm2 w2")
    out = torch.empty((R, N), dtype=torch.float32)
    out2 = torch.empty((R, N), dtype=torch.float32)
    _lib.mu_norm2(x.data_ptr(), x.stride(0), w.data_ptr(), eps, res.data_ptr(), res.stride(0), w2.data_ptr(), eps2,
                  out.data_ptr(), N, out2.data_ptr(), N, R, N)
    return out, out2


def qk_norm_rope(y: torch.Tensor, q_off: int, k_off: int, H: int, KV: int, D: int, qn: torch.Tensor,
                 kn: torch.Tensor, eps: float, cos: torch.Tensor | None, sin: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """y [T, n] (q heads at columns q_off.., k heads at k_off..) -> q [T, H, D], k [T, KV, D]:
    per-head rms_norm * q_norm / k_norm, then RoPE (cos, sin [T, D/2]) when given."""
    _f32rows(y, "qk_norm_rope y")
    T = y.shape[0]
    assert D % 2 == 0 and D <= 1024 and q_off + H * D <= y.shape[1] and k_off + KV * D <= y.shape[1]
    _vec(qn, D, "q_norm")
    _vec(kn, D, "k_norm")
    if cos is not None:
        assert cos.shape == sin.shape == (T, D // 2) and cos.is_contiguous() and sin.is_contiguous()
        assert cos.dtype == sin.dtype == torch.float32
    q = torch.empty((T, H, D), dtype=torch.float32)
    k = torch.empty((T, KV, D), dtype=torch.float32)
    _lib.mu_qk_norm_rope(y.data_ptr(), y.stride(0), q_off, k_off, T, H, KV, D, qn.data_ptr(), kn.data_ptr(), eps,
                         cos.data_ptr() if cos is not None else None, sin.data_ptr() if sin is not None else None,
                         q.data_ptr(), k.data_ptr())
    return q, k


def _gate(a: torch.Tensor, g: torch.Tensor, silu: bool) -> torch.Tensor:
    _f32rows(a, "gate a")
    _f32rows(g, "gate g")
    assert a.shape == g.shape
    R, N = a.shape
    out = torch.empty((R, N), dtype=torch.float32)
    _lib.mu_gate(a.data_ptr(), a.stride(0), g.data_ptr(), g.stride(0), out.data_ptr(), N, R, N, int(silu))
    return out


def gate_mul(a: torch.Tensor, g: torch.Tensor, act=None) -> torch.Tensor:
    """a * sigmoid(g), both [R, N] f32."""
    _no_act(act)
    return _gate(a, g, False)


def silu_mul(g: torch.Tensor, u: torch.Tensor, act=None) -> torch.Tensor:
    """silu(g) * u, both [R, N] f32."""
    _no_act(act)
    return _gate(u, g, True)


def softcap(l: torch.Tensor, scale: float, cap: float) -> torch.Tensor:
    """forward.softcap_logits in place on a contiguous f32 tensor."""
    assert l.dtype == torch.float32 and l.is_contiguous() and l.device.type == "cpu"
    inv = float(np.float32(1.0) / np.float32(cap)) if cap > 0 else 0.0
    _lib.mu_softcap(l.data_ptr(), l.numel(), scale, inv, cap)
    return l


# ---------------------------------------------------------------------------------------------
# attention (reference: kernels/attention.attend_ref; same arguments)


def attend(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_plane: torch.Tensor,
           v_plane: torch.Tensor, head_major: bool, origin_logical: int, origin_physical: int, length: int,
           capacity: int, p0: int, window: int, scale: float, f16_operands: bool = False) -> torch.Tensor:
    """q [T, H, D] f32; k_new, v_new [T, n_kv, D] in the plane's dtype (f16 | f32); planes
    token-major [cap, n_kv * D] or head-major [n_kv, cap, D]; window 0 = full attention;
    f16_operands (f16 planes only): q and the normalised p rounded to f16 (attention.attend_ref).
    -> [T, H, D] f32."""
    from .attention import plane_strides

    T, H, D = q.shape
    n_kv = k_new.shape[1]
    assert q.dtype == torch.float32 and q.is_contiguous()
    assert k_new.shape == v_new.shape == (T, n_kv, D) and k_new.is_contiguous() and v_new.is_contiguous()
    dt = k_plane.dtype
    assert dt in (torch.float16, torch.float32) and k_new.dtype == v_new.dtype == v_plane.dtype == dt
    s_slot, s_head = plane_strides(k_plane, head_major, n_kv, D)
    assert plane_strides(v_plane, head_major, n_kv, D) == (s_slot, s_head)
    if f16_operands and dt != torch.float16:
        raise LaneError(f"f16 attention operands need an f16 KV plane, not {dt}")
    out = torch.empty((T, H, D), dtype=torch.float32)
    rc = _lib.mu_attend(q.data_ptr(), T, H, n_kv, D, k_new.data_ptr(), v_new.data_ptr(), k_plane.data_ptr(),
                        v_plane.data_ptr(), s_slot, s_head, int(dt == torch.float16), int(f16_operands),
                        origin_logical, origin_physical, length, capacity, p0, window, scale, out.data_ptr())
    if rc:
        raise LaneError(f"CPU attention refused T={T}, H={H}, n_kv={n_kv}, D={D}")
    return out


__all__ = ["CpuMat", "CpuStack", "attend", "dot_ref", "gate_mul", "gemm", "get_threads", "norm2", "norm_mul",
           "qk_norm_rope", "set_threads", "silu_mul", "softcap", "stack"]
