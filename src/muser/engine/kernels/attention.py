"""Attention of T new rows over one layer's KV plane plus the rows themselves (book 16).

Every call attends *before* the new rows are stored: row t (position p0 + t) sees the plane's
live rows whose logical position q satisfies the window rule (p_t - q < W on sliding layers,
llama.cpp LLAMA_SWA_TYPE_STANDARD; no limit on full layers) and new rows j <= t under the same
rule. The engine stores the new rows afterwards, so a ring chunk never overwrites a row a
later row of the same chunk still needs (the book's staging shadow, 10.10, without a copy).
New K/V arrive already rounded to the plane's element type (f16 by default), because llama.cpp
reads the current token back from its f16 cache. The plane's rows end where the new rows start
(p0 = origin_logical + len, muser.kv's next_position).

Math (f32): s = (q . k) * scale, masked softmax over all visible rows, weighted sum of V.

f32 operands (the exact lane): both dots run on tf32 tensor cores with every product exact. q
and the probabilities p are split into three tf32 parts (11 + 11 + 2 significant bits, the sum
exact); f16 plane values are tf32 values as they are (an f32 plane's are split too); each part
product (11 x 11 bits) is exact in f32, so only the accumulation rounds, as in an f32 dot: the
CUDA-core IEEE dot this replaces took ~1.9 instructions an FMA and bounded depth-32k decode.

f16 operands (`f16_operands=True`: the fast lane over f16 K/V; f32 planes refuse it): the pinned
llama.cpp CPU graph's non-flash path (llama-graph.cpp build_attn_mha) runs K·Q and V·P as
mul_mats against f16 src0, whose vec_dot_type F16 converts src1 to f16 (RNE): q is rounded to
f16 before the scores, and the probabilities after ggml's normalisation (ops.cpp soft_max:
p = e * (1/sum)) before V·P (oracle numerics.Arithmetic.attn_query / attn_probs). Every product
is then exact in f32, so the Triton kernel takes both dots on tensor cores (f16 tl.dot, f32
accumulation); the normalised p needs the row's global max and sum first, so it runs two passes
over the keys (statistics, then probabilities x V), each split at the same fixed positions. Both
passes hold scores in log2 units: exp(s - m) is 2^(fma(q.k, scale * log2 e, -m2)), one FFMA and
one ex2 an element, the same value in either pass.

* `attend_ref`  - torch; plane metadata as host ints; the reference of the Triton kernel and of
  the CPU lane's C kernel (kernels/cpu_native.attend, same arguments), and the path of devices
  with neither.
* `attend_triton` - split softmax (flash-decoding): a worker's (max, sum, acc) triple summarises
  the keys it saw, so pieces merge exactly (book 16.2); the plane's metadata and the addresses of
  its K and V storage are read from a device tensor (`plane_meta`), so one captured CUDA graph
  serves every position of every session (book 10.3, CUDA graphs).

Row invariance (DESIGN.md "Exactness contract", Gate 3): with or without f16 operands, a row's
output at position p is bitwise the same whether it is decoded alone, verified as row j of a
block, prefilled in any chunking or stepped beside other sequences' rows. So every reduction order of
`attend_triton` is fixed by absolute logical positions, never by T, the plane's length or its
capacity:

* keys go in blocks of BS positions [BS*b, BS*(b + 1)) (BS = BLOCK_EXACT, at most S, with f32
  operands; BLOCK with f16 operands; one step of the loop each) inside splits of S
  positions [S*s, S*(s+1)), S = SPLIT_SLIDING on sliding layers and SPLIT_FULL on full ones;
* a key position below p0 is read from the plane at slot (origin_physical + pos -
  origin_logical) % capacity, one at or above p0 from the new rows (row pos - p0): the same
  value either way, so it does not matter which side of p0 a key fell in a given call;
* visibility depends on the row position and origin_logical only: pos <= p_t, p_t - pos < W on
  sliding layers, pos >= origin_logical;
* one program per (group of rows, KV head, split) runs each row's online softmax over the
  blocks of the split that some row of the group sees, in ascending order, each key block read
  once for the group (ROW_GROUP_F16 / ROW_GROUP_EXACT rows, fixed for every row count, a decoded
  row being a group with idle rows); a row is masked off a block it does not see, which leaves
  its (max, sum, acc) bitwise as they were, so a row's bits are its visible blocks'. The reduce
  takes the (order-free) max over the row's splits, then accumulates l and o weighted by
  exp(m - max) per lane of REDUCE_CHUNK splits aligned at absolute split indices, chunks in
  ascending order, and sums the lanes in one fixed-size tree.
  Only splits holding a key the row sees take part; masked keys and lanes weigh exactly 0.
  With f16 operands the first pass's reduce stores the row's (max, 1 / sum) instead, the second
  pass recomputes the same scores, and its reduce sums the splits' P·V in the same lane order.

The grid is sized from bounds (the plane's capacity, or its length where the host knows it) and
programs whose split holds nothing the row sees exit at once, so the launch shape never reaches
the arithmetic. Rows are launched in groups that fit the scratch (AttnScratch, allocated once).
"""

from __future__ import annotations

import torch

from . import gdc
from .interpreter import compiled

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover
    HAVE_TRITON = False


