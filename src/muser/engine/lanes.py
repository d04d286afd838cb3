"""Lanes and how a projection is computed on each (DESIGN.md "Exactness contract").

* exact: f32 activations and f32 accumulation against weights decoded bit-exactly from their
  stored blocks. Decode-shaped calls (<= 16 rows) on CUDA use the fused Triton dequant-matvec;
  wider calls decode row chunks and run an f32 GEMM with TF32 off.
* fast: as exact for <= 16 rows; wider calls (prefill) use bf16 operands on tensor cores with
  f32 output. Its drift is measured and reported, never called exact.

On the CPU every projection runs the C library's GEMM (kernels/cpu_native.py: one fixed
reduction order per output, whatever the row count or thread count, so the lane is
row-invariant), reading Q8_0 as stored, NVFP4 as int8 codes with its scales (values bit-equal
to the decoder's) and other formats as their exact f32 decode, cached once
per weight within a byte budget; beyond it each call decodes row chunks. The fast lane's wide
calls on the CPU stay bf16 torch GEMMs.
"""

from __future__ import annotations

from enum import Enum

import torch

from ..errors import LaneError
from .kernels import qmatvec
from .weights import QWeight


class Lane(str, Enum):
    EXACT = "exact"
    FAST = "fast"
    W4A4 = "w4a4"  # exact, except verify-shaped calls on W4A4 weights: FP4 activations (engine/w4a4.py)

    @classmethod
    def parse(cls, value: str) -> "Lane":
        try:
            return cls(value)
        except ValueError:
            raise LaneError(f"unknown lane {value!r} (expected 'exact', 'fast' or 'w4a4')") from None


DEVICES = ("cpu", "cuda")
KV_TYPES = ("f16", "f32")


def parse_device(value: str) -> torch.device:
    if value not in DEVICES:
        raise LaneError(f"unknown device {value!r} (expected 'cpu' or 'cuda')")
    if value == "cuda":
        if not torch.cuda.is_available():
            raise LaneError("device 'cuda' was requested but torch sees no CUDA device")
        if not qmatvec.HAVE_TRITON:
            raise LaneError("device 'cuda' needs Triton for the engine's kernels; it is not installed")
        # Exact lane: no TF32 anywhere (f32 GEMMs stay f32).
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def parse_kv(value: str) -> str:
    if value not in KV_TYPES:
        raise LaneError(f"unknown KV type {value!r} (expected 'f16' or 'f32')")
    return value


CHUNK_BYTES = 256 << 20  # decoded temporary per GEMM chunk on the GPU
CPU_CACHE_BYTES = 8 << 30  # decoded-weight cache budget on the CPU


