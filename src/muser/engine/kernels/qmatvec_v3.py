"""Fused dequant + matvec, third design: a device layout built for the decode loop (book ch. 1:
decode streams every weight byte once; the loop must issue few instructions per weight and keep
many bytes in flight). Q4_K, Q5_K, Q6_K and both NVFP4 forms, 1..16 activation rows.

Why a third layout (bench/NOTES.md, "v2 in SASS"): the v2 loop spends ~28 instructions per
weight, most of them cross-thread reductions and layout shuffles through shared memory, because
ggml's byte order puts the two nibbles of a byte in different 32-element sub-blocks.

The layout (`pack`), per 32-element unit u of a row (one K-quant scale slot; Q6_K: two):
* `q`  int32 [N, K/8]: 4 words per unit; nibble e (0..7) of word w (0..3) is element 4e + w of
  the unit. A thread that holds the unit's 16 bytes (one 16-byte load) decodes nibble e of its
  4 words against x[32u + 4e : 32u + 4e + 4] (one 16-byte load of the activations).
* Q5_K `h` int32 [N, K/32]: bit i = the 5th bit of element i of the unit (ggml qh).
* Q6_K `h` int32 [N, K/16]: 2 words per unit; element i's two high bits at 2 (i % 16) of word
  i // 16, so nibble e < 4 reads word 0 and e >= 4 word 1, 8 bits per e.
* `s`  int16 [N, K/32]: Q4_K/Q5_K: sc | m << 8 (the unpacked 6-bit scale and min of book 6.2);
  Q6_K: the two int8 scales of the unit's 16-element halves, low byte first.
* `dd` Q4_K/Q5_K int32 [N, K/256]: d's f16 bits | dmin's f16 bits << 16; Q6_K: d f16 [N, K/256].
Bytes per weight are unchanged (Q4_K 4.5 + 1/32 bits: the scales are bytes, as in the v1/v2
repack); only their order moves.

The decoded weight is ggml's value bit for bit (tested through `dequant_v3`, which runs the same
decoder): Q4_K/Q5_K fma(d1, q, -m1) with d1 = d * sc and m1 = dmin * m each rounded once, where
d1 * q is exact in f32 (11 + 6 + 5 significant bits), so the only rounding is ggml's subtraction
(ggml-quants.c dequantize_row_q4_K: y = d1 * q - m1); Q6_K (d * sc) * (q - 32) with d * sc exact
(dequantize_row_q6_K: y = d * sc[is] * q); NVFP4 kvalues_fp4[q] * d (type 40) and
(e2m1 * e4m3fn) * scale2 (the companion form), each product exact but the last. Integer -> float
by the 0x4B000000 trick (2^23 + q, minus 2^23).

NVFP4 (`q` 4 words per unit, word w holding the E2M1 codes of elements 4e + w, e = 0..7, each
code's 3-bit magnitude index at bits 4e and its sign at bit 8e + 7 (e < 4) or 8(e - 4) + 3;
`s` the unit's two per-16 scale bytes, low byte first; `dd` the companion form's scale2 per
row, f32 [N]; the same 4.5 bits a weight as stored). With that order each half-word is the
selector of one byte permute (PTX prmt) that reads four magnitudes' f16 high bytes from a
two-word table, and the signs are or-ed onto the byte tops in one mask: about 2.5 instructions
a weight to an f32 value (tools/sass_loop.py) against ~9 for shift-and-mask decoding. The
matvec multiplies the exact E2M1 values by the activations, sums each 16-block's four
products of a lane, applies the block's scale to that sum in f32, and scale2 once per output
(the scales in f32 after the exact value products); the dequant kernel forms ggml's decoded
weight.

The matvec does not form the decoded weight (the dequant kernel does; the exact lane's contract
is Gate 2, not ggml's per-weight rounding): it factors each K-quant unit's scale out of its dot,
sum (d1 q - m1) x = d1 sum q x - m1 sum x (Q6_K: d sc sum q x - 32 d sc sum x per 16-element
half), so a weight costs one mask and one fma. The mask leaves the integer code q at bit P of an
int32 (P = 4e for nibbles e <= 4, 4e - 12 above, read from the word shifted right by 12) whose
other bits are 0; read as f32 that is the subnormal q 2^(P - 149), exact, with no float
conversion. The one-row path multiplies each activation by 2^(64 - P) in its loop (exact, once
per activation for all of a thread's rows); the several-row path reads activations `act_prep`
multiplied by the same factor once a call: the fma products are the same real number q x 2^-85,
so they round to the same bits.
Per unit lane, t = sum over the unit's nibbles of those products and xs = sum x, both in nibble
order; then acc = fma(t, d1 2^85, fma(xs, -m1, acc)). Domain: activations below 2^64 in
magnitude (beyond it x 2^64 overflows; a finite model's activations never come near); products
below 2^-41 in magnitude lose low bits to the subnormal range, far under the f32 rounding of any
sum they join.

Each output row keeps J * 4 lane accumulators, reduced once at the end by a fixed pairwise tree:
an order that differs from the reference at the ulp level (the exact lane's contract) and that is
the same for every row count, so a row's bits do not depend on how it was batched (row invariance).

Several activation rows (2..16, `_matvec_rows_kernel`): a program takes BN weight rows and RT = 2
or 4 activation rows (`rows_per_program`, or the tuning table's fourth entry). A thread holds one
8-byte pair of words (2p, 2p + 1) of a unit for each of its weight rows: the chunk's 64 pairs run
along the lanes of two warps, the program's other warps take other weight rows, so a thread has
BN / (num_warps / 2) weight rows and two accumulator lanes of each (per activation row). The
activation pairs a thread multiplies are one 8-byte load per row and nibble, reused by all its
weight rows, and the codes one mask per word and nibble, reused by all RT rows: the activation
bytes a product costs fall with the weight rows a thread holds, the masks with the activation
rows, and the registers hold (weight rows) x (activation rows) x 2 lanes x 2 sums. The row groups
of a weight block are adjacent programs, so L2 serves their re-reads of its bytes. Each lane's
operations are the one-row path's, in its order (bits: the one-row path's for every row; tests
and tools/device_kernels.py hold them equal). `act_prep` runs once a call before it: the
activations multiplied by 2^(64 - P) (the factor the one-row loop applies; same real products,
same roundings) and written in chunk order (one nibble's activations of a chunk's 32 units
contiguous), padded with zeros to whole chunks, and each unit lane's sum of x in the one-row
path's order (Q6_K: per half), which the loop reads instead of adding; the kernel reads both as
int64 pairs.

Reference beside it: `qmatvec.matvec_ref(w, x)`; `unpack` inverts `pack` and `decode` decodes
the packed form with the torch reference decoder.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from ...gguf.types import GgmlType as G
from ..weights import QK, QWeight, decode_fields, index_maps
from . import gdc
from .interpreter import compiled
from .qmatvec import _rows_bucket, check_matvec_args

try:  # Triton is optional on the CPU; the CUDA backend requires it.
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAVE_TRITON = False

FORMATS = (G.Q4_K, G.Q5_K, G.Q6_K, G.NVFP4_E2M1, G.NVFP4)
NVFP4 = (G.NVFP4_E2M1, G.NVFP4)
UNIT = 32
# the FMT constexpr (same codes as weights.FMT_CODE)
_CODE = {G.Q4_K: 5, G.Q5_K: 6, G.Q6_K: 7, G.NVFP4_E2M1: 8, G.NVFP4: 9}
# NVFP4 word layout (module doc): code e of a word is element 4e + w; its 3-bit magnitude index
# sits at bits 4e, its sign at bit 8e + 7 (e < 4) or 8(e - 4) + 3, so
# that the low and high half-words are byte-permute selectors and the signs land on byte tops
_FP4_MAG_SHIFT = torch.tensor([0, 4, 8, 12, 16, 20, 24, 28], dtype=torch.int64)
_FP4_SIGN_SHIFT = torch.tensor([7, 15, 23, 31, 3, 11, 19, 27], dtype=torch.int64)
# the f16 high byte of ggml's kvalues_fp4 magnitudes 0, 1, 2, 3, 4, 6, 8, 12 (the low byte is 0),
# as the two table words of a byte permute
_FP4_F16_HI = (0x42403C00, 0x4A484644)

# Row invariance (DESIGN.md "Exactness contract"): every output is the same f32 sum whatever the
# row bucket, so decode, verify and batched decode give a row the same bits. Each output keeps
# J * 4 accumulator lanes (lane 4j + w takes element 32(cJ + j) + 4e + w of chunk c, nibble e, in
# the order c, e) and they are combined by one fixed pairwise tree (`_lane_tree`). J is therefore
# one constant for every bucket and weight; tuning may change BN, the warps and the pipelining only.
J_UNITS = 32
# (BN rows per program, num_warps, PIPE: check_config) per row bucket; device sweeps override through
# `config`. One chunk moves BN * J_UNITS * 16 bytes of quants per program.
# Several rows (`_matvec_rows_kernel`, module doc): a program takes `rows_per_program` of them
# (or the table's RT), BN / (num_warps / 2) weight rows a thread, and the row groups of a weight
# block run as adjacent programs (L2 serves their re-reads). Registers bound the product
# (activation rows) x (weight rows a thread) (tools/sass_loop.py v3 FMT 16: 4 x 4 compiles to 168
# registers for every format; 4 x 8 to 255, spilling for Q5_K and Q6_K); the device sweep
# (tools/device_kernels.py) picks per shape, and the defaults below serve shapes the tuning table
# does not name.
CONFIGS: dict[int, tuple[int, int, int]] = {
    1: (16, 4, 1),
    2: (8, 4, 0),
    4: (8, 4, 0),
    8: (8, 4, 0),
    16: (8, 4, 0),
}
ROWS_PER_PROGRAM = {G.Q4_K: 4, G.Q5_K: 4, G.Q6_K: 4, G.NVFP4_E2M1: 4, G.NVFP4: 4}


def rows_per_program(fmt: G, rows: int) -> int:
    """Activation rows one program takes in a `rows`-row bucket of weights of type `fmt`."""
    return 1 if rows == 1 else min(rows, ROWS_PER_PROGRAM[fmt])


def supports(fmt: G) -> bool:
    return fmt in FORMATS


@dataclass
class Packed:
    """One weight in the v3 layout (module doc)."""

    name: str
    fmt: G
    n_out: int
    n_in: int
    fields: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return self.fields["q"].device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.fields.values())

    def pointers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        f = self.fields  # absent slots repeat q (never dereferenced)
        return f["q"], f.get("h", f["q"]), f["s"], f.get("dd", f["q"])


def _wrap32(v: torch.Tensor) -> torch.Tensor:
    """int64 holding an unsigned 32-bit pattern -> int32 with the same bits."""
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


def _values(w: QWeight, f: dict[str, torch.Tensor], r: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows of `f`: the 4-bit low parts [r, nb, 256] and the high parts (Q5_K 1 bit, Q6_K 2 bits)
    of every element, as uint8 in element order (weights.index_maps)."""
    nb = w.n_in // QK
    dev = f["d"].device
    mp = {k: torch.from_numpy(v).to(dev) for k, v in index_maps(w.fmt).items()}
    if w.fmt in (G.Q4_K, G.Q5_K):
        lo = (f["qs"].view(r, nb, 128)[:, :, mp["qs_idx"]] >> mp["qs_shift"].to(torch.uint8)) & 0xF
        hi = None
        if w.fmt == G.Q5_K:
            hi = (f["qh"].view(r, nb, 32)[:, :, mp["qh_idx"]] >> mp["qh_bit"].to(torch.uint8)) & 1
        return lo, hi
    lo = (f["ql"].view(r, nb, 128)[:, :, mp["ql_idx"]] >> mp["ql_shift"].to(torch.uint8)) & 0xF
    hi = (f["qh"].view(r, nb, 64)[:, :, mp["qh_idx"]] >> mp["qh_shift"].to(torch.uint8)) & 3
    return lo, hi


