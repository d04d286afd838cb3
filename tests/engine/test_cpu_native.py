"""The CPU kernel library (kernels/cpu.c via kernels/cpu_native.py) against its references.

* GEMM: every output equals the scalar fixed-order reference (`dot_ref`) bit for bit, for any
  row count, either thread count and either ISA instantiation (AVX2 / baseline); Q8_0 read as
  stored equals the GEMM over its ggml decode bit for bit; the float64 product within 1e-6 of
  the sum of |x| |w| (another summation order).
* The integer lane's GEMM (gemm_i8, Q8_0 and Q4_0 weights): muser.quant.dot.matmul_ggml's bits
  for 1..17 rows, one and several 1024-element chunks of the float64 sum (a partial last chunk),
  zero rows and rounding ties, N not a multiple of 4, 1 and 2 threads, AVX2 and portable forms;
  bad inputs refused.
* Attention vs attention.attend_ref (both plane layouts, f16 / f32 K/V, fresh / wrapped rings,
  windows cutting the live rows, T = 1..16): |d| <= 2e-6.
* Tails vs the torch ops of engine/forward.py (ggml's op order): <= 4 ulp-scale (rtol 1e-6).
* A whole session on the shipped-format fixture: logits bitwise the same with 1 and 2 threads.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from muser.engine import Engine
from muser.engine.forward import rms_norm, rope, sigmoid, silu, softcap_logits
from muser.engine.kernels import cpu_native as C
from muser.engine.kernels.attention import attend_ref
from muser.engine.weights import random_bytes, repack
from muser.errors import FormatError, LaneError
from muser.gguf.types import GgmlType as G
from muser.model.synth import SynthSpec


@pytest.fixture(autouse=True)
def _threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)
    C.set_threads(n)


def _q8_weight(n_out: int, n_in: int, seed: int):
    raw = torch.from_numpy(random_bytes(G.Q8_0, n_out, n_in, seed=seed))
    return repack("w", G.Q8_0, n_out, n_in, raw)


@pytest.mark.parametrize("n_in", [64, 256, 288])
@pytest.mark.parametrize("threads", [1, 2])
def test_gemm_fixed_order_any_rows_any_threads(n_in, threads):
    C.set_threads(threads)
    g = torch.Generator().manual_seed(n_in)
    qw = _q8_weight(37, n_in, seed=n_in)
    q8 = C.CpuMat.of(qw)
    assert C.CpuMat.resident_bytes(qw) == q8.nbytes
    assert q8.fmt == C.FMT_Q8_0
    assert torch.equal(q8.decode(), qw.decode())  # ggml's q * d, bit for bit
    f32 = C.CpuMat(C.FMT_F32, qw.decode().contiguous(), None, 37, n_in)
    x = torch.randn(19, n_in, generator=g)
    y = C.gemm(q8, x)
    assert torch.equal(y, C.gemm(f32, x))  # quants decoded in registers = the decoded matrix
    for T in (1, 2, 5, 16):  # every row count: the same bits per output
        for t0 in range(0, 19 - T + 1, 7):
            assert torch.equal(C.gemm(q8, x[t0:t0 + T]), y[t0:t0 + T]), (T, t0)
    for t, n in [(0, 0), (3, 11), (18, 36)]:
        assert y[t, n].item() == C.dot_ref(x[t].contiguous(), f32.w[n].contiguous())
    ref = x.double() @ f32.w.double().T
    scale = (x.abs().double() @ f32.w.abs().double().T)
    assert ((y.double() - ref).abs() <= 1e-6 * scale + 1e-30).all()
    odd = C.CpuMat(C.FMT_F32, torch.randn(9, 70, generator=g), None, 9, 70)  # a tail past 64
    xo = torch.randn(13, 70, generator=g)  # passes of 8 and 4 rows and one single row, each with the tail
    yo = C.gemm(odd, xo)
    for t in range(13):
        assert yo[t, 4].item() == C.dot_ref(xo[t].contiguous(), odd.w[4].contiguous()), t


def test_gemm_does_not_depend_on_the_isa():
    g = torch.Generator().manual_seed(3)
    q8 = C.CpuMat.of(_q8_weight(45, 256, seed=3))
    f32 = C.CpuMat(C.FMT_F32, torch.randn(45, 200, generator=g), None, 45, 200)
    for m in (q8, f32):
        x = torch.randn(7, m.n_in, generator=g)
        fast = [C.gemm(m, x[:1]), C.gemm(m, x)]
        C.gemm_baseline(True)
        try:
            base = [C.gemm(m, x[:1]), C.gemm(m, x)]
        finally:
            C.gemm_baseline(False)
        assert all(torch.equal(a, b) for a, b in zip(fast, base))


def test_gemm_refuses_bad_shapes():
    with pytest.raises(AssertionError):
        C.gemm(C.CpuMat.of(_q8_weight(8, 64, 0)), torch.randn(2, 32))


H, N_KV, D = 8, 2, 64
CASES = [  # (capacity, origin_logical, origin_physical, len, p0, window)
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
def test_attend_matches_ref(head_major, dt, case, T):
    cap, ol, op, ln, p0, window = case
    g = torch.Generator().manual_seed(cap + T)
    shape = (N_KV, cap, D) if head_major else (cap, N_KV * D)
    kp, vp = torch.randn(shape, generator=g).to(dt), torch.randn(shape, generator=g).to(dt)
    q = torch.randn(T, H, D, generator=g)
    kn, vn = torch.randn(T, N_KV, D, generator=g).to(dt), torch.randn(T, N_KV, D, generator=g).to(dt)
    args = (kp, vp, head_major, ol, op, ln, cap, p0, window, 0.125)
    got = C.attend(q, kn, vn, *args)
    want = attend_ref(q, kn, vn, *args)
    assert (got - want).abs().max().item() <= 2e-6
    # row 0 of a T-row call is the one-row call: nothing depends on the rows after it
    assert torch.equal(C.attend(q[:1], kn[:1], vn[:1], *args)[0], got[0])
    C.set_threads(1)
    assert torch.equal(C.attend(q, kn, vn, *args), got)


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-6, atol: float = 1e-6) -> bool:
    return bool(((a - b).abs() <= atol + rtol * b.abs()).all())


def test_tails_match_the_torch_ops():
    g = torch.Generator().manual_seed(1)
    x, res = torch.randn(5, 96, generator=g) * 3, torch.randn(5, 96, generator=g)
    w, w2 = 1 + 0.1 * torch.randn(96, generator=g), 1 + 0.1 * torch.randn(96, generator=g)
    assert _close(C.norm_mul(x, w, 1e-5), rms_norm(x, 1e-5) * w)
    assert _close(C.norm_mul(x, w, 1e-5, res), rms_norm(x, 1e-5) * w + res)
    h, hn = C.norm2(x, w, 1e-8, res, w2, 1e-5)
    assert _close(h, rms_norm(x, 1e-8) * w + res) and _close(hn, rms_norm(h, 1e-5) * w2)
    T, Hq, KV, Dh = 3, 4, 2, 32
    y = torch.randn(T, 7 + (Hq + KV) * Dh, generator=g)
    qn, kn = torch.full((Dh,), 3.87), torch.ones(Dh)
    ang = torch.rand(T, Dh // 2, generator=g) * 6
    cos, sin = torch.cos(ang).contiguous(), torch.sin(ang).contiguous()
    q, k = C.qk_norm_rope(y, 7, 7 + Hq * Dh, Hq, KV, Dh, qn, kn, 1e-5, cos, sin)
    qr = rope(rms_norm(y[:, 7:7 + Hq * Dh].reshape(T, Hq, Dh), 1e-5) * qn, cos, sin)
    kr = rope(rms_norm(y[:, 7 + Hq * Dh:].reshape(T, KV, Dh), 1e-5) * kn, cos, sin)
    assert _close(q, qr) and _close(k, kr)
    q0, _ = C.qk_norm_rope(y, 7, 7 + Hq * Dh, Hq, KV, Dh, qn, kn, 1e-5, None, None)
    assert _close(q0, rms_norm(y[:, 7:7 + Hq * Dh].reshape(T, Hq, Dh), 1e-5) * qn)
    a, gt = torch.randn(4, 300, generator=g), torch.randn(4, 300, generator=g) * 8
    assert _close(C.gate_mul(a, gt), a * sigmoid(gt))
    assert _close(C.silu_mul(gt, a), silu(gt) * a)
    lg = torch.randn(2, 500, generator=g) * 200
    want = softcap_logits(lg.clone(), 0.196116, 20.0)
    assert _close(C.softcap(lg.clone(), 0.196116, 20.0), want, atol=4e-6)


def test_exp_and_tanh_accuracy():
    for v in np.concatenate([np.linspace(-86, 88.7, 4001), [-1e-8, 0.0, 1e-8]]):
        e, r = C.exp(float(v)), math.exp(float(np.float32(v)))
        assert abs(e - r) <= 2.5e-7 * r, v
    assert C.exp(-86.5) == 0.0  # flushed below -86 (exp(-86) < 4.5e-38)
    assert C.exp(100.0) == math.inf and C.exp(-200.0) == 0.0 and math.isnan(C.exp(math.nan))
    for v in np.linspace(-12, 12, 2401):
        assert abs(C.tanh(float(v)) - math.tanh(float(np.float32(v)))) <= 2e-7, v


def test_session_logits_do_not_depend_on_threads(make_gguf):
    eng = Engine.open(make_gguf(SynthSpec(dtype="Q8_0")), device="cpu", lane="exact", kv="f16")
    ids = [3 + (i * 41) % 300 for i in range(40)]
    outs = []
    for n in (1, 2):
        torch.set_num_threads(n)
        s = eng.session(max_context=64)
        outs.append(np.concatenate([s.prefill(ids[:30], all_logits=True), s.verify(ids[30:36]),
                                    s.decode(ids[36])[None]]))
        assert C.get_threads() == n
    assert np.array_equal(outs[0], outs[1])


@pytest.mark.parametrize("fmt", (G.Q8_0, G.Q4_0), ids=lambda f: f.name)
@pytest.mark.parametrize("n_in", (32, 96, 1024, 2080))
def test_gemm_i8_equals_matmul_ggml_bitwise(fmt, n_in):
    from muser.quant.dot import matmul_ggml

    N = 37
    raw = random_bytes(fmt, N, n_in, seed=n_in)
    w = repack("w", fmt, N, n_in, torch.from_numpy(raw.copy()))
    wq, wd = C.i8_codes(fmt, w.fields["qs"], w.fields["d"])
    rng = np.random.default_rng(n_in)
    x = (rng.standard_normal((17, n_in)) * rng.choice([1e-3, 1.0, 30.0], size=(17, 1))).astype(np.float32)
    x[0] = 0.0  # amax 0: d 0, codes 0
    x[1, :32] = np.arange(32, dtype=np.float32) - 15.5  # x * id lands on half-integers
    ref = matmul_ggml(raw.reshape(N, -1), fmt, x).view(np.int32)
    try:
        for base in (False, True):  # the AVX2 form (four rows a vector) and the portable one
            C.gemm_baseline(base)
            for threads in (1, 2):
                C.set_threads(threads)
                for T in (1, 2, 7, 17):
                    got = C.gemm_i8(wq, wd, torch.from_numpy(x[:T].copy())).numpy().view(np.int32)
                    assert np.array_equal(got, ref[:T]), (base, threads, T)
    finally:
        C.gemm_baseline(False)
    out = torch.full((3, N + 5), float("nan"))
    C.gemm_i8(wq, wd, torch.from_numpy(x[:3].copy()), out=out[:, 2:N + 2])  # a column slice of a wider output
    assert np.array_equal(out[:, 2:N + 2].numpy().view(np.int32), ref[:3])


def test_gemm_i8_refuses_bad_inputs():
    w = _q8_weight(8, 64, 0)
    wq, wd = C.i8_codes(G.Q8_0, w.fields["qs"], w.fields["d"])
    with pytest.raises(AssertionError, match="gemm_i8 x"):
        C.gemm_i8(wq, wd, torch.zeros(2, 64, dtype=torch.float64))
    with pytest.raises(AssertionError, match="codes"):
        C.gemm_i8(wq, wd, torch.zeros(2, 96))
    f16 = repack("h", G.F16, 4, 64, torch.from_numpy(random_bytes(G.F16, 4, 64, 0).copy()))
    with pytest.raises(LaneError, match="F16"):
        C.i8_codes(G.F16, f16.fields.get("w", torch.zeros(1)), torch.zeros(1))
    for bad in (float("nan"), float("inf"), -float("inf")):  # refused, naming the value, nothing written
        x = torch.ones(3, 64)
        x[1, 37] = bad
        out = torch.zeros(3, 8)
        with pytest.raises(FormatError, match=r"non-finite value .* at row 1, column 37"):
            C.gemm_i8(wq, wd, x, out=out)
        assert torch.equal(out, torch.zeros(3, 8))
