"""Triton kernels against their torch references, run by the Triton interpreter on tiny shapes
(the same kernels run compiled on the GPU machine: tools/device_engine.py)."""

from __future__ import annotations

import pytest
import torch

from muser.gguf.types import GgmlType as G
from muser.engine.weights import BASE_FORMATS, repack

from .test_weights import random_weight_bytes


def _w(fmt, n_out, n_in, seed=0):
    raw = random_weight_bytes(fmt, n_out, n_in, seed)
    return repack("t", fmt, n_out, n_in, torch.from_numpy(raw.copy()))


@pytest.mark.parametrize("fmt", BASE_FORMATS, ids=lambda f: f.name)
def test_triton_tile_decoder_bit_exact(kernels, fmt):
    qmv, _ = kernels
    n_in = 288 if fmt in (G.F32, G.F16, G.BF16, G.Q8_0, G.Q4_0) else 512  # partial last tile too
    w = _w(fmt, 5, n_in, 1)
    got = qmv.dequant_triton(w)
    assert torch.equal(got.view(torch.int32), w.decode().view(torch.int32))


def _planes(head_major, n_kv, cap, D, dtype, g):
    shape = (n_kv, cap, D) if head_major else (cap, n_kv * D)
    return (torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))


CASES = [
    # T, cap, len, origin_logical, origin_physical, p0, window, head_major, dtype
    (1, 32, 32, 10, 10, 42, 32, False, torch.float16),  # full wrapped ring, decode
    (5, 32, 20, 0, 0, 20, 32, False, torch.float16),  # filling ring, verify rows
    (4, 32, 32, 40, 8, 72, 32, False, torch.float32),  # wrapped ring, rows cross the window
    (9, 16, 16, 3, 3, 19, 16, False, torch.float16),  # 9 rows over a full ring
    (3, 100, 50, 0, 0, 50, 0, True, torch.float16),  # growing NoPE plane
    (1, 100, 0, 0, 0, 0, 0, True, torch.float32),  # first token: only itself
    (2, 64, 0, 0, 0, 0, 32, False, torch.float16),  # empty ring, two rows
]


@pytest.mark.parametrize("case", CASES)
def test_triton_attention_vs_reference(kernels, monkeypatch, case):
    _, att = kernels
    T, cap, ln, ol, op, p0, window, hm, dt = case
    H, n_kv, D = 4, 2, 16
    g = torch.Generator().manual_seed(cap + T)
    q = torch.randn(T, H, D, generator=g)
    kn = torch.randn(T, n_kv, D, generator=g).to(dt)
    vn = torch.randn(T, n_kv, D, generator=g).to(dt)
    kp, vp = _planes(hm, n_kv, cap, D, dt, g)
    ref = att.attend_ref(q, kn, vn, kp, vp, hm, ol, op, ln, cap, p0, window, 0.17)
    meta = torch.tensor([ol, op, ln, cap], dtype=torch.int64)
    pos = torch.tensor([p0], dtype=torch.int64)
    for split in (512, 16):  # one split, or split boundaries inside the rows' spans
        monkeypatch.setattr(att, "SPLIT", split)
        sc = att.AttnScratch(T, H, D, att.pick_splits(cap), "cpu")
        got = att.attend_triton(q, kn, vn, kp, vp, hm, meta, pos, window, 0.17, sc)
        assert (got - ref).abs().max().item() < 2e-6
        rows = att.attend_triton(q, kn, vn, kp, vp, hm, meta, pos, window, 0.17, None)  # prefill form
        assert torch.equal(rows, got), "row programs differ from split programs"


def _ring(K, V, p0, cap, head_major):
    """The plane before position p0: positions [max(0, p0 - cap), p0) at slot position % cap."""
    n_kv, D = K.shape[1], K.shape[2]
    ol = max(0, p0 - cap)
    kp = torch.zeros((n_kv, cap, D) if head_major else (cap, n_kv * D), dtype=K.dtype)
    vp = torch.zeros_like(kp)
    for p in range(ol, p0):
        if head_major:
            kp[:, p % cap], vp[:, p % cap] = K[p], V[p]
        else:
            kp[p % cap], vp[p % cap] = K[p].reshape(-1), V[p].reshape(-1)
    return kp, vp, torch.tensor([ol, ol % cap, p0 - ol, cap], dtype=torch.int64)


@pytest.mark.parametrize("window,cap,hm", [(20, 20, False), (0, 48, True)])
def test_triton_attention_rows_do_not_depend_on_the_call(kernels, monkeypatch, window, cap, hm):
    """A row's attention is the same bits alone (decode) as inside a verify block or a prefill
    chunk: fixed absolute splits (here 16 positions, so spans cross several), blocks at absolute
    positions, split order merges; a sliding ring that wraps and a growing full plane."""
    _, att = kernels
    monkeypatch.setattr(att, "SPLIT", 16)
    H, n_kv, D, N = 4, 2, 16, 48
    g = torch.Generator().manual_seed(window)
    Q = torch.randn(N, H, D, generator=g)
    K = torch.randn(N, n_kv, D, generator=g).to(torch.float16)
    V = torch.randn(N, n_kv, D, generator=g).to(torch.float16)

    def call(p0, T, scratch):
        kp, vp, meta = _ring(K, V, p0, cap, hm)
        sc = att.AttnScratch(T, H, D, att.pick_splits(cap), "cpu") if scratch else None
        return att.attend_triton(Q[p0:p0 + T], K[p0:p0 + T].contiguous(), V[p0:p0 + T].contiguous(), kp, vp,
                                 hm, meta, torch.tensor([p0]), window, 0.17, sc)

    alone = torch.cat([call(p, 1, True) for p in range(N)])
    for p0, T, scratch in ((0, 21, False), (21, N - 21, False), (25, 16, True), (41, 7, True)):
        got = call(p0, T, scratch)
        assert torch.equal(got, alone[p0:p0 + T]), f"rows at {p0}..{p0 + T - 1} differ from decode-alone"


def test_attention_reference_window_rule():
    """attend_ref sees exactly the rows with p1 - p0 < W (llama.cpp SWA standard), causal."""
    from muser.engine.kernels.attention import attend_ref

    D, W = 16, 4
    T, p0 = 3, 6  # rows at positions 6, 7, 8; plane holds positions 2..5 (a ring of W)
    cap = W
    kp = torch.zeros(cap, D)
    vp = torch.zeros(cap, D)
    for pos in range(2, 6):
        vp[pos % cap, 0] = float(pos)  # value = its position; keys all zero -> uniform weights
    kn = torch.zeros(T, 1, D)
    vn = torch.zeros(T, 1, D)
    vn[:, 0, 0] = torch.tensor([6.0, 7.0, 8.0])
    q = torch.zeros(T, 1, D)
    out = attend_ref(q, kn, vn, kp, vp, False, 2, 2, 4, cap, p0, W, 1.0)
    # row at 6 sees 3..6, row at 7 sees 4..7, row at 8 sees 5..8: means 4.5, 5.5, 6.5
    assert torch.allclose(out[:, 0, 0], torch.tensor([4.5, 5.5, 6.5]))
