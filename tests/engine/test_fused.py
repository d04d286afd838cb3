"""The fused element-wise tails (kernels/fused.py) against the torch op chains of
engine/forward.py, run by the Triton interpreter (compiled and gated on the GPU machine)."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from muser.engine import forward as F


@pytest.fixture(scope="module")
def fk(kernels):
    from muser.engine.kernels import fused

    return importlib.reload(fused)


def _close(a, b, rel=2e-6):
    return float((a - b).abs().max()) <= rel * max(1.0, float(b.abs().max()))


def test_norm_mul_matches_torch(fk):
    g = torch.Generator().manual_seed(0)
    for R, N in ((1, 512), (3, 6656), (2, 100)):
        x = torch.randn(R, N, generator=g) * 3
        w = 1 + 0.1 * torch.randn(N, generator=g)
        res = torch.randn(R, N, generator=g)
        assert _close(fk.norm_mul(x, w, 1e-5), F.rms_norm(x, 1e-5) * w)
        assert _close(fk.norm_mul(x, w, 1e-8, res=res), F.rms_norm(x, 1e-8) * w + res)


def test_qk_norm_rope_matches_torch(fk):
    g = torch.Generator().manual_seed(1)
    T, H, KV, D = 3, 4, 2, 32
    y = torch.randn(T, 5 + H * D + KV * D + 7, generator=g)
    q0, k0 = 5, 5 + H * D
    qn, kn = 1 + 0.1 * torch.randn(D, generator=g), torch.ones(D)
    c, s = (torch.from_numpy(a) for a in F.rope_tables(16, D, 10000.0))
    pos = torch.tensor([3, 9, 15])
    cos, sin = c[pos].contiguous(), s[pos].contiguous()
    for rope in (False, True):
        q, k = fk.qk_norm_rope(y, q0, k0, H, KV, D, qn, kn, 1e-5, cos if rope else None, sin if rope else None)
        rq = F.rms_norm(y[:, q0:q0 + H * D].reshape(T, H, D), 1e-5) * qn
        rk = F.rms_norm(y[:, k0:k0 + KV * D].reshape(T, KV, D), 1e-5) * kn
        if rope:
            rq, rk = F.rope(rq, cos, sin), F.rope(rk, cos, sin)
        assert q.is_contiguous() and k.is_contiguous()
        assert _close(q, rq) and _close(k, rk)


def test_gate_and_silu_match_torch(fk):
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(2, 3000, generator=g) * 4, torch.randn(2, 3000, generator=g) * 4
    assert _close(fk.gate_mul(a, b), a * F.sigmoid(b))
    assert _close(fk.silu_mul(b, a), F.silu(b) * a)
    wide = torch.randn(2, 6000, generator=g)
    assert _close(fk.silu_mul(wide[:, :3000], wide[:, 3000:]), F.silu(wide[:, :3000]) * wide[:, 3000:])


def test_norm2_matches_torch(fk):
    g = torch.Generator().manual_seed(3)
    for R, N in ((1, 6656), (3, 512)):
        x, res = torch.randn(R, N, generator=g) * 2, torch.randn(R, N, generator=g)
        w, w2 = 1 + 0.1 * torch.randn(N, generator=g), 1 + 0.1 * torch.randn(N, generator=g)
        h, x2 = fk.norm2(x, w, 1e-8, res, w2, 1e-5)
        rh = F.rms_norm(x, 1e-8) * w + res
        assert _close(h, rh) and _close(x2, F.rms_norm(rh, 1e-5) * w2)


# torch ops whose CUDA kernels choose their reduction tiling from the tensor's shape (ATen
# Reduce.cuh setReduceConfig sizes the block from the row count; cuBLAS picks GEMM tiles by M)
_SHAPED_REDUCTIONS = {"mean", "sum", "amax", "amin", "max", "min", "prod", "var", "std", "norm",
                      "linalg_vector_norm", "_softmax", "_log_softmax", "logsumexp", "cumsum", "argmax",
                      "argmin", "mm", "addmm", "bmm", "matmul"}


@pytest.mark.parametrize("dtype", ["F16", "Q4_K"])
def test_cuda_forward_launches_do_not_depend_on_rows(fk, make_gguf, monkeypatch, dtype):
    """The CUDA forward's path on the CPU (interpreted Triton tails and matvec; only attention is
    the C kernel here): with 1 and with 16 rows it runs no torch reduction or GEMM (their CUDA
    kernels tile by the row count: the weightless entry norm's torch mean once made 16-row verify
    differ from decode on the H200), and every Triton launch outside the matvec family (whose row
    buckets are bitwise-tested by themselves) has the same constexprs and integer
    specializations for both row counts. Q4_K takes the stacked q|k|v|gate path, F16 the per-
    projection one. The matvec family is bitwise-tested by itself (test_kernels.py,
    test_qmatvec_v3.py); here its product is the reference one, outside the watch, so the
    interpreter runs only the rest."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime.interpreter import InterpretedFunction

    from muser.engine import Engine
    from muser.engine.kernels import qmatvec, qmatvec_v3
    from muser.model.synth import SynthSpec

    quiet = [False]
    dense: dict[int, torch.Tensor] = {}

    def product(key, decode, x):
        quiet[0] = True
        try:
            if key not in dense:
                dense[key] = decode()
            return x @ dense[key].T
        finally:
            quiet[0] = False

    monkeypatch.setattr(qmatvec, "matvec", lambda w, x, out=None: product(id(w), w.decode, x))
    monkeypatch.setattr(qmatvec_v3, "matvec_v3",
                        lambda p, x, out=None: product(id(p), lambda: qmatvec_v3.decode_rows(p), x))

    path = make_gguf(SynthSpec(dtype=dtype, hidden=256, ffn=256))
    eng = Engine.open(path, device="cpu", lane="exact", kv="f32")
    if dtype == "F16":  # CUDA keeps F16 projections unstacked (qmatvec_v3.stack: K-quant and NVFP4 layouts only)
        for L in eng.weights.layers:
            L.attn_in = L.ffn_in = None
    else:
        eng.weights.pack_for_decode(drop_fields=True)
        assert all(L.attn_in is not None for L in eng.weights.layers)
    eng.forward.linear.triton_rows = True  # the CUDA path: fused kernels for <= 16 rows
    eng.forward.native, eng.forward.tails = False, fk  # the CUDA forward's Triton tails

    shaped: list[str] = []
    launches: dict[int, set] = {1: set(), 16: set()}
    rows = [1]

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not quiet[0] and func.overloadpacket.__name__ in _SHAPED_REDUCTIONS:
                shaped.append(str(func))
            return func(*args, **(kwargs or {}))

    real_run = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        if not self.fn.__module__.endswith(("qmatvec", "qmatvec_v3", "nvfp4")):
            skip = set(self.kwargs.get("do_not_specialize") or ())
            ints = tuple((n, a == 1, a % 16 == 0) for n, a in zip(self.arg_names, args)
                         if isinstance(a, int) and not isinstance(a, bool) and n not in skip)
            launches[rows[0]].add((self.fn.__name__, ints, tuple(sorted(kwargs.items()))))
        return real_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    ids = [6 + (i * 37) % 250 for i in range(18)]
    s = eng.session(max_context=64, graphs=False)
    s.prefill(ids[:1])  # not watched: builds the plane
    InterpretedFunction.run = run
    try:
        with Watch():
            s.decode(ids[1])
            rows[0] = 16
            s.verify(ids[2:18])
    finally:
        InterpretedFunction.run = real_run
    assert not shaped, f"row-count-tiled torch ops in the CUDA forward: {sorted(set(shaped))}"
    assert launches[1] and launches[1] == launches[16], launches[1] ^ launches[16]


