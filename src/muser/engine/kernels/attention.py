"""Attention of T new rows over one layer's KV plane plus the rows themselves (book 16).

Every call attends *before* the new rows are stored: row t (position p0 + t) sees the plane's
live rows whose logical position q satisfies the window rule (p_t - q < W on sliding layers,
llama.cpp LLAMA_SWA_TYPE_STANDARD; no limit on full layers) and new rows j <= t under the same
rule. The engine stores the new rows afterwards, so a ring chunk never overwrites a row a
later row of the same chunk still needs (the book's staging shadow, 10.10, without a copy).
New K/V arrive already rounded to the plane's element type (f16 by default), because llama.cpp
reads the current token back from its f16 cache.

Math (f32): s = (q . k) * scale, masked softmax over all visible rows, weighted sum of V.

* `attend_ref`  - torch; plane metadata as host ints; used by eager CUDA prefill chunks, and the
  reference of the CPU lane's C kernel (kernels/cpu_native.attend, same arguments).
* `attend_triton` - split-sequence online softmax (16.2) with splits at fixed absolute
  positions merged in a fixed order (row-invariant: DESIGN.md "Exactness contract"), plane
  metadata read from device tensors, so one captured CUDA graph serves every position (book
  10.3, CUDA graphs).
"""

from __future__ import annotations

import math

import torch

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


def _old_rows(plane: torch.Tensor, physical: torch.Tensor, head_major: bool, n_kv: int, d: int) -> torch.Tensor:
    """Rows at `physical` slots as [n, n_kv, D] f32."""
    if head_major:
        return plane[:, physical, :].transpose(0, 1).to(torch.float32)
    return plane[physical].view(-1, n_kv, d).to(torch.float32)


def attend_ref(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
               k_plane: torch.Tensor, v_plane: torch.Tensor, head_major: bool,
               origin_logical: int, origin_physical: int, length: int, capacity: int,
               p0: int, window: int, scale: float, q_chunk: int = 128) -> torch.Tensor:
    """q [T, H, D] f32; k_new, v_new [T, n_kv, D] (plane dtype); -> [T, H, D] f32.

    window = 0 means full attention (NoPE layer)."""
    T, H, D = q.shape
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
        s = torch.bmm(qg, kg).view(n_kv, t1 - t0, hpk, -1) * scale  # [n_kv, t, hpk, S]
        if T > 1:  # one row sees every gathered row (the gather starts at its window)
            s = s.masked_fill(~vis[None, :, None, :], float("-inf"))
        m = s.amax(-1, keepdim=True)
        p = torch.exp(s - m)
        p = p / p.sum(-1, keepdim=True)
        o = torch.bmm(p.view(n_kv, -1, p.shape[-1]), vg)  # [n_kv, t*hpk, D]
        out[t0:t1] = o.view(n_kv, t1 - t0, hpk, D).permute(1, 0, 2, 3).reshape(t1 - t0, H, D)
    return out


SPLIT = 512  # positions per attention split: boundaries at multiples of SPLIT, whatever the batch
BS = 16  # keys per block inside a split, aligned at absolute positions


def pick_splits(capacity: int) -> int:
    """Split programs per row of a decode/verify launch over a plane of `capacity` slots: enough
    for any row's split range (a row sees at most `capacity` consecutive positions, which meet
    at most ceil(capacity / SPLIT) + 1 splits). Programs past a row's last split exit at once;
    the count changes speed only, never a value."""
    return math.ceil(capacity / SPLIT) + 1


