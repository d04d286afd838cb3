"""The CPU decode/verify fast path against its references: `attend_cpu` vs `attend_ref` on
planes in both layouts, wrapped and unwrapped rings, both KV element types, T = 1..16; and the
CPU small-T forward (`Forward.run_cpu`) vs the reference graph (`Forward.run` with the fast path
off) through whole sessions. Only f32 summation order may differ."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from muser.engine import Engine
from muser.engine.kernels.attention import CpuAttnScratch, attend_cpu, attend_ref

H, N_KV, D = 8, 2, 64
SCALE = 0.125


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _planes(cap: int, head_major: bool, dt: torch.dtype, g: torch.Generator):
    shape = (N_KV, cap, D) if head_major else (cap, N_KV * D)
    return (torch.randn(shape, generator=g).to(dt), torch.randn(shape, generator=g).to(dt))


# (capacity, origin_logical, origin_physical, len, p0, window): fresh, partly filled, full and
# wrapped rings (the visible run crossing the end of the buffer), windows cutting the live rows,
# a full-attention plane, an empty plane.
CASES = [
    (64, 0, 0, 0, 0, 0),
    (64, 0, 0, 20, 20, 0),
    (64, 0, 0, 20, 20, 8),
    (48, 100, 37, 48, 148, 40),
    (48, 100, 47, 48, 148, 48),
    (48, 100, 5, 48, 148, 30),
    (80, 0, 0, 77, 77, 0),
]


@pytest.mark.parametrize("head_major", [False, True])
@pytest.mark.parametrize("dt", [torch.float16, torch.float32])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("T", [1, 5, 16])
def test_attend_cpu_matches_ref(head_major, dt, case, T):
    cap, ol, op, ln, p0, window = case
    g = torch.Generator().manual_seed(cap * 131 + op * 7 + T)
    kp, vp = _planes(cap, head_major, dt, g)
    q = torch.randn((T, H, D), generator=g)
    kn = torch.randn((T, N_KV, D), generator=g).to(dt)
    vn = torch.randn((T, N_KV, D), generator=g).to(dt)
    ref = attend_ref(q, kn, vn, kp, vp, head_major, ol, op, ln, cap, p0, window, SCALE)
    sc = CpuAttnScratch(N_KV, D)
    got = attend_cpu(q, kn, vn, kp, vp, head_major, ol, op, ln, cap, p0, window, SCALE, sc)
    assert got.shape == ref.shape == (T, H, D) and got.dtype == torch.float32
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6), (got - ref).abs().max()
    # the scratch is reused: a second, narrower call on the grown buffers gives the same rows
    again = attend_cpu(q[:1], kn[:1], vn[:1], kp, vp, head_major, ol, op, ln, cap, p0, window, SCALE, sc)
    ref1 = attend_ref(q[:1], kn[:1], vn[:1], kp, vp, head_major, ol, op, ln, cap, p0, window, SCALE)
    assert torch.allclose(again, ref1, rtol=1e-5, atol=1e-6)


def test_attend_cpu_sees_only_the_window():
    """A key outside the window must get no weight: make it dominate the scores and check the
    output ignores it (row 0 of the chunk hides old rows the later rows may not see either)."""
    cap, ol, op, ln, p0, window, T = 32, 0, 0, 32, 32, 8, 4
    kp = torch.zeros((cap, N_KV * D))
    vp = torch.zeros((cap, N_KV * D))
    kp[p0 - window] = 100.0  # logical p0 - 8: invisible to every row (p - q >= 8)
    vp[p0 - window] = 1e6
    q = torch.ones((T, H, D))
    kn = torch.zeros((T, N_KV, D))
    vn = torch.zeros((T, N_KV, D))
    out = attend_cpu(q, kn, vn, kp, vp, False, ol, op, ln, cap, p0, window, SCALE, CpuAttnScratch(N_KV, D))
    assert out.abs().max() == 0.0
    kp[p0 - window + 1] = 100.0  # visible to row 0 only
    vp[p0 - window + 1] = 1.0
    out = attend_cpu(q, kn, vn, kp, vp, False, ol, op, ln, cap, p0, window, SCALE, CpuAttnScratch(N_KV, D))
    assert torch.allclose(out[0], torch.ones((H, D)), atol=1e-6)
    assert out[1:].abs().max() == 0.0


@pytest.fixture(scope="module", params=["f16", "f32"])
def eng(request, tiny_gguf):
    return Engine.open(tiny_gguf, device="cpu", lane="exact", kv=request.param)


def _decode_run(eng, fast: bool, prompt, n_decode: int, verify_block):
    f = eng.forward
    old = f.cpu_fast
    f.cpu_fast = fast
    try:
        s = eng.session(max_context=160, capture=(0, eng.cfg.n_layers))
        out = [s.prefill(prompt)]
        caps = [s.captured]
        tok = int(np.argmax(out[-1]))
        for _ in range(n_decode):  # crosses the sliding ring's end (window 32)
            out.append(s.decode(tok))
            caps.append(s.captured)
            tok = int(np.argmax(out[-1]))
        cp = s.checkpoint(block=16)
        out.append(s.verify(verify_block))
        caps.append(s.captured)
        s.rollback(cp, keep=3)
        out.append(s.decode(tok))
        return out, caps
    finally:
        f.cpu_fast = old


def test_run_cpu_matches_reference_forward(eng):
    prompt = [6 + (i * 37) % 370 for i in range(40)]
    block = [5 + (i * 11) % 300 for i in range(16)]
    ref, ref_caps = _decode_run(eng, False, prompt, 40, block)
    assert eng.forward._cpu is None  # the reference pass never built the fast constants
    got, got_caps = _decode_run(eng, True, prompt, 40, block)
    assert eng.forward._cpu  # and the fast pass did take its path
    assert len(ref) == len(got)
    for a, b in zip(ref, got):
        assert a.shape == b.shape
        assert np.array_equal(np.argmax(a, -1), np.argmax(b, -1))
        assert np.max(np.abs(a - b)) <= 1e-4 * max(1.0, float(np.max(np.abs(a))))
    for ca, cb in zip(ref_caps, got_caps):
        assert ca.keys() == cb.keys()
        for il in ca:
            assert np.allclose(ca[il], cb[il], rtol=1e-5, atol=1e-5)