def plane_strides(plane: torch.Tensor, head_major: bool, n_kv: int, head_dim: int) -> tuple[int, int]:
    """(slot stride, head stride) in elements: token-major [cap, H*D] or head-major [H, cap, D]."""
    if head_major:
        assert plane.dim() == 3 and plane.shape[0] == n_kv and plane.shape[2] == head_dim
        return plane.stride(1), plane.stride(0)
    assert plane.dim() == 2 and plane.shape[1] == n_kv * head_dim
    return plane.stride(0), head_dim


META_FIELDS = 6  # a plane's device metadata: plane_meta's fields, one int64 each


def plane_meta(k_plane: torch.Tensor, v_plane: torch.Tensor, head_major: bool, n_kv: int, head_dim: int,
               origin_logical: int, origin_physical: int, length: int) -> list[int]:
    """A plane's metadata as the kernels read it (int64 [META_FIELDS]): (origin_logical,
    origin_physical, len, capacity, K storage address, V storage address), the state before the
    step's append. The kernels form every address from these, so a captured graph reads the
    storage of whichever session the step's metadata names. Checked here, since the kernels
    cannot: both planes contiguous, of one dtype, token-major [cap, n_kv*D] or head-major
    [n_kv, cap, D], 16-byte aligned (the kernels' vector loads assume it), indexed in int32."""
    shape = tuple(k_plane.shape)
    cap = shape[1] if head_major else shape[0]
    want = (n_kv, cap, head_dim) if head_major else (cap, n_kv * head_dim)
    if shape != want or tuple(v_plane.shape) != want:
        raise ValueError(f"plane of shape {shape} / {tuple(v_plane.shape)}: expected {want} "
                         f"({'head' if head_major else 'token'}-major)")
    if k_plane.dtype != v_plane.dtype or not (k_plane.is_contiguous() and v_plane.is_contiguous()):
        raise ValueError(f"planes of {k_plane.dtype} / {v_plane.dtype} must share a dtype and be contiguous")
    if k_plane.numel() >= 2**31:
        raise ValueError(f"plane of {k_plane.numel()} elements: the kernels index in int32")
    ka, va = k_plane.data_ptr(), v_plane.data_ptr()
    if ka % 16 or va % 16:
        raise ValueError(f"plane storage at {ka:#x} / {va:#x} is not 16-byte aligned")
    if not (0 <= length <= cap and 0 <= origin_physical < max(cap, 1) and origin_logical >= 0):
        raise ValueError(f"plane state (origin_logical {origin_logical}, origin_physical {origin_physical}, "
                         f"len {length}) outside a capacity of {cap}")
    return [origin_logical, origin_physical, length, cap, ka, va]


def plane_meta_of(plane) -> list[int]:
    """plane_meta of a muser.kv plane (its storage and its state before the step's append)."""
    g = plane.geometry
    return plane_meta(plane.keys, plane.values, g.head_major, g.n_kv_heads, g.head_dim, plane.origin_logical,
                      plane.origin_physical, plane.len)


def _old_rows(plane: torch.Tensor, physical: torch.Tensor, head_major: bool, n_kv: int, d: int) -> torch.Tensor:
    """Rows at `physical` slots as [n, n_kv, D] f32."""
    if head_major:
        return plane[:, physical, :].transpose(0, 1).to(torch.float32)
    return plane[physical].view(-1, n_kv, d).to(torch.float32)


def attend_ref(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
               k_plane: torch.Tensor, v_plane: torch.Tensor, head_major: bool,
               origin_logical: int, origin_physical: int, length: int, capacity: int,
               p0: int, window: int, scale: float, q_chunk: int = 128,
               f16_operands: bool = False) -> torch.Tensor:
    """q [T, H, D] f32; k_new, v_new [T, n_kv, D] (plane dtype); -> [T, H, D] f32.

    window = 0 means full attention (NoPE layer). f16_operands: q and the normalised p rounded
    to f16 before their dots (f16 planes only; see the module docstring)."""
    T, H, D = q.shape
    assert not f16_operands or k_plane.dtype == torch.float16, f"f16 operands over a {k_plane.dtype} plane"
    n_kv = k_new.shape[1]
    hpk = H // n_kv
    dev = q.device
    # Visible old rows for any row of the chunk: logical [lo, origin_logical + length).
    lo = origin_logical if window == 0 else max(origin_logical, p0 - window + 1)
    hi = origin_logical + length
    if hi > lo:
        logical = torch.arange(lo, hi, device=dev, dtype=torch.int64)
        physical = (origin_physical + logical - origin_logical) % capacity
        k_old = _old_rows(k_plane, physical, head_major, n_kv, D)
        v_old = _old_rows(v_plane, physical, head_major, n_kv, D)
    else:
        logical = torch.empty(0, device=dev, dtype=torch.int64)
        k_old = torch.empty((0, n_kv, D), device=dev, dtype=torch.float32)
        v_old = k_old
    keys = torch.cat([k_old, k_new.to(torch.float32)], 0)  # [S, n_kv, D]
    vals = torch.cat([v_old, v_new.to(torch.float32)], 0)
    kpos = torch.cat([logical, torch.arange(p0, p0 + T, device=dev, dtype=torch.int64)])  # [S]
    kg = keys.permute(1, 2, 0)  # [n_kv, D, S]
    vg = vals.permute(1, 0, 2)  # [n_kv, S, D]
    out = torch.empty((T, H, D), dtype=torch.float32, device=dev)
    for t0 in range(0, T, q_chunk):
        t1 = min(T, t0 + q_chunk)
        qpos = torch.arange(p0 + t0, p0 + t1, device=dev, dtype=torch.int64)  # [t]
        vis = kpos[None, :] <= qpos[:, None]  # causal
        if window:
            vis &= (qpos[:, None] - kpos[None, :]) < window  # SWA: p1 - p0 < W
        qg = q[t0:t1].reshape(t1 - t0, n_kv, hpk, D).permute(1, 0, 2, 3).reshape(n_kv, -1, D)
        if f16_operands:
            qg = qg.to(torch.float16).to(torch.float32)  # Q enters K·Q as f16
        s = torch.bmm(qg, kg).view(n_kv, t1 - t0, hpk, -1) * scale  # [n_kv, t, hpk, S]
        if T > 1:  # one row sees every gathered row (the gather starts at its window)
            s = s.masked_fill(~vis[None, :, None, :], float("-inf"))
        m = s.amax(-1, keepdim=True)
        p = torch.exp(s - m)
        if f16_operands:  # ggml soft_max's p = e * (1/sum), then P enters V·P as f16
            p = (p * (1.0 / p.sum(-1, keepdim=True))).to(torch.float16).to(torch.float32)
        else:
            p = p / p.sum(-1, keepdim=True)
        o = torch.bmm(p.view(n_kv, -1, p.shape[-1]), vg)  # [n_kv, t*hpk, D]
        out[t0:t1] = o.view(n_kv, t1 - t0, hpk, D).permute(1, 0, 2, 3).reshape(t1 - t0, H, D)
    return out