if HAVE_TRITON:

    @triton.jit
    def _online_step(qv, kt, vt, valid, scale, m_i, l_i, acc):
        """One block of keys into the running softmax: qv [HP, D], kt/vt [BS, D] f32, valid [BS]
        -> updated (max [HP], sum [HP], acc [HP, D]); masked keys weigh exactly 0 and a block
        with no visible key leaves the state unchanged bit for bit."""
        sc = tl.dot(qv, tl.trans(kt), input_precision="ieee") * scale  # [HP, BS]
        sc = tl.where(valid[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(sc - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, vt, input_precision="ieee")
        return m_new, l_i, acc

    @triton.jit
    def _split(qv, kn, vn, kp, vp, g, ol, op, cap, p0, pt, lo, s, scale, s_nt, s_nh, s_slot, s_head,
               HP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, SP: tl.constexpr):
        """The softmax partial of one row over the visible positions [lo, pt] inside split s
        (positions [s*SP, s*SP + SP)), in blocks of BS at absolute positions: a key at position
        i < p0 is read from the plane (ring slot (op + i - ol) % cap), a later one from the new
        rows (i - p0); the same keys in the same blocks whichever call holds them."""
        dd = tl.arange(0, D)
        cc = tl.arange(0, BS)
        m_i = tl.full([HP], float("-inf"), tl.float32)
        l_i = tl.zeros([HP], tl.float32)
        acc = tl.zeros([HP, D], tl.float32)
        b0 = (tl.maximum(lo, s * SP) // BS) * BS
        b1 = tl.minimum(pt + 1, s * SP + SP)
        for start in range(b0, b1, BS):
            i = start + cc  # [BS] absolute positions
            valid = (i >= lo) & (i <= pt)
            old = valid & (i < p0)
            new = valid & (i >= p0)
            slot = ((op + i - ol) % cap).to(tl.int64)
            po = slot[:, None] * s_slot + g * s_head + dd[None, :]
            no = (i - p0).to(tl.int64)[:, None] * s_nt + g * s_nh + dd[None, :]
            kt = tl.where(old[:, None], tl.load(kp + po, mask=old[:, None], other=0.0).to(tl.float32),
                          tl.load(kn + no, mask=new[:, None], other=0.0).to(tl.float32))  # [BS, D]
            vt = tl.where(old[:, None], tl.load(vp + po, mask=old[:, None], other=0.0).to(tl.float32),
                          tl.load(vn + no, mask=new[:, None], other=0.0).to(tl.float32))
            m_i, l_i, acc = _online_step(qv, kt, vt, valid, scale, m_i, l_i, acc)
        return m_i, l_i, acc

    @triton.jit
    def _merge(M, L, ACC, m, l, o):
        """Fold one split's partial into the running (max, sum, weighted values), in split order."""
        m_new = tl.maximum(M, m)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.exp(M - m_safe)
        b = tl.exp(m - m_safe)
        return m_new, L * a + l * b, ACC * a[:, None] + o * b[:, None]

    @triton.jit
    def _row(meta, pos, t, window):
        """(ol, op, cap, p0, pt, lo) of row t: the plane's metadata, its position pt and the
        first position it sees, lo (window rule p_t - q < W; the plane's oldest row otherwise)."""
        ol = tl.load(meta + 0)
        op = tl.load(meta + 1)
        cap = tl.load(meta + 3)
        p0 = tl.load(pos)
        pt = p0 + t
        lo = ol
        if window > 0:
            lo = tl.maximum(ol, pt - window + 1)
        return ol, op, cap, p0, pt, lo

    @triton.jit(do_not_specialize=["T", "NS", "window"])
    def _attn_partial(q, kn, vn, kp, vp, meta, pos, m_out, l_out, o_out,
                      T, H, NS, window, scale,
                      s_qt, s_qh, s_nt, s_nh, s_slot, s_head,
                      HPK: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, SP: tl.constexpr):
        """Program (t, KV head g, j): row t's partial over its split first + j (decode/verify)."""
        t = tl.program_id(0)
        g = tl.program_id(1)
        j = tl.program_id(2)
        ol, op, cap, p0, pt, lo = _row(meta, pos, t, window)
        s = lo // SP + j
        if s <= pt // SP:
            hh = tl.arange(0, HP)
            hmask = hh < HPK
            dd = tl.arange(0, D)
            head = g * HPK + hh
            qv = tl.load(q + t * s_qt + head[:, None] * s_qh + dd[None, :], mask=hmask[:, None], other=0.0)
            m_i, l_i, acc = _split(qv, kn, vn, kp, vp, g, ol, op, cap, p0, pt, lo, s, scale, s_nt, s_nh,
                                   s_slot, s_head, HP, D, BS, SP)
            row = (t * H + head) * NS + j  # [HP]
            tl.store(m_out + row, m_i, mask=hmask)
            tl.store(l_out + row, l_i, mask=hmask)
            tl.store(o_out + row[:, None] * D + dd[None, :], acc, mask=hmask[:, None])

    @triton.jit(do_not_specialize=["NS", "window"])
    def _attn_reduce(meta, pos, m_in, l_in, o_in, out, H, NS, window, s_ot, s_oh,
                     HPK: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, SP: tl.constexpr):
        """Program (t, KV head g): row t's split partials merged in split order (as _attn_rows)."""
        t = tl.program_id(0)
        g = tl.program_id(1)
        ol, op, cap, p0, pt, lo = _row(meta, pos, t, window)
        hh = tl.arange(0, HP)
        hmask = hh < HPK
        head = g * HPK + hh
        dd = tl.arange(0, D)
        M = tl.full([HP], float("-inf"), tl.float32)
        L = tl.zeros([HP], tl.float32)
        ACC = tl.zeros([HP, D], tl.float32)
        for j in range(0, pt // SP - lo // SP + 1):
            row = (t * H + head) * NS + j
            m = tl.load(m_in + row, mask=hmask, other=float("-inf"))
            l = tl.load(l_in + row, mask=hmask, other=0.0)
            o = tl.load(o_in + row[:, None] * D + dd[None, :], mask=hmask[:, None], other=0.0)
            M, L, ACC = _merge(M, L, ACC, m, l, o)
        tl.store(out + t * s_ot + head[:, None] * s_oh + dd[None, :], ACC / tl.where(hmask, L, 1.0)[:, None], mask=hmask[:, None])

    @triton.jit(do_not_specialize=["T", "window"])
    def _attn_rows(q, kn, vn, kp, vp, meta, pos, out, T, window, scale,
                   s_qt, s_qh, s_nt, s_nh, s_slot, s_head, s_ot, s_oh,
                   HPK: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, SP: tl.constexpr):
        """Program (t, KV head g): row t's splits one after another, each partial merged as it is
        formed; the same partials and the same merge as _attn_partial + _attn_reduce (prefill)."""
        t = tl.program_id(0)
        g = tl.program_id(1)
        ol, op, cap, p0, pt, lo = _row(meta, pos, t, window)
        hh = tl.arange(0, HP)
        hmask = hh < HPK
        dd = tl.arange(0, D)
        head = g * HPK + hh
        qv = tl.load(q + t * s_qt + head[:, None] * s_qh + dd[None, :], mask=hmask[:, None], other=0.0)
        M = tl.full([HP], float("-inf"), tl.float32)
        L = tl.zeros([HP], tl.float32)
        ACC = tl.zeros([HP, D], tl.float32)
        for s in range(lo // SP, pt // SP + 1):
            m, l, o = _split(qv, kn, vn, kp, vp, g, ol, op, cap, p0, pt, lo, s, scale, s_nt, s_nh,
                             s_slot, s_head, HP, D, BS, SP)
            M, L, ACC = _merge(M, L, ACC, m, l, o)
        tl.store(out + t * s_ot + head[:, None] * s_oh + dd[None, :], ACC / tl.where(hmask, L, 1.0)[:, None], mask=hmask[:, None])


class AttnScratch:
    """Split partials for up to T rows and `splits` split programs per row, allocated once
    (graph-safe)."""

    def __init__(self, T: int, H: int, D: int, splits: int, device):
        self.splits = splits
        n = T * H * splits
        self.m = torch.empty(n, dtype=torch.float32, device=device)
        self.l = torch.empty(n, dtype=torch.float32, device=device)
        self.o = torch.empty(n * D, dtype=torch.float32, device=device)


def attend_triton(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                  k_plane: torch.Tensor, v_plane: torch.Tensor, head_major: bool,
                  meta: torch.Tensor, pos: torch.Tensor, window: int, scale: float,
                  scratch: AttnScratch | None, splits: int | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """As attend_ref, with the plane metadata in device memory: meta int64 [4] =
    (origin_logical, origin_physical, len, capacity) before the append; pos int64 [1] = p0.

    Each row reduces over its visible positions in splits at fixed absolute positions
    (multiples of SPLIT), blocks of BS inside, merged in split order: the same bits whether the
    row is decoded alone, verified in a block or prefilled in a chunk. With a scratch, `splits`
    programs per row run the splits in parallel and a second kernel merges them (decode,
    verify); without, one program per row runs them in turn (prefill)."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed")
    T, H, D = q.shape
    n_kv = k_new.shape[1]
    hpk = H // n_kv
    assert q.dtype == torch.float32 and q.stride(2) == 1
    assert k_new.shape == v_new.shape == (T, n_kv, D) and k_new.stride() == v_new.stride()
    assert k_new.dtype == k_plane.dtype == v_plane.dtype
    assert meta.dtype == torch.int64 and meta.numel() >= 4 and pos.dtype == torch.int64
    assert D >= 16 and (D & (D - 1)) == 0, f"head_dim {D} must be a power of two >= 16"
    s_slot, s_head = plane_strides(k_plane, head_major, n_kv, D)
    assert plane_strides(v_plane, head_major, n_kv, D) == (s_slot, s_head)
    if out is None:
        out = torch.empty((T, H, D), dtype=torch.float32, device=q.device)
    hp = max(16, triton.next_power_of_2(hpk))
    common = dict(HPK=hpk, HP=hp, D=D, num_warps=4, enable_fp_fusion=False)
    if scratch is None:
        _attn_rows[(T, n_kv)](q, k_new, v_new, k_plane, v_plane, meta, pos, out, T, window, scale,
                              q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), s_slot, s_head,
                              out.stride(0), out.stride(1), BS=BS, SP=SPLIT, **common)
        return out
    ns = scratch.splits if splits is None else splits
    assert 1 <= ns <= scratch.splits and scratch.m.numel() >= T * H * ns, "attention scratch too small"
    _attn_partial[(T, n_kv, ns)](
        q, k_new, v_new, k_plane, v_plane, meta, pos, scratch.m, scratch.l, scratch.o,
        T, H, ns, window, scale,
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), s_slot, s_head, BS=BS, SP=SPLIT, **common)
    _attn_reduce[(T, n_kv)](meta, pos, scratch.m, scratch.l, scratch.o, out, H, ns, window,
                            out.stride(0), out.stride(1), SP=SPLIT, **common)
    return out


__all__ = ["BS", "HAVE_TRITON", "SPLIT", "AttnScratch", "attend_ref", "attend_triton", "pick_splits", "plane_strides"]
