"""Attention with f16 operands (the fast lane over f16 K/V; kernels/attention.py docstring): q
rounded to f16 before K·Q and the normalised probabilities before V·P, as the pinned llama.cpp
CPU graph does (oracle numerics.Arithmetic.attn_query / attn_probs). attend_ref against the
oracle's own ggml-cpu attention math, the CPU C kernel and the Triton kernel (interpreter)
against attend_ref, and the flag refused over f32 planes. Row invariance of the Triton kernel
with the flag: tests/engine/test_attention_invariance.py (its *-f16ops cases)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from muser.engine.kernels import cpu_native as C
from muser.engine.kernels.attention import attend_ref
from muser.errors import LaneError
from muser.oracle import numerics as nm

H, N_KV, D = 4, 2, 16
SCALE = 0.125
REORDER = 4e-6  # f32 reordering of a 16-term dot and of the softmax sums at these magnitudes

# (capacity, origin_logical, origin_physical, len, p0, window)
CASES = [
    (64, 0, 0, 20, 20, 0),  # full plane, no wrap
    (48, 100, 37, 48, 148, 40),  # sliding ring, wrapped
    (48, 100, 5, 48, 148, 30),
    (80, 0, 0, 77, 77, 0),
]


def _inputs(case, T: int, head_major: bool, seed: int, qscale: float = 3.0):
    cap, ol, op, ln, p0, window = case
    g = torch.Generator().manual_seed(seed)
    shape = (N_KV, cap, D) if head_major else (cap, N_KV * D)
    kp, vp = torch.randn(shape, generator=g).half(), torch.randn(shape, generator=g).half()
    q = torch.randn(T, H, D, generator=g) * qscale  # peaked softmax: probabilities over many binades
    kn, vn = torch.randn(T, N_KV, D, generator=g).half(), torch.randn(T, N_KV, D, generator=g).half()
    return q, kn, vn, (kp, vp, head_major, ol, op, ln, cap, p0, window, SCALE)


def _f16_close(got: torch.Tensor, want: torch.Tensor, vmax: float, n_keys: int) -> None:
    """The same rounding points in another f32 order. Two orders give a probability a few f32 ulps
    apart, and one lying that close to an f16 rounding boundary lands on the neighbouring f16
    value: a change of at most max(2^-10 p_j, 2^-24) (one f16 ulp), so over keys with sum p = 1
    the output moves by at most (2^-10 + n_keys 2^-24) max|v|. That needs an f32 value within a
    few ulps of a boundary (~2^-13 per f32 ulp of an f16 ulp), so almost every element agrees to
    f32 reordering alone: where the rounding points differ, most elements do not (checked below)."""
    d = (got - want).abs()
    assert d.max().item() <= (2**-10 + n_keys * 2**-24) * vmax + REORDER, d.max().item()
    frac = (d <= REORDER).double().mean().item()
    assert frac >= 0.9, f"only {frac:.3f} of the elements agree to f32 reordering"


def _n_keys(case, T: int) -> int:
    return case[3] + T


def _oracle(q, kn, vn, args, arith: nm.Arithmetic) -> np.ndarray:
    """oracle/forward.py's attention loop over the same keys, through the oracle's numerics
    (f64-accumulated dots, ggml soft_max, the arithmetic's q / p rounding points)."""
    kp, vp, hm, ol, op, ln, cap, p0, window, scale = args
    T = q.shape[0]
    hpk = H // N_KV
    slots = [(op + i) % cap for i in range(ln)]
    if hm:
        ko, vo = kp[:, slots].transpose(0, 1), vp[:, slots].transpose(0, 1)
    else:
        ko, vo = kp[slots].view(ln, N_KV, D), vp[slots].view(ln, N_KV, D)
    keys = torch.cat([ko, kn]).float().numpy()
    vals = torch.cat([vo, vn]).float().numpy()
    kpos = np.concatenate([np.arange(ol, ol + ln), np.arange(p0, p0 + T)])
    qpos = np.arange(p0, p0 + T)
    diff = qpos[:, None] - kpos[None, :]
    mask = diff >= 0
    if window:
        mask &= diff < window
    qq = arith.attn_query(q.numpy())
    out = np.empty((T, H, D), dtype=np.float32)
    for g in range(N_KV):
        qg = qq[:, g * hpk:(g + 1) * hpk, :].transpose(1, 0, 2)
        scores = nm.dot(qg, keys[:, g, :].T)
        p = arith.attn_probs(nm.softmax_rows(scores, scale, mask[None]))
        out[:, g * hpk:(g + 1) * hpk, :] = nm.dot(p, vals[:, g, :]).transpose(1, 0, 2)
    return out


@pytest.mark.parametrize("case", CASES[:2])
@pytest.mark.parametrize("head_major", [False, True])
def test_ref_matches_oracle_ggml_cpu_attention(case, head_major):
    """attend_ref with f16 operands == the oracle's ggml-cpu attention (f16 KV) up to f32 order;
    without the flag it is not (the rounding points matter at this tolerance), and the oracle's
    f32 arithmetic is what the unflagged reference matches."""
    T = 5
    q, kn, vn, args = _inputs(case, T, head_major, seed=case[0] + 7)
    vmax = max(args[1].abs().max().item(), vn.abs().max().item())
    ggml = _oracle(q, kn, vn, args, nm.Arithmetic("ggml-cpu", "f16"))
    f32 = _oracle(q, kn, vn, args, nm.Arithmetic("f32", "f16"))
    flagged = attend_ref(q, kn, vn, *args, f16_operands=True)
    plain = attend_ref(q, kn, vn, *args)
    _f16_close(flagged, torch.from_numpy(ggml), vmax, _n_keys(case, T))
    assert (plain - torch.from_numpy(f32)).abs().max().item() <= REORDER
    assert ((plain - torch.from_numpy(ggml)).abs() <= REORDER).double().mean().item() < 0.5


@pytest.mark.parametrize("head_major", [False, True])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("T", [1, 5, 16])
def test_cpu_kernel_matches_ref(head_major, case, T):
    """The C kernel with f16 operands against attend_ref with them; row 0 of a T-row call is the
    one-row call bitwise, and the thread count changes nothing."""
    q, kn, vn, args = _inputs(case, T, head_major, seed=case[0] + T)
    vmax = max(args[1].abs().max().item(), vn.abs().max().item())
    got = C.attend(q, kn, vn, *args, f16_operands=True)
    _f16_close(got, attend_ref(q, kn, vn, *args, f16_operands=True), vmax, _n_keys(case, T))
    assert ((got - attend_ref(q, kn, vn, *args)).abs() <= REORDER).double().mean().item() < 0.5
    assert torch.equal(C.attend(q[:1], kn[:1], vn[:1], *args, f16_operands=True)[0], got[0])
    threads = C.get_threads()
    try:
        C.set_threads(1)
        assert torch.equal(C.attend(q, kn, vn, *args, f16_operands=True), got)
    finally:
        C.set_threads(threads)


def test_cpu_kernel_rounds_q_to_f16():
    """One key per row (p = 1 exactly, out = v): the output does not see q at all, so the q
    rounding is checked on scores through a two-key row instead: q that differ below f16's
    resolution give bitwise the same output with the flag, different outputs without it."""
    case = (64, 0, 0, 1, 1, 0)
    q, kn, vn, args = _inputs(case, 1, False, seed=3)
    q2 = (q.half().float() + q.half().float() * 2.0**-13).contiguous()  # same f16 value (below half an ulp)
    q1 = q.half().float().contiguous()
    assert torch.equal(q2.half(), q1.half()) and not torch.equal(q2, q1)
    for fn in (C.attend, attend_ref):
        assert torch.equal(fn(q1, kn, vn, *args, f16_operands=True), fn(q2, kn, vn, *args, f16_operands=True))
        assert not torch.equal(fn(q1, kn, vn, *args), fn(q2, kn, vn, *args))


def test_f16_operands_refused_over_f32_planes():
    q, kn, vn, args = _inputs(CASES[0], 2, False, seed=1)
    kp, vp = args[0].float(), args[1].float()
    args32 = (kp, vp) + args[2:]
    with pytest.raises(LaneError, match="f16 KV plane"):
        C.attend(q, kn.float(), vn.float(), *args32, f16_operands=True)
    with pytest.raises(AssertionError, match="f16 operands"):
        attend_ref(q, kn.float(), vn.float(), *args32, f16_operands=True)


TRITON_CASES = [  # (case, T, head_major)
    (CASES[1], 1, False),
    (CASES[1], 5, True),
    (CASES[0], 16, False),
    (CASES[3], 4, True),
]


@pytest.mark.parametrize("case, T, head_major", TRITON_CASES)
def test_triton_matches_ref(kernels, case, T, head_major):
    """attend_triton with f16 operands (tensor-core dots, split softmax in two passes) against
    attend_ref with them: the same rounding points in another f32 order (_f16_close); both
    planes' layouts, ring wrap, shipped split lengths. The grid sized from the capacity gives
    the same bits."""
    _, att = kernels
    q, kn, vn, args = _inputs(case, T, head_major, seed=case[0] * 3 + T)
    kp, vp, hm, ol, op, ln, cap, p0, window, scale = args
    vmax = max(kp.abs().max().item(), vn.abs().max().item())
    meta = torch.tensor(att.plane_meta(kp, vp, hm, N_KV, D, ol, op, ln), dtype=torch.int64)
    pos = torch.tensor([p0], dtype=torch.int64)
    sc = att.AttnScratch(T, H, D, att.split_count(T, cap, window), "cpu")
    got = att.attend_triton(q, kn, vn, hm, meta, pos, window, scale, sc, rows_bound=ln, f16_operands=True)
    _f16_close(got, attend_ref(q, kn, vn, *args, f16_operands=True), vmax, _n_keys(case, T))
    assert ((got - attend_ref(q, kn, vn, *args)).abs() <= REORDER).double().mean().item() < 0.5
    again = att.attend_triton(q, kn, vn, hm, meta, pos, window, scale, sc, rows_bound=cap, f16_operands=True)
    assert torch.equal(again.view(torch.int32), got.view(torch.int32))


def test_triton_refuses_f16_operands_over_f32_planes(kernels):
    _, att = kernels
    q, kn, vn, args = _inputs(CASES[0], 2, False, seed=2)
    kp, vp = args[0].float(), args[1].float()
    sc = att.AttnScratch(2, H, D, att.split_count(2, 64, 0), "cpu")
    with pytest.raises(AssertionError, match="f16 operands"):
        att.attend_triton(q, kn.float(), vn.float(), False, torch.tensor(att.plane_meta(kp, vp, False, N_KV, D, 0, 0, 20)),
                          torch.tensor([20]), 0, SCALE, sc, rows_bound=64, f16_operands=True)


def _recorder(seen: list, real):
    def rec(*a, **kw):
        seen.append(kw.get("f16_operands", False))
        return real(*a, **kw)

    return rec


@pytest.mark.parametrize("lane, kv, want", [("fast", "f16", True), ("fast", "f32", False), ("exact", "f16", False)])
def test_sessions_pass_f16_operands_for_the_fast_lane_over_f16_kv(tiny_gguf, monkeypatch, lane, kv, want):
    """The eager session's attention (the C kernel here) takes f16 operands exactly when the
    lane is fast and the KV cache f16; prefill and decode alike."""
    from muser.engine import Engine

    seen: list = []
    monkeypatch.setattr(C, "attend", _recorder(seen, C.attend))
    s = Engine.open(tiny_gguf, device="cpu", lane=lane, kv=kv).session(max_context=32)
    s.prefill([5, 6, 7])
    s.decode(1)
    assert seen and set(seen) == {want}


@pytest.mark.parametrize("lane, want", [("fast", True), ("exact", False)])
def test_graph_step_passes_f16_operands(tiny_gguf, kernels, monkeypatch, lane, want):
    """The graph step's attention (Triton, run uncaptured on the CPU) gets the same flag."""
    from muser.engine import Engine, graphs

    eng = Engine.open(tiny_gguf, device="cpu", lane=lane, kv="f16")
    s = eng.session(max_context=32)
    s.prefill([5, 6, 7])
    seen: list = []
    monkeypatch.setattr(graphs, "attend_triton", _recorder(seen, graphs.attend_triton))
    eng.graph(((1, "all", 32),), ()).run([s], [np.array([9])])
    assert seen and set(seen) == {want}


def test_triton_f16_operands_with_more_rows_per_launch_than_the_scratch_has_rows(kernels):
    """A launch may group up to rows x splits rows of a short plane (attend_triton's `group`); the
    f16-operand passes keep each grouped row's max and 1 / sum in scratch sized for that many, so
    a 12-row prefill through a 2-row scratch gives the bits of a 12-row scratch."""
    _, att = kernels
    T = 12
    q, kn, vn, args = _inputs(CASES[0], T, False, seed=5)
    kp, vp, hm, ol, op, ln, cap, p0, window, scale = args
    meta = torch.tensor(att.plane_meta(kp, vp, hm, N_KV, D, ol, op, ln), dtype=torch.int64)
    pos = torch.tensor([p0], dtype=torch.int64)
    small = att.AttnScratch(2, H, D, 8 * att.split_count(T, cap, window), "cpu")
    assert small.st_m.numel() >= T * H  # the grouped rows' statistics fit
    big = att.AttnScratch(T, H, D, att.split_count(T, cap, window), "cpu")
    a = att.attend_triton(q, kn, vn, hm, meta, pos, window, scale, small, rows_bound=ln, f16_operands=True)
    b = att.attend_triton(q, kn, vn, hm, meta, pos, window, scale, big, rows_bound=ln, f16_operands=True)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))
