"""Fused NVFP4 dequant + matvec for 1..16 activation rows over the resident NVFP4 fields of
engine/nvfp4.py (an NVFP4 weight without the decode layout: the engine packs its matrices into
kernels/qmatvec_v3 at load), a dequant-only kernel sharing its tile decoder, and the E4M3 /
UE4M3 scale decoder qmatvec_v3 uses.

The tile decoder builds every E2M1 value, E4M3FN scale and UE4M3 scale exactly in f32 (E2M1 by
selection, E4M3 normals by assembling the f32 bit pattern, subnormals as man * 2^-9), then
forms `(e2m1 * e4m3fn) * scale2` (companion) or `kvalues_fp4[q] * ue4m3_half(d)` (ggml type 40)
with one rounding per product; the launches pass `enable_fp_fusion=False`. The decoded weight
is therefore muser.quant's dequantizer value bit for bit (tests: every code, every byte). The
dot accumulates in f32 in the same structure as kernels/qmatvec.py's matvec (fixed lanes and
tree: row-invariant).

Reference beside it: `matvec_ref(w, x) = x @ w.decode().T` (kernels/qmatvec.py).
"""

from __future__ import annotations

import torch

from ..weights import QWeight
from .qmatvec import HAVE_TRITON, launch_dequant, launch_matvec

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .qmatvec import _lane_tree

    @triton.jit
    def _e2m1_mag(m):
        """|E2M1| for magnitude codes m (0..7), in units of 1 (0, .5, 1, 1.5, 2, 3, 4, 6)."""
        lo = m.to(tl.float32) * 0.5  # codes 0..3: m / 2 exactly
        hi = tl.where(m == 4, 2.0, tl.where(m == 5, 3.0, tl.where(m == 6, 4.0, 6.0)))
        return tl.where(m < 4, lo, hi)

    @triton.jit
    def _with_sign(v, bit):
        """v (>= 0) with the sign bit set where `bit` != 0, by bits (so 0 becomes -0.0)."""
        neg = tl.where(bit != 0, -2147483648, 0)
        return (v.to(tl.int32, bitcast=True) | neg).to(tl.float32, bitcast=True)

    @triton.jit
    def _e4m3(b, UE: tl.constexpr):
        """Scale bytes (int32) -> f32. UE=False: E4M3FN with sign (NaN bytes never reach here:
        refused at load). UE=True: ggml_ue4m3_to_fp32 (bit 7 ignored, 0 and 0x7F -> 0, x0.5)."""
        ex = (b >> 3) & 0xF
        man = b & 0x7
        if UE:
            # (1 + man/8) * 2^(ex-7) * 0.5 = bits ((ex - 8 + 127) << 23) | (man << 20)
            nrm = (((ex + 119) << 23) | (man << 20)).to(tl.float32, bitcast=True)
            sub = man.to(tl.float32) * 0.0009765625  # man * 2^-9 * 0.5
            v = tl.where(ex == 0, sub, nrm)
            v = tl.where((b == 0) | (b == 0x7F), 0.0, v)
        else:
            nrm = (((ex + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
            sub = man.to(tl.float32) * 0.001953125  # man * 2^-9
            v = tl.where(ex == 0, sub, nrm)
            v = _with_sign(v, b & 0x80)  # 0x80 is -0.0
        return v

    @triton.jit
    def _tile_nvfp4(FMT: tl.constexpr, qp, sp, s2p, n, nmask, kb, K):
        """Decode tile kb (256 elements) of rows n [BLOCK_N] -> f32 [BLOCK_N, 256]."""
        e = tl.arange(0, 256)
        row = n.to(tl.int64)
        k = kb * 256 + e
        m2 = nmask[:, None] & (k[None, :] < K)
        if FMT == 8:  # companion: qs [N, K/2] (low nibble = even k), sc [N, K/16], s2 [N]
            b = tl.load(qp + row[:, None] * (K // 2) + (k // 2)[None, :], mask=m2, other=0).to(tl.int32)
            code = (b >> (4 * (k % 2))[None, :]) & 0xF
            mag = _e2m1_mag(code & 7)
            ev = _with_sign(mag, code & 8)  # code 8 is -0.0, as the codebook
            sb = tl.load(sp + row[:, None] * (K // 16) + (k // 16)[None, :], mask=m2, other=0).to(tl.int32)
            s2 = tl.load(s2p + row, mask=nmask, other=0.0)
            w = (ev * _e4m3(sb, False)) * s2[:, None]  # (e2m1 * e4m3fn) * scale2, book 7.2
        else:  # ggml type 40: qs [N, K/2] (per 16: low nibble j, high j + 8), d [N, K/16]
            j = k % 16
            byte = (k // 16) * 8 + j % 8
            b = tl.load(qp + row[:, None] * (K // 2) + byte[None, :], mask=m2, other=0).to(tl.int32)
            code = (b >> (4 * (j // 8))[None, :]) & 0xF
            mag = _e2m1_mag(code & 7) * 2.0  # kvalues_fp4: E2M1 doubled (0, 1, 2, 3, 4, 6, 8, 12)
            qv = tl.where((code & 8) != 0, 0.0 - mag, mag)  # int8 table: code 8 is +0
            db = tl.load(sp + row[:, None] * (K // 16) + (k // 16)[None, :], mask=m2, other=0).to(tl.int32)
            w = qv * _e4m3(db, True)  # ggml: kvalues_fp4[q] * ue4m3_to_fp32(d)
        return w

    @triton.jit
    def _dequant_nvfp4_kernel(out, qp, sp, s2p, N, K, FMT: tl.constexpr, BLOCK_N: tl.constexpr):
        pid_n = tl.program_id(0)
        kb = tl.program_id(1)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < N
        w = _tile_nvfp4(FMT, qp, sp, s2p, n, nmask, kb, K)
        k = kb * 256 + tl.arange(0, 256)
        tl.store(out + n.to(tl.int64)[:, None] * K + k[None, :], w, mask=nmask[:, None] & (k[None, :] < K))

    @triton.jit(do_not_specialize=["T"])
    def _matvec_nvfp4_kernel(x, y, qp, sp, s2p, N, K, sx, sy, T,
                             FMT: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
        pid = tl.program_id(0)
        n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < N
        r = tl.arange(0, ROWS)
        rmask = r < T
        acc = tl.zeros([ROWS, BLOCK_N, 256], dtype=tl.float32)  # lanes, as kernels/qmatvec.py
        for kb in range(0, (K + 255) // 256):
            w = _tile_nvfp4(FMT, qp, sp, s2p, n, nmask, kb, K)  # [BLOCK_N, 256]
            k = kb * 256 + tl.arange(0, 256)
            xv = tl.load(x + r[:, None] * sx + k[None, :], mask=rmask[:, None] & (k[None, :] < K), other=0.0)
            acc = tl.fma(w[None, :, :], xv[:, None, :], acc)  # f32
        res = tl.reshape(_lane_tree(tl.reshape(acc, (ROWS * BLOCK_N, 256)), ROWS * BLOCK_N, 256), (ROWS, BLOCK_N))
        tl.store(y + r[:, None] * sy + n[None, :], res, mask=rmask[:, None] & nmask[None, :])


def _ptrs(w: QWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(payload, scale bytes, scale2) in kernel order; ggml's type 40 has no scale2 (the slot
    repeats the payload pointer, never dereferenced)."""
    f = w.fields
    if "sc" in f:
        return f["qs"], f["sc"], f["s2"]
    return f["qs"], f["d"], f["qs"]


def dequant_nvfp4_triton(w: QWeight, block_n: int = 4) -> torch.Tensor:
    """The Triton tile decoder over the whole weight: f32 [n_out, n_in] (tests compare it
    bit-exact with `w.decode()`)."""
    return launch_dequant(_dequant_nvfp4_kernel, _ptrs(w), w, block_n)


def matvec_nvfp4(w: QWeight, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, n_in] f32 (T <= 16, rows contiguous) -> [T, n_out] f32, NVFP4 decoded in-kernel."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed")
    return launch_matvec(_matvec_nvfp4_kernel, _ptrs(w), w, x, out)


__all__ = ["dequant_nvfp4_triton", "matvec_nvfp4"]