def _nvfp4_codes(w: QWeight, f: dict[str, torch.Tensor], r: int) -> torch.Tensor:
    """The 4-bit codes of NVFP4 rows in element order, uint8 [r, n_in] (engine/nvfp4.py layouts)."""
    qs = f["qs"]
    if w.fmt == G.NVFP4_E2M1:  # low nibble = even element
        return torch.stack([qs & 0xF, qs >> 4], -1).view(r, w.n_in)
    q = qs.view(r, w.n_in // 16, 8)  # ggml type 40, per 16: low nibble j, high nibble j + 8
    return torch.cat([q & 0xF, q >> 4], -1).view(r, w.n_in)


def _pack_rows(w: QWeight, f: dict[str, torch.Tensor], r: int) -> dict[str, torch.Tensor]:
    nu = w.n_in // UNIT
    if w.fmt in NVFP4:
        c = _nvfp4_codes(w, f, r).view(r, nu, 8, 4).to(torch.int64)  # [r, unit, e, w]
        mag, sgn = _FP4_MAG_SHIFT.to(c.device).view(1, 1, 8, 1), _FP4_SIGN_SHIFT.to(c.device).view(1, 1, 8, 1)
        word = (((c & 7) << mag) | ((c >> 3) << sgn)).sum(2)  # the bit positions are disjoint
        sb = f["sc" if w.fmt == G.NVFP4_E2M1 else "d"].view(r, nu, 2).to(torch.int64)  # per-16 scale bytes
        out = {"q": _wrap32(word).view(r, nu * 4), "s": _wrap16(sb[:, :, 0] | (sb[:, :, 1] << 8))}
        if w.fmt == G.NVFP4_E2M1:
            out["dd"] = f["s2"].clone()  # scale2 per row [r] f32
        return out
    lo, hi = _values(w, f, r)
    lo = lo.view(r, nu, 8, 4).to(torch.int64)  # [r, unit, e, w]: element 4e + w of the unit
    sh = (4 * torch.arange(8, device=lo.device, dtype=torch.int64)).view(1, 1, 8, 1)
    out = {"q": _wrap32((lo << sh).sum(2)).view(r, nu * 4)}
    if w.fmt == G.Q5_K:
        b = hi.view(r, nu, 32).to(torch.int64)
        out["h"] = _wrap32((b << torch.arange(32, device=b.device, dtype=torch.int64)).sum(2))
    if w.fmt == G.Q6_K:
        b = hi.view(r, nu, 2, 16).to(torch.int64)
        out["h"] = _wrap32((b << (2 * torch.arange(16, device=b.device, dtype=torch.int64))).sum(3)).view(r, nu * 2)
    if w.fmt in (G.Q4_K, G.Q5_K):
        out["s"] = (f["sc"].to(torch.int32) | (f["m"].to(torch.int32) << 8)).to(torch.int16)
        d = f["d"].view(torch.int16).to(torch.int64) & 0xFFFF
        dm = f["dmin"].view(torch.int16).to(torch.int64) & 0xFFFF
        out["dd"] = _wrap32(d | (dm << 16))
    else:
        sc = f["sc"].view(torch.uint8).view(r, nu, 2).to(torch.int32)
        out["s"] = _wrap32((sc[:, :, 0] | (sc[:, :, 1] << 8)).to(torch.int64)).view(r, nu)
        out["s"] = torch.where(out["s"] >= 2**15, out["s"] - 2**16, out["s"]).to(torch.int16)
        out["dd"] = f["d"].clone()
    return out


def pack(w: QWeight, chunk_elems: int = 1 << 26) -> Packed:
    """QWeight (weights.repack layout) -> Packed, on the weight's device, in row chunks of at most
    `chunk_elems` elements (bounded temporaries for the 1.3 G-element LM head)."""
    if not supports(w.fmt):
        raise ValueError(f"matvec_v3: no v3 layout for {w.fmt.name}")
    rows = max(1, chunk_elems // w.n_in)
    parts: list[dict[str, torch.Tensor]] = []
    for n0 in range(0, w.n_out, rows):
        n1 = min(w.n_out, n0 + rows)
        parts.append(_pack_rows(w, {k: v[n0:n1] for k, v in w.fields.items()}, n1 - n0))
    f = {k: torch.cat([p[k] for p in parts], 0).contiguous() for k in parts[0]}
    return Packed(w.name, w.fmt, w.n_out, w.n_in, f)


def unpack(p: Packed) -> dict[str, torch.Tensor]:
    """Packed -> the weights.repack fields (the inverse of `pack`; tests hold it exact)."""
    r, nu, nb = p.n_out, p.n_in // UNIT, p.n_in // QK
    f = p.fields
    q = f["q"].view(r, nu, 4).to(torch.int64) & 0xFFFFFFFF
    sh = (4 * torch.arange(8, device=q.device, dtype=torch.int64)).view(1, 1, 8, 1)
    if p.fmt in NVFP4:
        qe = q.unsqueeze(2)  # [r, unit, 1, w]
        mag, sgn = _FP4_MAG_SHIFT.to(q.device).view(1, 1, 8, 1), _FP4_SIGN_SHIFT.to(q.device).view(1, 1, 8, 1)
        codes = (((qe >> mag) & 7) | (((qe >> sgn) & 1) << 3)).to(torch.uint8).view(r, p.n_in)  # element order
        s = f["s"].to(torch.int64) & 0xFFFF
        sb = torch.stack([s & 0xFF, s >> 8], -1).to(torch.uint8).view(r, p.n_in // 16)
        if p.fmt == G.NVFP4_E2M1:
            c = codes.view(r, p.n_in // 2, 2)
            return {"qs": c[:, :, 0] | (c[:, :, 1] << 4), "sc": sb, "s2": f["dd"].clone()}
        c = codes.view(r, p.n_in // 16, 2, 8)
        return {"qs": (c[:, :, 0] | (c[:, :, 1] << 4)).view(r, p.n_in // 2), "d": sb}
    lo = ((q.unsqueeze(2) >> sh) & 0xF).view(r, nb, 256)  # element order
    hi = None
    if p.fmt == G.Q5_K:
        hi = (((f["h"].to(torch.int64).unsqueeze(2) & 0xFFFFFFFF) >> torch.arange(32, device=q.device)) & 1).view(r, nb, 256)
    if p.fmt == G.Q6_K:
        hw = f["h"].view(r, nu, 2).to(torch.int64) & 0xFFFFFFFF
        hi = ((hw.unsqueeze(3) >> (2 * torch.arange(16, device=q.device))) & 3).view(r, nb, 256)
    return repacked_fields(p.fmt, lo, hi, f["s"], f["dd"], p.n_in)


def repacked_fields(fmt: G, lo: torch.Tensor, hi: torch.Tensor | None, s: torch.Tensor, dd: torch.Tensor,
                    n_in: int) -> dict[str, torch.Tensor]:
    """K-quant codes in element order (lo: the 4 low bits, hi: Q5_K's 5th bit / Q6_K's 2 high bits;
    int64 [r, nb, 256]) and the packed `s` / `dd` fields (this module's, shared by
    qgemm_split) -> the weights.repack fields."""
    r, nb = lo.shape[0], n_in // QK
    dev = lo.device
    mp = {k: torch.from_numpy(v).to(dev) for k, v in index_maps(fmt).items()}
    sv = s.to(torch.int64) & 0xFFFF
    if fmt in (G.Q4_K, G.Q5_K):
        qs = torch.zeros(r, nb, 128, dtype=torch.int64, device=dev)
        qs.scatter_add_(2, mp["qs_idx"].expand(r, nb, 256), lo << mp["qs_shift"])
        out = {"qs": qs.to(torch.uint8).view(r, nb * 128)}
        if fmt == G.Q5_K:
            assert hi is not None
            qh = torch.zeros(r, nb, 32, dtype=torch.int64, device=dev)
            qh.scatter_add_(2, mp["qh_idx"].expand(r, nb, 256), hi << mp["qh_bit"])
            out["qh"] = qh.to(torch.uint8).view(r, nb * 32)
        out["sc"] = (sv & 0xFF).to(torch.uint8)
        out["m"] = (sv >> 8).to(torch.uint8)
        d2 = dd.to(torch.int64) & 0xFFFFFFFF
        out["d"] = _wrap16(d2 & 0xFFFF).view(torch.float16)
        out["dmin"] = _wrap16(d2 >> 16).view(torch.float16)
        return out
    assert hi is not None
    ql = torch.zeros(r, nb, 128, dtype=torch.int64, device=dev)
    ql.scatter_add_(2, mp["ql_idx"].expand(r, nb, 256), lo << mp["ql_shift"])
    qh = torch.zeros(r, nb, 64, dtype=torch.int64, device=dev)
    qh.scatter_add_(2, mp["qh_idx"].expand(r, nb, 256), hi << mp["qh_shift"])
    sc = torch.stack([sv & 0xFF, sv >> 8], -1).view(r, n_in // 16)
    return {"ql": ql.to(torch.uint8).view(r, nb * 128), "qh": qh.to(torch.uint8).view(r, nb * 64),
            "sc": sc.to(torch.uint8).view(torch.int8), "d": dd.clone()}


def _wrap16(v: torch.Tensor) -> torch.Tensor:
    return torch.where(v >= 2**15, v - 2**16, v).to(torch.int16)


def decode(p: Packed) -> torch.Tensor:
    """f32 [n_out, n_in] by the torch reference decoder (weights.decode_fields) of `unpack(p)`."""
    return decode_fields(p.fmt, unpack(p), p.n_in)


if HAVE_TRITON:
    from .gdc import after_prior
    from .nvfp4 import _e4m3
    from .qmatvec import _lane_tree

    @triton.jit
    def _load_chunk(FMT: tl.constexpr, qp, hp, sp, dp, row, nmask, c, NU, zero, J: tl.constexpr):
        """Raw fields of chunk c (units c*J .. c*J+J-1) of rows `row` [BN]: words [BN, J, 4],
        high bits (Q5_K [BN, J]; Q6_K two [BN, J]; Q4_K zeros), s [BN, J] int32, dd [BN, J].

        Layout steering (Triton's coalescing pass picks each load's thread layout from the
        pointer's contiguity): the words are loaded as [BN, J*4] (contiguous along K, 16-byte
        vectors, a warp along K) and reshaped, and the per-unit fields are offset by `zero` (a
        runtime 0) so they are not vectorized across units; both then land in the same thread
        layout and no shared-memory shuffle is needed inside the loop."""
        u = c * J + tl.arange(0, J)  # [J]
        um = u < NU
        m2 = nmask[:, None] & um[None, :]  # [BN, J]
        kw = c * (J * 4) + tl.arange(0, J * 4)  # word index along the row
        words = tl.load(qp + row[:, None] * (NU * 4) + kw[None, :],
                        mask=nmask[:, None] & (kw < NU * 4)[None, :], other=0)  # [BN, J*4] int32
        words = tl.reshape(words, (row.shape[0], J, 4))  # [BN, J, 4]
        sv = tl.load(sp + row[:, None] * NU + (u + zero)[None, :], mask=m2, other=0).to(tl.int32)  # [BN, J]
        NB = NU // 8
        if FMT >= 8:  # NVFP4: no per-256 field and no high bits (scale2 is applied per output)
            dv = sv * 0
            h0 = dv
            h1 = dv
        else:
            # [J, BN] then transposed: a pointer with no contiguity gets its threads along dim 0, so
            # the transpose puts them along the units, as for `sv` (same per 8 units)
            dv = tl.trans(tl.load(dp + (u // 8 + zero)[:, None] + (row * NB)[None, :], mask=tl.trans(m2), other=0))
            if FMT == 6:
                h0 = tl.load(hp + row[:, None] * NU + (u + zero)[None, :], mask=m2, other=0)
                h1 = h0
            elif FMT == 7:
                # stride-2 pointers: transposed loads, as for `dv`
                h0 = tl.trans(tl.load(hp + (u * 2 + zero)[:, None] + (row * (NU * 2))[None, :], mask=tl.trans(m2),
                                      other=0))
                h1 = tl.trans(tl.load(hp + (u * 2 + 1 + zero)[:, None] + (row * (NU * 2))[None, :],
                                      mask=tl.trans(m2), other=0))
            else:
                h0 = sv * 0
                h1 = h0
        return words, h0, h1, sv, dv

    @triton.jit
    def _scales(FMT: tl.constexpr, sv, dv):
        """Per-(row, unit) factors [BN, J]: Q4_K/Q5_K (d1, -m1); Q6_K (d * sc_lo, d * sc_hi); NVFP4 the
        scales of the unit's two 16-element blocks (companion: E4M3FN x 0.5, the E2M1 values being
        read as ggml's doubled ones; ggml type 40: ue4m3_to_fp32, which already halves)."""
        if FMT >= 8:
            a = _e4m3(sv & 0xFF, FMT == 9)
            b = _e4m3((sv >> 8) & 0xFF, FMT == 9)
            if FMT == 8:
                a = a * 0.5  # exact: an E4M3FN value halved stays normal in f32
                b = b * 0.5
        elif FMT == 7:
            d = dv.to(tl.float32)  # f16 -> f32 exact
            lo = ((sv << 24) >> 24).to(tl.float32)  # signed low byte
            hi = ((sv << 16) >> 24).to(tl.float32)  # signed high byte
            a = d * lo  # ggml: d * sc[is], exact (11 + 8 bits)
            b = d * hi
        else:
            d = (dv & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            dmin = ((dv >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            sc = (sv & 0xFF).to(tl.float32)
            mn = ((sv >> 8) & 0xFF).to(tl.float32)
            a = d * sc  # ggml: d1 = d * sc
            b = -1.0 * (dmin * mn)  # -m1 (ggml: m1 = min * m); -1.0 * keeps the sign of a zero
        return a, b

    @triton.jit
    def _nibble(words, e: tl.constexpr, ASM: tl.constexpr):
        """(words >> 4e) & 0xF | 0x4B000000, int32. ASM: one shift and one lop3 per word
        (LLVM otherwise forms a bit-field extract, which ptxas emits as shift + sign-extend,
        and a separate or: 3 instructions; the interpreter takes the plain expression)."""
        if ASM:
            if e == 0:
                q = tl.inline_asm_elementwise("lop3.b32 $0, $1, 15, 1258291200, 0xEA;", "=r,r", [words],
                                              dtype=tl.int32, is_pure=True, pack=1)
            else:
                q = tl.inline_asm_elementwise(
                    "{ .reg .b32 t; shr.u32 t, $1, $2; lop3.b32 $0, t, 15, 1258291200, 0xEA; }", "=r,r,r",
                    [words, tl.full(words.shape, 4 * e, tl.int32)], dtype=tl.int32, is_pure=True, pack=1)
        else:
            q = ((words >> (4 * e)) & 0xF) | 0x4B000000
        return q

    # NVFP4 codes -> f32 values, eight per word: the magnitudes' f16 high bytes by one byte permute
    # per half-word (PTX prmt; the half-word's nibbles are the selectors), the signs or-ed onto the
    # byte tops, byte pairs spread into f16x2 words (low bytes 0), each half made f32 (exact)
    _FP4_PTX = tl.constexpr("""{
    .reg .b32 ta, tb, s, h, t, p;
    .reg .b16 lo, hi;
    mov.b32 ta, %d;
    mov.b32 tb, %d;
    and.b32 s, $8, 0x7777;
    prmt.b32 h, ta, tb, s;
    and.b32 t, $8, 0x80808080;
    or.b32 h, h, t;
    prmt.b32 p, h, 0, 0x1404;
    mov.b32 {lo, hi}, p;
    cvt.f32.f16 $0, lo;
    cvt.f32.f16 $1, hi;
    prmt.b32 p, h, 0, 0x3424;
    mov.b32 {lo, hi}, p;
    cvt.f32.f16 $2, lo;
    cvt.f32.f16 $3, hi;
    shr.u32 s, $8, 16;
    and.b32 s, s, 0x7777;
    prmt.b32 h, ta, tb, s;
    shl.b32 t, $8, 4;
    and.b32 t, t, 0x80808080;
    or.b32 h, h, t;
    prmt.b32 p, h, 0, 0x1404;
    mov.b32 {lo, hi}, p;
    cvt.f32.f16 $4, lo;
    cvt.f32.f16 $5, hi;
    prmt.b32 p, h, 0, 0x3424;
    mov.b32 {lo, hi}, p;
    cvt.f32.f16 $6, lo;
    cvt.f32.f16 $7, hi;
    }""" % _FP4_F16_HI)

    @triton.jit
    def _fp4_value(words, e: tl.constexpr):
        """Value of code e (plain integer form, for the interpreter): the magnitude from a nibble
        table in one int32 (0xC8643210), made f32 as 2^23 + m - 2^23 (exact), the sign moved onto
        it (code 8 gives -0.0, as the permute path does)."""
        m4 = ((words >> (4 * e)) & 7) * 4
        if e < 4:
            sgn = (words << (24 - 8 * e)) & -2147483648  # sign at bit 8e + 7
        else:
            sgn = (words << (28 - 8 * (e - 4))) & -2147483648  # sign at bit 8(e - 4) + 3
        mag = ((((-932957680) >> m4) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        return (mag.to(tl.int32, bitcast=True) ^ sgn).to(tl.float32, bitcast=True)

    @triton.jit
    def _fp4_values(words, ASM: tl.constexpr):
        """NVFP4 words [BN, J, 4] -> ggml's kvalues_fp4 values (0, 1, 2, 3, 4, 6, 8, 12 with the
        sign) of codes 0..7, eight f32 [BN, J, 4] (element 4e + w of each unit)."""
        if ASM:
            v = tl.inline_asm_elementwise(_FP4_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [words], dtype=(tl.float32,) * 8,
                                          is_pure=True, pack=1)
        else:
            v = (_fp4_value(words, 0), _fp4_value(words, 1), _fp4_value(words, 2), _fp4_value(words, 3),
                 _fp4_value(words, 4), _fp4_value(words, 5), _fp4_value(words, 6), _fp4_value(words, 7))
        return v

    @triton.jit
    def _weights_e(FMT: tl.constexpr, e: tl.constexpr, words, h0, h1, a, b, ASM: tl.constexpr):
        """Decoded K-quant weights of nibble e: f32 [BN, J, 4] (element 4e + w of each unit)."""
        wi = tl.arange(0, 4)
        q = _nibble(words, e, ASM)  # 2^23 + the low 4 bits, as f32 bits
        if FMT == 6:  # 5th bit of element i = 4e + w sits at bit i of h0; move it to bit 4
            if e == 0:
                q = q | ((h0[:, :, None] << (4 - wi)[None, None, :]) & 0x10)
            else:
                q = q | ((h0[:, :, None] >> (4 * e - 4 + wi)[None, None, :]) & 0x10)
        if FMT == 7:  # 2 high bits of element i at 2 (i % 16) of word i // 16; move to bits 4-5
            if e < 4:
                t = (h0 >> (8 * e)) << 4
            else:
                t = (h1 >> (8 * (e - 4))) << 4
            q = q | ((t[:, :, None] >> (2 * wi)[None, None, :]) & 0x30)
            qf = q.to(tl.float32, bitcast=True) - 8388640.0  # exactly q - 32
            if e < 4:
                w = a[:, :, None] * qf  # ggml: y = d * sc[is] * q (d * sc exact)
            else:
                w = b[:, :, None] * qf
        else:
            qf = q.to(tl.float32, bitcast=True) - 8388608.0  # exactly q
            w = tl.fma(a[:, :, None], qf, b[:, :, None])  # d1 * q exact: one rounding, ggml's
        return w

    @triton.jit
    def _code_bits(FMT: tl.constexpr, e: tl.constexpr, words, wsh, h0, h1, wi):
        """The integer code of nibble e (Q4_K 4 bits, Q5_K 5, Q6_K 6 unsigned) left at bit P(e) of
        an int32 whose other bits are 0: read as f32 it is the subnormal code * 2^(P(e) - 149),
        exact, with no float conversion (one and-mask for nibbles 0..4; nibbles 5..7 from
        `wsh` = words >> 12, so that a 6-bit code ends below the exponent field, bit 23).
        P(e) = 4e for e <= 4, 4e - 12 above (`_code_pos`)."""
        return _pair_bits(FMT, e, words, wsh, h0[:, :, None], h1[:, :, None], wi[None, None, :])

    @triton.jit
    def _act_scale(e: tl.constexpr):
        """2^(64 - P(e)), exact in f32: the activation factor that undoes a code's bit position
        (`_code_bits`), so that code * x products land at code * x * 2^-85 (`_UNIT_SCALE` undoes
        it once per unit)."""
        if e == 0:
            f = 18446744073709551616.0  # 2^64
        elif e == 1:
            f = 1152921504606846976.0  # 2^60
        elif e == 2 or e == 5:
            f = 72057594037927936.0  # 2^56
        elif e == 3 or e == 6:
            f = 4503599627370496.0  # 2^52
        else:
            f = 281474976710656.0  # 2^48
        return f

    @triton.jit
    def _unit_factors(FMT: tl.constexpr, e: tl.constexpr, a, b):
        """The factors [BN, J] of a unit's (Q6_K: half-unit's) two sums, t = 2^-85 sum code x and
        xs = sum x. Q4_K/Q5_K: sum (d1 code - m1) x = d1 sum code x - m1 sum x, so (d1 2^85, -m1);
        Q6_K: d sc sum (code - 32) x = d sc sum code x - 32 d sc sum x, so (d sc 2^85, -32 d sc),
        the low half (e < 4) from a, the high half from b. Every factor is exact."""
        if FMT == 7:
            if e < 4:
                s = a
            else:
                s = b
            fa = s * 3.8685626227668134e+25  # 2^85, exact
            fb = s * -32.0  # exact
        else:
            fa = a * 3.8685626227668134e+25
            fb = b
        return fa, fb

    @triton.jit
    def _dequant_v3_kernel(out, qp, hp, sp, dp, N, K, FMT: tl.constexpr, BN: tl.constexpr, J: tl.constexpr,
                           ASM: tl.constexpr):
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        nmask = n < N
        row = n.to(tl.int64)
        c = tl.program_id(1)
        NU = K // 32
        words, h0, h1, sv, dv = _load_chunk(FMT, qp, hp, sp, dp, row, nmask, c, NU, 0, J)
        a, b = _scales(FMT, sv, dv)
        u = c * J + tl.arange(0, J)
        wi = tl.arange(0, 4)
        m3 = nmask[:, None, None] & (u < NU)[None, :, None]
        if FMT == 8:
            s2 = tl.load(dp + row, mask=nmask, other=0.0)  # [BN] scale2 per row
        if FMT >= 8:
            vals = _fp4_values(words, ASM)
        for e in tl.static_range(8):
            if FMT >= 8:  # NVFP4: value * its block's scale, exact (ggml dequantize_row_nvfp4)
                w = vals[e]
                if FMT == 9:  # ggml's kvalues_fp4 has +0 at code 8 (the companion codebook's -0.0 stays)
                    w = tl.where(w == 0.0, 0.0, w)
                if e < 4:
                    w = w * a[:, :, None]
                else:
                    w = w * b[:, :, None]
                if FMT == 8:
                    w = w * s2[:, None, None]  # (e2m1 * e4m3fn) * scale2: one rounding (book 7.2)
            else:
                w = _weights_e(FMT, e, words, h0, h1, a, b, ASM)
            k = (u * 32 + 4 * e)[:, None] + wi[None, :]  # [J, 4]
            tl.store(out + row[:, None, None] * K + k[None, :, :], w, mask=m3)

    @triton.jit
    def _act_prep_kernel(x, xq, xs, sx, NU, NUP, BU: tl.constexpr, J: tl.constexpr, SCALE: tl.constexpr,
                         PDL: tl.constexpr):
        """The several-row path's activations, once per call (row program_id(0), units BU a
        program; NUP = NU rounded up to whole J-unit chunks, the units past NU zero):
        * xq [T, NUP * 32]: x * 2^(64 - P(e)) for element 4e + w of each unit (`_act_scale`:
          exact, the factor the one-row path applies in its loop; SCALE false, NVFP4: x as it
          is), in chunk order: element
          (unit u, nibble e, lane w) at ((u // J) * 8 + e) * 4J + 4 (u % J) + w, so that the 32
          threads of a warp, one unit each, read one nibble's activations as 512 contiguous bytes
          (x itself: 16 bytes at a 128-byte stride, 32 cache lines a load);
        * xs [T, 3, NUP, 4] (SCALE only: the K-quants' factored dot reads them): the one-row path's
          unit sums in its order, x[4*0 + w] + x[4*1 + w] + ... + x[4*7 + w] (nibbles 0..7), then
          the same over nibbles 4h .. 4h + 3 (Q6_K's halves)."""
        after_prior(PDL)  # gdc.py: the previous kernel done before the first read
        r = tl.program_id(0).to(tl.int64)
        u = tl.program_id(1) * BU + tl.arange(0, BU)
        wi = tl.arange(0, 4)
        keep = (u < NUP)[:, None] & (wi < 4)[None, :]
        m = (u < NU)[:, None] & (wi < 4)[None, :]
        src = u[:, None] * 32 + wi[None, :]  # [BU, 4]: element w of nibble 0
        dst = ((u // J) * 8)[:, None] * (4 * J) + ((u % J) * 4)[:, None] + wi[None, :]
        for e in tl.static_range(8):
            xe = tl.load(x + r * sx + src + 4 * e, mask=m, other=0.0)
            if SCALE:
                tl.store(xq + r * (NUP * 32) + dst + e * (4 * J), xe * _act_scale(e), mask=keep)
            else:
                tl.store(xq + r * (NUP * 32) + dst + e * (4 * J), xe, mask=keep)
            if SCALE:
                if e == 0:
                    full = xe
                    half = xe
                else:
                    full = full + xe
                    if e == 4:
                        half = xe
                    else:
                        half = half + xe
                if e == 3:
                    tl.store(xs + (r * 3 + 1) * (NUP * 4) + u[:, None] * 4 + wi[None, :], half, mask=keep)
        if SCALE:
            tl.store(xs + (r * 3 + 2) * (NUP * 4) + u[:, None] * 4 + wi[None, :], half, mask=keep)
            tl.store(xs + (r * 3) * (NUP * 4) + u[:, None] * 4 + wi[None, :], full, mask=keep)

    @triton.jit
    def _row_store(FMT: tl.constexpr, acc, y, dp, row, n, nmask, r, T, sy, BN: tl.constexpr, J: tl.constexpr):
        res = _lane_tree(tl.reshape(acc, (BN, J * 4)), BN, J * 4)  # [BN]
        if FMT == 8:  # the companion form's per-row scale2, once per output
            res = res * tl.load(dp + row, mask=nmask, other=0.0)
        tl.store(y + r * sy + n, res, mask=nmask & (r < T))

    @triton.jit
    def _pair_bits(FMT: tl.constexpr, e: tl.constexpr, words, wsh, h0, h1, wi):
        """The code bits of nibble e (`_code_bits`) from words, wsh, h0, h1 and the word index wi of
        one broadcast shape: the several-row layout (a thread holds one word of a unit per tensor)
        passes them so, the one-row layout with h0, h1 and wi expanded over the unit's words."""
        if e <= 4:
            q = words & (0xF << (4 * e))
            P = 4 * e
        else:
            q = wsh & (0xF << (4 * e - 12))
            P = 4 * e - 12
        if FMT == 6:  # 5th bit of element i = 4e + w at bit i of h0 -> bit P + 4
            if e <= 4:
                q = q | ((h0 << (4 - wi)) & (1 << (P + 4)))
            else:
                q = q | ((h0 >> (8 + wi)) & (1 << (P + 4)))
        if FMT == 7:  # element i's 2 high bits at 2 (i % 16) of word i // 16 -> bits P + 4, P + 5
            if e < 4:
                t = (h0 >> (8 * e)) << (P + 4)
            else:
                t = (h1 >> (8 * (e - 4))) << (P + 4)
            q = q | ((t >> (2 * wi)) & (3 << (P + 4)))
        return q.to(tl.float32, bitcast=True)

    @triton.jit
    def _split_pair(v):
        """int64 holding two adjacent f32 (low word first) -> the two f32."""
        lo = v.to(tl.int32).to(tl.float32, bitcast=True)
        hi = (v >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        return lo, hi

    @triton.jit
    def _pair_e(FMT: tl.constexpr, e: tl.constexpr, vl, vh, xp, tl_, th):
        """One row's nibble-e products: its activations of the thread's two lanes (one int64 load,
        `_act_prep_kernel`'s copy) times the codes, into the lanes' unit sums."""
        v = tl.load(xp)
        xl, xh = _split_pair(tl.reshape(v, (1, v.shape[0], v.shape[1])))
        if e % 4 == 0 if FMT >= 8 else (e == 0 or (FMT == 7 and e == 4)):
            tl_ = vl * xl
            th = vh * xh
        else:
            tl_ = tl.fma(vl, xl, tl_)
            th = tl.fma(vh, xh, th)
        return tl_, th

    @triton.jit
    def _pair_unit(FMT: tl.constexpr, tl_, th, sp, fa, fb, al, ah):
        """A unit's (Q6_K: half-unit's; NVFP4: 16-block's) sums into a row's two lane accumulators:
        the one-row path's acc = fma(t, fa, fma(xs, fb, acc))."""
        if FMT >= 8:
            al = tl.fma(tl_, fa, al)
            ah = tl.fma(th, fa, ah)
        else:
            v = tl.load(sp)
            sl, sh = _split_pair(tl.reshape(v, (1, v.shape[0], v.shape[1])))
            al = tl.fma(tl_, fa, tl.fma(sl, fb, al))
            ah = tl.fma(th, fa, tl.fma(sh, fb, ah))
        return al, ah

    @triton.jit
    def _pair_store(FMT: tl.constexpr, al, ah, y, dp, n, nmask, r, T, sy, BN: tl.constexpr, J: tl.constexpr):
        # lane 4u + w = 2k + half (k = 2u + w // 2): the pair's two halves side by side
        acc = tl.reshape(tl.join(al, ah), (BN, J * 4))
        res = _lane_tree(acc, BN, J * 4)  # [BN]
        if FMT == 8:  # the companion form's per-row scale2, once per output
            res = res * tl.load(dp + n.to(tl.int64), mask=nmask, other=0.0)
        tl.store(y + r * sy + n, res, mask=nmask & (r < T))

    @triton.jit
    def _pairs_chunk(FMT: tl.constexpr, RT: tl.constexpr, MASKED: tl.constexpr, c, qp, hp, sp, dp, row, N, NU, NB,
                     zero, k, lane, wil, wih, zl, x, xsp, sx, ss, d1, d2, d3, a0l, a0h, a1l, a1h, a2l, a2h, a3l, a3h,
                     R: tl.constexpr, WN: tl.constexpr, J: tl.constexpr, ASM: tl.constexpr):
        """Chunk c of `_matvec_rows_kernel` (MASKED: the partial last chunk, its units past NU and
        rows past N masked to zeros; otherwise no load is masked)."""
        u = c * J + k // 2  # [2J]
        if MASKED:  # the row's last, partial chunk: units past NU read as zeros (the one-row path's)
            m2 = (row < N)[:, None] & (u < NU)[None, :]  # [BN, 2J]
        else:  # whole chunks: every load unmasked (rows past N read row N - 1; never stored)
            m2 = None
        pw = tl.load(qp + row[:, None] * (NU * 2) + (c * (2 * J) + k + zero)[None, :], mask=m2, other=0 if MASKED else None)
        pw = tl.reshape(pw, (R, WN, 2 * J))
        wl = pw.to(tl.int32)
        wh = (pw >> 32).to(tl.int32)
        # per-unit fields: the pointer has no contiguity along either dimension, so a load takes
        # its threads along dimension 0; loaded as [2J, BN] and transposed they sit along the
        # pairs, in the words' layout (no shuffle)
        if MASKED:
            mt = tl.trans(m2)
        else:
            mt = None
        sv = tl.trans(tl.load(sp + (u + zero)[:, None] + (row * NU)[None, :], mask=mt, other=0 if MASKED else None))
        sv = tl.reshape(sv.to(tl.int32), (R, WN, 2 * J))
        if FMT >= 8:
            dv = sv * 0
            h0 = dv
            h1 = dv
        else:
            dv = tl.trans(tl.load(dp + (u // 8 + zero)[:, None] + (row * NB)[None, :], mask=mt,
                                  other=0 if MASKED else None))
            dv = tl.reshape(dv, (R, WN, 2 * J))
            if FMT == 6:
                h0 = tl.trans(tl.load(hp + (u + zero)[:, None] + (row * NU)[None, :], mask=mt,
                                      other=0 if MASKED else None))
                h0 = tl.reshape(h0, (R, WN, 2 * J))
                h1 = h0
            elif FMT == 7:
                h0 = tl.trans(tl.load(hp + (u * 2 + zero)[:, None] + (row * (NU * 2))[None, :], mask=mt,
                                      other=0 if MASKED else None))
                h1 = tl.trans(tl.load(hp + (u * 2 + 1 + zero)[:, None] + (row * (NU * 2))[None, :], mask=mt,
                                      other=0 if MASKED else None))
                h0 = tl.reshape(h0, (R, WN, 2 * J))
                h1 = tl.reshape(h1, (R, WN, 2 * J))
            else:
                h0 = sv * 0
                h1 = h0
        a, b = _scales(FMT, sv, dv)
        xb = x + c * (J * 16) + lane  # nibble e's pairs at 2J e
        sb = xsp + c * (J * 2) + lane
        if FMT >= 8:
            vl8 = _fp4_values(wl, ASM)
            vh8 = _fp4_values(wh, ASM)
        else:
            wsl = wl >> 12
            wsh = wh >> 12
        t0l = zl  # placeholders: set at the unit's first nibble
        t0h = zl
        t1l = zl
        t1h = zl
        t2l = zl
        t2h = zl
        t3l = zl
        t3h = zl
        for e in tl.static_range(8):
            if FMT >= 8:
                vl = vl8[e]
                vh = vh8[e]
            else:
                vl = _pair_bits(FMT, e, wl, wsl, h0, h1, wil)
                vh = _pair_bits(FMT, e, wh, wsh, h0, h1, wih)
            xe = xb + e * (2 * J)
            t0l, t0h = _pair_e(FMT, e, vl, vh, xe, t0l, t0h)
            t1l, t1h = _pair_e(FMT, e, vl, vh, xe + d1 * sx, t1l, t1h)
            if RT > 2:
                t2l, t2h = _pair_e(FMT, e, vl, vh, xe + d2 * sx, t2l, t2h)
                t3l, t3h = _pair_e(FMT, e, vl, vh, xe + d3 * sx, t3l, t3h)
            if e == 3 or e == 7:
                if FMT >= 8 or FMT == 7 or e == 7:
                    if FMT >= 8:
                        if e == 3:
                            fa = a
                        else:
                            fa = b
                        fb = fa
                    else:
                        fa, fb = _unit_factors(FMT, e, a, b)
                    if FMT == 7:  # the half's sums
                        sh = sb + (1 + e // 4) * (ss // 3)
                    else:
                        sh = sb
                    a0l, a0h = _pair_unit(FMT, t0l, t0h, sh, fa, fb, a0l, a0h)
                    a1l, a1h = _pair_unit(FMT, t1l, t1h, sh + d1 * ss, fa, fb, a1l, a1h)
                    if RT > 2:
                        a2l, a2h = _pair_unit(FMT, t2l, t2h, sh + d2 * ss, fa, fb, a2l, a2h)
                        a3l, a3h = _pair_unit(FMT, t3l, t3h, sh + d3 * ss, fa, fb, a3l, a3h)
        return a0l, a0h, a1l, a1h, a2l, a2h, a3l, a3h

    @triton.jit(do_not_specialize=["T", "zero"])
    def _matvec_rows_kernel(x, xsp, y, qp, hp, sp, dp, N, K, sx, ss, sy, T, zero, FMT: tl.constexpr,
                            RT: tl.constexpr, BN: tl.constexpr, J: tl.constexpr, STAGES: tl.constexpr,
                            WN: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr):
        """Several activation rows (module doc): a program takes BN weight rows and RT activation
        rows. Tensors are [BN / WN, WN, 2J]: element (i, j, k) is weight row i WN + j and the pair
        k = 2u + p of words 2p, 2p + 1 of the chunk's unit u (one 8-byte load a thread, the two
        words split in registers), so a thread holds two accumulator lanes of each of its weight
        rows and activation rows. x and xsp are `_act_prep_kernel`'s outputs read as int64 pairs
        (row strides sx, ss in pairs), y f32 [T, N]."""
        after_prior(PDL)  # gdc.py
        G = (T + RT - 1) // RT
        pid = tl.program_id(0)
        r0 = (pid % G) * RT
        R: tl.constexpr = BN // WN
        n = (pid // G) * BN + tl.arange(0, BN)
        nmask = n < N
        row = n.to(tl.int64)
        k = tl.arange(0, 2 * J)
        NU = K // 32
        NB = NU // 8
        n_chunks = (NU + J - 1) // J
        wil = tl.reshape(tl.broadcast_to(((k % 2) * 2)[None, :], (BN, 2 * J)), (R, WN, 2 * J))  # low word's index
        wih = wil + 1
        # rows past T read row T - 1 (loads stay unmasked; never stored)
        d1 = tl.minimum(r0 + 1, T - 1) - r0
        d2 = tl.minimum(r0 + 2, T - 1) - r0
        d3 = tl.minimum(r0 + 3, T - 1) - r0
        x = x + r0 * sx
        xsp = xsp + r0 * ss
        zl = tl.zeros([R, WN, 2 * J], dtype=tl.float32)
        a0l = zl
        a0h = zl
        a1l = zl
        a1h = zl
        a2l = zl
        a2h = zl
        a3l = zl
        a3h = zl
        # one copy of a row's activation pairs per warp ([WN, 2J] loads, as the words' [BN, 2J],
        # reshaped to [1, WN, 2J]: the same thread layout); + zero: 8-byte loads, not 16
        lane = (tl.arange(0, WN) * 0)[:, None] + (k + zero)[None, :]
        rowc = tl.minimum(n, N - 1).to(tl.int64)  # whole chunks: rows past N read row N - 1
        n_full = NU // J
        for c in tl.range(0, n_full, num_stages=STAGES):
            a0l, a0h, a1l, a1h, a2l, a2h, a3l, a3h = _pairs_chunk(
                FMT, RT, False, c, qp, hp, sp, dp, rowc, N, NU, NB, zero, k, lane, wil, wih, zl, x, xsp, sx, ss,
                d1, d2, d3, a0l, a0h, a1l, a1h, a2l, a2h, a3l, a3h, R, WN, J, ASM)
        if n_full < n_chunks:
            a0l, a0h, a1l, a1h, a2l, a2h, a3l, a3h = _pairs_chunk(
                FMT, RT, True, n_full, qp, hp, sp, dp, row, N, NU, NB, zero, k, lane, wil, wih, zl, x, xsp, sx, ss,
                d1, d2, d3, a0l, a0h, a1l, a1h, a2l, a2h, a3l, a3h, R, WN, J, ASM)
        _pair_store(FMT, a0l, a0h, y, dp, n, nmask, r0, T, sy, BN, J)
        _pair_store(FMT, a1l, a1h, y, dp, n, nmask, r0 + 1, T, sy, BN, J)
        if RT > 2:
            _pair_store(FMT, a2l, a2h, y, dp, n, nmask, r0 + 2, T, sy, BN, J)
            _pair_store(FMT, a3l, a3h, y, dp, n, nmask, r0 + 3, T, sy, BN, J)

    @triton.jit(do_not_specialize=["zero"])
    def _matvec_v3_kernel(x, y, qp, hp, sp, dp, N, K, zero, FMT: tl.constexpr, BN: tl.constexpr, J: tl.constexpr,
                          PREFETCH: tl.constexpr, STAGES: tl.constexpr, NW: tl.constexpr, ASM: tl.constexpr,
                          PDL: tl.constexpr):
        """One activation row: x f32 [K], y f32 [N]; BN weight rows a program."""
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        nmask = n < N
        row = n.to(tl.int64)
        wi = tl.arange(0, 4)
        NU = K // 32
        n_chunks = (NU + J - 1) // J
        # the accumulator in the words' own thread layout [BN/NW, NW, J, 4] (row = i * NW + warp):
        # the activations are one 16-byte load a thread, used by its BN/NW rows of weights with no
        # shuffle
        acc = tl.zeros([BN // NW, NW, J, 4], dtype=tl.float32)
        if PREFETCH:
            nw, nh0, nh1, nsv, ndv = _load_chunk(FMT, qp, hp, sp, dp, row, nmask, 0, NU, zero, J)
        # PDL (gdc.py): the first chunk's weight loads go out while the previous kernel
        # finishes; the activations are read after it
        after_prior(PDL)
        # STAGES > 1: Triton's pipeliner issues the loads of the next STAGES - 1 chunks as async
        # copies into shared memory (bytes in flight that cost no registers). Measured on the H200
        # it lost 3-5x at one row on every shape
        for c in tl.range(0, n_chunks, num_stages=STAGES):
            if PREFETCH:  # next chunk's loads go out before this chunk's arithmetic
                words, h0, h1, sv, dv = nw, nh0, nh1, nsv, ndv
                nw, nh0, nh1, nsv, ndv = _load_chunk(FMT, qp, hp, sp, dp, row, nmask & (c + 1 < n_chunks),
                                                     c + 1, NU, zero, J)
            else:
                words, h0, h1, sv, dv = _load_chunk(FMT, qp, hp, sp, dp, row, nmask, c, NU, zero, J)
            a, b = _scales(FMT, sv, dv)
            # x as [NW, J*4] (one copy per warp: 16-byte loads in the words' thread layout),
            # reshaped to [1, NW, J, 4]
            kw = c * (J * 4) + tl.arange(0, J * 4)
            xb = x + (tl.arange(0, NW) * 0)[:, None] + ((kw // 4) * 32 + kw % 4)[None, :]  # [NW, J*4]
            xm = (tl.arange(0, NW) < NW)[:, None] & (kw < NU * 4)[None, :]
            if FMT >= 8:  # NVFP4: each 16-block's dot of values, then times its scale (f32)
                vals = _fp4_values(words, ASM)
                for e in tl.static_range(8):
                    v = tl.reshape(vals[e], (BN // NW, NW, J, 4))
                    xe = tl.reshape(tl.load(xb + 4 * e, mask=xm, other=0.0), (1, NW, J, 4))
                    if e % 4 == 0:
                        t = v * xe
                    else:
                        t = tl.fma(v, xe, t)
                    if e == 3:
                        acc = tl.fma(t, tl.reshape(tl.broadcast_to(a[:, :, None], (BN, J, 4)), (BN // NW, NW, J, 4)), acc)
                    if e == 7:
                        acc = tl.fma(t, tl.reshape(tl.broadcast_to(b[:, :, None], (BN, J, 4)), (BN // NW, NW, J, 4)), acc)
            else:  # K-quants: the factored dot (module doc), per unit lane
                wsh = words >> 12
                for e in tl.static_range(8):
                    v = tl.reshape(_code_bits(FMT, e, words, wsh, h0, h1, wi), (BN // NW, NW, J, 4))
                    xe = tl.reshape(tl.load(xb + 4 * e, mask=xm, other=0.0), (1, NW, J, 4))
                    xq = xe * _act_scale(e)  # exact: a power of two
                    if e == 0 or (FMT == 7 and e == 4):
                        t = v * xq
                        xs = xe
                    else:
                        t = tl.fma(v, xq, t)
                        xs = xs + xe
                    if (FMT == 7 and e == 3) or e == 7:
                        fa, fb = _unit_factors(FMT, e, a, b)  # [BN, J]
                        fa = tl.reshape(tl.broadcast_to(fa[:, :, None], (BN, J, 4)), (BN // NW, NW, J, 4))
                        fb = tl.reshape(tl.broadcast_to(fb[:, :, None], (BN, J, 4)), (BN // NW, NW, J, 4))
                        acc = tl.fma(t, fa, tl.fma(xs, fb, acc))
        # the J * 4 lanes of each output by one fixed tree, whatever the row count (row invariance)
        _row_store(FMT, acc, y, dp, row, n, nmask, 0, 1, 0, BN, J)


ACT_PREP_UNITS = 64  # units a program of the activation prep takes


def act_prep(x: torch.Tensor, scale: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [T, K] f32 -> (xq [T, NUP * 32], xs [T, 3, NUP, 4] or None), NUP = K/32 rounded up to
    whole J_UNITS chunks: `_act_prep_kernel`'s chunk-ordered activations and, with `scale` (the
    K-quants), their pre-scaling and the unit sums; without it (NVFP4, whose loop reads no sums)
    the values only, and xs None. Read by the several-row path."""
    T, K = x.shape
    nu = K // UNIT
    nup = -(-nu // J_UNITS) * J_UNITS
    xq = torch.empty((T, nup * UNIT), dtype=torch.float32, device=x.device)
    xs = torch.empty((T, 3, nup, 4), dtype=torch.float32, device=x.device) if scale else None
    _act_prep_kernel[(T, triton.cdiv(nup, ACT_PREP_UNITS))](x, xq, xq if xs is None else xs, x.stride(0), nu, nup,
                                                            BU=ACT_PREP_UNITS, J=J_UNITS, SCALE=scale,
                                                            enable_fp_fusion=False, **gdc.kwargs(x))
    return xq, xs


def dequant_v3(p: Packed, bn: int = 4, j: int = 8) -> torch.Tensor:
    """The v3 in-kernel decoder over the whole weight: f32 [n_out, n_in] (tests hold it
    bit-exact with the reference decoder)."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed")
    out = torch.empty((p.n_out, p.n_in), dtype=torch.float32, device=p.device)
    grid = (triton.cdiv(p.n_out, bn), triton.cdiv(p.n_in // UNIT, j))
    _dequant_v3_kernel[grid](out, *p.pointers(), p.n_out, p.n_in, FMT=_CODE[p.fmt], BN=bn, J=j,
                             ASM=compiled(), enable_fp_fusion=False)
    return out


def decode_rows(p: Packed, rows: torch.Tensor | None = None, n0: int = 0, n1: int | None = None) -> torch.Tensor:
    """f32 [r, n_in] of rows `rows` (int64 tensor) or of the row range [n0, n1), bit-exact:
    the Triton decoder on CUDA, the torch reference decoder elsewhere."""
    from .qgemm_split import SplitPacked

    if isinstance(p, SplitPacked):  # the split GEMM's layout decodes through its own unpack
        from .qgemm_split import decode as decode_split

        return decode_split(p, n0, n1, rows)
    n1 = p.n_out if n1 is None else n1
    if rows is not None:
        f = {k: v.index_select(0, rows) for k, v in p.fields.items()}
        r = int(rows.shape[0])
    else:
        f = {k: v[n0:n1] for k, v in p.fields.items()}
        r = n1 - n0
    sub = Packed(p.name, p.fmt, r, p.n_in, f)
    if sub.device.type == "cuda" and HAVE_TRITON:
        return dequant_v3(sub, bn=4, j=8)
    return decode(sub)


def pack_matrices(ws, drop_fields: bool) -> None:
    """Attach the v3 layout to every weight of a supported format (in place); with
    `drop_fields`, free the repacked fields so only the packed copy stays resident."""
    for w in ws:
        if supports(w.fmt) and w.packed is None:
            w.packed = pack(w)
            if drop_fields and "isi" not in w.fields:  # W4A4 verify rows read the repacked fields
                w.fields = {}


@dataclass
class Stack:
    """Weights that read the same input, packed as one matrix (rows stacked in order): one
    launch instead of several, and enough rows to fill the GPU for the 256-row K/V
    projections. Each member's `packed` becomes a row view of the stack (no second copy).
    Every output is the same dot product as its own matrix's (rows are independent)."""

    packed: Packed
    bounds: tuple[tuple[int, int], ...]  # [n0, n1) of each member

    def split(self, y: torch.Tensor) -> list[torch.Tensor]:
        """y [T, sum n_out] -> the members' outputs [T, n_out_i] (column views)."""
        return [y[:, a:b] for a, b in self.bounds]


def stack(ws) -> Stack | None:
    """One Stack over weights that all carry a packed layout of one format and row length;
    None when they do not."""
    if not ws or any(w.packed is None for w in ws):
        return None
    f0 = ws[0].packed
    if any(w.packed.fmt != f0.fmt or w.packed.n_in != f0.n_in or type(w.packed) is not type(f0) for w in ws):
        return None
    fields = {k: torch.cat([w.packed.fields[k] for w in ws], 0).contiguous() for k in f0.fields}
    n, bounds = 0, []
    for w in ws:
        bounds.append((n, n + w.n_out))
        n += w.n_out
    kind = type(f0)  # the layout's class (this module's Packed or qgemm_split.SplitPacked)
    sp = kind("+".join(w.name for w in ws), f0.fmt, n, f0.n_in, fields)
    for w, (a, b) in zip(ws, bounds):
        w.packed = kind(w.name, f0.fmt, b - a, f0.n_in, {k: v[a:b] for k, v in fields.items()})
    return Stack(sp, tuple(bounds))


# Measured winners of the device sweep per (format, rows bucket, n_out, n_in) (tools/device_kernels.py
# writes v3_tuning.json; `load_tuning` reads one); other shapes use CONFIGS.
TUNED: dict[tuple[str, int, int, int], tuple[int, int, int, int]] = {}


def check_config(config, rows: int) -> tuple[int, int, int, int]:
    """(BN, num_warps, PIPE, RT) for a row bucket, or ValueError naming it (tl.arange extents are
    powers of two; BN a multiple of num_warps: each warp's weight rows in the one-row layout).
    PIPE: 0 a plain chunk loop, 1 the next chunk's loads held in registers (prefetch; the one-row
    loop only), 2..4 that many pipeline stages through shared memory (the loop's loads as async
    copies); false/true in a table read as 0/1. RT, the activation rows a program takes, may
    follow for several rows (2 or 4); absent, `ROWS_PER_PROGRAM`'s (0 stands for that default)."""
    vals = [int(v) for v in config]
    if len(vals) not in (3, 4):
        raise ValueError(f"config {list(config)!r} for the {rows}-row bucket: expected [BN, num_warps, PIPE(, RT)]")
    bn, nw, pipe = vals[:3]
    rt = vals[3] if len(vals) == 4 else 0
    pow2 = all(v > 0 and v & (v - 1) == 0 for v in (bn, nw))
    bad_rt = rt not in ((0,) if rows == 1 else (0, 2, 4))
    if not pow2 or rows not in CONFIGS or bn % nw or not 0 <= pipe <= 4 or (pipe == 1 and rows > 1) or bad_rt:
        raise ValueError(f"config {list(config)!r} for the {rows}-row bucket")
    return bn, nw, pipe, rt


def load_tuning(path: str) -> int:
    """Merge a v3_tuning.json (list of {fmt, rows, n_out, n_in, config: [BN, num_warps, PIPE(, RT)]})
    into TUNED; returns the number of entries. Every entry is checked before any is taken; an
    entry naming a "path" other than "matvec" is refused (the matvec is the only kernel a table
    tunes)."""
    import json

    from ...errors import LaneError

    try:
        entries = json.loads(open(path).read())
        parsed = []
        for e in entries:
            key = (str(e["fmt"]), int(e["rows"]), int(e["n_out"]), int(e["n_in"]))
            route = e.get("path", "matvec")
            if route != "matvec":
                raise ValueError(f"path {route!r} for {key}: only 'matvec' is tuned")
            parsed.append((key, check_config(e["config"], key[1])))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise LaneError(f"v3 tuning file {path!r}: {err}") from None
    TUNED.update(parsed)  # all or nothing
    return len(parsed)


# The shipped table: the winners of the CUDA-graph-timed sweep over the full geometry's launch
# shapes on an H200 (tools/device_kernels.py; bench/NOTES.md). Configs change speed only, never
# values: every config sums each output in the same order (J_UNITS, `_lane_tree`).
TUNING_FILE = os.path.join(os.path.dirname(__file__), "v3_tuning.json")
if os.path.isfile(TUNING_FILE):
    load_tuning(TUNING_FILE)


def config_for(p: Packed, rows: int) -> tuple[int, int, int, int]:
    """(BN, num_warps, PIPE, RT) of a weight's `rows`-row bucket: the tuning table's, else CONFIGS'
    (RT 0: `rows_per_program`'s default)."""
    hit = TUNED.get((p.fmt.name, rows, p.n_out, p.n_in))
    if hit is None and rows > 1:  # the several-row buckets share one loop: the 16-row winner
        hit = TUNED.get((p.fmt.name, 16, p.n_out, p.n_in))
    if hit is not None:
        return hit
    bn, nw, pf = CONFIGS[rows]
    if p.n_out < 2048:  # small outputs: fewer rows per program, more programs
        bn = nw
    return bn, nw, pf, 0


def matvec_v3(p: Packed, x: torch.Tensor, out: torch.Tensor | None = None,
              config: tuple | None = None, rt: int | None = None) -> torch.Tensor:
    """x [T, n_in] f32 (T <= 16) -> [T, n_out] f32 over a Packed weight. `config` =
    (BN, num_warps, PIPE(, RT)) and `rt` (rows a program takes: 1, 2 or 4; 1 only for one row)
    override the table (device sweeps); the bits never depend on them."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed")
    out = check_matvec_args(p, x, out)  # the shared contract (n_in, n_out, name: Packed has them)
    T = x.shape[0]
    rows = _rows_bucket(T)
    bn, num_warps, pipe, trt = check_config(config, rows) if config is not None else config_for(p, rows)
    if rt is None:
        rt = trt or rows_per_program(p.fmt, rows)
    rt = int(rt)
    if rt not in (1, 2, 4) or (rt == 1) != (rows == 1):
        raise ValueError(f"rows per program {rt} for the {rows}-row bucket (1 for one row, else 2 or 4)")
    if rt == 1:
        _matvec_v3_kernel[(triton.cdiv(p.n_out, bn),)](x, out, *p.pointers(), p.n_out, p.n_in, 0, FMT=_CODE[p.fmt],
                                                       BN=bn, J=J_UNITS, PREFETCH=pipe == 1, STAGES=max(pipe, 1),
                                                       NW=num_warps, ASM=compiled(), num_warps=num_warps,
                                                       enable_fp_fusion=False, **gdc.kwargs(x))
        return out
    # several rows: chunk-ordered activations (K-quants: pre-scaled) and unit sums, once a call,
    # read by the kernel as pairs of f32 (int64 views; the words too)
    xq, sums = act_prep(x, scale=p.fmt not in NVFP4)
    xp = xq.view(torch.int64)
    sp2 = xp if sums is None else sums.view(torch.int64)
    q, h, s, d = p.pointers()
    wn = max(num_warps // 2, 1)  # warps along the weight rows (two along a chunk's 64 word pairs)
    grid = (triton.cdiv(p.n_out, bn) * triton.cdiv(T, rt),)
    _matvec_rows_kernel[grid](xp, sp2, out, q.view(torch.int64), h, s, d, p.n_out, p.n_in, xp.stride(0),
                              sp2.stride(0) if sums is not None else 0, out.stride(0), T, 0, FMT=_CODE[p.fmt], RT=rt,
                              BN=bn, J=J_UNITS, STAGES=max(pipe, 1), WN=wn, ASM=compiled(), num_warps=num_warps,
                              enable_fp_fusion=False, **gdc.kwargs(x))
    return out


__all__ = ["CONFIGS", "FORMATS", "J_UNITS", "ROWS_PER_PROGRAM", "rows_per_program", "check_config", "HAVE_TRITON", "Packed", "decode", "decode_rows", "dequant_v3", "matvec_v3",
           "pack", "pack_matrices", "Stack", "stack", "config_for", "load_tuning", "supports", "unpack"]