class Linear:
    """y = x @ W^T for a QWeight, by lane and device. x: f32 [T, n_in] -> f32 [T, n_out]."""

    def __init__(self, lane: Lane, device: torch.device):
        self.lane = lane
        self.device = device
        self.cuda = device.type == "cuda"
        self.triton_rows = self.cuda  # fused dequant-matvec for <= 16 rows (CUDA)
        self._cache: dict[int, torch.Tensor] = {}
        self._cached_bytes = 0

    def stacked_ok(self, T: int) -> bool:
        """Stacked projections serve this call: on CUDA (kernels/qmatvec_v3.Stack) decode-shaped
        calls; on the CPU (cpu_native.CpuStack) every call of the C GEMM."""
        if self.lane is Lane.W4A4 and 1 < T <= qmatvec.MAX_ROWS:
            return False  # verify rows of the W4A4 lane: each projection by itself (__call__)
        if self.triton_rows:
            return T <= qmatvec.MAX_ROWS
        return not self.cuda and not self._torch_wide(T)

    def _torch_wide(self, T: int) -> bool:
        return self.lane is Lane.FAST and T > qmatvec.MAX_ROWS

    def stacked_raw(self, st, x: torch.Tensor) -> torch.Tensor:
        """x [T, n_in] -> [T, sum n_out] for a Stack (one launch / one GEMM)."""
        if not self.cuda:
            from .kernels import cpu_native

            if isinstance(st, cpu_native.CpuStack):
                return cpu_native.gemm(st.mat, x.contiguous())
        from .kernels import qmatvec_v3

        return qmatvec_v3.matvec_v3(st.packed, x.contiguous())

    def stacked(self, st, x: torch.Tensor) -> list[torch.Tensor]:
        """x [T, n_in] -> the members' outputs of a Stack (column views of one [T, sum] result)."""
        return st.split(self.stacked_raw(st, x))

    def __call__(self, w: QWeight, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        if self.lane is Lane.W4A4 and 1 < T <= qmatvec.MAX_ROWS and "isi" in w.fields:
            from .w4a4 import matmul_w4a4  # book 7.4.3: the verify forward of a W4A4 file

            return matmul_w4a4(w, x)
        if self.triton_rows and T <= qmatvec.MAX_ROWS:
            return qmatvec.matvec(w, x.contiguous())
        wide = self._torch_wide(T)
        dt = torch.bfloat16 if wide else torch.float32
        if not self.cuda and not wide:
            return self._cpu_gemm(w, x.contiguous())
        if not self.cuda:
            wd = self._cpu_decoded(w, dt)
            if wd is not None:
                return self._mm(x, wd, dt)
        out = torch.empty((T, w.n_out), dtype=torch.float32, device=x.device)
        rows = max(1, CHUNK_BYTES // (4 * w.n_in))
        for n0 in range(0, w.n_out, rows):
            n1 = min(w.n_out, n0 + rows)
            wd = decode_range(w, n0, n1).to(dt)
            out[:, n0:n1] = self._mm(x, wd, dt)
        return out

    @staticmethod
    def _mm(x: torch.Tensor, wd: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
        if dt == torch.float32:
            return x @ wd.T
        return (x.to(dt) @ wd.T).to(torch.float32)

    def cpu_mat(self, w: QWeight):
        """The GEMM's form of `w` (cpu_native.CpuMat), cached; None past the byte budget."""
        from .kernels.cpu_native import CpuMat

        key = ("mat", id(w))
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        size = CpuMat.resident_bytes(w)
        if self._cached_bytes + size > CPU_CACHE_BYTES:
            return None
        m = CpuMat.of(w)
        self._cache[key] = m
        self._cached_bytes += m.nbytes
        return m

    def _cpu_gemm(self, w: QWeight, x: torch.Tensor) -> torch.Tensor:
        """x f32 [T, n_in] -> [T, n_out] through the C GEMM; past the cache budget each call
        decodes row chunks (every output is still one whole-row dot in the fixed order)."""
        from .kernels import cpu_native

        m = self.cpu_mat(w)
        if m is not None:
            return cpu_native.gemm(m, x)
        out = torch.empty((x.shape[0], w.n_out), dtype=torch.float32)
        rows = max(1, CHUNK_BYTES // (4 * w.n_in))
        for n0 in range(0, w.n_out, rows):
            n1 = min(w.n_out, n0 + rows)
            part = cpu_native.CpuMat(cpu_native.FMT_F32, decode_range(w, n0, n1).contiguous(), None, n1 - n0, w.n_in)
            cpu_native.gemm(part, x, out=out[:, n0:n1])
        return out

    def _cpu_decoded(self, w: QWeight, dt: torch.dtype) -> torch.Tensor | None:
        key = (id(w), dt)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        size = w.n_out * w.n_in * (4 if dt == torch.float32 else 2)
        if self._cached_bytes + size > CPU_CACHE_BYTES:
            return None
        wd = w.decode().to(dt).contiguous()
        self._cache[key] = wd
        self._cached_bytes += size
        return wd


def decode_range(w: QWeight, n0: int, n1: int) -> torch.Tensor:
    """Decode rows [n0, n1) through row views of the fields (no gather copy)."""
    from .weights import decode_fields

    if not w.fields and w.packed is not None:  # only the decode kernel's layout is resident
        from .kernels.qmatvec_v3 import decode_rows

        return decode_rows(w.packed, None, n0, n1)
    return decode_fields(w.fmt, {k: v[n0:n1] for k, v in w.fields.items()}, w.n_in)
