"""The integer lane's K-quant GEMM on int8 tensor cores with explicit layouts (Triton's gluon):
y = x @ W^T for Q4_K, Q5_K and Q6_K weights, bit for bit `muser.quant.dot.matmul_ggml`, at any
number of activation rows (one row is an 8-row tile with 7 idle rows).

Why a second kernel beside kernels/qmatmul_i8.py (its reference, same contract, interpretable):
there each 32-element sub-block is a `tl.dot` whose weight operand Triton stages through shared
memory with a barrier, so the one-row call ran at 1.2-2x the exact lane's matvec (bench/NOTES.md,
"The integer lane on the H200"). Here the codes are read from the engine's repacked fields
(ggml's own byte order, weights.FIELDS) one 8-byte word per two operand registers and unpacked
in registers straight into the m16n8k32 IMMA fragments: no shared memory, no barrier.

Orientation: weights are the mma's M side (BN weight rows a program, 16 a warp per m-tile) and
activation rows its N side (BM, a multiple of 8), so a decode step wastes 7 of 8 columns of an
n8 tile instead of 15 of 16 rows.

Why ggml's layout already is the operand layout: an m16n8k32 s8 A fragment gives thread l the
operands k = 4t .. +3 and 16 + 4t .. +3 (t = l % 4) of rows l / 4 and l / 4 + 8, and the B fragment
the same k of column l / 4. An integer dot does not depend on which operand k holds which element
as long as both sides agree, so operand k = 16h + 4t + i holds element 8t + 4h + i of the
sub-block: a thread's two registers of a row are the two halves of the sub-block's 8-byte word t,
one 8-byte load (for the activations too). Q4_K/Q5_K keep sub-block 2c in the low nibbles and
2c + 1 in the high nibbles of the same 32 bytes (qs[32c + k]), so one load gives the thread its
registers for both sub-blocks; Q5_K's fifth bit is bit 2c + h of qh[k], the same word position;
Q6_K's 32-element quarter q of half h reads ql[64h + 32(q % 2) + k] (low or high nibble) and bits
2q of qh[32h + k], and its 16-element sub-blocks are t < 2 and t >= 2. Each register is
(word >> s) & 0x0F0F0F0F (| the high bits << 4) in PTX; Q6_K's code - 32 is a SWAR byte
subtraction ((v | 0x80..) - 0x20.. ) ^ 0x80.. (every byte v < 64, so no borrow crosses a byte).

Arithmetic (dot.py's, one fixed float order; the integer steps are exact whatever the tiling):
- Q4_K/Q5_K: isum_j per 32-element sub-block (an IMMA into zeros), sumi = sum_j sc_j isum_j and
  summ = sum_j m_j bsum32_j in int32 (|sumi| < 2^26, |summ| < 2^21). summ is formed on the tensor
  cores: a second IMMA per sub-block against the same activation operand, its weight operand the
  row's 6-bit m_j in every code slot (one byte permute of the m word), accumulating over the
  sub-blocks: sum_j sum_k m_j x_jk is the same integer as sum_j m_j bsum32_j, without a multiply
  per output and sub-block or the bsum32 loads; the block term, in float32,
  f32(sumi) * f32(ad * wd) + f32(summ) * f32(-ad * wmin), each step rounded once.
- Q6_K: per 16-element sub-block one IMMA against the activations with the other half loaded as
  zeros (a masked load; the zeros add nothing), sumi = sum_s sc_s isum_s (|sumi| < 2^28), term
  f32(sumi) * f32(ad * wd).
- The terms are summed in f32 per chunk of dot.CHUNK_ELEMS elements from +0.0 in block order,
  then the chunks from +0.0 in chunk order. Calls of <= SPLIT_ROWS
  rows give each chunk its own program and add the chunk sums with qmatmul_i8's reduce launch.
Launched with enable_fp_fusion=False: no multiply and add contract into an FMA. A one-row launch
takes programmatic dependent launch on sm_90 (gdc.py; `_after_prior` is the kernel's first step).

Gluon has no interpreter: the bits are checked on the GPU against qmatmul_i8 and matmul_ggml
(tools/device_kernels.py; `self_check` when the fast lane is set up on a GPU), the index and
bit identities on the CPU against dot.codes_from_fields (`codes_ref`, the same operations in
numpy), the operand layouts Triton assigns (four consecutive k of one row a register group: one
word) and every launch compiling for sm_90 in the tests.
"""

from __future__ import annotations

import functools
import json
import os
from typing import NamedTuple

import numpy as np
import torch

from ...errors import LaneError
from ...gguf.types import GgmlType as G
from ...quant.dot import CHUNK_ELEMS
from ..weights import FIELDS, QWeight
from . import gdc

try:  # the explicit-layout API ships with Triton >= 3.5; optional like Triton itself
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

    HAVE_GLUON = True
except (ImportError, AssertionError):  # pragma: no cover - absent, or Triton already loaded interpreted
    HAVE_GLUON = False

FORMATS = (G.Q4_K, G.Q5_K, G.Q6_K)
_CODE = {G.Q4_K: 2, G.Q5_K: 3, G.Q6_K: 4}  # qmatmul_i8's FMT numbers
SPLIT_ROWS = 16  # as qmatmul_i8.SPLIT_ROWS: one program per chunk up to this many rows

# (BN weight rows, BM activation rows, num_warps, PF) per row bucket. BM 8 serves decode, 16 verify
# and prefill tiles; BN 16 x warps is one m-tile a warp. Above one row, (128, 16, 4), two m-tiles a
# warp (Q4_K 0.110-0.112 warp-instructions a weight, 254-255 registers), ran 23-33 % faster than
# (64, 16, 4) on every full-geometry shape of the H200's sweeps at 16 and 512 rows (Q4_K 39936 x
# 6656: 144.7 against 201.7 us at 16 rows, 3,311 against 4,959 at 512; bench/receipts/
# 20261205T043516Z-kernels-cuda.json), though a value or two lands in local memory outside the
# block loop. Since the 8-byte loads (64, 16, 4, 0) needs 161 registers and beats it on most shapes
# at 16 rows (Q4_K 39936 x 6656: 107.0 against 117.2 us on an H100, bench/receipts/
# 20261206T061639Z-kernels-cuda.json), which the table routes per shape; BM 32 no longer spills in
# the loop but was slower at 512 rows on every shape. The device sweep overrides through `config`,
# never the bits.
# One row: (32, 8, 2, 1), the next block's weight words in flight during this block's IMMAs (PF),
# one m-tile a warp; with the min sums on the tensor cores (78 registers at PF 0) it ran faster
# than (64, 8, 4, 0) on seven of the eight full-geometry shapes of an H100's sweep (Q4_K 39936 x
# 6656: 67.6 against 77.1 us; the Q5_K LM head the exception, which the table routes),
# bench/receipts/20261205T223814Z-kernels-cuda.json.
CONFIGS: dict[int, tuple[int, int, int, int]] = {8: (32, 8, 2, 1), 16: (128, 16, 4, 0), 64: (128, 16, 4, 0)}


def _bucket(t: int) -> int:
    return 8 if t <= 8 else 16 if t <= 16 else 64


def supports(fmt: G) -> bool:
    return fmt in FORMATS


def available(device: torch.device | str) -> bool:
    """The tile runs here: gluon importable and a CUDA device of compute capability >= 8.0 (mma.sync
    s8.s8.s32 m16n8k32)."""
    dev = torch.device(device)
    return (HAVE_GLUON and dev.type == "cuda" and torch.cuda.is_available()
            and torch.cuda.get_device_capability(dev)[0] >= 8)


def check_config(config) -> tuple[int, int, int, int]:
    """(BN, BM, num_warps, PF) or ValueError naming it: num_warps a power of two to 8, BN a multiple
    of 16 x num_warps up to 256, BM a power of two from 8 to 64, PF 0 or 1 (the next block's
    weight words loaded before this block's IMMAs)."""
    try:
        bn, bm, nw, pf = (int(v) for v in config)
    except (TypeError, ValueError):
        raise ValueError(f"config {config!r}: expected (BN, BM, num_warps, PF)") from None
    if not (nw in (1, 2, 4, 8) and bm in (8, 16, 32, 64) and 16 * nw <= bn <= 256 and bn % (16 * nw) == 0
            and bn & (bn - 1) == 0 and pf in (0, 1)):
        raise ValueError(f"config {list(config)!r}: num_warps 1, 2, 4 or 8; BN a power of two, a multiple of "
                         f"16 x num_warps, <= 256; BM 8, 16, 32 or 64; PF 0 or 1")
    return bn, bm, nw, pf


def check_ring_config(config) -> tuple[int, int, int, int]:
    """(BN, BM, num_warps, S) of the ring variant or ValueError naming it: num_warps 1, 2, 4 or 8, BN
    a power of two, a multiple of 16 x num_warps, <= 128; BM 8, 16 or 32; S (ring slots) 2, 3, 4
    or 6, at most RING_BYTES of shared memory."""
    try:
        bn, bm, nw, s = (int(v) for v in config)
    except (TypeError, ValueError):
        raise ValueError(f"ring config {config!r}: expected (BN, BM, num_warps, S)") from None
    if not (nw in (1, 2, 4, 8) and bm in (8, 16, 32) and 16 * nw <= bn <= 128 and bn % (16 * nw) == 0
            and bn & (bn - 1) == 0 and s in (2, 3, 4, 6) and ring_bytes(bn, bm, s) <= RING_BYTES):
        raise ValueError(f"ring config {list(config)!r}: num_warps 1, 2, 4 or 8; BN a power of two, a multiple "
                         f"of 16 x num_warps, <= 128; BM 8, 16 or 32; S 2, 3, 4 or 6; at most {RING_BYTES} "
                         f"bytes of ring")
    return bn, bm, nw, s


MAX_GROUP = 16
MAX_STREAM = 8


def check_group(group, split) -> int:
    """The ring's chunks a program (1 to MAX_GROUP) or ValueError naming it: more than one only where
    the call splits (`split` as resolved: a walking program already runs over all its chunks)."""
    if isinstance(group, bool) or not isinstance(group, int) or not 1 <= group <= MAX_GROUP:
        raise ValueError(f"ring group {group!r}: expected an int from 1 to {MAX_GROUP} (chunks a program)")
    if group > 1 and not split:
        raise ValueError(f"ring group {group}: a walking program (split false) sums all its chunks; "
                         f"a group needs a split call")
    return group