@pytest.mark.parametrize("kind", ["Q8_K", "Q8_0"])
def test_tails_write_the_integer_lanes_activations_bitwise(fk, kind):
    """Given an Act, norm_mul, norm2, gate_mul and silu_mul also write their output quantized:
    bitwise what quantize_act of that output gives (one quantizer, qmatmul_i8.store_act), with
    the f32 output unchanged. Widths whose power-of-two block runs past the row (768 in 1,024;
    the gate's last 1,024-column program holding 256) leave the blocks past the row unwritten;
    a zero row gives zero codes and scales."""
    from muser.engine.kernels import qmatmul_i8 as i8
    from muser.gguf.types import GgmlType as G

    kind = G[kind]
    g = torch.Generator().manual_seed(4)

    def check(out, act):
        ref = i8.quantize_act(out, kind)
        assert torch.equal(act.qs, ref.qs) and torch.equal(act.d.view(torch.int32), ref.d.view(torch.int32))
        assert (act.bsum32 is None) == (ref.bsum32 is None)
        if ref.bsum32 is not None:
            assert torch.equal(act.bsum32, ref.bsum32)

    def fresh(R, N):
        a = i8.Act.empty(kind, R, N, "cpu")
        a.qs.fill_(99)  # every value the kernel owns is written
        return a

    for R, N in ((3, 768), (2, 512)):
        x, res = torch.randn(R, N, generator=g) * 3, torch.randn(R, N, generator=g)
        x[0] = 0.0
        w, w2 = 1 + 0.1 * torch.randn(N, generator=g), 1 + 0.1 * torch.randn(N, generator=g)
        act = fresh(R, N)
        y = fk.norm_mul(x, w, 1e-5, act=act)
        assert torch.equal(y, fk.norm_mul(x, w, 1e-5))
        check(y, act)
        assert not act.qs[0].any() and not act.d[0].any()
        act = fresh(R, N)
        h, x2 = fk.norm2(x, w, 1e-8, res, w2, 1e-5, act=act)
        h0, x20 = fk.norm2(x, w, 1e-8, res, w2, 1e-5)
        assert torch.equal(h, h0) and torch.equal(x2, x20)
        check(x2, act)
    a, b = torch.randn(2, 2304, generator=g) * 4, torch.randn(2, 2304, generator=g) * 4
    for fn in (fk.gate_mul, fk.silu_mul):
        act = fresh(2, 2304)
        y = fn(a, b, act=act)
        assert torch.equal(y, fn(a, b))
        check(y, act)
    with pytest.raises(ValueError, match="act"):
        fk.gate_mul(a, b, act=i8.Act.empty(kind, 2, 2048, "cpu"))


