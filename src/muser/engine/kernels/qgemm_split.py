"""Split-activation integer GEMM: the exact lane's one kernel family for K-quant weights on CUDA,
1..N activation rows (decode, verify, batched decode and prefill tiles), row-invariant by
construction.

Arithmetic (the contract; `matmul_ref` is its torch statement, the kernels are bitwise equal to it):
1. `split_act`: per row and 256-element block (one K-quant super-block), amax = max |x| and
   s = amax / A_MAX (IEEE division; A_MAX = 127 * 254^2), A = floor(x / s + 0.5) clamped to
   +-A_MAX (|A| < 2^23, so x / s and A are exact in f32 where they need to be), and A written as
   three balanced base-254 digits A = 254^2 a1 + 254 a2 + a3, each in [-127, 127] (integer
   floor divisions of non-negative operands). x is then s * A to within s / 2 ~ amax * 2^-24:
   the precision of an f32 value of amax, which is what keeps the lane inside Gate 2. The digit
   sums per 16 elements (bsums, int32) serve the K-quants' offsets.
2. Per weight unit (32 elements; Q6_K: 16) and digit p, D_p = sum code * a_p is an integer sum
   (int8 x int8, |D| < 2^18): exact in any order, so tensor-core tiles (int8 `tl.dot`) and
   CUDA-core dp4a give the same value. Within a super-block the K-quant sub-scales are integers
   too: S_p = sum_u sc_u D_pu, M_p = sum_u m_u bsum32_pu (Q4_K/Q5_K; |.| < 2^25), and for Q6_K
   Z_p = sum_h sc_h (D_ph - 32 bsum16_ph) (|Z| < 2^29), all in int32.
3. The digits recombine exactly in f64 (integers < 2^53): Sx = (64516 S_1 + 254 S_2) + S_3, then
   one f32 rounding each. The super-block's term is, in f32, each product rounded once:
   Q4_K/Q5_K  f32(Sx) * (s * d) - f32(Mx) * (s * dmin);   Q6_K  f32(Zx) * (s * d).
4. Terms are summed in f32 in one fixed order: chunks of CHUNK_SB = 4 super-blocks, each chunk
   0.0 + t0 + t1 + t2 + t3 (a super-block past the row's end adds 0.0), and the row's value
   0.0 + chunk0 + chunk1 + ... in chunk order. Kernels launch with enable_fp_fusion=False.
Every output (t, n) depends only on activation row t and weight row n, through exact integers
and then the same f32 steps in the same order, whatever the kernel, tile shape or row count:
a row decoded alone, verified among 16, prefilled in any chunking or stepped beside other
sequences gets the same bits.

The layout (`pack`), per 32-element unit u of a weight row (bytes per weight as stored):
* `q` int32 [N, K/8]: 4 words a unit; word w byte b: low nibble = element 8w + b, high nibble =
  element 8w + 4 + b. So (q & 0x0F0F0F0F) holds the codes of elements 8w..8w+3 as four bytes,
  ((q >> 4) & 0x0F0F0F0F) those of 8w+4..8w+7: one dp4a operand each against four activation
  digits in natural order (group g = element // 4 pairs code group 2w / 2w + 1 with act word g).
* Q5_K `h` int32 [N, K/32]: byte b bit g = the 5th bit of element 4g + b.
* Q6_K `h` int32 [N, K/16]: 2 words a unit; word k byte b bits 2j, 2j+1 = the two high bits of
  element 4(4k + j) + b (so a unit's 16-element halves are words 0-1 and 2-3 of `q`).
* `s` int16 [N, K/32]: Q4_K/Q5_K sc | m << 8 (the unpacked 6-bit scale and min, book 6.2);
  Q6_K the two int8 scales of the unit's halves, low byte first.
* `dd` Q4_K/Q5_K int32 [N, K/256]: d's f16 bits | dmin's f16 bits << 16; Q6_K: d f16 [N, K/256].

Kernels: `_rows_kernel` (CUDA cores, ROWS_MAX rows: dp4a on the packed words, code word w's low
nibbles against activation word 2w and its high nibbles against word 2w + 1) and `_tile_kernel`
(tensor cores, more rows: one super-block an iteration, weights as the dot's M side; the unit
scale folds into the weight operand as two int8 parts whose products stay exact (Q4_K/Q5_K
sc = 8 sh + sl, code * part <= 105; Q5_K's fifth bit a third operand; Q6_K sc (code - 32) + 4096
in 16-bit lanes, 128 H + L), so one int8 `tl.dot` per operand covers the super-block's 256 slots
and gives the same integer S as the unit sums times their scales; narrow calls put the three
digits side by side in the dot's columns). Both end in `_sb_term` and the same chunked sum.
Reference beside them: `matmul_ref` (torch, exact integer sums in f64, the same f32 steps) and
`split_act_ref`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...gguf.types import GgmlType as G
from ..weights import QK, QWeight, decode_fields
from .interpreter import compiled
from .qmatvec_v3 import Packed, _values, _wrap16, _wrap32, repacked_fields

try:  # Triton is optional on the CPU; the CUDA backend requires it.
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAVE_TRITON = False

FORMATS = (G.Q4_K, G.Q5_K, G.Q6_K)
_CODE = {G.Q4_K: 5, G.Q5_K: 6, G.Q6_K: 7}
UNIT = 32
PARTS = 3  # base-254 digits of an activation
BASE = 254
A_MAX = 127 * BASE * BASE  # 8,193,532 < 2^23
CHUNK_SB = 4  # super-blocks per chunk of the fixed f32 order
ROWS_MAX = 1  # rows served by the CUDA-core kernel (one: 109.2 us against the tiles' 157.0 on Q4_K 39936 x 6656)
# tile kernel (BM, BN, num_warps, num_stages) per format by rows: <= 2, <= 8, <= 16, wider calls
# (16-row tiles along M); BM <= DIGITS_ON_N_MAX puts the three digits side by side in one dot's
# columns (one dot per operand instead of three: the narrow calls' mma columns are otherwise idle).
# The H200 sweeps' fastest (20261204T132055Z- and 20261204T133441Z-kernels-cuda.json: Q4_K 39936 x
# 6656, Q6_K 6656 x 19968, Q5_K 202048 x 6656; every tiling bitwise equal). In sm_90 SASS
# (tools/sass_loop.py split) only Q6_K's 16-row tile uses local memory; it is still its fastest.
TILE_CONFIGS: dict[G, dict[int, tuple[int, int, int, int]]] = {
    G.Q4_K: {2: (2, 32, 2, 1), 8: (8, 32, 2, 1), 16: (16, 32, 2, 2), 64: (16, 32, 2, 2)},
    G.Q5_K: {2: (2, 32, 2, 1), 8: (8, 32, 2, 1), 16: (16, 32, 2, 2), 64: (16, 32, 2, 2)},
    G.Q6_K: {2: (2, 32, 2, 1), 8: (8, 32, 2, 2), 16: (16, 32, 2, 1), 64: (16, 64, 4, 1)},
}
DIGITS_ON_N_MAX = 8
ROWS_CONFIG = (16, 2)  # (BN, num_warps) of the CUDA-core kernel


def supports(fmt: G) -> bool:
    return fmt in FORMATS


class SplitPacked(Packed):
    """A weight in this module's layout (module doc); a `qmatvec_v3.Packed` in shape, so stacks
    and row views work the same way."""


@dataclass(frozen=True)
class Act:
    """Activations split into base-254 digits: a int8 [T, PARTS, K] (element order), s f32
    [T, K/256], and the sums of the integers A = 254^2 a1 + 254 a2 + a3 per 16 elements (bx16) and
    per unit (bx32), f64 [T, K/16] and [T, K/32] (exact: |sum| < 2^28), which the K-quants'
    offsets read."""

    a: torch.Tensor
    s: torch.Tensor
    bx16: torch.Tensor
    bx32: torch.Tensor

    def rows_slice(self, t0: int, t1: int) -> "Act":
        return Act(self.a[t0:t1], self.s[t0:t1], self.bx16[t0:t1], self.bx32[t0:t1])

    @property
    def rows(self) -> int:
        return int(self.a.shape[0])

    @property
    def n_in(self) -> int:
        return int(self.a.shape[2])


# ---------------------------------------------------------------------------------------------
# layout


def _pack_rows(w: QWeight, f: dict[str, torch.Tensor], r: int) -> dict[str, torch.Tensor]:
    nu = w.n_in // UNIT
    lo, hi = _values(w, f, r)  # element order [r, nb, 256]
    c = lo.view(r, nu, 4, 2, 4).to(torch.int64)  # [r, unit, w, half-byte h, byte b]: element 8w + 4h + b
    dev = c.device
    sh = (4 * torch.arange(2, device=dev).view(2, 1) + 8 * torch.arange(4, device=dev).view(1, 4)).to(torch.int64)
    out = {"q": _wrap32((c << sh).sum((3, 4))).view(r, nu * 4)}
    if w.fmt == G.Q5_K:
        b = hi.view(r, nu, 8, 4).to(torch.int64)  # [r, unit, g, b]
        bit = 8 * torch.arange(4, device=dev).view(1, 4) + torch.arange(8, device=dev).view(8, 1)
        out["h"] = _wrap32((b << bit).sum((2, 3)))
    if w.fmt == G.Q6_K:
        b = hi.view(r, nu, 2, 4, 4).to(torch.int64)  # [r, unit, k, j, b]: element 4(4k + j) + b
        bit = 8 * torch.arange(4, device=dev).view(1, 4) + 2 * torch.arange(4, device=dev).view(4, 1)
        out["h"] = _wrap32((b << bit).sum((3, 4))).view(r, nu * 2)
    if w.fmt in (G.Q4_K, G.Q5_K):
        out["s"] = (f["sc"].to(torch.int32) | (f["m"].to(torch.int32) << 8)).to(torch.int16)
        d = f["d"].view(torch.int16).to(torch.int64) & 0xFFFF
        dm = f["dmin"].view(torch.int16).to(torch.int64) & 0xFFFF
        out["dd"] = _wrap32(d | (dm << 16))
    else:
        sc = f["sc"].view(torch.uint8).view(r, nu, 2).to(torch.int64)
        out["s"] = _wrap16(sc[:, :, 0] | (sc[:, :, 1] << 8))
        out["dd"] = f["d"].clone()
    return out


def pack(w: QWeight, chunk_elems: int = 1 << 26) -> SplitPacked:
    """QWeight (weights.repack layout) -> SplitPacked on the weight's device, in row chunks of at
    most `chunk_elems` elements."""
    if not supports(w.fmt):
        raise ValueError(f"split GEMM: no layout for {w.fmt.name}")
    rows = max(1, chunk_elems // w.n_in)
    parts = []
    for n0 in range(0, w.n_out, rows):
        n1 = min(w.n_out, n0 + rows)
        parts.append(_pack_rows(w, {k: v[n0:n1] for k, v in w.fields.items()}, n1 - n0))
    f = {k: torch.cat([p[k] for p in parts], 0).contiguous() for k in parts[0]}
    return SplitPacked(w.name, w.fmt, w.n_out, w.n_in, f)


def codes(p: SplitPacked) -> torch.Tensor:
    """The integer codes in element order, int64 [N, K] (Q5_K/Q6_K with their high bits)."""
    r, nu = p.n_out, p.n_in // UNIT
    dev = p.fields["q"].device
    q = p.fields["q"].view(r, nu, 4, 1, 1).to(torch.int64) & 0xFFFFFFFF
    sh = (4 * torch.arange(2, device=dev).view(2, 1) + 8 * torch.arange(4, device=dev).view(1, 4)).to(torch.int64)
    c = ((q >> sh) & 0xF).view(r, nu, 32)
    if p.fmt == G.Q5_K:
        h = p.fields["h"].view(r, nu, 1, 1).to(torch.int64) & 0xFFFFFFFF
        bit = 8 * torch.arange(4, device=dev).view(1, 4) + torch.arange(8, device=dev).view(8, 1)
        c = c | (((h >> bit) & 1) << 4).view(r, nu, 32)
    if p.fmt == G.Q6_K:
        h = p.fields["h"].view(r, nu, 2, 1, 1).to(torch.int64) & 0xFFFFFFFF
        bit = 8 * torch.arange(4, device=dev).view(1, 4) + 2 * torch.arange(4, device=dev).view(4, 1)
        c = c | (((h >> bit) & 3) << 4).view(r, nu, 32)
    return c.view(r, p.n_in)


def unpack(p: SplitPacked) -> dict[str, torch.Tensor]:
    """SplitPacked -> the weights.repack fields (the inverse of `pack`; tests hold it exact)."""
    r, nb = p.n_out, p.n_in // QK
    c = codes(p).view(r, nb, 256)
    hi = c >> 4 if p.fmt != G.Q4_K else None
    return repacked_fields(p.fmt, c & 0xF, hi, p.fields["s"], p.fields["dd"], p.n_in)


def decode(p: SplitPacked, n0: int = 0, n1: int | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
    """f32 [r, n_in] of rows [n0, n1) (or the int64 `rows`), ggml's decoded values bit for bit
    (the torch reference decoder over `unpack`)."""
    n1 = p.n_out if n1 is None else n1
    if rows is not None:
        f = {k: v.index_select(0, rows) for k, v in p.fields.items()}
    else:
        f = {k: v[n0:n1] for k, v in p.fields.items()}
    sub = SplitPacked(p.name, p.fmt, int(next(iter(f.values())).shape[0]), p.n_in, f)
    return decode_fields(p.fmt, unpack(sub), p.n_in)


# ---------------------------------------------------------------------------------------------
# reference (torch; the contract)


def split_act_ref(x: torch.Tensor) -> Act:
    """x f32 [T, K] (K a multiple of 256) -> Act, by the module doc's step 1."""
    T, K = x.shape
    xb = x.view(T, K // QK, QK)
    amax = xb.abs().amax(-1)  # [T, nb]
    s = amax / A_MAX
    safe = torch.where(amax > 0, s, torch.ones_like(s))
    A = torch.floor(xb / safe[..., None] + 0.5)
    A = torch.where((amax > 0)[..., None], A, torch.zeros_like(A)).clamp(-A_MAX, A_MAX).to(torch.int64)
    u = A + (127 * BASE * BASE + BASE * BASE // 2)  # >= 0
    a1 = torch.div(u, BASE * BASE, rounding_mode="floor") - 127
    r = A - a1 * (BASE * BASE)
    a2 = torch.div(r + (127 * BASE + 127), BASE, rounding_mode="floor") - 127
    a3 = r - a2 * BASE
    a = torch.stack([a1, a2, a3], 1).view(T, PARTS, K)  # [T, P, K] element order
    bx16 = A.view(T, K // 16, 16).sum(-1).to(torch.float64)
    bx32 = A.view(T, K // 32, 32).sum(-1).to(torch.float64)
    return Act(a.to(torch.int8).contiguous(), s.contiguous(), bx16.contiguous(), bx32.contiguous())


def digits(act: Act) -> torch.Tensor:
    """The digits, int64 [T, P, K]."""
    return act.a.to(torch.int64)


def matmul_ref(p: SplitPacked, act: Act) -> torch.Tensor:
    """y f32 [T, N] by the module doc's steps 2-4 (torch; any device)."""
    T, K, N = act.rows, p.n_in, p.n_out
    nu, nb = K // UNIT, K // QK
    dev = act.a.device
    c = codes(p).to(dev).to(torch.float64)  # [N, K]
    ai = digits(act)  # [T, P, K]
    a = ai.to(torch.float64)
    bs16 = ai.view(T, PARTS, K // 16, 16).sum(-1)  # [T, P, K/16] digit sums
    s_field = p.fields["s"].to(dev).to(torch.int64) & 0xFFFF  # [N, nu]
    if p.fmt == G.Q6_K:
        # per 16-element half: D [T, P, N, K/16]
        D = torch.einsum("tphk,nhk->tpnh", a.view(T, PARTS, K // 16, 16), c.view(N, K // 16, 16)).to(torch.int64)
        sc = torch.stack([s_field & 0xFF, s_field >> 8], -1).view(N, K // 16)
        sc = torch.where(sc >= 128, sc - 256, sc)  # int8
        z = (sc[None, None] * (D - 32 * bs16[:, :, None, :])).view(T, PARTS, N, nb, 16).sum(-1)
        zx = (z[:, 0] * (BASE * BASE) + z[:, 1] * BASE) + z[:, 2]  # exact (int64)
        d = p.fields["dd"].to(dev).to(torch.float32)  # [N, nb]
        term = zx.to(torch.float64).to(torch.float32) * (act.s[:, None, :] * d[None])
    else:
        D = torch.einsum("tpuk,nuk->tpnu", a.view(T, PARTS, nu, UNIT), c.view(N, nu, UNIT)).to(torch.int64)
        sc, mn = s_field & 0xFF, s_field >> 8  # [N, nu]
        bs32 = ai.view(T, PARTS, nu, 32).sum(-1)  # [T, P, nu]
        S = (sc[None, None] * D).view(T, PARTS, N, nb, 8).sum(-1)
        M = (mn[None, None] * bs32[:, :, None, :]).view(T, PARTS, N, nb, 8).sum(-1)
        sx = (S[:, 0] * (BASE * BASE) + S[:, 1] * BASE) + S[:, 2]
        mx = (M[:, 0] * (BASE * BASE) + M[:, 1] * BASE) + M[:, 2]
        dd = p.fields["dd"].to(dev).to(torch.int64) & 0xFFFFFFFF
        d = _wrap16(dd & 0xFFFF).view(torch.float16).to(torch.float32)
        dmin = _wrap16(dd >> 16).view(torch.float16).to(torch.float32)
        sd = act.s[:, None, :] * d[None]
        sm = act.s[:, None, :] * dmin[None]
        term = sx.to(torch.float64).to(torch.float32) * sd - mx.to(torch.float64).to(torch.float32) * sm
    # [T, N, nb] -> the fixed order: chunks of CHUNK_SB super-blocks, then chunks in order
    y = torch.zeros((T, N), dtype=torch.float32, device=dev)
    for c0 in range(0, nb, CHUNK_SB):
        ch = torch.zeros((T, N), dtype=torch.float32, device=dev)
        for i in range(CHUNK_SB):
            ch = ch + (term[:, :, c0 + i] if c0 + i < nb else 0.0)
        y = y + ch
    return y


# ---------------------------------------------------------------------------------------------
# kernels

if HAVE_TRITON:

    @triton.jit
    def _dot4(a, b, c, ASM: tl.constexpr):
        """c + the four signed byte products of a and b (int32): PTX dp4a where compiled, the
        plain byte expression under the interpreter (the same integer)."""
        if ASM:
            r = tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                          dtype=tl.int32, is_pure=True, pack=1)
        else:
            r = c
            for k in tl.static_range(4):
                r += ((a << (24 - 8 * k)) >> 24) * ((b << (24 - 8 * k)) >> 24)
        return r

    @triton.jit
    def _dot4z(a, b, ASM: tl.constexpr):
        """_dot4 with c = 0 (an immediate: no register to clear)."""
        if ASM:
            r = tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, 0;", "=r,r,r", [a, b],
                                          dtype=tl.int32, is_pure=True, pack=1)
        else:
            r = ((a << 24) >> 24) * ((b << 24) >> 24)
            for k in tl.static_range(1, 4):
                r += ((a << (24 - 8 * k)) >> 24) * ((b << (24 - 8 * k)) >> 24)
        return r

    @triton.jit
    def _split_act_kernel(x, a, s, bx16, bx32, K, sx):
        """One program per (row, super-block): step 1 of the module doc."""
        t = tl.program_id(0)
        b = tl.program_id(1)
        e = tl.arange(0, 256)
        k = b * 256 + e
        v = tl.load(x + t * sx + k)  # [256] f32
        amax = tl.max(tl.abs(v), 0)
        sc = tl.div_rn(amax, tl.full((), 8193532.0, tl.float32))
        safe = tl.where(amax > 0, sc, 1.0)
        A = tl.floor(tl.div_rn(v, tl.full((256,), 1.0, tl.float32) * safe) + 0.5)
        A = tl.where(amax > 0, A, 0.0)
        A = tl.minimum(tl.maximum(A, -8193532.0), 8193532.0).to(tl.int32)
        u = A + (127 * 64516 + 32258)
        a1 = u // 64516 - 127
        r = A - a1 * 64516
        a2 = (r + (127 * 254 + 127)) // 254 - 127
        a3 = r - a2 * 254
        NB = K // 256
        tl.store(s + t * NB + b, sc)
        base = a + t * (3 * K) + k
        tl.store(base, a1.to(tl.int8))
        tl.store(base + K, a2.to(tl.int8))
        tl.store(base + 2 * K, a3.to(tl.int8))
        tl.store(bx16 + t * (K // 16) + b * 16 + tl.arange(0, 16), tl.sum(tl.reshape(A, (16, 16)), 1).to(tl.float64))
        tl.store(bx32 + t * (K // 32) + b * 8 + tl.arange(0, 8), tl.sum(tl.reshape(A, (8, 32)), 1).to(tl.float64))

    @triton.jit
    def _sb_term(FMT: tl.constexpr, s0, s1, s2, mx, sa, dd):
        """Step 3 of the module doc. s* int32 per digit (sum of sc x D), mx f64 the offsets' sum
        (Q4_K/Q5_K sum_u m_u bx32_u, Q6_K sum_h sc_h bx16_h: the same integers as the digit-wise
        M, Z), sa the activation scale and dd the weight's per-256 field, all broadcast to the
        result's shape. Every f64 step is exact (integers < 2^53)."""
        sx = (s0.to(tl.float64) * 64516.0 + s1.to(tl.float64) * 254.0) + s2.to(tl.float64)
        if FMT == 7:
            d = dd.to(tl.float32)
            term = (sx - 32.0 * mx).to(tl.float32) * (sa * d)
        else:
            d = (dd & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            dmin = ((dd >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            term = sx.to(tl.float32) * (sa * d) - mx.to(tl.float32) * (sa * dmin)
        return term

    @triton.jit
    def _chunk_sum(term, R: tl.constexpr, BN: tl.constexpr):
        """[R, BN, 4] super-block terms -> 0.0 + t0 + t1 + t2 + t3 (step 4's chunk order)."""
        e, o = tl.split(tl.reshape(term, (R, BN, 2, 2)))  # e: super-blocks 0, 2; o: 1, 3
        t0, t2 = tl.split(e)
        t1, t3 = tl.split(o)
        ch = tl.zeros((R, BN), tl.float32)
        ch = ch + t0
        ch = ch + t1
        ch = ch + t2
        ch = ch + t3
        return ch

    @triton.jit
    def _rows_kernel(ap, sap, b16p, b32p, y, qp, hp, sp, dp, N, K, sy, FMT: tl.constexpr, ROWS: tl.constexpr,
                     BN: tl.constexpr, ASM: tl.constexpr):
        """CUDA-core GEMM for ROWS activation rows; ap: the digits as int32 words [T, 3, K/4]. Each
        program BN weight rows, one chunk (4 super-blocks) an iteration; a thread holds whole units
        ([ROWS, BN, 4 super-blocks, 4 words], the 8 units of a super-block one after another), so a
        super-block's sums stay in its registers: per unit and digit 8 dp4a (low nibbles against
        slots 0..3, high against 4..7) and the scale product; the offsets' f64 sum; then `_sb_term`
        and the fixed chunk order. Loads past the last row or super-block read the last one
        (clamped, no predicates); those super-blocks' terms are zeros (their sa and dd are)."""
        pid = tl.program_id(0)
        n = pid * BN + tl.arange(0, BN)  # [BN]
        nmask = n < N
        nc = tl.minimum(n, N - 1)
        NU = K // 32
        NB = K // 256
        KW = K // 4  # activation words a row and digit
        w4 = tl.arange(0, 4)
        sbi = tl.arange(0, 4)
        r = tl.arange(0, ROWS)  # [R]
        nn = nc[None, :, None, None]
        rr = r[:, None, None, None]
        ww = w4[None, None, None, :]
        hh = tl.arange(0, 2)[None, None, None, None, :]
        total = tl.zeros((ROWS, BN), tl.float32)
        for c in range(0, tl.cdiv(NB, 4)):
            sb = c * 4 + sbi  # [4]
            sbm = sb < NB
            sbc = tl.minimum(sb, NB - 1)
            s0 = tl.zeros((ROWS, BN, 4), tl.int32)
            s1 = s0
            s2 = s0
            mx = tl.zeros((ROWS, BN, 4), tl.float64)
            for uu in tl.static_range(8):
                u3 = sbc * 8 + uu  # [4]
                u = u3[None, None, :, None]  # [1, 1, 4, 1]
                words = tl.load(qp + (nn * NU + u) * 4 + ww)  # [1, BN, 4, 4]
                c0 = words & 0x0F0F0F0F
                c1 = (words >> 4) & 0x0F0F0F0F
                if FMT == 6:
                    h = tl.load(hp + nn * NU + u)  # [1, BN, 4, 1]
                    c0 = c0 | (((h >> (2 * ww)) & 0x01010101) << 4)
                    c1 = c1 | (((h >> (2 * ww + 1)) & 0x01010101) << 4)
                if FMT == 7:
                    hk = tl.load(hp + (nn * NU + u) * 2 + ww // 2)  # word w // 2
                    c0 = c0 | (((hk >> (4 * (ww % 2))) & 0x03030303) << 4)
                    c1 = c1 | (((hk >> (4 * (ww % 2) + 2)) & 0x03030303) << 4)
                cc0 = tl.broadcast_to(c0, (ROWS, BN, 4, 4))
                cc1 = tl.broadcast_to(c1, (ROWS, BN, 4, 4))
                scs = tl.reshape(tl.load(sp + nn * NU + u).to(tl.int32), (1, BN, 4))  # [1, BN, 4]
                roff = r[:, None, None] + nc[None, :, None] * 0  # [R, BN, 1]: a row's per-unit sums
                if FMT == 7:
                    sclo = (scs << 24) >> 24
                    schi = (scs << 16) >> 24
                    b16 = b16p + roff * (K // 16) + (u3 * 2)[None, None, :]
                    mx += sclo.to(tl.float64) * tl.load(b16) + schi.to(tl.float64) * tl.load(b16 + 1)
                else:
                    mx += ((scs >> 8) & 0xFF).to(tl.float64) * tl.load(b32p + roff * NU + u3[None, None, :])
                for p in tl.static_range(3):
                    abase = ap + (rr * 3 + p) * KW + u * 8 + 2 * ww + nn * 0  # [R, BN, 4, 4]
                    alo, ahi = tl.split(tl.load(tl.expand_dims(abase, 4) + hh))  # act words 2w, 2w + 1
                    dw = _dot4(cc1, ahi, _dot4z(cc0, alo, ASM), ASM)
                    if FMT == 7:
                        d_lo, d_hi = tl.split(tl.sum(tl.reshape(dw, (ROWS, BN, 4, 2, 2)), 4))  # words 0-1, 2-3
                        z = sclo * d_lo + schi * d_hi
                    else:
                        z = (scs & 0xFF) * tl.sum(dw, 3)
                    if p == 0:
                        s0 += z
                    elif p == 1:
                        s1 += z
                    else:
                        s2 += z
            dd = tl.load(dp + n[:, None] * NB + sb[None, :], mask=nmask[:, None] & sbm[None, :], other=0)  # [BN, 4]
            sa = tl.load(sap + r[:, None] * NB + sb[None, :], mask=sbm[None, :], other=0.0)  # [R, 4]
            term = _sb_term(FMT, s0, s1, s2, mx, sa[:, None, :], dd[None])  # [R, BN, 4]
            total = total + _chunk_sum(term, ROWS, BN)
        tl.store(y + r[:, None] * sy + n[None, :], total, mask=nmask[None, :])

    @triton.jit
    def _bytes(wd):
        """int32 words [A, B, C, D] -> int8 [A, B, C, D, 4]: byte i of each word at index i (joined in
        one thread, so where compiled the truncations fold into the words' registers)."""
        e0 = wd.to(tl.int8)
        e1 = (wd >> 8).to(tl.int8)
        e2 = (wd >> 16).to(tl.int8)
        e3 = (wd >> 24).to(tl.int8)
        return tl.join(tl.join(e0, e2), tl.join(e1, e3)).reshape(wd.shape[0], wd.shape[1], wd.shape[2], wd.shape[3], 4)

    @triton.jit
    def _digits(acc, BN: tl.constexpr, BM: tl.constexpr):
        """[BN, 4 BM] int32, column 4 m + p -> the three digits' [BN, BM] (column p = 3 dropped)."""
        ev, od = tl.split(tl.reshape(acc, (BN, BM, 2, 2)))  # ev: p = 0, 2; od: p = 1, 3
        d0, d2 = tl.split(ev)
        d1, d3 = tl.split(od)
        return d0, d1, d2

    @triton.jit
    def _dot3(op, a, a1, a2, acc, acc1, acc2, DN: tl.constexpr):
        """acc + op @ a (DN: the digits side by side in a's columns) or, per digit, acc_p + op @ a_p."""
        if DN:
            acc = tl.dot(op, a, acc, out_dtype=tl.int32)
        else:
            acc = tl.dot(op, a, acc, out_dtype=tl.int32)
            acc1 = tl.dot(op, a1, acc1, out_dtype=tl.int32)
            acc2 = tl.dot(op, a2, acc2, out_dtype=tl.int32)
        return acc, acc1, acc2

    @triton.jit
    def _tile_kernel(ap, sap, b16p, b32p, y, qp, hp, sp, dp, T, N, K, sy, FMT: tl.constexpr, BM: tl.constexpr,
                     BN: tl.constexpr, DN: tl.constexpr):
        """Tensor-core GEMM: each program a [BN, BM] tile of outputs (weight rows x activation
        rows), one super-block an iteration. The unit scale folds into the weight operand, so one
        int8 `tl.dot` per operand (DN: the three digits side by side in its columns; else one per
        digit) covers the super-block's 256 slots:
        Q4_K  sc = 8 sh + sl (3-bit parts; code * part <= 105 stays in a byte): S = 8 D(code sh)
              + D(code sl), the same integer as sum_u sc_u D_u (step 2);
        Q5_K  the same over the low 4 bits, + 16 D(high bit * sc);
        Q6_K  v + 4096 = sc_half (code - 32) + 4096 = 128 H + L in 16-bit lanes (each in [32, 8192]);
              S = 128 D(H) + D(L), the 4096 taken off through _sb_term's sx - 32 mx.
        Q4_K/Q5_K offsets: Mx = sum_u m_u bx32_u in f64. Then `_sb_term` and the fixed chunk order.
        Loads are clamped to the last row / super-block (no predicates)."""
        pm = tl.program_id(0)
        pn = tl.program_id(1)
        m = pm * BM + tl.arange(0, BM)
        n = pn * BN + tl.arange(0, BN)
        mmask = m < T
        nmask = n < N
        mc = tl.minimum(m, T - 1)
        nc = tl.minimum(n, N - 1)
        NU = K // 32
        NB = K // 256
        # the operands' element of slot (u, w, h, b) is 32 u + 8 w + 4 h + b (unit u, code word w,
        # nibble half h, byte b): the natural order, in which the digits are stored
        kk = tl.arange(0, 256)
        u3 = tl.arange(0, 8)[None, :, None]  # [1, 8, 1]
        w3 = tl.arange(0, 4)[None, None, :]  # [1, 1, 4]
        h4 = tl.arange(0, 2)[None, None, None, :]  # [1, 1, 1, 2]
        w4 = tl.expand_dims(w3, 3)  # [1, 1, 4, 1]
        nn = nc[:, None, None]
        j4 = tl.arange(0, 4 * BM)
        pj = j4 % 4  # the activation operand's column 4 m + p
        mcj = tl.minimum(pm * BM + j4 // 4, T - 1)
        total = tl.zeros((BN, BM), tl.float32)
        for c in range(0, tl.cdiv(NB, 4)):
            ch = tl.zeros((BN, BM), tl.float32)
            for i in range(0, 4):
                b = c * 4 + i
                bvalid = b < NB
                bc = tl.minimum(b, NB - 1)
                u = bc * 8 + u3
                wv = tl.load(qp + (nn * NU + u) * 4 + w3)  # [BN, 8, 4]
                cw = tl.join(wv & 0x0F0F0F0F, (wv >> 4) & 0x0F0F0F0F)  # [BN, 8, 4, 2]: bytes b of (w, h)
                sv = tl.expand_dims(tl.load(sp + nn * NU + u).to(tl.int32), 3)  # [BN, 8, 1, 1]
                if DN:  # the activation operand [256, 4 BM]: column 4 m + p holds digit p of row m (p = 3: zeros)
                    a0 = tl.load(ap + mcj[None, :] * (3 * K) + pj[None, :] * K + bc * 256 + kk[:, None],
                                 mask=(pj < 3)[None, :], other=0)
                    a1 = a0
                    a2 = a0
                    z = tl.zeros((BN, 4 * BM), tl.int32)
                else:  # one [256, BM] operand per digit
                    arow = ap + mc[None, :] * (3 * K) + bc * 256 + kk[:, None]
                    a0 = tl.load(arow)
                    a1 = tl.load(arow + K)
                    a2 = tl.load(arow + 2 * K)
                    z = tl.zeros((BN, BM), tl.int32)
                # one operand at a time against the digits (fewer live registers)
                if FMT == 7:
                    hk = tl.load(hp + (nn * NU + u) * 2 + tl.arange(0, 2)[None, None, :])  # [BN, 8, 2]: words k
                    hw = tl.reshape(tl.join(hk, hk >> 4), (BN, 8, 4))  # code word w = 2k + j: its bits at 0
                    q = tl.join((wv & 0x0F0F0F0F) | ((hw & 0x03030303) << 4),
                                ((wv >> 4) & 0x0F0F0F0F) | (((hw >> 2) & 0x03030303) << 4))  # [BN, 8, 4, 2]: 6-bit codes
                    s16 = tl.load(sp + nc[:, None] * NU + bc * 8 + tl.arange(0, 8)[None, :]).to(tl.int32)  # [BN, 8]
                    sc2 = tl.join((s16 << 24) >> 24, (s16 << 16) >> 24)  # [BN, 8, 2]: the halves' int8 scales
                    sc = tl.expand_dims(tl.reshape(tl.join(sc2, sc2), (BN, 8, 4)), 3)  # [BN, 8, 4, 1] by word
                    bias = (4096 - 32 * sc) * 0x00010001
                    wa = (q & 0x00FF00FF) * sc + bias
                    wb = ((q >> 8) & 0x00FF00FF) * sc + bias
                    # v + 4096 = 128 H + L: L = v & 127, H = (v >> 7) + 32 in [0, 64], back in byte order
                    op = tl.reshape(_bytes(((wa >> 7) & 0x007F007F) | (((wb >> 7) & 0x007F007F) << 8)), (BN, 256))
                    s0, s1, s2 = _dot3(op, a0, a1, a2, z, z, z, DN)
                    op = tl.reshape(_bytes((wa & 0x007F007F) | ((wb & 0x007F007F) << 8)), (BN, 256))
                    s0, s1, s2 = _dot3(op, a0, a1, a2, s0 * 128, s1 * 128, s2 * 128, DN)
                    # the H offset, 128 * 32 * (the super-block's sum of A), taken off by _sb_term's
                    # sx - 32 mx (exact f64 integers)
                    sa_sum = tl.sum(tl.load(b32p + mc[None, :] * NU + bc * 8 + tl.arange(0, 8)[:, None]), 0)  # [BM]
                    mx = tl.broadcast_to(128.0 * sa_sum[None, :], (BN, BM))
                else:
                    sc = sv & 0xFF
                    op = tl.reshape(_bytes(cw * (sc >> 3)), (BN, 256))
                    s0, s1, s2 = _dot3(op, a0, a1, a2, z, z, z, DN)
                    op = tl.reshape(_bytes(cw * (sc & 7)), (BN, 256))
                    s0, s1, s2 = _dot3(op, a0, a1, a2, s0 * 8, s1 * 8, s2 * 8, DN)
                    if FMT == 6:
                        hv = tl.expand_dims(tl.load(hp + nn * NU + u), 3)  # [BN, 8, 1, 1]
                        op = tl.reshape(_bytes(((hv >> (2 * w4 + h4)) & 0x01010101) * sc), (BN, 256))
                        h0, h1, h2 = _dot3(op, a0, a1, a2, z, z, z, DN)
                        s0 += h0 * 16
                        s1 += h1 * 16
                        s2 += h2 * 16
                    # the offsets' sum Mx = sum_u m_u bx32_u (bx32: the unit's sum of A), exact in f64
                    mx = tl.zeros((BN, BM), tl.float64)
                    for uu in tl.static_range(8):
                        mn = ((tl.load(sp + nc * NU + bc * 8 + uu).to(tl.int32) >> 8) & 0xFF).to(tl.float64)
                        mx = tl.fma(mn[:, None], tl.load(b32p + mc * NU + bc * 8 + uu)[None, :], mx)
                if DN:
                    s0, s1, s2 = _digits(s0, BN, BM)
                dd = tl.load(dp + n * NB + b, mask=nmask & bvalid, other=0)
                sa = tl.load(sap + m * NB + b, mask=mmask & bvalid, other=0.0)
                ch = ch + _sb_term(FMT, s0, s1, s2, mx, sa[None, :], dd[:, None])
            total = total + ch
        tl.store(y + m[None, :] * sy + n[:, None], total, mask=mmask[None, :] & nmask[:, None])


def split_act(x: torch.Tensor) -> Act:
    """x f32 [T, K] -> Act: the Triton kernel on CUDA, the reference elsewhere (bitwise equal)."""
    T, K = x.shape
    if K % QK:
        raise ValueError(f"split GEMM: {K} activation columns is not a multiple of {QK}")
    if x.device.type != "cuda" or not HAVE_TRITON:
        return split_act_ref(x)
    return launch_split_act(x)


def launch_split_act(x: torch.Tensor) -> Act:
    """The Triton launch of `split_act` on x's device (tools/triton_aot_check.py drives it on CPU
    tensors)."""
    T, K = x.shape
    x = x.contiguous()
    a = torch.empty((T, PARTS, K), dtype=torch.int8, device=x.device)
    s = torch.empty((T, K // QK), dtype=torch.float32, device=x.device)
    bx16 = torch.empty((T, K // 16), dtype=torch.float64, device=x.device)
    bx32 = torch.empty((T, K // 32), dtype=torch.float64, device=x.device)
    _split_act_kernel[(T, K // QK)](x, a, s, bx16, bx32, K, x.stride(0), num_warps=4, enable_fp_fusion=False)
    return Act(a, s, bx16, bx32)


def check_rows_config(config) -> tuple[int, int]:
    """(BN, num_warps) of the CUDA-core kernel or ValueError naming it."""
    try:
        bn, nw = (int(v) for v in config)
    except (TypeError, ValueError):
        raise ValueError(f"config {config!r}: expected (BN, num_warps)") from None
    if not all(v > 0 and v & (v - 1) == 0 for v in (bn, nw)) or bn > 256 or nw > 16:
        raise ValueError(f"config {list(config)!r}: BN and num_warps powers of two (BN <= 256, num_warps <= 16)")
    return bn, nw


def check_tile_config(config) -> tuple[int, int, int, int]:
    """(BM, BN, num_warps, num_stages) or ValueError naming it (tl.dot tiles from 16)."""
    try:
        bm, bn, nw, ns = (int(v) for v in config)
    except (TypeError, ValueError):
        raise ValueError(f"config {config!r}: expected (BM, BN, num_warps, num_stages)") from None
    p2 = all(v > 0 and v & (v - 1) == 0 for v in (bm, bn, nw))
    if not (p2 and 2 <= bm <= 64 and 16 <= bn <= 256 and nw <= 16 and 1 <= ns <= 8):
        raise ValueError(f"config {list(config)!r}: BM 2..64, BN 16..256 powers of two, num_warps <= 16, 1..8 stages")
    return bm, bn, nw, ns


def matmul(p: SplitPacked, x: "torch.Tensor | Act", out: torch.Tensor | None = None,
           config: tuple | None = None, rows_kernel: bool | None = None) -> torch.Tensor:
    """(config: the tiles' (BM, BN, num_warps, num_stages), or with the CUDA-core kernel its
    (BN, num_warps).)"""
    """y = x @ W^T, f32 [T, n_out], for x f32 [T, n_in] or its Act. CUDA: `_rows_kernel` for
    T <= ROWS_MAX, tiles above (`rows_kernel` forces either; `config` = (BM, BN, num_warps,
    num_stages) of the tiles); elsewhere `matmul_ref`. The bits never depend on the choice."""
    act = x if isinstance(x, Act) else split_act(x)
    T, K = act.rows, act.n_in
    if K != p.n_in:
        raise ValueError(f"split GEMM: activations have {K} columns, weight {p.name!r} has n_in {p.n_in}")
    dev = act.a.device
    if out is None:
        out = torch.empty((T, p.n_out), dtype=torch.float32, device=dev)
    if dev.type != "cuda" or not HAVE_TRITON:
        out.copy_(matmul_ref(p, act))
        return out
    return launch_matmul(p, act, out, config, rows_kernel)


def launch_matmul(p: SplitPacked, act: Act, out: torch.Tensor, config: tuple | None = None,
                  rows_kernel: bool | None = None) -> torch.Tensor:
    """The Triton launches of `matmul` on the tensors' device (tools/triton_aot_check.py drives
    them on CPU tensors)."""
    T, K = act.rows, act.n_in
    f = p.fields
    ptrs = (f["q"], f.get("h", f["q"]), f["s"], f["dd"])
    if config is not None and rows_kernel is None:
        rows_kernel = len(config) == 2
    use_rows = T <= ROWS_MAX if rows_kernel is None else rows_kernel
    if use_rows:
        bn, nw = ROWS_CONFIG if config is None else check_rows_config(config)
        for t0 in range(0, T, ROWS_MAX):
            t1 = min(T, t0 + ROWS_MAX)
            rows = 1 if t1 - t0 == 1 else 2
            sub = act.rows_slice(t0, t1) if (t0, t1) != (0, T) else act
            o = out[t0:t1]
            _rows_kernel[(triton.cdiv(p.n_out, bn),)](sub.a.view(torch.int32), sub.s, sub.bx16, sub.bx32, o, *ptrs, p.n_out,
                                                      K, o.stride(0),
                                                      FMT=_CODE[p.fmt], ROWS=rows, BN=bn, ASM=compiled(),
                                                      num_warps=nw, enable_fp_fusion=False)
        return out
    tiles = TILE_CONFIGS[p.fmt]
    bucket = next((r for r in sorted(tiles) if T <= r), max(tiles))
    bm, bn, nw, ns = check_tile_config(config) if config is not None else tiles[bucket]
    grid = (triton.cdiv(T, bm), triton.cdiv(p.n_out, bn))  # [M tiles, N tiles]
    dn = bm <= DIGITS_ON_N_MAX
    _tile_kernel[grid](act.a, act.s, act.bx16, act.bx32, out, *ptrs, T, p.n_out, K, out.stride(0), FMT=_CODE[p.fmt],
                       BM=bm, BN=bn, DN=dn, num_warps=nw, num_stages=ns, enable_fp_fusion=False)
    return out


__all__ = ["Act", "FORMATS", "HAVE_TRITON", "PARTS", "SplitPacked", "codes", "decode", "matmul", "matmul_ref",
           "pack", "split_act", "split_act_ref", "supports", "unpack"]