# Split lengths in positions (multiples of BLOCK). Sliding layers: 64, so a 2,048 window spreads
# over ~33 programs per KV head (64-position splits took the depth-32,768 decode attention from
# 3.85 to 2.21 ms: bench/NOTES.md item 9). Full layers: 256, so a depth-32,768 decode still runs
# 258 programs (H200: 132 SMs) while a 131,072 context needs 514 partials per row, not 2,050.
# Changing either changes the exact lane's bits (they fix the reduction order).
SPLIT_SLIDING = 64
SPLIT_FULL = 256
# Keys per tl.dot step with f16 operands. With 4 rows a program and 4 warps, 32 keys beat 16 at
# both depths and both row counts on the H100 sweep (tools/device_attn.py --sweep-f16, all 52
# layers: depth 64, 0.642 / 0.817 ms at 1 / 16 rows against 0.676 / 0.851; depth 32,768, 0.958 /
# 2.223 against 1.105 / 2.288; bench/reports/device-20261206i-h100/call1/attn.json).
BLOCK = 32
BLOCK_EXACT = 64  # keys per step of the f32-operand (exact-split tf32) pass, at most a split


# Launch options of the partial kernel (warps, software-pipelined key blocks in flight), the same
# for every row count (row invariance); the warps set the layout of a block's max and sum, so
# they are part of the exact lane's bits. 8 warps, 2 stages: the H200 sweep's best for decode at
# both layer kinds and depths 2,048 and 32,768 (tools/device_attn.py, bench/NOTES.md).
PARTIAL_LAUNCH = {"num_warps": 8, "num_stages": 2}
F16_LAUNCH = {"num_warps": 4}
# Rows per partial program (a group reads each key block once for all its rows; the dots' M is
# the group's rows x the padded heads). Fixed for every row count, like the launch options: a
# decoded row is a group with idle rows. The f16-operand passes take 4 (M = 64 at 16 heads a KV
# head); the exact lane's three-part tf32 dots keep 1.
ROW_GROUP_F16 = 4
ROW_GROUP_EXACT = 1


def block_len(S: int, f16_operands: bool) -> int:
    """Keys per step of a call's partial kernel: a divisor of the split length S, so the
    blocks, like the splits, sit at fixed absolute positions."""
    bs = BLOCK if f16_operands else min(BLOCK_EXACT, S)
    assert S % bs == 0, f"split of {S} positions is not a multiple of {bs}-key blocks"
    return bs
REDUCE_CHUNK = 32  # split partials merged per step of the reduce


def split_len(window: int) -> int:
    """Positions per split of a layer: SPLIT_SLIDING with a window, SPLIT_FULL without."""
    return SPLIT_SLIDING if window > 0 else SPLIT_FULL


def _span(r0: int, r1: int, plane_rows: int, window: int) -> int:
    """A bound on how many key positions rows [r0, r1) of a call can see together: from row
    r0's first visible position to p0 + r1 - 1, where p0 - origin_logical <= plane_rows."""
    n = plane_rows + r1
    if window > 0:
        n = min(n, window - 1 + r1 - r0)
    return n


def _splits_over(n: int, s: int) -> int:
    """Splits of s positions that a run of n >= 1 consecutive positions can touch."""
    return (n + s - 2) // s + 1


def split_count(rows: int, capacity: int, window: int) -> int:
    """Split programs per row that a call of `rows` rows over a plane of `capacity` can launch:
    the grid bound, and what AttnScratch's `splits` must cover (not part of the arithmetic)."""
    return _splits_over(_span(0, rows, capacity, window), split_len(window))