@pytest.mark.parametrize("dtype", ["Q4_K", "Q8_0"])
def test_integer_lane_forward_reads_the_activations_its_tails_wrote(fk, make_gguf, dtype):
    """The integer lane's CUDA forward on the CPU (interpreted tails and integer GEMM; attention is
    the C kernel): every projection's input comes quantized from the kernel that wrote it (the
    norms and gates), so no separate quantize launch runs in a prefill, a decode or a verify, and
    the logits are bitwise those of the same forward quantizing each input by itself. Q4_K reads
    Q8_K activations, Q8_0 reads Q8_0."""
    from muser.engine import Engine
    from muser.engine.kernels import qmatmul_i8
    from muser.model.synth import SynthSpec

    path = make_gguf(SynthSpec(dtype=dtype, hidden=256, ffn=256))
    ids = [6 + (i * 37) % 250 for i in range(9)]
    real = qmatmul_i8.quantize_act

    def run(from_tails: bool):
        eng = Engine.open(path, device="cpu", lane="fast", kv="f32")
        lin = eng.forward.linear
        lin.cuda = True  # the CUDA path: quantized activations into kernels/qmatmul_i8
        eng.forward.native, eng.forward.tails = False, fk  # the CUDA forward's Triton tails
        lin.tail_acts = from_tails
        calls: list[int] = []

        def counted(x, kind):
            calls.append(x.shape[0])
            return real(x, kind)

        qmatmul_i8.quantize_act = counted
        try:
            s = eng.session(max_context=32, graphs=False)
            out = [s.prefill(ids[:5], all_logits=True), s.decode(ids[5]), s.verify(ids[6:9])]
        finally:
            qmatmul_i8.quantize_act = real
        return out, calls, eng.cfg.n_layers

    fused, fused_calls, n_layers = run(True)
    alone, alone_calls, _ = run(False)
    assert fused_calls == []
    assert len(alone_calls) == 3 * (4 * n_layers + 1)  # per layer q|k|v|gate, o, gate|up, down; the head
    for a, b in zip(fused, alone):
        assert a.shape == b.shape and np.array_equal(a.view(np.int32), b.view(np.int32))
