"""The fast (integer) lane on the CPU: every projection is muser.quant.dot.matmul_ggml bit for
bit (SPEC of dot.py), read from the engine's repacked fields, cached or past the cache budget;
float weights take the vec_dot_type rounding of x and the exact lane's GEMM; formats with no
vec_dot_type are refused at load, naming the tensor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from muser.engine import Engine, lanes
from muser.engine import nvfp4 as nv
from muser.engine.lanes import Lane, Linear, fast_stack
from muser.engine.weights import random_bytes, repack
from muser.errors import LaneError
from muser.gguf.types import GgmlType as G
from muser.quant.dot import matmul_ggml

INT = [G.Q8_0, G.Q4_0, G.NVFP4, G.Q4_K, G.Q5_K, G.Q6_K]
CPU = torch.device("cpu")


def _weight(fmt: G, n_out: int, n_in: int, seed: int = 0):
    raw = nv.random_bytes(fmt, n_out, n_in, seed)[0] if fmt == G.NVFP4 else random_bytes(fmt, n_out, n_in, seed)
    return raw, repack(f"w.{fmt.name}", fmt, n_out, n_in, torch.from_numpy(raw.copy()))


def _x(T: int, n_in: int, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((T, n_in)) * np.exp(rng.standard_normal((T, 1)))).astype(np.float32)
    x[0, :] = 0  # an all-zero row: zero blocks of the activation
    if T > 1:
        x[1, 5], x[1, 9] = 7.0, -7.0  # a tie of |max| of opposite signs (Q8_K's first index)
    return x


@pytest.mark.parametrize("fmt", INT, ids=lambda t: t.name)
@pytest.mark.parametrize("budget", ["cached", "per-call"])
def test_projection_is_matmul_ggml_bitwise(fmt, budget, monkeypatch):
    n_in = 512 if fmt in (G.Q4_K, G.Q5_K, G.Q6_K) else 384
    raw, w = _weight(fmt, 40, n_in)
    if budget == "per-call":
        monkeypatch.setattr(lanes, "CPU_CACHE_BYTES", 0)
        monkeypatch.setattr(lanes, "CHUNK_BYTES", 4 * n_in * 16)  # row chunks of 16 (40 = 16 + 16 + 8)
    lin = Linear(Lane.FAST, CPU)
    for T in (1, 2, 7, 16, 17, 33):
        x = _x(T, n_in, seed=T)
        got = lin(w, torch.from_numpy(x)).numpy()
        want = matmul_ggml(raw, fmt, x)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (fmt.name, T)
    assert (len(lin._cache) == 1) == (budget == "cached")


@pytest.mark.parametrize("fmts", [(G.Q4_K,) * 3, (G.Q4_K, G.Q6_K, G.Q4_K, G.Q5_K)], ids=["one", "mixed"])
def test_stack_rows_have_their_own_matrix_bits(fmts):
    ws = [_weight(f, 8 * (i + 1), 256, seed=i)[1] for i, f in enumerate(fmts)]
    lin = Linear(Lane.FAST, CPU)
    x = torch.from_numpy(_x(9, 256))
    alone = [lin(w, x) for w in ws]
    st = fast_stack(ws)
    assert st is not None and st.n_out == sum(w.n_out for w in ws)
    assert len(st.groups) == (1 if len(set(fmts)) == 1 else len(fmts))  # one weight per run of a format
    for a, b in zip(alone, lin.stacked(st, x)):
        assert torch.equal(a, b)
    assert [torch.equal(a, b) for a, b in zip(alone, [lin(w, x) for w in ws])] == [True] * len(ws)  # row views
    assert fast_stack([ws[0], _weight(G.Q8_0, 8, 256)[1]]) is None  # Q8_K and Q8_0 activations
    assert fast_stack([_weight(G.F16, 8, 256)[1], _weight(G.BF16, 8, 256)[1]]) is None


@pytest.mark.parametrize("fmt", [G.F32, G.F16, G.BF16], ids=lambda t: t.name)
def test_float_weights_round_x_to_the_vec_dot_type(fmt):
    raw, w = _weight(fmt, 24, 64)
    x = torch.from_numpy(_x(5, 64))
    got = Linear(Lane.FAST, CPU)(w, x)
    xr = {G.F32: x, G.F16: x.half().float(), G.BF16: x.bfloat16().float()}[fmt]
    assert torch.equal(got, Linear(Lane.EXACT, CPU)(w, xr))  # the exact lane's GEMM on rounded x
    if fmt != G.F32:
        assert not torch.equal(got, Linear(Lane.EXACT, CPU)(w, x))  # the rounding is there
    ref = matmul_ggml(raw, fmt, x.numpy())  # f64 sums of the oracle: a few ulps away
    assert np.abs(got.numpy() - ref).max() <= 8 * np.spacing(np.abs(ref).max())


def test_companion_nvfp4_is_refused_at_load_naming_the_tensor(make_gguf, tmp_path):
    from muser.model.synth import SynthSpec
    from muser.quant.convert import convert

    path = convert(make_gguf(SynthSpec(dtype="F32")), tmp_path / "nv.gguf", "nvfp4")
    with pytest.raises(LaneError, match=r"lane 'fast': tensor 'blk\.\d+\..*' is NVFP4_E2M1"):
        Engine.open(path, device="cpu", lane="fast")
    Engine.open(path, device="cpu", lane="exact")  # the exact lane serves it


def test_cuda_refuses_formats_the_integer_kernel_does_not_serve():
    qmatmul_i8 = pytest.importorskip("muser.engine.kernels.qmatmul_i8")
    assert not qmatmul_i8.supports(G.NVFP4)
    with pytest.raises(LaneError, match=r"on cuda: the integer kernel does not serve NVFP4 \(tensor 'b'\)"):
        lanes.fast_refusal({"a": G.Q4_K, "b": G.NVFP4, "c": G.F16}, cuda=True)
    lanes.fast_refusal({"a": G.Q4_K, "b": G.NVFP4, "c": G.F16}, cuda=False)  # the CPU path serves type 40