def check_stream(stream, split, rows: int, bm: int) -> int:
    """The ring's stream-K walk, programs an SM (0: off; 1 to MAX_STREAM) or ValueError naming it:
    only for a walking call (split false) whose rows fit one activation tile (rows <= BM)."""
    if isinstance(stream, bool) or not isinstance(stream, int) or not 0 <= stream <= MAX_STREAM:
        raise ValueError(f"ring stream {stream!r}: expected an int from 0 to {MAX_STREAM} (programs an SM; 0 off)")
    if stream and (split is not False or rows > bm):
        raise ValueError(f"ring stream {stream}: the stream-K walk is a walking call's (split false) of at most "
                         f"BM = {bm} rows (got split {split!r}, rows {rows})")
    return stream


RING_BYTES = 160 * 1024  # a program's ring, within the 227 KB of shared memory sm_90 gives a block


def ring_bytes(bn: int, bm: int, s: int) -> int:
    """Shared memory of a ring of s slots: each a block's 128 code bytes (+ 64 of Q6_K's qh, the
    largest) of bn weight rows and 256 activation codes of bm rows."""
    return s * (bn * (128 + 64) + bm * 256)


def config_for(rows: int) -> tuple[int, int, int, int]:
    return CONFIGS[_bucket(rows)]


class Route(NamedTuple):
    """Where the lane sends a call: `path` "tile" (matmul_tile with `config` and `split`; None:
    its defaults) or "ring" (matmul_ring with `config`, `split`, `group` and `stream`)."""
    path: str
    config: tuple[int, int, int, int] | None = None
    split: bool | None = None
    group: int = 1
    stream: int = 0


# The device sweep's winners per (format, row bucket 8 / 16 / 64, n_out, n_in) (tools/device_kernels.py
# --lane fast writes i8_tuning.json; `load_tuning` reads one); other shapes take the tile's CONFIGS.
# Every route gives the same bits (each ring route is checked against qmatmul_i8 before it serves);
# the table changes speed only.
TUNED: dict[tuple[str, int, int, int], Route] = {}
TUNING_FILE = os.path.join(os.path.dirname(__file__), "i8_tuning.json")


def _parse_route(e: dict) -> tuple[tuple[str, int, int, int], Route]:
    key = (str(e["fmt"]), int(e["rows"]), int(e["n_out"]), int(e["n_in"]))
    fmt = G[key[0]] if key[0] in G.__members__ else None
    if fmt not in FORMATS or key[1] not in CONFIGS or key[2] <= 0 or key[3] <= 0 or key[3] % 256:
        raise ValueError(f"entry {key}: expected a K-quant format the tile serves "
                         f"({', '.join(f.name for f in FORMATS)}), rows 8, 16 or 64 and a 256-multiple row length")
    path, split = e.get("path", "tile"), e.get("split")
    if path == "tile":
        if split is not None and (not isinstance(split, bool) or (split and key[1] > SPLIT_ROWS)):
            raise ValueError(f"entry {key}: split {split!r} (true or false, true only up to {SPLIT_ROWS} rows)")
        return key, Route("tile", check_config(e["config"]), split)
    if path == "ring":
        if split is not None and (not isinstance(split, bool) or (split and key[1] > SPLIT_ROWS)):
            raise ValueError(f"entry {key}: split {split!r} (true or false, true only up to {SPLIT_ROWS} rows)")
        group = e.get("group", 1)
        check_group(group, split if split is not None else key[1] <= SPLIT_ROWS)
        config = check_ring_config(e["config"])
        stream = check_stream(e.get("stream", 0), split, key[1], config[1])
        return key, Route("ring", config, split, group, stream)
    raise ValueError(f"entry {key}: path {path!r} (expected 'tile' or 'ring')")


def load_tuning(path: str) -> int:
    """Merge an i8_tuning.json (a list of {fmt, rows, n_out, n_in, path: "tile" | "ring",
    config, split (tile and ring, optional), group (ring, optional: chunks a split program),
    stream (ring, optional: the stream-K walk's programs an SM)}) into TUNED; returns the number of
    entries. Every entry is checked
    before any is taken (LaneError naming the file and the entry)."""
    try:
        entries = json.loads(open(path).read())
        if not isinstance(entries, list):
            raise ValueError(f"expected a list of entries, got {type(entries).__name__}")
        parsed = [_parse_route(e) for e in entries]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise LaneError(f"int8 tuning file {path!r}: {err}") from None
    TUNED.update(parsed)  # all or nothing
    return len(parsed)


if os.path.isfile(TUNING_FILE):
    load_tuning(TUNING_FILE)


def route(w: QWeight, rows: int) -> Route:
    """The table's route for a `rows`-row call on `w`, else the tile on its defaults."""
    return TUNED.get((G(w.fmt).name, _bucket(rows), w.n_out, w.n_in), Route("tile"))


def matmul(w: QWeight, act, out: torch.Tensor | None = None) -> torch.Tensor:
    """The lane's product through the table's route for this shape and row bucket (`route`): the tile
    or its ring variant on the route's tiling. Every route has the same bits."""
    r = route(w, act.rows)
    if r.path == "ring":
        return matmul_ring(w, act, out, config=r.config, split=r.split, group=r.group, stream=r.stream)
    return matmul_tile(w, act, out, config=r.config, split=r.split)


def ring_routes() -> list[tuple[str, tuple[int, ...], bool | None, int, int]]:
    """The table's distinct (format, ring tiling, split, group, stream) routes (the lane checks each
    at load)."""
    return sorted({(k[0], r.config, r.split, r.group, r.stream) for k, r in TUNED.items()
                   if r.path == "ring" and r.config is not None}, key=repr)


# ---------------------------------------------------------------------------------------------
# numpy model of the operand registers (the PTX below, step for step), for the CPU tests

_LO = 0x0F0F0F0F


def _words(b: np.ndarray) -> np.ndarray:
    """u8 [..., 4n] -> u32 [..., n] little-endian words."""
    return np.ascontiguousarray(b).view(np.uint32)


def _bytes(w: np.ndarray) -> np.ndarray:
    """u32 [..., n] -> the 4n bytes as int8 (the register's four int8 operands)."""
    return np.ascontiguousarray(w).view(np.int8)


