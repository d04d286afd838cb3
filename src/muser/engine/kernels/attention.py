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
* `attend_triton` - split-sequence online softmax (16.2), plane metadata read from device
  tensors, so one captured CUDA graph serves every position (book 10.3, CUDA graphs).
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


MAX_SPLITS = 64  # module attribute so device profiles can try others (tools/device_profile.py)


def pick_splits(capacity: int) -> int:
    """Sequence splits for the decode kernel: ~64 rows each, at most MAX_SPLITS (flash-decoding).
    64-row splits give a 2,560-slot sliding ring 40 programs per KV head rather than 10 (the
    full-geometry profile at depth 32,768: bench/NOTES.md); a split only changes how the softmax
    sums are partitioned (ulp level)."""
    return max(1, min(MAX_SPLITS, math.ceil(capacity / 64)))


if HAVE_TRITON:

    @triton.jit
    def _online_step(qv, kt, vt, valid, scale, m_i, l_i, acc):
        """One block of keys into the running softmax: qv [HP, D], kt/vt [BS, D] f32, valid [BS]
        -> updated (max [HP], sum [HP], acc [HP, D]); masked keys weigh exactly 0."""
        sc = tl.dot(qv, tl.trans(kt), input_precision="ieee") * scale  # [HP, BS]
        sc = tl.where(valid[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(sc - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, vt, input_precision="ieee")
        return m_new, l_i, acc

    @triton.jit(do_not_specialize=["T", "NS", "window"])
    def _attn_partial(q, kn, vn, kp, vp, meta, pos, m_out, l_out, o_out,
                      T, H, NS, window, scale,
                      s_qt, s_qh, s_nt, s_nh, s_slot, s_head,
                      HPK: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr):
        t = tl.program_id(0)
        g = tl.program_id(1)  # KV head
        s = tl.program_id(2)  # split; s == NS handles the new rows
        hh = tl.arange(0, HP)
        hmask = hh < HPK
        dd = tl.arange(0, D)
        head = g * HPK + hh
        qv = tl.load(q + t * s_qt + head[:, None] * s_qh + dd[None, :], mask=hmask[:, None], other=0.0)
        ol = tl.load(meta + 0)
        op = tl.load(meta + 1)
        ln = tl.load(meta + 2)
        cap = tl.load(meta + 3)
        pt = tl.load(pos) + t  # this row's position
        m_i = tl.full([HP], float("-inf"), tl.float32)
        l_i = tl.zeros([HP], tl.float32)
        acc = tl.zeros([HP, D], tl.float32)
        cc = tl.arange(0, BS)
        if s < NS:
            chunk = (ln + NS - 1) // NS
            i0 = s * chunk
            i1 = tl.minimum(ln, i0 + chunk)
            for start in range(i0, i1, BS):
                i = start + cc
                valid = i < i1
                qpos = ol + i
                if window > 0:
                    valid = valid & ((pt - qpos) < window)
                slot = ((op + i) % cap).to(tl.int64)
                kv_off = slot[:, None] * s_slot + g * s_head + dd[None, :]
                kt = tl.load(kp + kv_off, mask=valid[:, None], other=0.0).to(tl.float32)  # [BS, D]
                vt = tl.load(vp + kv_off, mask=valid[:, None], other=0.0).to(tl.float32)
                m_i, l_i, acc = _online_step(qv, kt, vt, valid, scale, m_i, l_i, acc)
        else:
            for jstart in range(0, t + 1, BS):  # distinct name: an int32 loop beside the int64 one
                j = jstart + cc
                valid = j <= t
                if window > 0:
                    valid = valid & ((t - j) < window)
                off = j[:, None] * s_nt + g * s_nh + dd[None, :]
                kt = tl.load(kn + off, mask=valid[:, None], other=0.0).to(tl.float32)
                vt = tl.load(vn + off, mask=valid[:, None], other=0.0).to(tl.float32)
                m_i, l_i, acc = _online_step(qv, kt, vt, valid, scale, m_i, l_i, acc)
        row = (t * H + head) * (NS + 1) + s  # [HP]
        tl.store(m_out + row, m_i, mask=hmask)
        tl.store(l_out + row, l_i, mask=hmask)
        tl.store(o_out + row[:, None] * D + dd[None, :], acc, mask=hmask[:, None])

    @triton.jit(do_not_specialize=["NS"])
    def _attn_reduce(m_in, l_in, o_in, out, H, NS, s_ot, s_oh, D: tl.constexpr, SP: tl.constexpr):
        t = tl.program_id(0)
        h = tl.program_id(1)
        ss = tl.arange(0, SP)
        smask = ss < NS + 1
        base = (t * H + h) * (NS + 1)
        m = tl.load(m_in + base + ss, mask=smask, other=float("-inf"))
        l = tl.load(l_in + base + ss, mask=smask, other=0.0)
        dd = tl.arange(0, D)
        o = tl.load(o_in + (base + ss)[:, None] * D + dd[None, :], mask=smask[:, None], other=0.0)
        mx = tl.max(m, 0)  # finite: row t always sees itself
        w = tl.exp(m - mx)
        w = tl.where(smask, w, 0.0)
        den = tl.sum(l * w, 0)
        num = tl.sum(o * w[:, None], 0)
        tl.store(out + t * s_ot + h * s_oh + dd, num / den)


class AttnScratch:
    """Partial-softmax buffers for up to T rows and `splits` splits, allocated once (graph-safe)."""

    def __init__(self, T: int, H: int, D: int, splits: int, device):
        self.splits = splits
        n = T * H * (splits + 1)
        self.m = torch.empty(n, dtype=torch.float32, device=device)
        self.l = torch.empty(n, dtype=torch.float32, device=device)
        self.o = torch.empty(n * D, dtype=torch.float32, device=device)


def attend_triton(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                  k_plane: torch.Tensor, v_plane: torch.Tensor, head_major: bool,
                  meta: torch.Tensor, pos: torch.Tensor, window: int, scale: float,
                  scratch: AttnScratch, splits: int | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """As attend_ref, with the plane metadata in device memory: meta int64 [4] =
    (origin_logical, origin_physical, len, capacity) before the append; pos int64 [1] = p0.
    `splits` sequence splits of the plane (<= scratch.splits)."""
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
    ns = scratch.splits if splits is None else splits
    assert 1 <= ns and scratch.m.numel() >= T * H * (ns + 1), "attention scratch too small"
    if out is None:
        out = torch.empty((T, H, D), dtype=torch.float32, device=q.device)
    hp = max(16, triton.next_power_of_2(hpk))
    _attn_partial[(T, n_kv, ns + 1)](
        q, k_new, v_new, k_plane, v_plane, meta, pos, scratch.m, scratch.l, scratch.o,
        T, H, ns, window, scale,
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), s_slot, s_head,
        HPK=hpk, HP=hp, D=D, BS=16, num_warps=4)
    _attn_reduce[(T, H)](scratch.m, scratch.l, scratch.o, out, H, ns, out.stride(0), out.stride(1),
                         D=D, SP=triton.next_power_of_2(ns + 1), num_warps=4)
    return out


__all__ = ["HAVE_TRITON", "AttnScratch", "attend_ref", "attend_triton", "pick_splits", "plane_strides"]