def row_groups(T: int, rows_bound: int, window: int, units: int) -> list[tuple[int, int]]:
    """The launches of a T-row call over a plane of at most `rows_bound` rows: consecutive row
    ranges [r0, r1), each as many rows as a scratch of `units` (row, split) partials per head
    holds at the splits a row of such a launch can touch. Only the launch count depends on it:
    a row's splits sit at fixed absolute positions and merge in one order (module docstring)."""
    S = split_len(window)

    def per_row(g: int) -> int:  # splits per row of any launch of g consecutive rows (>= _span's)
        return _splits_over(min(rows_bound + T, window - 1 + g) if window > 0 else rows_bound + T, S)

    group = min(T, units)
    while group > 1 and group * per_row(group) > units:
        group = max(1, min(group - 1, units // per_row(group)))
    assert group * per_row(group) <= units, (
        f"attention scratch of {units} partials per head is too small for {per_row(1)} splits per row")
    return [(r0, min(T, r0 + group)) for r0 in range(0, T, group)]


def scratch_units(verify_rows: int, chunk: int, capacity: int, window: int) -> int:
    """(row, split) partials per head a session's scratch holds for a plane of `capacity`: a
    verify block of `verify_rows` at any position, and a prefill chunk of `chunk` rows over an empty
    plane, each in one launch a pass (a chunk deeper in the context runs in row_groups)."""
    return max(verify_rows * split_count(verify_rows, capacity, window), chunk * split_count(chunk, 0, window))


if HAVE_TRITON:
    from .gdc import after_prior

    @triton.jit
    def _tf32_hi(x):
        # x with its 13 low mantissa bits cleared: a tf32 value (11 significant bits), |hi| <= |x|
        return (x.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)

    @triton.jit
    def _tf32_parts(x):
        # x = a + b + c exactly, each a tf32 value: a takes 11 significant bits, b the next 11,
        # c the last 2 (x - a and r - b are exact: Sterbenz, same sign, within a factor 2)
        a = _tf32_hi(x)
        r = x - a
        b = _tf32_hi(r)
        return a, b, r - b

    @triton.jit
    def _dot_exact(a1, a2, a3, b, acc, SPLIT_B: tl.constexpr):
        # acc + (a1 + a2 + a3) @ b on tf32 tensor cores, every product exact (11 x 11 significant
        # bits fit f32's 24), the parts added smallest first. b: f16 plane values are tf32 values
        # already; an f32 plane's (SPLIT_B) go in three parts too (nine dots).
        if SPLIT_B:
            b1, b2, b3 = _tf32_parts(b)
            acc = tl.dot(a3, b3, acc, input_precision="tf32")
            acc = tl.dot(a3, b2, acc, input_precision="tf32")
            acc = tl.dot(a2, b3, acc, input_precision="tf32")
            acc = tl.dot(a3, b1, acc, input_precision="tf32")
            acc = tl.dot(a2, b2, acc, input_precision="tf32")
            acc = tl.dot(a1, b3, acc, input_precision="tf32")
            acc = tl.dot(a2, b1, acc, input_precision="tf32")
            acc = tl.dot(a1, b2, acc, input_precision="tf32")
            acc = tl.dot(a1, b1, acc, input_precision="tf32")
        else:
            acc = tl.dot(a3, b, acc, input_precision="tf32")
            acc = tl.dot(a2, b, acc, input_precision="tf32")
            acc = tl.dot(a1, b, acc, input_precision="tf32")
        return acc

    @triton.jit
    def _ex2_ftz(x, ASM: tl.constexpr):
        # 2^x by ex2.approx with results below 2^-126 flushed to 0 (tl.math.exp2's non-flushing
        # ex2 costs a compare and two predicated multiplies an element). Where it is used a flushed
        # value changes no stored bit: a p under 2^-126 is 0 after p * (1 / sum) (<= p) rounds to
        # f16, and a split's sum holds ~1 (its running max's own term), which absorbs it. The
        # interpreter has no PTX: tl.math.exp2 there.
        if ASM:
            return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                             is_pure=True, pack=1)
        else:
            return tl.math.exp2(x)

    @triton.jit
    def _plane(meta, i: tl.constexpr, like):
        # the storage address in meta[i] (plane_meta) as a pointer of `like`'s element type, 16-byte
        # aligned (plane_meta checks it): the hint keeps the row loads vectorized, which an address
        # formed from an integer otherwise loses
        return tl.multiple_of(tl.load(meta + i).to(tl.pointer_type(like.dtype.element_ty)), 16)

    @triton.jit
    def _plane_strides(cap, KV: tl.constexpr, D: tl.constexpr, HEAD_MAJOR: tl.constexpr):
        # (slot, head) strides in elements of a contiguous plane: [KV, cap, D] or [cap, KV*D]
        if HEAD_MAJOR:
            return D, cap * D
        else:
            return KV * D, D

    @triton.jit
    def _store_partial(m_out, l_out, o_out, m_i, l_i, acc, r, H, head, NSP, k, keep, dd, D: tl.constexpr,
                       PASS: tl.constexpr):
        # a split's (m, l, acc) of the lanes in keep, as its pass writes them
        row = (r * H + head) * NSP + k  # [M]
        if PASS < 2:
            tl.store(m_out + row, m_i, mask=keep)
            tl.store(l_out + row, l_i, mask=keep)
        if PASS != 1:
            tl.store(o_out + row[:, None] * D + dd[None, :], acc, mask=keep[:, None])

    @triton.jit(do_not_specialize=["r0", "NR", "NSP", "window"])
    def _attn_partial(q, kn, vn, meta, pos, m_out, l_out, o_out, st_m, st_inv,
                      r0, NR, H, NSP, window, scale,
                      s_qt, s_qh, s_nt, s_nh,
                      HPK: tl.constexpr, HP: tl.constexpr, RG: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                      KV: tl.constexpr, HEAD_MAJOR: tl.constexpr, S: tl.constexpr, PASS: tl.constexpr,
                      SPLIT_KV: tl.constexpr, PDL: tl.constexpr, ASM: tl.constexpr):
        # PASS 0: f32 operands, online softmax -> (m, l, acc) per split; both dots on tf32 tensor
        # cores with every product exact (_dot_exact; SPLIT_KV: f32 planes, K and V split too).
        # f16 operands, PASS 1: (m, l) per split from f16 K·Q; PASS 2: p = f16(exp(s - m_row) *
        # inv_row) with the row's reduced statistics (st_m, st_inv), acc = P·V per split.
        # One program takes RG consecutive rows of the launch (a group; rows past NR idle) and one
        # KV head: the dots' M is RG x HP lanes, lane m = row (m // HP), head (m % HP), so a key block
        # is read once for the group's rows while each lane's arithmetic is the row-alone's (a row
        # is masked off the blocks it does not see, and such a block changes none of its bits).
        g = tl.program_id(1)  # KV head
        k = tl.program_id(2)  # split, counted from the launch's first
        # the step's metadata and first position come from the host's upload before the step, which
        # no kernel writes: which keys a program sees is known before the wait below, so a program
        # whose split no row of its group sees (a graph's grid is sized for its bound, not for the
        # plane's length) exits without waiting for the previous kernel and stores nothing
        ol = tl.load(meta + 0).to(tl.int32)  # positions and offsets fit int32 (asserted by the host)
        p0 = tl.load(pos).to(tl.int32)
        mm = tl.arange(0, RG * HP)
        r = tl.program_id(0) * RG + mm // HP  # [M] the lane's row of this launch (row r0 + r of the call)
        hh = mm % HP
        live = r < NR
        pt = p0 + r0 + r  # [M] the lane's row position
        # the lowest visible key position: of the lane's row, and of the launch's first row
        lo = tl.where(window > 0, tl.maximum(ol, pt - window + 1), ol)
        lo_first = tl.where(window > 0, tl.maximum(ol, p0 + r0 - window + 1), ol)
        s = lo_first // S + k  # absolute split index
        a = tl.maximum(lo, s * S)
        b = tl.minimum(pt + 1, s * S + S)  # [a, b): what the lane's row sees of split s
        sees = live & (a < b)
        # the group's rows see [a_g, b_g) of the split together (consecutive rows: one interval)
        a_g = tl.min(tl.where(sees, a, s * S + S), 0)
        b_g = tl.max(tl.where(sees, b, s * S), 0)
        hmask = (hh < HPK) & live
        dd = tl.arange(0, D)
        head = g * HPK + hh
        c = scale * 1.4426950408889634  # the f16 passes' scores in log2 units: s * log2(e)
        if PASS > 0:  # the f16 passes store after the branch below: the empty triple where not taken
            m_i = tl.full([RG * HP], float("-inf"), tl.float32)
            l_i = tl.zeros([RG * HP], tl.float32)
            acc = tl.zeros([RG * HP, D], tl.float32)
        if a_g < b_g:
            after_prior(PDL)  # gdc.py: the previous kernel done before the first read of K, V or q
            op = tl.load(meta + 1).to(tl.int32)
            ln = tl.load(meta + 2).to(tl.int32)
            cap = tl.load(meta + 3).to(tl.int32)
            kp = _plane(meta, 4, kn)  # the session's K and V storage (plane_meta)
            vp = _plane(meta, 5, vn)
            s_slot, s_head = _plane_strides(cap, KV, D, HEAD_MAJOR)
            qv = tl.load(q + (r0 + r)[:, None] * s_qt + head[:, None] * s_qh + dd[None, :], mask=hmask[:, None],
                         other=0.0)
            if PASS > 0:
                qv = qv.to(tl.float16)  # Q enters K·Q as f16 (RNE); padded heads are 0
            q1, q2, q3 = _tf32_parts(qv.to(tl.float32))  # PASS 0: q = q1 + q2 + q3 exactly
            if PASS == 2:
                st = r * H + head
                m_row = tl.load(st_m + st, mask=hmask, other=0.0)
                inv = tl.load(st_inv + st, mask=hmask, other=0.0)
            if PASS == 0:
                m_i = tl.full([RG * HP], float("-inf"), tl.float32)
                l_i = tl.zeros([RG * HP], tl.float32)
                acc = tl.zeros([RG * HP, D], tl.float32)
            cc = tl.arange(0, BS)
            pend = ol + ln  # the plane holds [ol, pend); the new rows start at p0
            blk0 = a_g // BS
            for i in range(0, (b_g - 1) // BS + 1 - blk0):
                kpos = (blk0 + i) * BS + cc  # [BS] absolute key positions of block blk0 + i
                held = (kpos < pend) | (kpos >= p0)
                valid = (kpos >= a_g) & (kpos < b_g) & held  # [BS] seen by some row of the group
                seen = held[None, :] & (kpos[None, :] >= a[:, None]) & (kpos[None, :] < b[:, None])  # [M, BS]
                old = valid & (kpos < p0)
                new = valid & (kpos >= p0)
                # op < cap and an old key's kpos - ol < len <= cap (plane_meta checks both), so the
                # slot (op + kpos - ol) % cap is one conditional subtraction, not an integer division
                slot = op + tl.where(old, kpos - ol, 0)
                slot = tl.where(slot >= cap, slot - cap, slot)
                j = tl.where(new, kpos - p0, 0)
                po = slot[:, None] * s_slot + g * s_head + dd[None, :]
                pn = j[:, None] * s_nt + g * s_nh + dd[None, :]
                if PASS == 0:
                    kt = tl.load(tl.where(old[:, None], kp + po, kn + pn), mask=valid[:, None],
                                 other=0.0).to(tl.float32)  # [BS, D]
                    vt = tl.load(tl.where(old[:, None], vp + po, vn + pn), mask=valid[:, None],
                                 other=0.0).to(tl.float32)
                    # the block into the running softmax (book 16.2); masked keys weigh exactly 0
                    sc = _dot_exact(q1, q2, q3, tl.trans(kt), tl.zeros([RG * HP, BS], tl.float32), SPLIT_KV) * scale
                    sc = tl.where(seen, sc, float("-inf"))
                    m_new = tl.maximum(m_i, tl.max(sc, 1))
                    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing visible yet
                    alpha = tl.exp(m_i - m_safe)
                    p = tl.exp(sc - m_safe[:, None])
                    l_i = l_i * alpha + tl.sum(p, 1)
                    p1, p2, p3 = _tf32_parts(p)
                    acc = _dot_exact(p1, p2, p3, vt, acc * alpha[:, None], SPLIT_KV)  # [M, D]
                    m_i = m_new
                else:
                    # f16 K (the plane's own values), exact f16 x f16 products, f32 accumulation
                    kt = tl.load(tl.where(old[:, None], kp + po, kn + pn), mask=valid[:, None], other=0.0)
                    sc = tl.dot(qv, tl.trans(kt), out_dtype=tl.float32)  # [M, BS] q·k, unscaled
                    sc = tl.where(seen, sc, float("-inf"))
                    # exp(s - m) as 2^(fma(q·k, c, -m2)), c = scale * log2(e), m2 = the max in log2 units:
                    # one FFMA and one ex2 an element, and both passes form the same value
                    if PASS == 1:
                        m_new = tl.maximum(m_i, tl.max(sc, 1) * c)  # c > 0: max(q·k) * c = max(q·k * c)
                        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                        l_i = (l_i * _ex2_ftz(m_i - m_safe, ASM)
                               + tl.sum(_ex2_ftz(tl.fma(sc, c, -m_safe[:, None]), ASM), 1))
                        m_i = m_new
                    else:
                        # ggml soft_max's p = e * (1/sum), rounded to f16 for V·P; masked keys 0
                        pt16 = (_ex2_ftz(tl.fma(sc, c, -m_row[:, None]), ASM) * inv[:, None]).to(tl.float16)
                        vt = tl.load(tl.where(old[:, None], vp + po, vn + pn), mask=valid[:, None], other=0.0)
                        acc += tl.dot(pt16, vt, out_dtype=tl.float32)  # [M, D]
            if PASS == 0:
                _store_partial(m_out, l_out, o_out, m_i, l_i, acc, r, H, head, NSP, k, hmask & sees, dd, D, PASS)
        # the f16 passes store after the branch (keep is empty where it was not taken); the exact
        # pass inside it: each placement was the faster for its pass on the H200 (bench/NOTES.md)
        if PASS > 0:
            _store_partial(m_out, l_out, o_out, m_i, l_i, acc, r, H, head, NSP, k, hmask & sees, dd, D, PASS)

    @triton.jit(do_not_specialize=["r0", "NSP", "window"])
    def _attn_reduce(m_in, l_in, o_in, out, st_m, st_inv, meta, pos, r0, H, NSP, window, s_ot, s_oh,
                     D: tl.constexpr, S: tl.constexpr, SC: tl.constexpr, PASS: tl.constexpr, PDL: tl.constexpr):
        # PASS 0: out = sum_s o_s w_s / sum_s l_s w_s, w_s = exp(m_s - max). f16 operands (m_s in
        # log2 units, w_s = 2^(m_s - max)): PASS 1 stores the row's (max, 1 / sum_s l_s w_s);
        # PASS 2: out = sum_s o_s (p normalised).
        after_prior(PDL)
        r = tl.program_id(0)
        h = tl.program_id(1)
        ol = tl.load(meta + 0).to(tl.int32)
        p0 = tl.load(pos).to(tl.int32)
        pt = p0 + r0 + r
        lo = tl.where(window > 0, tl.maximum(ol, pt - window + 1), ol)
        lo_first = tl.where(window > 0, tl.maximum(ol, p0 + r0 - window + 1), ol)
        s_lo = lo // S  # the row's splits [s_lo, s_hi], none empty
        s_hi = pt // S
        base = (r * H + h) * NSP - lo_first // S  # + s: split s's partial
        c0 = s_lo // SC
        n_chunks = s_hi // SC + 1 - c0
        cc = tl.arange(0, SC)
        dd = tl.arange(0, D)
        mx = tl.full([SC], float("-inf"), tl.float32)
        for i in range(0, n_chunks):
            s = (c0 + i) * SC + cc  # lane i of chunk c holds split c * SC + i
            ok = (s >= s_lo) & (s <= s_hi)
            mx = tl.maximum(mx, tl.load(m_in + base + s, mask=ok, other=float("-inf")))
        m_row = tl.max(mx, 0)  # finite: row t always sees itself
        den = tl.zeros([SC], tl.float32)
        num = tl.zeros([SC, D], tl.float32)
        for i2 in range(0, n_chunks):
            s = (c0 + i2) * SC + cc
            ok = (s >= s_lo) & (s <= s_hi)
            if PASS == 2:
                num += tl.load(o_in + (base + s)[:, None] * D + dd[None, :], mask=ok[:, None], other=0.0)
            else:
                m_s = tl.load(m_in + base + s, mask=ok, other=float("-inf"))
                w = tl.where(ok, tl.math.exp2(m_s - m_row) if PASS == 1 else tl.exp(m_s - m_row), 0.0)
                den += tl.load(l_in + base + s, mask=ok, other=0.0) * w
                if PASS == 0:
                    num += tl.load(o_in + (base + s)[:, None] * D + dd[None, :], mask=ok[:, None],
                                   other=0.0) * w[:, None]
        if PASS == 0:
            tl.store(out + (r0 + r) * s_ot + h * s_oh + dd, tl.sum(num, 0) / tl.sum(den, 0))
        elif PASS == 1:
            tl.store(st_m + r * H + h, m_row)
            tl.store(st_inv + r * H + h, 1.0 / tl.sum(den, 0))
        else:
            tl.store(out + (r0 + r) * s_ot + h * s_oh + dd, tl.sum(num, 0))


class AttnScratch:
    """Partial-softmax buffers for `rows` rows x `splits` split programs per row (or any grouping
    of the same size), allocated once (graph-safe)."""

    def __init__(self, rows: int, H: int, D: int, splits: int, device):
        self.rows = rows
        self.splits = splits
        n = rows * H * splits
        self.m = torch.empty(n, dtype=torch.float32, device=device)
        self.l = torch.empty(n, dtype=torch.float32, device=device)
        self.o = torch.empty(n * D, dtype=torch.float32, device=device)
        # f16 operands: each row's max and 1 / sum; a launch may group up to rows x splits rows
        # (attend_triton's `group`), so they are sized for that many
        self.st_m = torch.empty(n, dtype=torch.float32, device=device)
        self.st_inv = torch.empty(n, dtype=torch.float32, device=device)


def attend_triton(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, head_major: bool,
                  meta: torch.Tensor, pos: torch.Tensor, window: int, scale: float,
                  scratch: AttnScratch, rows_bound: int, out: torch.Tensor | None = None,
                  f16_operands: bool = False) -> torch.Tensor:
    """As attend_ref, with the plane in device memory: meta int64 [META_FIELDS] as `plane_meta`
    writes it (the state before the append and the storage addresses); pos int64 [1] = p0.

    rows_bound: an upper bound on the plane's len (its length, where the host knows it; a graph's
    bound on every capacity it serves), which only sizes the grid. Rows go in launches of as many
    as the scratch holds; neither choice changes a bit of the result. f16_operands: K·Q and V·P on
    f16 operands (f16 planes only), in two passes (module docstring)."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed")
    T, H, D = q.shape
    n_kv = k_new.shape[1]
    hpk = H // n_kv
    assert q.dtype == torch.float32 and q.stride(2) == 1
    # one set of strides serves both (the kernel's s_nt, s_nh); a dimension of size 1 is never stepped
    assert k_new.shape == v_new.shape == (T, n_kv, D) and all(
        a == b or n == 1 for a, b, n in zip(k_new.stride(), v_new.stride(), k_new.shape)), (k_new.stride(), v_new.stride())
    assert k_new.stride(2) == 1
    assert k_new.dtype in (torch.float16, torch.float32)
    assert not f16_operands or k_new.dtype == torch.float16, f"f16 operands over a {k_new.dtype} plane"
    assert meta.dtype == torch.int64 and meta.numel() >= META_FIELDS and pos.dtype == torch.int64
    assert D >= 16 and (D & (D - 1)) == 0, f"head_dim {D} must be a power of two >= 16"
    assert k_new.numel() < 2**31, "the kernel indexes in int32"
    assert rows_bound >= 0, f"rows_bound {rows_bound}"
    S = split_len(window)
    bs = block_len(S, f16_operands)
    units = scratch.rows * scratch.splits  # (row, split) partials per head the scratch holds
    assert scratch.m.numel() >= units * H and scratch.st_m.numel() >= units * H and scratch.o.numel() < 2**31
    groups = row_groups(T, rows_bound, window, units)
    if out is None:
        out = torch.empty((T, H, D), dtype=torch.float32, device=q.device)
    assert out.shape == (T, H, D) and out.dtype == torch.float32 and out.stride(2) == 1
    hp = max(16, triton.next_power_of_2(hpk))  # tl.dot's M >= 16: padded heads load q = 0
    sc = scratch
    for r0, r1 in groups:
        nsp = _splits_over(_span(r0, r1, rows_bound, window), S)
        for ps in ((1, 2) if f16_operands else (0,)):
            rg = ROW_GROUP_F16 if ps else ROW_GROUP_EXACT
            _attn_partial[(triton.cdiv(r1 - r0, rg), n_kv, nsp)](
                q, k_new, v_new, meta, pos, sc.m, sc.l, sc.o, sc.st_m, sc.st_inv,
                r0, r1 - r0, H, nsp, window, scale,
                q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1),
                HPK=hpk, HP=hp, RG=rg, D=D, BS=bs, KV=n_kv, HEAD_MAJOR=head_major, S=S, PASS=ps,
                SPLIT_KV=k_new.dtype == torch.float32, ASM=compiled(),
                **(PARTIAL_LAUNCH if ps == 0 else F16_LAUNCH), **gdc.kwargs(q))
            _attn_reduce[(r1 - r0, H)](sc.m, sc.l, sc.o, out, sc.st_m, sc.st_inv, meta, pos, r0, H, nsp, window,
                                       out.stride(0), out.stride(1), D=D, S=S, SC=REDUCE_CHUNK, PASS=ps,
                                       num_warps=4, **gdc.kwargs(q))
    return out


__all__ = ["BLOCK", "BLOCK_EXACT", "HAVE_TRITON", "META_FIELDS", "REDUCE_CHUNK", "ROW_GROUP_EXACT", "ROW_GROUP_F16",
           "SPLIT_FULL", "SPLIT_SLIDING",
           "AttnScratch", "attend_ref", "attend_triton", "block_len", "plane_meta", "plane_meta_of", "plane_strides",
           "row_groups", "scratch_units", "split_count", "split_len"]


# --- the step's new K/V rows: rounded to the plane type once, stored into both planes once ------
# (graph steps: one launch each instead of a cast per K and V and an index_copy per plane; the
# graph launch costs host time per node, bench/NOTES.md "the step profile")

if HAVE_TRITON:

    @triton.jit
    def _kv_round_kernel(k, v, kq, vq, E, s_k, s_v, BLOCK: tl.constexpr, PDL: tl.constexpr):
        after_prior(PDL)
        t = tl.program_id(0).to(tl.int64)  # row
        i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] of the row's E = KV * D values
        m = i < E
        # f32 -> the plane's type, round to nearest even: torch's .to, what the store keeps
        tl.store(kq + t * E + i, tl.load(k + t * s_k + i, mask=m).to(kq.dtype.element_ty), mask=m)
        tl.store(vq + t * E + i, tl.load(v + t * s_v + i, mask=m).to(vq.dtype.element_ty), mask=m)

    @triton.jit
    def _kv_store_kernel(kq, vq, meta, widx, s_row, KV: tl.constexpr, D: tl.constexpr, HEAD_MAJOR: tl.constexpr,
                         PDL: tl.constexpr):
        after_prior(PDL)
        t = tl.program_id(0)
        h = tl.program_id(1)
        kp = _plane(meta, 4, kq)  # the session's K and V storage (plane_meta)
        vp = _plane(meta, 5, vq)
        s_slot, s_head = _plane_strides(tl.load(meta + 3), KV, D, HEAD_MAJOR)
        d = tl.arange(0, D)
        slot = tl.load(widx + t)  # int64: the slot offset is formed in 64 bits
        src = t * s_row + h * D + d
        dst = slot * s_slot + h * s_head + d
        tl.store(kp + dst, tl.load(kq + src))
        tl.store(vp + dst, tl.load(vq + src))


def kv_round(k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v f32 [T, KV, D], each row's heads packed (strides (any, D, 1): a row slice of a wider
    projection output, such as v of the stacked q|k|v, is read in place) -> both rounded to
    `dtype` (RNE) into contiguous tensors, in one launch; f32 planes take the rows as they are
    (contiguous)."""
    assert k.shape == v.shape and k.dim() == 3 and k.dtype == v.dtype == torch.float32
    T, n_kv, D = k.shape
    for x in (k, v):
        assert (x.stride(2) == 1 or D == 1) and (x.stride(1) == D or n_kv == 1), \
            f"rows of packed heads, got strides {x.stride()}"
    if dtype == torch.float32:
        return k.contiguous(), v.contiguous()
    kq = torch.empty(k.shape, dtype=dtype, device=k.device)
    vq = torch.empty(v.shape, dtype=dtype, device=v.device)
    if T == 0:
        return kq, vq
    E = n_kv * D
    B = 1024
    _kv_round_kernel[(T, triton.cdiv(E, B))](k, v, kq, vq, E, k.stride(0), v.stride(0), BLOCK=B, num_warps=4,
                                             **gdc.kwargs(k))
    return kq, vq


def kv_store(kq: torch.Tensor, vq: torch.Tensor, meta: torch.Tensor, widx: torch.Tensor, head_major: bool) -> None:
    """Row t of kq / vq [T, KV, D] (the plane's type, contiguous) into slot widx[t] (int64 [T],
    device) of the planes whose storage `meta` names (plane_meta: int64 [META_FIELDS]), token-major
    [cap, KV*D] or head-major [KV, cap, D]; the slots of one call are distinct (muser.kv reserves
    each once). What TorchBackend.write_rows_at does for each plane, in one launch
    (graph-capturable; a graph serves every session, the addresses being data)."""
    T, n_kv, D = kq.shape
    assert vq.shape == kq.shape and kq.is_contiguous() and vq.is_contiguous()
    assert kq.dtype == vq.dtype
    assert meta.dtype == torch.int64 and meta.numel() >= META_FIELDS
    assert widx.dtype == torch.int64 and widx.shape == (T,) and widx.stride(0) == 1
    assert (D & (D - 1)) == 0
    if T:
        _kv_store_kernel[(T, n_kv)](kq, vq, meta, widx, n_kv * D, KV=n_kv, D=D, HEAD_MAJOR=head_major, num_warps=1,
                                    **gdc.kwargs(kq))