def operand_elements() -> np.ndarray:
    """int64 [32]: the sub-block element operand k of an IMMA holds, on both sides (the kernel's
    word indices: 8-byte word t = (k % 16) // 4, its half h = k // 16, byte i = k % 4)."""
    k = np.arange(32)
    return 8 * ((k % 16) // 4) + 4 * (k // 16) + k % 4


def codes_ref(fmt: G, fields: dict[str, np.ndarray], n_in: int) -> np.ndarray:
    """int8 codes [N, n_in // 16 sub-blocks of 16 (Q6_K) or n_in // 32 of 32, element] as the
    kernel's registers hold them (operand k holds element operand_elements()[k]), built by the
    register operations the kernel's PTX performs on the 32-bit words of `fields` (numpy views of
    the repacked fields; a register is one half of an 8-byte load): Q4_K/Q5_K codes 0..31, Q6_K
    code - 32. The tests compare them with dot.codes_from_fields, the contract's codes."""
    fmt = G(fmt)
    nb = n_in // 256
    if fmt in (G.Q4_K, G.Q5_K):
        qs = _words(fields["qs"]).reshape(-1, nb, 4, 8)  # [N, block, chunk c, word k // 4]
        if fmt == G.Q5_K:
            qh = _words(fields["qh"]).reshape(-1, nb, 1, 8)
        subs = []
        for c in range(4):
            for s in range(2):
                r = (qs[:, :, c] >> np.uint32(4 * s)) & np.uint32(_LO)
                if fmt == G.Q5_K:
                    r = r | (((qh[:, :, 0] >> np.uint32(2 * c + s)) & np.uint32(0x01010101)) << np.uint32(4))
                subs.append(r)
        return _bytes(np.stack(subs, 2)).reshape(-1, nb * 8, 32)
    if fmt == G.Q6_K:
        ql = _words(fields["ql"]).reshape(-1, nb, 2, 2, 8)  # [N, block, half h, g, word]
        qh = _words(fields["qh"]).reshape(-1, nb, 2, 8)
        quarters = []
        for h in range(2):
            for q in range(4):
                v = (ql[:, :, h, q % 2] >> np.uint32(4 * (q // 2))) & np.uint32(_LO)
                v = v | (((qh[:, :, h] >> np.uint32(2 * q)) & np.uint32(0x03030303)) << np.uint32(4))
                v = ((v | np.uint32(0x80808080)) - np.uint32(0x20202020)) ^ np.uint32(0x80808080)
                quarters.append(v)
        return _bytes(np.stack(quarters, 2)).reshape(-1, nb * 16, 16)
    raise LaneError(f"qtile_i8: no tile for {fmt.name}")


if HAVE_GLUON:

    @gluon.jit
    def _after_prior(PDL: gl.constexpr):
        """gdc.after_prior for the explicit-layout kernel: wait until the previous kernel has
        finished (its writes visible), then let the next kernel's programs launch."""
        if PDL:
            gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False,
                                      pack=1)
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)

    @gluon.jit
    def _nib(words, sh):
        """int8 operands: byte i = (word >> sh) & 0xF (four codes a register)."""
        return gl.inline_asm_elementwise(
            "{ .reg .b32 t; shr.u32 t, $1, $5; and.b32 $0, t, 0x0F0F0F0F; }",
            "=r,r,r,r,r,r,r,r,r", [words, sh], dtype=gl.int8, is_pure=True, pack=4)

    @gluon.jit
    def _ld_a(ptrs, ok):
        """A weight operand's words: one 8-byte load a thread and row of its m-tile (the words of
        operand k = 4t.. and 16 + 4t.. are the 8-byte word t of a 32-byte segment), each 32-bit
        half repeated over its four k (the register groups _nib reads), 0 where `ok` is 0. pack 16:
        a thread's registers of one m-tile in the A layout's order (row g, k low), (g + 8, low),
        (g, high), (g + 8, high): tests/engine/test_qtile_i8.py holds that order."""
        return gl.inline_asm_elementwise(
            "{ .reg .pred p, q; .reg .b32 a, b, c, d; setp.ne.b32 p, $32, 0; setp.ne.b32 q, $36, 0; "
            "mov.b32 a, 0; mov.b32 b, 0; mov.b32 c, 0; mov.b32 d, 0; "
            "@p ld.global.v2.b32 {a, c}, [$16]; @q ld.global.v2.b32 {b, d}, [$20]; "
            "mov.b32 $0, a; mov.b32 $1, a; mov.b32 $2, a; mov.b32 $3, a; mov.b32 $4, b; mov.b32 $5, b; mov.b32 $6, b; mov.b32 $7, b; mov.b32 $8, c; mov.b32 $9, c; mov.b32 $10, c; mov.b32 $11, c; mov.b32 $12, d; mov.b32 $13, d; mov.b32 $14, d; mov.b32 $15, d; }",
            "=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,l,l,l,l,l,l,l,l,l,l,l,l,l,l,l,l,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r", [ptrs, ok], dtype=gl.int32, is_pure=True, pack=16)

    @gluon.jit
    def _ld_b(ptrs, ok):
        """An activation operand's registers: one 8-byte load a thread and activation row (operand k
        = 4t.. the low half of the sub-block's 8-byte word t, k = 16 + 4t.. its high half), 0 where
        `ok` is 0. pack 8: the B layout's registers (k low, column), (k high, column)."""
        return gl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $10, 0; mov.b32 $0, 0; mov.b32 $1, 0; "
            "@p ld.global.v2.b32 {$0, $1}, [$2]; }",
            "=r,=r,l,l,l,l,l,l,l,l,r,r,r,r,r,r,r,r", [ptrs, ok], dtype=gl.int8, is_pure=True, pack=8)

    @gluon.jit
    def _as_i8(words):
        """int8 operands: the four bytes of a 32-bit word (a row's min in every code slot)."""
        return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r,r,r", [words], dtype=gl.int8, is_pure=True,
                                         pack=4)

    @gluon.jit
    def _nib5(words, sh, hw, hs):
        """Q5_K: the low nibble at sh, the fifth bit from the qh word at bit hs (bit 4)."""
        return gl.inline_asm_elementwise(
            "{ .reg .b32 t, u; shr.u32 t, $1, $5; and.b32 t, t, 0x0F0F0F0F; shr.u32 u, $9, $13; "
            "and.b32 u, u, 0x01010101; shl.b32 u, u, 4; or.b32 $0, t, u; }",
            "=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r", [words, sh, hw, hs], dtype=gl.int8, is_pure=True, pack=4)

    @gluon.jit
    def _six(words, sh, hw, hs):
        """Q6_K: (low nibble at sh | two bits of the qh word at hs << 4) - 32 per byte (SWAR)."""
        return gl.inline_asm_elementwise(
            "{ .reg .b32 t, u; shr.u32 t, $1, $5; and.b32 t, t, 0x0F0F0F0F; shr.u32 u, $9, $13; "
            "and.b32 u, u, 0x03030303; shl.b32 u, u, 4; or.b32 t, t, u; or.b32 t, t, 0x80808080; "
            "sub.u32 t, t, 0x20202020; xor.b32 $0, t, 0x80808080; }",
            "=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r", [words, sh, hw, hs], dtype=gl.int8, is_pure=True, pack=4)

    @gluon.jit
    def _acc_index(n0, m0, N, T, BN: gl.constexpr, BM: gl.constexpr, mma: gl.constexpr):
        """The accumulator's weight rows n0.. and activation rows m0..: int64 indices and in-range
        masks of each, and the output mask [BN, BM]."""
        sn = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
        st = m0 + gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
        return sn.to(gl.int64), sn < N, st.to(gl.int64), st < T, (sn < N)[:, None] & (st < T)[None, :]

    @gluon.jit
    def _sub_block(codes, x, zero, sumi, summ, e0, e1, e2, e3, j: gl.constexpr, BN: gl.constexpr,
                   la: gl.constexpr):
        """Q4_K/Q5_K sub-block j of a block: sumi += sc_j * (codes . x) (an IMMA into zeros, exact) and
        summ += m_j . x: m_j in every code slot of its row against the same activations, one IMMA
        accumulating over the sub-blocks (sum_k m_j x_k = m_j bsum32_j, the same integer)."""
        isum = mma_v2(codes, x, zero)  # [BN, BM] exact
        scj = _byte_of(e0, e1, e0, e1, j, False)
        sumi = sumi + isum * scj[:, None]
        if j < 4:
            mw = _rep(e2, j)
        else:
            mw = _rep(e3, j - 4)
        mops = _as_i8(mw[:, None] + gl.zeros([BN, 32], gl.int32, layout=la))  # [BN, 32] int8
        return sumi, mma_v2(mops, x, summ)

    @gluon.jit
    def _words2(v):
        """The two 32-bit halves (low, high) of 8-byte words [BN]: bytes 0..3 and 4..7."""
        return v.to(gl.int32), (v >> 32).to(gl.int32)

    @gluon.jit
    def _byte_of(w0, w1, w2, w3, i: gl.constexpr, SIGNED: gl.constexpr):
        """Byte i (0..15) of four int32 words [BN] (little-endian), as int32."""
        if i // 4 == 0:
            w = w0
        elif i // 4 == 1:
            w = w1
        elif i // 4 == 2:
            w = w2
        else:
            w = w3
        if SIGNED:
            return (w << (24 - 8 * (i % 4))) >> 24  # arithmetic shift: int8 sign
        return (w >> (8 * (i % 4))) & 0xFF

    @gluon.jit
    def _rep(w, i: gl.constexpr):
        """Byte i (0..3) of each word in all four of its bytes (PTX prmt): a weight row's 6-bit min
        m_j as a register of four int8 operands, the same value for every code k of the row."""
        if i == 0:
            r = gl.inline_asm_elementwise("prmt.b32 $0, $1, 0, 0x0000;", "=r,r", [w], dtype=gl.int32, is_pure=True,
                                          pack=1)
        elif i == 1:
            r = gl.inline_asm_elementwise("prmt.b32 $0, $1, 0, 0x1111;", "=r,r", [w], dtype=gl.int32, is_pure=True,
                                          pack=1)
        elif i == 2:
            r = gl.inline_asm_elementwise("prmt.b32 $0, $1, 0, 0x2222;", "=r,r", [w], dtype=gl.int32, is_pure=True,
                                          pack=1)
        else:
            r = gl.inline_asm_elementwise("prmt.b32 $0, $1, 0, 0x3333;", "=r,r", [w], dtype=gl.int32, is_pure=True,
                                          pack=1)
        return r

    @gluon.jit
    def _load(FMT: gl.constexpr, b, ok, w0, w1, w2, w3, w4, w5, K, arow, kw, amask, srow, snm, arow1, anm1):
        """The weight side of 256-block b, as the registers _term reads (nothing is loaded where `ok`
        is false: the block past a program's last). Q4_K/Q5_K: v0..v3 the qs words of 64-element
        chunks 0..3 [BN, 32], v4 Q5_K's qh words (Q4_K: v0 again, unread), e0/e1 the sc words [BN]
        and e2/e3 the m words [BN] by the weight operand's rows (arow1: they build an operand), f0/f1
        d and dmin (f16 [BN]). Q6_K: v0..v3 the ql words of (half,
        64-element group) (0, 0), (0, 1), (1, 0), (1, 1), v4/v5 the qh words of halves 0 and 1,
        e0..e3 the sc words, f0 d (f1 = f0)."""
        nb = K // 256
        am = amask & ok
        sm = snm & ok
        am = am.to(gl.int32)
        if FMT <= 3:
            v0 = _ld_a(w0 + arow * (nb * 16) + b * 16 + kw, am)  # [BN, 32] int32 words
            v1 = _ld_a(w0 + arow * (nb * 16) + b * 16 + 4 + kw, am)
            v2 = _ld_a(w0 + arow * (nb * 16) + b * 16 + 8 + kw, am)
            v3 = _ld_a(w0 + arow * (nb * 16) + b * 16 + 12 + kw, am)
            if FMT == 3:
                v4 = _ld_a(w5 + arow * (nb * 4) + b * 4 + kw, am)
            else:
                v4 = v0
            v5 = v0
            e0, e1 = _words2(gl.load(w3 + srow * nb + b, mask=sm, other=0))  # [BN] sc bytes 0..3, 4..7
            e2, e3 = _words2(gl.load(w4 + arow1 * nb + b, mask=anm1 & ok, other=0))  # m bytes 0..3, 4..7
            f0 = gl.load(w1 + srow * nb + b, mask=sm, other=0.0)  # [BN] f16
            f1 = gl.load(w2 + srow * nb + b, mask=sm, other=0.0)
        else:
            v0 = _ld_a(w0 + arow * (nb * 16) + b * 16 + kw, am)
            v1 = _ld_a(w0 + arow * (nb * 16) + b * 16 + 4 + kw, am)
            v2 = _ld_a(w0 + arow * (nb * 16) + b * 16 + 8 + kw, am)
            v3 = _ld_a(w0 + arow * (nb * 16) + b * 16 + 12 + kw, am)
            v4 = _ld_a(w1 + arow * (nb * 8) + b * 8 + kw, am)
            v5 = _ld_a(w1 + arow * (nb * 8) + b * 8 + 4 + kw, am)
            e0, e1 = _words2(gl.load(w2 + srow * (nb * 2) + b * 2, mask=sm, other=0))  # [BN] sc bytes 0..15
            e2, e3 = _words2(gl.load(w2 + srow * (nb * 2) + b * 2 + 1, mask=sm, other=0))
            f0 = gl.load(w3 + srow * nb + b, mask=sm, other=0.0)
            f1 = f0
        return v0, v1, v2, v3, v4, v5, e0, e1, e2, e3, f0, f1

    @gluon.jit
    def _term(FMT: gl.constexpr, b, v0, v1, v2, v3, v4, v5, e0, e1, e2, e3, f0, f1, ad, K,
              bptr, bmask, bmask_lo, bmask_hi, stok, stm, w0, w1, w2, w3, w4, w5, arow, kw, amask, srow, snm,
              arow1, anm1, PF: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr, mma: gl.constexpr,
              la: gl.constexpr):
        """The float32 term [BN, BM] of 256-block b, formed as dot.py forms it. PF: its weight side
        as _load read it an iteration ahead (v*, e*, f*); otherwise each word is loaded where it is
        used (fewer registers live: the 128-row tiles keep their loop out of local memory)."""
        nb = K // 256
        if not PF:
            if FMT <= 3:
                e0, e1 = _words2(gl.load(w3 + srow * nb + b, mask=snm, other=0))  # [BN] sc bytes 0..3, 4..7
                e2, e3 = _words2(gl.load(w4 + arow1 * nb + b, mask=anm1, other=0))  # m bytes 0..3, 4..7
                if FMT == 3:
                    v4 = _ld_a(w5 + arow * (nb * 4) + b * 4 + kw, amask.to(gl.int32))  # [BN, 32]
            else:
                e0, e1 = _words2(gl.load(w2 + srow * (nb * 2) + b * 2, mask=snm, other=0))  # sc bytes 0..15
                e2, e3 = _words2(gl.load(w2 + srow * (nb * 2) + b * 2 + 1, mask=snm, other=0))
        zero = gl.zeros([BN, BM], gl.int32, layout=mma)
        sumi = gl.zeros([BN, BM], gl.int32, layout=mma)
        if FMT <= 3:  # Q4_K / Q5_K
            summ = gl.zeros([BN, BM], gl.int32, layout=mma)
            for c in gl.static_range(4):
                if not PF:
                    words = _ld_a(w0 + arow * (nb * 16) + b * 16 + 4 * c + kw, amask.to(gl.int32))  # [BN, 32]
                elif c == 0:
                    words = v0
                elif c == 1:
                    words = v1
                elif c == 2:
                    words = v2
                else:
                    words = v3
                for s in gl.static_range(2):
                    j = 2 * c + s
                    sh = gl.full([BN, 32], 4 * s, gl.int32, layout=la)
                    if FMT == 3:
                        codes = _nib5(words, sh, v4, gl.full([BN, 32], j, gl.int32, layout=la))
                    else:
                        codes = _nib(words, sh)
                    x = _ld_b(bptr + b * 32 + 4 * j, bmask)  # [32, BM] int8
                    sumi, summ = _sub_block(codes, x, zero, sumi, summ, e0, e1, e2, e3, j, BN, la)
            a_d = gl.load(ad + stok * nb + b, mask=stm, other=0.0)  # [BM] f32
            if not PF:
                f0 = gl.load(w1 + srow * nb + b, mask=snm, other=0.0)
                f1 = gl.load(w2 + srow * nb + b, mask=snm, other=0.0)
            wd = f0.to(gl.float32)  # [BN] f16 -> f32
            wm = f1.to(gl.float32)
            dd = wd[:, None] * a_d[None, :]  # f32: y.d * fp16(x.d)
            dm = wm[:, None] * (-a_d)[None, :]  # f32: -y.d * fp16(x.dmin)
            term = sumi.to(gl.float32) * dd + summ.to(gl.float32) * dm
        else:  # Q6_K
            for hh in gl.static_range(2):  # 128-element halves
                if not PF:
                    hw = _ld_a(w1 + arow * (nb * 8) + b * 8 + 4 * hh + kw, amask.to(gl.int32))
                elif hh == 0:
                    hw = v4
                else:
                    hw = v5
                for g in gl.static_range(2):
                    if not PF:
                        lw = _ld_a(w0 + arow * (nb * 16) + b * 16 + 8 * hh + 4 * g + kw, amask.to(gl.int32))
                    elif 2 * hh + g == 0:
                        lw = v0
                    elif 2 * hh + g == 1:
                        lw = v1
                    elif 2 * hh + g == 2:
                        lw = v2
                    else:
                        lw = v3
                    for hi in gl.static_range(2):
                        qq = g + 2 * hi  # quarter: elements 128 hh + 32 qq + k
                        codes = _six(lw, gl.full([BN, 32], 4 * hi, gl.int32, layout=la), hw,
                                     gl.full([BN, 32], 2 * qq, gl.int32, layout=la))
                        xp = bptr + b * 32 + 16 * hh + 4 * qq
                        xl = _ld_b(xp, bmask_lo)  # elements < 16 (t < 2): sub-block 8 hh + 2 qq
                        xh = _ld_b(xp, bmask_hi)  # elements >= 16: the next
                        il = mma_v2(codes, xl, zero)
                        ih = mma_v2(codes, xh, zero)
                        sl = _byte_of(e0, e1, e2, e3, 8 * hh + 2 * (g + 2 * hi), True)
                        sh_ = _byte_of(e0, e1, e2, e3, 8 * hh + 2 * (g + 2 * hi) + 1, True)
                        sumi = sumi + il * sl[:, None]
                        sumi = sumi + ih * sh_[:, None]
            a_d = gl.load(ad + stok * nb + b, mask=stm, other=0.0)
            if not PF:
                f0 = gl.load(w3 + srow * nb + b, mask=snm, other=0.0)
            wd = f0.to(gl.float32)
            dd = wd[:, None] * a_d[None, :]
            term = sumi.to(gl.float32) * dd
        return term

    @gluon.jit
    def _qtile_kernel(aq, ad, y, part, w0, w1, w2, w3, w4, w5, N, K, T, sy,
                     FMT: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr, NW: gl.constexpr,
                     CB: gl.constexpr, SPLIT: gl.constexpr, PF: gl.constexpr, PDL: gl.constexpr):
        """y [T, N] f32 (or, SPLIT over several chunks, part [n_chunks, T, N] f32): program (c, i, j)
        takes activation rows i*BM.. and weight rows j*BN.. (and, SPLIT, chunk c; else c is 0)."""
        _after_prior(PDL)  # gdc.py: the previous kernel done before the first read
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
        la: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)
        lb: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=4)
        # program (c, i, j): a weight tile's chunks and then its activation tiles vary fastest, so the
        # programs that read one weight row's bytes run together and share each DRAM burst through
        # L2 (a chunk's d, dmin, sc and m are 8-32 bytes a row, less than a DRAM burst: in
        # chunk-slowest order a one-row Q4_K 39936 x 6656 call read 171.6 MB from DRAM for its
        # 153.7 MB of fields, the exact lane's matvec 153.8 for as many; ncu, tools/device_counters.py)
        m0 = gl.program_id(1) * BM
        n0 = gl.program_id(2) * BN
        # the weight operand [BN, 32]: row n, operand k = 16h + 4t + i holds element 8t + 4h + i of a
        # sub-block (byte 4h + i of its 32 bytes' 8-byte word t), and the activation operand the same
        # element, so each IMMA is still the sub-block's integer dot (one 8-byte load a thread and row)
        an = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, la))
        ak = gl.arange(0, 32, layout=gl.SliceLayout(0, la))
        amask = (an < N)[:, None] & (ak < 32)[None, :]
        arow = an.to(gl.int64)[:, None]
        arow1 = an.to(gl.int64)  # [BN] by the weight operand's rows (the m words: an operand of theirs)
        anm1 = an < N
        kw = ((ak % 16) // 4)[None, :]  # the 8-byte word t
        # the activation operand [32, BM]: element k of a sub-block, activation row t
        bk = gl.arange(0, 32, layout=gl.SliceLayout(1, lb))
        bt = m0 + gl.arange(0, BM, layout=gl.SliceLayout(0, lb))
        bok = (bt < T)[None, :]
        bmask = ((bk < 32)[:, None] & bok).to(gl.int32)
        bmask_lo = (((bk % 16) < 8)[:, None] & bok).to(gl.int32)  # elements 8t + 4h + i < 16: t < 2
        bmask_hi = (((bk % 16) >= 8)[:, None] & bok).to(gl.int32)
        bptr = aq + bt.to(gl.int64)[None, :] * (K // 8) + ((bk % 16) // 4)[:, None]  # 8-byte words (8 codes)
        # per weight row / per activation row vectors of the accumulator's layout
        srow, snm, stok, stm, omask = _acc_index(n0, m0, N, T, BN, BM, mma)
        nb = K // 256
        # PF: the next block's weight words are loaded before this block's IMMAs (kept in registers
        # across the iteration), so a warp has a block's loads in flight while it computes; PF 0
        # loads each word where it is used. Same values, same arithmetic: same bits.
        if SPLIT:  # this program's chunk
            b0 = gl.program_id(0) * CB
        else:  # every chunk
            b0 = 0
        if PF:  # the first block's weight side
            v0, v1, v2, v3, v4, v5, e0, e1, e2, e3, f0, f1 = _load(FMT, b0, True, w0, w1, w2, w3, w4, w5, K, arow,
                                                                   kw, amask, srow, snm, arow1, anm1)
        else:  # placeholders: _term loads the block itself
            v0 = gl.zeros([BN, 32], gl.int32, layout=la)
            v1, v2, v3, v4, v5 = v0, v0, v0, v0, v0
            e0 = gl.zeros([BN], gl.int32, layout=gl.SliceLayout(1, mma))
            e1, e2, e3 = e0, e0, e0
            f0 = gl.zeros([BN], gl.float16, layout=gl.SliceLayout(1, mma))
            f1 = f0
        if SPLIT:
            c = gl.program_id(0)
            b1 = gl.minimum(nb, c * CB + CB)
            acc = gl.zeros([BN, BM], gl.float32, layout=mma)  # +0.0 (dot._chunk_sum)
            for b in range(b0, b1):
                if PF:
                    n0_, n1_, n2_, n3_, n4_, n5_, g0, g1, g2, g3, h0, h1 = _load(
                        FMT, b + 1, b + 1 < b1, w0, w1, w2, w3, w4, w5, K, arow, kw, amask, srow, snm, arow1, anm1)
                acc = acc + _term(FMT, b, v0, v1, v2, v3, v4, v5, e0, e1, e2, e3, f0, f1, ad, K, bptr, bmask,
                                  bmask_lo, bmask_hi, stok, stm, w0, w1, w2, w3, w4, w5, arow, kw, amask, srow, snm,
                                  arow1, anm1, PF, BN, BM, mma, la)
                if PF:
                    v0, v1, v2, v3, v4, v5, e0, e1, e2, e3, f0, f1 = n0_, n1_, n2_, n3_, n4_, n5_, g0, g1, g2, g3, h0, h1
            if (nb + CB - 1) // CB == 1:  # +0.0 + acc is acc (acc starts at +0.0, never -0.0)
                gl.store(y + stok[None, :] * sy + srow[:, None], acc, mask=omask)
            else:
                gl.store(part + (c * T + stok[None, :]) * N + srow[:, None], acc, mask=omask)
        else:
            tot = gl.zeros([BN, BM], gl.float32, layout=mma)
            for c in range(0, (nb + CB - 1) // CB):
                acc = gl.zeros([BN, BM], gl.float32, layout=mma)
                for b in range(c * CB, gl.minimum(nb, c * CB + CB)):
                    if PF:  # runs on across chunk boundaries
                        n0_, n1_, n2_, n3_, n4_, n5_, g0, g1, g2, g3, h0, h1 = _load(
                            FMT, b + 1, b + 1 < nb, w0, w1, w2, w3, w4, w5, K, arow, kw, amask, srow, snm, arow1, anm1)
                    acc = acc + _term(FMT, b, v0, v1, v2, v3, v4, v5, e0, e1, e2, e3, f0, f1, ad, K, bptr, bmask,
                                      bmask_lo, bmask_hi, stok, stm, w0, w1, w2, w3, w4, w5, arow, kw, amask, srow,
                                      snm, arow1, anm1, PF, BN, BM, mma, la)
                    if PF:
                        v0, v1, v2, v3, v4, v5, e0, e1, e2, e3, f0, f1 = (n0_, n1_, n2_, n3_, n4_, n5_, g0, g1, g2, g3,
                                                                          h0, h1)
                tot = tot + acc
            gl.store(y + stok[None, :] * sy + srow[:, None], tot, mask=omask)

    # --- the ring variant: a program's next blocks copied into shared memory ahead of its IMMAs ---

    @gluon.jit
    def _nib8(x, SH: gl.constexpr):
        """int8 codes [BN, 32] (four a register): (byte >> SH) & 0xF."""
        if SH == 0:
            return gl.inline_asm_elementwise("and.b32 $0, $1, 0x0F0F0F0F;", "=r,r", [x], dtype=gl.int8, is_pure=True,
                                             pack=4)
        else:
            return gl.inline_asm_elementwise("{ .reg .b32 t; shr.u32 t, $1, 4; and.b32 $0, t, 0x0F0F0F0F; }", "=r,r",
                                             [x], dtype=gl.int8, is_pure=True, pack=4)

    @gluon.jit
    def _hib8(x, h, hs, TWO: gl.constexpr):
        """Q5_K / Q6_K: the codes x [BN, 32] int8 with bit hs (TWO: bits hs, hs + 1) of each qh byte of h
        at bit 4 (4, 5); hs an int32 tensor of the shift."""
        if TWO:
            return gl.inline_asm_elementwise(
                "{ .reg .b32 u; shr.u32 u, $2, $3; and.b32 u, u, 0x03030303; shl.b32 u, u, 4; or.b32 $0, $1, u; }",
                "=r,r,r,r,r,r,r", [x, h, hs], dtype=gl.int8, is_pure=True, pack=4)
        else:
            return gl.inline_asm_elementwise(
                "{ .reg .b32 u; shr.u32 u, $2, $3; and.b32 u, u, 0x01010101; shl.b32 u, u, 4; or.b32 $0, $1, u; }",
                "=r,r,r,r,r,r,r", [x, h, hs], dtype=gl.int8, is_pure=True, pack=4)

    @gluon.jit
    def _and8(x, m):
        """Bytewise x & m of two int8 tensors (four a register)."""
        return gl.inline_asm_elementwise("and.b32 $0, $1, $2;", "=r,r,r", [x, m], dtype=gl.int8, is_pure=True, pack=4)

    @gluon.jit
    def _minus32(x):
        """Q6_K: code - 32 in every byte (codes < 64: no borrow crosses a byte)."""
        return gl.inline_asm_elementwise(
            "{ .reg .b32 t; or.b32 t, $1, 0x80808080; sub.u32 t, t, 0x20202020; xor.b32 $0, t, 0x80808080; }",
            "=r,r", [x], dtype=gl.int8, is_pure=True, pack=4)

    @gluon.jit
    def _ring_copy(FMT: gl.constexpr, bb, ok, slot, c0, c1, aq, K, wq, wh, xa, qrow, qk, qm, hrow, hk, hm, xrow, xk, xm):
        """Block bb's code bytes (Q4_K/Q5_K qs, Q6_K ql; Q5_K/Q6_K qh) of this program's weight rows and
        its activation codes into ring slot `slot` (cp.async, 16 bytes a thread and copy), where ok."""
        nb = K // 256
        async_copy.async_copy_global_to_shared(wq.index(slot), c0 + qrow * (nb * 128) + bb * 128 + qk, mask=qm & ok)
        if FMT == 3:
            async_copy.async_copy_global_to_shared(wh.index(slot), c1 + hrow * (nb * 32) + bb * 32 + hk, mask=hm & ok)
        if FMT == 4:
            async_copy.async_copy_global_to_shared(wh.index(slot), c1 + hrow * (nb * 64) + bb * 64 + hk, mask=hm & ok)
        async_copy.async_copy_global_to_shared(xa.index(slot), aq + xrow * K + bb * 256 + xk, mask=xm & ok)
        async_copy.commit_group()

    @gluon.jit
    def _ring_small(FMT: gl.constexpr, bb, ok, s0, s1, s2, s3, ad, K, srow, snm, arow1, anm1, stok, stm):
        """Block bb's scale words (sc, m; Q6_K's two sc words), d (and dmin) and the activations' d."""
        nb = K // 256
        if FMT <= 3:
            e0, e1 = _words2(gl.load(s2 + srow * nb + bb, mask=snm & ok, other=0))  # sc bytes 0..7
            e2, e3 = _words2(gl.load(s3 + arow1 * nb + bb, mask=anm1 & ok, other=0))  # m bytes 0..7 (an operand's rows)
            f1 = gl.load(s1 + srow * nb + bb, mask=snm & ok, other=0.0)
        else:
            e0, e1 = _words2(gl.load(s2 + srow * (nb * 2) + bb * 2, mask=snm & ok, other=0))  # sc bytes 0..15
            e2, e3 = _words2(gl.load(s2 + srow * (nb * 2) + bb * 2 + 1, mask=snm & ok, other=0))
        f0 = gl.load(s0 + srow * nb + bb, mask=snm & ok, other=0.0)
        if FMT == 4:
            f1 = f0
        a_d = gl.load(ad + stok * nb + bb, mask=stm & ok, other=0.0)  # [BM] f32
        return e0, e1, e2, e3, f0, f1, a_d

    @gluon.jit
    def _ring_term(FMT: gl.constexpr, slot, wq, wh, xa, e0, e1, e2, e3, f0, f1, a_d, lo16, hi16,
                   BN: gl.constexpr, BM: gl.constexpr, mma: gl.constexpr, la: gl.constexpr, lb: gl.constexpr):
        """The float32 term [BN, BM] of the block in ring slot `slot`: _term's arithmetic, operands in
        ggml's own element order (both sides alike) read from shared memory."""
        zero = gl.zeros([BN, BM], gl.int32, layout=mma)
        sumi = gl.zeros([BN, BM], gl.int32, layout=mma)
        if FMT <= 3:
            summ = gl.zeros([BN, BM], gl.int32, layout=mma)
            for c in gl.static_range(4):
                q = wq.index(slot).slice(32 * c, 32, dim=1).load(la)  # [BN, 32] int8: sub-blocks 2c, 2c + 1
                if FMT == 3:
                    h = wh.index(slot).load(la)  # [BN, 32] qh: bit j of byte k is element 32 j + k's fifth bit
                for s in gl.static_range(2):
                    j = 2 * c + s
                    codes = _nib8(q, 4 * s)
                    if FMT == 3:
                        codes = _hib8(codes, h, gl.full([BN, 32], j, gl.int32, layout=la), False)
                    x = xa.index(slot).slice(32 * (2 * c + s), 32, dim=1).permute((1, 0)).load(lb)  # [32, BM] int8
                    sumi, summ = _sub_block(codes, x, zero, sumi, summ, e0, e1, e2, e3, j, BN, la)
            wd = f0.to(gl.float32)
            wm = f1.to(gl.float32)
            dd = wd[:, None] * a_d[None, :]  # f32: y.d * fp16(x.d)
            dm = wm[:, None] * (-a_d)[None, :]  # f32: -y.d * fp16(x.dmin)
            term = sumi.to(gl.float32) * dd + summ.to(gl.float32) * dm
        else:
            for hh in gl.static_range(2):  # 128-element halves
                h = wh.index(slot).slice(32 * hh, 32, dim=1).load(la)  # qh bytes 32 hh + k
                for g in gl.static_range(2):
                    lq = wq.index(slot).slice(64 * hh + 32 * g, 32, dim=1).load(la)  # ql bytes 64 hh + 32 g + k
                    for hi in gl.static_range(2):  # quarter g + 2 hi: elements 128 hh + 32 (g + 2 hi) + k
                        codes = _minus32(_hib8(_nib8(lq, 4 * hi), h,
                                               gl.full([BN, 32], 2 * (g + 2 * hi), gl.int32, layout=la), True))
                        x = xa.index(slot).slice(128 * hh + 32 * (g + 2 * hi), 32, dim=1).permute((1, 0)).load(lb)
                        il = mma_v2(_and8(codes, lo16), x, zero)  # elements k < 16: sub-block 8 hh + 2 qq
                        ih = mma_v2(_and8(codes, hi16), x, zero)
                        sl = _byte_of(e0, e1, e2, e3, 8 * hh + 2 * (g + 2 * hi), True)
                        sh_ = _byte_of(e0, e1, e2, e3, 8 * hh + 2 * (g + 2 * hi) + 1, True)
                        sumi = sumi + il * sl[:, None]
                        sumi = sumi + ih * sh_[:, None]
            wd = f0.to(gl.float32)
            dd = wd[:, None] * a_d[None, :]
            term = sumi.to(gl.float32) * dd
        return term

    @gluon.jit
    def _ring_block(FMT: gl.constexpr, b, b0, b1, S: gl.constexpr, c0, c1, s0, s1, s2, s3, aq, ad, K, wq, wh, xa,
                    qrow, qk, qm, hrow, hk, hm, xrow, xk, xm, srow, snm, arow1, anm1, stok, stm,
                    e0, e1, e2, e3, f0, f1, a_d, lo16, hi16, BN: gl.constexpr, BM: gl.constexpr, mma: gl.constexpr,
                    la: gl.constexpr, lb: gl.constexpr):
        """Block b of the program's blocks [b0, b1): wait for its copies (issued S - 1 blocks earlier)
        on this thread, then on every thread (after the barrier no warp still reads slot (b - 1) % S,
        which the next copy fills); copy block b + S - 1; load block b + 1's small fields; its term
        from the ring and this block's small fields (e*, f*, a_d). Returns the term and block b + 1's
        small fields."""
        async_copy.wait_group(S - 2)
        gl.thread_barrier()
        _ring_copy(FMT, b + S - 1, b + S - 1 < b1, (b - b0 + S - 1) % S, c0, c1, aq, K, wq, wh, xa, qrow, qk, qm,
                   hrow, hk, hm, xrow, xk, xm)
        g0, g1, g2, g3, h0, h1, nd = _ring_small(FMT, b + 1, b + 1 < b1, s0, s1, s2, s3, ad, K, srow, snm, arow1,
                                                 anm1, stok, stm)
        term = _ring_term(FMT, (b - b0) % S, wq, wh, xa, e0, e1, e2, e3, f0, f1, a_d, lo16, hi16, BN, BM, mma, la, lb)
        return term, g0, g1, g2, g3, h0, h1, nd

    @gluon.jit
    def _ring_buffers(FMT: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr, NW: gl.constexpr, S: gl.constexpr):
        """The ring's shared memory, S slots each of a block's code bytes of BN weight rows (wq),
        their Q5_K/Q6_K high bits (wh; Q4_K: wq again, never read) and BM rows of activation codes
        (xa), and the copy layouts' index vectors: the code copy's rows [BN] and bytes [128], the
        high bits' rows [BN] and bytes [32 or 64], the activation copy's rows [BM] and codes [256]."""
        # copy layouts: 16 bytes a thread (one cp.async), a warp over 4 weight rows of 128 bytes, 16 of
        # 32 (Q5_K qh), 8 of 64 (Q6_K qh), 2 activation rows of 256
        cq: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[4, 8], warps_per_cta=[NW, 1],
                                            order=[1, 0])
        ch32: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[16, 2],
                                              warps_per_cta=[NW, 1], order=[1, 0])
        ch64: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[8, 4],
                                              warps_per_cta=[NW, 1], order=[1, 0])
        cx: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[2, 16], warps_per_cta=[NW, 1],
                                            order=[1, 0])
        sw: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=8, order=[1, 0])
        flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
        wq = gl.allocate_shared_memory(gl.int8, [S, BN, 128], sw)
        if FMT == 3:
            wh = gl.allocate_shared_memory(gl.int8, [S, BN, 32], flat)
            hl = gl.arange(0, BN, layout=gl.SliceLayout(1, ch32))
            hk = gl.arange(0, 32, layout=gl.SliceLayout(0, ch32))
        elif FMT == 4:
            wh = gl.allocate_shared_memory(gl.int8, [S, BN, 64], flat)
            hl = gl.arange(0, BN, layout=gl.SliceLayout(1, ch64))
            hk = gl.arange(0, 64, layout=gl.SliceLayout(0, ch64))
        else:
            wh = wq  # never read
            hl = gl.arange(0, BN, layout=gl.SliceLayout(1, ch32))
            hk = gl.arange(0, 32, layout=gl.SliceLayout(0, ch32))
        xa = gl.allocate_shared_memory(gl.int8, [S, BM, 256], sw)
        ql = gl.arange(0, BN, layout=gl.SliceLayout(1, cq))
        qk = gl.arange(0, 128, layout=gl.SliceLayout(0, cq))
        xl = gl.arange(0, BM, layout=gl.SliceLayout(1, cx))
        xk = gl.arange(0, 256, layout=gl.SliceLayout(0, cx))
        return wq, wh, xa, ql, qk, hl, hk, xl, xk

    @gluon.jit
    def _ring_index(n0, m0, N, T, ql, qk, hl, hk, xl, xk, BN: gl.constexpr, BM: gl.constexpr, mma: gl.constexpr,
                    la: gl.constexpr):
        """The copies' and the accumulator's indices and masks of weight rows n0.. and activation rows
        m0..: code bytes (qrow, qk, qm), high bits (hrow, hk, hm), activation codes (xrow, xk, xm),
        the accumulator's (srow, snm, stok, stm, omask) and the m words' rows (arow1, anm1)."""
        qn = n0 + ql
        qk2 = qk[None, :]
        qm = (qn < N)[:, None] & (qk2 < 128)
        qrow = qn.to(gl.int64)[:, None]
        hn = n0 + hl
        hm = (hn < N)[:, None] & (hk < 64)[None, :]
        hrow = hn.to(gl.int64)[:, None]
        hk2 = hk[None, :]
        xt = m0 + xl
        xk2 = xk[None, :]
        xm = (xt < T)[:, None] & (xk2 < 256)
        xrow = xt.to(gl.int64)[:, None]
        srow, snm, stok, stm, omask = _acc_index(n0, m0, N, T, BN, BM, mma)
        an = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, la))
        arow1 = an.to(gl.int64)  # [BN] by the weight operand's rows (the m words: an operand of theirs)
        anm1 = an < N
        return qrow, qk2, qm, hrow, hk2, hm, xrow, xk2, xm, srow, snm, stok, stm, omask, arow1, anm1

    @gluon.jit
    def _q6_halves(BN: gl.constexpr, la: gl.constexpr):
        """Q6_K's byte masks [BN, 32] of a quarter's first (k < 16) and second sub-block."""
        ak = gl.arange(0, 32, layout=gl.SliceLayout(0, la))
        lo16 = gl.where((ak < 16)[None, :], gl.full([BN, 32], -1, gl.int8, layout=la),
                        gl.full([BN, 32], 0, gl.int8, layout=la))
        hi16 = gl.where((ak >= 16)[None, :], gl.full([BN, 32], -1, gl.int8, layout=la),
                        gl.full([BN, 32], 0, gl.int8, layout=la))
        return lo16, hi16

    @gluon.jit
    def _ring_chunks(FMT: gl.constexpr, tot, c_lo, c_hi, nb, b0, b1, S: gl.constexpr, CB: gl.constexpr, c0, c1, s0, s1,
                     s2, s3, aq, ad, K, wq, wh, xa, qrow, qk, qm, hrow, hk, hm, xrow, xk, xm, srow, snm, arow1, anm1,
                     stok, stm, e0, e1, e2, e3, f0, f1, a_d, lo16, hi16, BN: gl.constexpr, BM: gl.constexpr,
                     mma: gl.constexpr, la: gl.constexpr, lb: gl.constexpr, PARTS: gl.constexpr, keep, part, N, T,
                     omask):
        """Chunks c_lo .. c_hi - 1 of the program's blocks [b0, b1) walked through the ring (it runs on
        across chunks): each chunk's sum from +0.0 in block order, added onto `tot` in chunk order
        (dot._chunk_sum's two levels). PARTS (the stream-K walk) and not `keep`: each chunk's sum is
        stored in part [chunks, T, N] instead, `tot` left as it came. Returns the fold and the next
        block's small fields."""
        if PARTS:
            # loops counted from 0 (a chunk, a block of the chunk): with the start chunk c_lo a runtime
            # value, counting from it took the segment loop to 509 instructions a block (sm_90, Q4_K
            # (64, 16, 4, 4)), counted from 0 to the walk's 437; the walk keeps its own form (counted
            # from 0 here its registers rose from 168 to 245: two programs an SM, not three)
            for ci in range(0, c_hi - c_lo):
                c = c_lo + ci
                acc = gl.zeros([BN, BM], gl.float32, layout=mma)
                for bi in range(0, gl.minimum(nb - c * CB, CB)):
                    term, e0, e1, e2, e3, f0, f1, a_d = _ring_block(
                        FMT, c * CB + bi, b0, b1, S, c0, c1, s0, s1, s2, s3, aq, ad, K, wq, wh, xa, qrow, qk, qm, hrow,
                        hk, hm, xrow, xk, xm, srow, snm, arow1, anm1, stok, stm, e0, e1, e2, e3, f0, f1, a_d, lo16,
                        hi16, BN, BM, mma, la, lb)
                    acc = acc + term
                if keep:
                    tot = tot + acc
                else:
                    gl.store(part + (c * T + stok[None, :]) * N + srow[:, None], acc, mask=omask)
        else:
            for c in range(c_lo, c_hi):
                acc = gl.zeros([BN, BM], gl.float32, layout=mma)
                for b in range(c * CB, gl.minimum(nb, c * CB + CB)):
                    term, e0, e1, e2, e3, f0, f1, a_d = _ring_block(
                        FMT, b, b0, b1, S, c0, c1, s0, s1, s2, s3, aq, ad, K, wq, wh, xa, qrow, qk, qm, hrow, hk, hm,
                        xrow, xk, xm, srow, snm, arow1, anm1, stok, stm, e0, e1, e2, e3, f0, f1, a_d, lo16, hi16, BN,
                        BM, mma, la, lb)
                    acc = acc + term
                tot = tot + acc
        return tot, e0, e1, e2, e3, f0, f1, a_d

    @gluon.jit
    def _ring_kernel(aq, ad, y, part, c0, c1, s0, s1, s2, s3, N, K, T, sy,
                     FMT: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr, NW: gl.constexpr, CB: gl.constexpr,
                     SPLIT: gl.constexpr, CG: gl.constexpr, S: gl.constexpr, PDL: gl.constexpr):
        """_qtile_kernel's output (the same terms, the same f32 additions in the same order) with a
        ring of S shared-memory slots: a block's code bytes and activation codes are copied
        (cp.async) S - 1 blocks before its IMMAs, so a warp waits on a copy issued S - 1 iterations
        earlier, not on its own loads; the small fields (scales, d) are loaded one block ahead.
        SPLIT: a program sums CG consecutive chunks, each from +0.0 into its own partial (the ring
        runs on across them), so a short row still gives the ring blocks to stream."""
        _after_prior(PDL)
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
        la: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)
        lb: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=4)
        wq, wh, xa, ql, qk, hl, hk, xl, xk = _ring_buffers(FMT, BN, BM, NW, S)
        m0 = gl.program_id(1) * BM
        n0 = gl.program_id(2) * BN
        nb = K // 256
        qrow, qk, qm, hrow, hk, hm, xrow, xk, xm, srow, snm, stok, stm, omask, arow1, anm1 = _ring_index(
            n0, m0, N, T, ql, qk, hl, hk, xl, xk, BN, BM, mma, la)
        lo16, hi16 = _q6_halves(BN, la)
        nch = (nb + CB - 1) // CB
        if SPLIT:
            g0 = gl.program_id(0) * CG  # this program's first chunk
            b0 = g0 * CB
            b1 = gl.minimum(nb, b0 + CG * CB)
        else:
            b0 = 0
            b1 = nb
        for i in gl.static_range(S - 1):  # the ring's first S - 1 blocks
            _ring_copy(FMT, b0 + i, b0 + i < b1, i, c0, c1, aq, K, wq, wh, xa, qrow, qk, qm, hrow, hk, hm, xrow, xk, xm)
        e0, e1, e2, e3, f0, f1, a_d = _ring_small(FMT, b0, b0 < b1, s0, s1, s2, s3, ad, K, srow, snm, arow1, anm1,
                                                  stok, stm)
        if SPLIT and CG == 1:  # its own loop: no store in it (462 against 526 instructions a block, sm_90)
            acc = gl.zeros([BN, BM], gl.float32, layout=mma)  # +0.0 (dot._chunk_sum)
            for b in range(b0, b1):
                term, e0, e1, e2, e3, f0, f1, a_d = _ring_block(
                    FMT, b, b0, b1, S, c0, c1, s0, s1, s2, s3, aq, ad, K, wq, wh, xa, qrow, qk, qm, hrow, hk, hm,
                    xrow, xk, xm, srow, snm, arow1, anm1, stok, stm, e0, e1, e2, e3, f0, f1, a_d, lo16, hi16, BN, BM,
                    mma, la, lb)
                acc = acc + term
        elif SPLIT:
            acc = gl.zeros([BN, BM], gl.float32, layout=mma)  # +0.0 (dot._chunk_sum)
            for b in range(b0, b1):  # one loop, as CG 1's: the chunk's partial stored at its last block
                term, e0, e1, e2, e3, f0, f1, a_d = _ring_block(
                    FMT, b, b0, b1, S, c0, c1, s0, s1, s2, s3, aq, ad, K, wq, wh, xa, qrow, qk, qm, hrow, hk, hm,
                    xrow, xk, xm, srow, snm, arow1, anm1, stok, stm, e0, e1, e2, e3, f0, f1, a_d, lo16, hi16, BN, BM,
                    mma, la, lb)
                acc = acc + term
                if ((b + 1) % CB == 0) | (b + 1 == b1):  # nch > 1 (the launcher): chunk b // CB's partial
                    gl.store(part + ((b // CB) * T + stok[None, :]) * N + srow[:, None], acc, mask=omask)
                    acc = gl.zeros([BN, BM], gl.float32, layout=mma)
        else:
            tot, e0, e1, e2, e3, f0, f1, a_d = _ring_chunks(
                FMT, gl.zeros([BN, BM], gl.float32, layout=mma), 0, nch, nb, b0, b1, S, CB, c0, c1, s0, s1, s2, s3,
                aq, ad, K, wq, wh, xa, qrow, qk, qm, hrow, hk, hm, xrow, xk, xm, srow, snm, arow1, anm1, stok, stm, e0,
                e1, e2, e3, f0, f1, a_d, lo16, hi16, BN, BM, mma, la, lb, False, True, part, N, T, omask)
        async_copy.wait_group(0)
        if SPLIT and CG == 1:
            if nch == 1:  # +0.0 + acc is acc (acc starts at +0.0, never -0.0)
                gl.store(y + stok[None, :] * sy + srow[:, None], acc, mask=omask)
            else:
                gl.store(part + (gl.program_id(0) * T + stok[None, :]) * N + srow[:, None], acc, mask=omask)
        elif not SPLIT:
            gl.store(y + stok[None, :] * sy + srow[:, None], tot, mask=omask)


    @gluon.jit
    def _sk_fold(y, part, t, h, N, T, sy, stok, srow, omask, NCH: gl.constexpr):
        """Tile t's output from its chunk sums: the fold through chunk h - 1 (stored by the program
        that took the tile's first chunks) plus chunks h .. NCH - 1 in chunk order, read from L2
        (.cg: the other programs' stores, no stale L1 line)."""
        at = part + (stok[None, :] * N + srow[:, None])
        tot = gl.load(at + (h - 1) * T * N, mask=omask, other=0.0, cache_modifier=".cg")
        for c in range(h, NCH):
            tot = tot + gl.load(at + c * T * N, mask=omask, other=0.0, cache_modifier=".cg")
        gl.store(y + stok[None, :] * sy + srow[:, None], tot, mask=omask)

    @gluon.jit
    def _ring_sk_kernel(aq, ad, y, part, cnt, c0, c1, s0, s1, s2, s3, N, K, T, sy, U,
                        FMT: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr, NW: gl.constexpr, CB: gl.constexpr,
                        NCH: gl.constexpr, S: gl.constexpr, PDL: gl.constexpr):
        """The walked ring's output (the same terms, chunk sums and additions in the same order) with
        the work shared out stream-K: the U = tiles x NCH (weight tile, chunk) units in tile order,
        program p taking units [p U / P, (p + 1) U / P) across tile boundaries (P <= U programs), so
        every slot of the GPU streams to the end instead of a last wave of whole tiles leaving
        slots idle (the waves probe, bench/NOTES.md), and a shape of fewer tiles than slots still
        fills them. A whole tile is walked and stored as the walk does. Of a tile shared by several
        programs, the one with its first chunks folds them from +0.0 in chunk order and stores the
        running sum (part [NCH, T, N] f32, at its last chunk's place); the others store each of
        their chunks' sums there; each then arrives at the tile's counter (cnt[t]), and the last to
        arrive, whichever it is, adds the stored sums onto the running one in chunk order (_sk_fold),
        stores the output and sets the counter back to 0 for the next call. The fold order is the
        walk's whoever computes which chunk, so the bits are; no program waits on another. One
        activation tile (T <= BM)."""
        _after_prior(PDL)  # gdc.py: the previous kernel done before the first read
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
        la: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)
        lb: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=4)
        wq, wh, xa, ql, qk, hl, hk, xl, xk = _ring_buffers(FMT, BN, BM, NW, S)
        nb = K // 256
        p = gl.program_id(0)
        P = gl.num_programs(0)
        u0 = p * U // P
        u1 = (p + 1) * U // P
        lo16, hi16 = _q6_halves(BN, la)
        for t in range(u0 // NCH, (u1 - 1) // NCH + 1):
            c_lo = gl.maximum(u0 - t * NCH, 0)
            c_hi = gl.minimum(u1 - t * NCH, NCH)
            qrow, qk2, qm, hrow, hk2, hm, xrow, xk2, xm, srow, snm, stok, stm, omask, arow1, anm1 = _ring_index(
                t * BN, 0, N, T, ql, qk, hl, hk, xl, xk, BN, BM, mma, la)
            b0 = c_lo * CB
            b1 = gl.minimum(nb, c_hi * CB)
            gl.thread_barrier()  # no warp still reads the ring of the segment before
            for i in gl.static_range(S - 1):  # the ring's first S - 1 blocks
                _ring_copy(FMT, b0 + i, b0 + i < b1, i, c0, c1, aq, K, wq, wh, xa, qrow, qk2, qm, hrow, hk2, hm, xrow,
                           xk2, xm)
            e0, e1, e2, e3, f0, f1, a_d = _ring_small(FMT, b0, b0 < b1, s0, s1, s2, s3, ad, K, srow, snm, arow1, anm1,
                                                      stok, stm)
            # the tile's first chunks folded here from +0.0 (dot._chunk_sum); later ones stored one by one
            tot, e0, e1, e2, e3, f0, f1, a_d = _ring_chunks(
                FMT, gl.zeros([BN, BM], gl.float32, layout=mma), c_lo, c_hi, nb, b0, b1, S, CB, c0, c1, s0, s1, s2,
                s3, aq, ad, K, wq, wh, xa, qrow, qk2, qm, hrow, hk2, hm, xrow, xk2, xm, srow, snm, arow1, anm1, stok,
                stm, e0, e1, e2, e3, f0, f1, a_d, lo16, hi16, BN, BM, mma, la, lb, True, c_lo == 0, part, N, T, omask)
            async_copy.wait_group(0)
            if (c_lo == 0) & (c_hi == NCH):  # a whole tile
                gl.store(y + stok[None, :] * sy + srow[:, None], tot, mask=omask)
            else:
                if c_lo == 0:  # the running sum through chunk c_hi - 1
                    gl.store(part + ((c_hi - 1) * T + stok[None, :]) * N + srow[:, None], tot, mask=omask)
                gl.thread_barrier()  # every warp's sums stored before the arrival (its release)
                seen = gl.atomic_add(cnt + t, 1, sem="acq_rel", scope="gpu")  # one thread's, its value broadcast
                # the tile's programs: from the one whose run holds its first unit to the one with its last
                # (program q's run holds unit u when q = ((u + 1) P - 1) // U)
                q0 = ((t * NCH + 1) * P - 1) // U
                q1 = ((t * NCH + NCH) * P - 1) // U
                if seen == q1 - q0:
                    # the first program's chunks end where the next program's run begins
                    _sk_fold(y, part, t, (q0 + 1) * U // P - t * NCH, N, T, sy, stok, srow, omask, NCH)
                    gl.atomic_xchg(cnt + t, 0, sem="relaxed", scope="gpu")  # every program of the tile arrived


_COUNTERS: dict[str, torch.Tensor] = {}
COUNTERS_MIN = 1 << 16  # counters a device: a full-geometry call has at most 6,314 weight tiles (the LM head)


def sk_counters(device: torch.device | str, n: int) -> torch.Tensor:
    """The device's stream-K arrival counters (int32, at least `n`, one a weight tile): zero between
    calls (the last program to arrive at a tile sets its counter back to 0), so one buffer serves
    every call and every replay of a captured graph. The calls that share it run in one stream
    order (the engine's); a graph captures the buffer of the eager step before it, so a capture
    never allocates one (LaneError if it would have to)."""
    dev = torch.device(device)
    key = str(dev)
    c = _COUNTERS.get(key)
    if c is None or c.numel() < n:
        if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise LaneError(f"int8 ring: a graph capture needs {n} stream-K counters on {key}, more than the eager "
                            f"steps before it allocated ({0 if c is None else c.numel()})")
        c = torch.zeros(max(n, COUNTERS_MIN), dtype=torch.int32, device=dev)
        _COUNTERS[key] = c
    return c


@functools.lru_cache(maxsize=None)
def _sms_of(key: str) -> int:
    return torch.cuda.get_device_properties(torch.device(key)).multi_processor_count


def _sms(device: torch.device) -> int:
    """The device's multiprocessors (132 on an H100 and an H200); 1 off CUDA (the compile checks)."""
    return _sms_of(str(device)) if device.type == "cuda" else 1


def _need_gluon() -> None:
    if not HAVE_GLUON:
        raise RuntimeError("triton.experimental.gluon is not installed")


def _word_fields(w: QWeight) -> list[torch.Tensor]:
    """The fields in FIELDS order as the kernel reads them: byte fields as 8-byte words (a K-quant
    field is 8, 16, 32, 64 or 128 bytes a 256-block), d/dmin as stored (f16)."""
    out = []
    for k in FIELDS[w.fmt]:
        t = w.fields[k]
        out.append(t if t.dtype == torch.float16 else t.view(torch.int64))
    return out


def matmul_tile(w: QWeight, act, out: torch.Tensor | None = None, config=None,
                split: bool | None = None) -> torch.Tensor:
    """Q8_K activations (qmatmul_i8.Act) [T, K] x K-quant weight [N, K] -> f32 [T, N], bitwise
    matmul_ggml. `out` may be a column slice of a wider output (unit column stride); `config` =
    (BN, BM, num_warps, PF) overrides the table (speed only). `split`: each 1,024-element chunk
    its own program and the chunk sums added by a second launch (True), or a program walking its
    chunks (False); by default split at most SPLIT_ROWS rows. Speed only: the same additions in
    the same order either way."""
    from . import qmatmul_i8

    if w.fmt not in FORMATS:
        raise LaneError(f"tensor {w.name!r}: {G(w.fmt).name} has no int8 tile (served: "
                        f"{', '.join(f.name for f in FORMATS)})")
    out = qmatmul_i8.check_call(w, act, out)
    T, N = act.rows, w.n_out
    bn, bm, nw, pf = check_config(config) if config is not None else config_for(T)
    _need_gluon()
    ptrs = _word_fields(w)
    ptrs += [ptrs[0]] * (6 - len(ptrs))  # absent slots repeat the first field (never read)
    cb = CHUNK_ELEMS // 256
    nch = -(-(w.n_in // 256) // cb)
    split = T <= SPLIT_ROWS if split is None else bool(split)
    part = out  # never read unless split over several chunks
    if split and nch > 1:
        part = torch.empty((nch, T, N), dtype=torch.float32, device=out.device)
    grid = (nch if split else 1, -(-T // bm), -(-N // bn))  # chunks fastest (the kernel's note)
    _qtile_kernel[grid](act.qs.view(torch.int64), act.d, out, part, *ptrs, N, w.n_in, T, out.stride(0),
                       FMT=_CODE[w.fmt], BN=bn, BM=bm, NW=nw, CB=cb, SPLIT=split, PF=pf, num_warps=nw,
                       enable_fp_fusion=False, **gdc.kwargs(out))
    if split and nch > 1:
        qmatmul_i8.reduce_chunks(part, out)
    return out


def matmul_ring(w: QWeight, act, out: torch.Tensor | None = None, config=(64, 16, 4, 4),
                split: bool | None = None, group: int = 1, stream: int = 0,
                programs: int | None = None) -> torch.Tensor:
    """matmul_tile's product, bit for bit, through the ring variant (_ring_kernel: a program's next
    S - 1 blocks of code bytes and activation codes in flight as cp.async copies into shared
    memory). `config` = (BN, BM, num_warps, S); `split` as in matmul_tile; `group` (split only):
    the chunks a program sums, each into its own partial (check_group). `stream` (walking calls of
    at most BM rows): the stream-K walk (_ring_sk_kernel) on stream x SMs programs, or on
    `programs` where given (the self-check's count; `stream` still sets the registers), at most one
    a (weight tile, chunk) unit. Speed only: a call whose code bytes or activation codes do not
    start on 16 bytes runs matmul_tile (the same bits)."""
    from . import qmatmul_i8

    if w.fmt not in FORMATS:
        raise LaneError(f"tensor {w.name!r}: {G(w.fmt).name} has no int8 tile (served: "
                        f"{', '.join(f.name for f in FORMATS)})")
    out = qmatmul_i8.check_call(w, act, out)
    T, N = act.rows, w.n_out
    bn, bm, nw, s = check_ring_config(config)
    split = T <= SPLIT_ROWS if split is None else bool(split)
    group = check_group(group, split)
    if programs is not None and (isinstance(programs, bool) or not isinstance(programs, int) or programs < 1):
        raise ValueError(f"ring programs {programs!r}: expected a positive int")
    stream = check_stream(stream or (1 if programs else 0), split, T, bm)
    _need_gluon()
    f = w.fields
    if w.fmt == G.Q6_K:
        c0, c1 = f["ql"].view(torch.int8), f["qh"].view(torch.int8)
        s0, s1, s2, s3 = f["d"], f["d"], f["sc"].view(torch.int64), f["sc"].view(torch.int64)
    else:
        c0 = f["qs"].view(torch.int8)
        c1 = f["qh"].view(torch.int8) if w.fmt == G.Q5_K else c0
        s0, s1, s2, s3 = f["d"], f["dmin"], f["sc"].view(torch.int64), f["m"].view(torch.int64)
    aq = act.qs.view(torch.int8)
    if any(x.data_ptr() % 16 for x in (c0, c1, aq)):
        # the copies move 16 bytes a thread (cp.async needs the alignment); a call whose code bytes or
        # activation rows do not start on 16 bytes takes the tile, which computes the same bits
        return matmul_tile(w, act, out, split=split)
    cb = CHUNK_ELEMS // 256
    nch = -(-(w.n_in // 256) // cb)
    if stream:
        tiles = -(-N // bn)
        # `stream` programs an SM are co-resident: the registers are capped at an SM's 65,536 over
        # their threads (left alone the segment loop's indices took the kernel to 253 registers,
        # two programs an SM; capped at 168 a few values outside the ring's loop go to local memory)
        n_prog = min(tiles * nch, programs if programs is not None else stream * _sms(out.device))
        part = torch.empty((nch, T, N), dtype=torch.float32, device=out.device)  # shared tiles' chunk sums
        _ring_sk_kernel[(n_prog,)](aq, act.d, out, part, sk_counters(out.device, tiles), c0, c1, s0, s1, s2, s3, N,
                                   w.n_in, T, out.stride(0), tiles * nch, FMT=_CODE[w.fmt], BN=bn, BM=bm, NW=nw, CB=cb,
                                   NCH=nch, S=s, num_warps=nw, enable_fp_fusion=False,
                                   maxnreg=min(255, 65536 // (stream * nw * 32) // 8 * 8), **gdc.kwargs(out))
        return out
    part = out
    if split and nch > 1:
        part = torch.empty((nch, T, N), dtype=torch.float32, device=out.device)
    else:
        group = 1  # one chunk: the program stores it as the output (the grouped kernel writes partials only)
    grid = (-(-nch // group) if split else 1, -(-T // bm), -(-N // bn))
    _ring_kernel[grid](aq, act.d, out, part, c0, c1, s0, s1, s2, s3, N, w.n_in, T,
                       out.stride(0), FMT=_CODE[w.fmt], BN=bn, BM=bm, NW=nw, CB=cb, SPLIT=split, CG=group, S=s,
                       num_warps=nw, enable_fp_fusion=False, **gdc.kwargs(out))
    if split and nch > 1:
        qmatmul_i8.reduce_chunks(part, out)
    return out


@functools.lru_cache(maxsize=None)
def self_check(device: str) -> None:
    """The tile against its reference (qmatmul_i8.check_against_reference) on this device, once a
    process, before the fast lane serves a K-quant projection with it: every format at 1, 3, 16 and
    40 rows; LaneError on any differing bit."""
    from . import qmatmul_i8

    qmatmul_i8.check_against_reference("int8 tile", FORMATS, (1, 3, 16, 40), matmul_tile, device)


@functools.lru_cache(maxsize=None)
def self_check_ring(device: str, fmt: str, config, split, group: int = 1, stream: int = 0) -> None:
    """The ring variant on one format, tiling, chunk group and stream-K walk against the tile's
    reference on this device (as self_check), before the table's routes to it serve: LaneError on
    any differing bit. A grouped route is checked at the split row counts (1, 3, 16) only, where it
    serves; a stream-K route at 1, 3 and BM rows over a weight of five tiles of three chunks
    (4 x BN + 24 rows, 2,304 columns: a partial last tile) on 4 programs (whole tiles, tiles
    shared by two, first chunks of one and of two, a program with a tile's last chunks and the
    next one's first) and on 12 (tiles shared by three: a program with a tile's middle chunk)."""
    from . import qmatmul_i8

    if stream:
        bn, bm = config[0], config[1]
        for n in (4, 12):
            qmatmul_i8.check_against_reference(
                f"int8 tile's ring {list(config)} stream-K walk on {n} programs", (G[fmt],), (1, 3, bm),
                lambda w, act, n=n: matmul_ring(w, act, config=config, split=False, stream=stream, programs=n),
                device, (4 * bn + 24, 2304))
        return
    rows = (1, 3, 16, 40) if group == 1 else (1, 3, 16)
    qmatmul_i8.check_against_reference(f"int8 tile's ring {list(config)} group {group}", (G[fmt],), rows,
                                       lambda w, act: matmul_ring(w, act, config=config, split=split, group=group),
                                       device)


__all__ = ["matmul", "CONFIGS", "FORMATS", "MAX_GROUP", "MAX_STREAM", "RING_BYTES", "check_group", "check_stream", "sk_counters", "check_ring_config", "matmul_ring", "ring_bytes", "ring_routes", "self_check_ring", "HAVE_GLUON", "TUNED", "TUNING_FILE", "Route", "available", "check_config", "codes_ref", "config_for",
           "operand_elements",
           "load_tuning", "route",
           "matmul_tile", "self_check", "supports"]
