"""The row-invariant quantized GEMM (kernels/qgemm.py) against its references, under the Triton
interpreter on tiny shapes (the same kernel runs compiled on the H200: tools/device_kernels.py)."""

from __future__ import annotations

import importlib

import pytest
import torch

from muser.engine.weights import BASE_FORMATS, repack
from muser.gguf.types import GgmlType as G

from .test_weights import random_weight_bytes


@pytest.fixture(scope="module")
def qg(kernels):  # the interpreter is set up by the `kernels` fixture (conftest.py)
    from muser.engine.kernels import qgemm

    yield importlib.reload(qgemm)
    importlib.reload(qgemm)


def _w(fmt, n_out, n_in, seed=0):
    raw = random_weight_bytes(fmt, n_out, n_in, seed)
    return repack("t", fmt, n_out, n_in, torch.from_numpy(raw.copy()))


def _n_in(fmt):  # float rows of any length (a masked tail); 32-blocks past one 256 tile
    return 200 if fmt in (G.F32, G.F16, G.BF16) else 320 if fmt in (G.Q8_0, G.Q4_0) else 512


@pytest.mark.parametrize("fmt", BASE_FORMATS, ids=lambda f: f.name)
def test_gemm_vs_reference(qg, fmt):
    n_in = _n_in(fmt)
    w = _w(fmt, 20, n_in, 3)
    x = torch.randn(18, n_in, generator=torch.Generator().manual_seed(1))  # two M tiles, one partial
    got = qg.gemm(w, x)
    ref = qg.gemm_ref(w, x)
    # bound relative to the sum of |products| (f32 accumulation, ~2 ulp of that sum)
    scale = (x.abs().double() @ w.decode().abs().double().T).to(torch.float32)
    err = ((got - ref).abs() / scale).max().item()
    assert err <= 2e-7, f"{fmt.name}: max error {err:.3e} of sum |x w|"
    from muser.engine.kernels.qmatvec import matvec_ref

    assert torch.allclose(got, matvec_ref(w, x), rtol=0, atol=1e-5 * scale.max().item())


@pytest.mark.parametrize("fmt", [G.Q8_0, G.Q4_0, G.Q4_K, G.Q5_K, G.Q6_K], ids=lambda f: f.name)
def test_gemm_rows_do_not_mix(qg, fmt):
    """A row's output is the same alone, at any place of a tile and in the second tile (the N
    tile fixed: the interpreter's dot is numpy's, exact per element only for one shape)."""
    n_in = _n_in(fmt)
    w = _w(fmt, 16, n_in, 4)
    x = torch.randn(20, n_in, generator=torch.Generator().manual_seed(2))
    full = qg.gemm(w, x, bn=16)
    for i in (0, 7, 17):
        alone = qg.gemm(w, x[i:i + 1].contiguous(), bn=16)
        assert torch.equal(alone, full[i:i + 1]), f"row {i}"


@pytest.mark.parametrize("fmt", [G.Q4_K, G.Q6_K, G.Q8_0, G.BF16], ids=lambda f: f.name)
def test_split_k_chunks_give_the_same_bits(qg, monkeypatch, fmt):
    """K chunks as parallel programs + an in-order sum (decode, verify) == the chunks in turn in
    one program (prefill tiles), bitwise; a partial last chunk too (chunks of 512 here)."""
    monkeypatch.setattr(qg, "KC", 512)
    n_in = 1280 if fmt in (G.Q4_K, G.Q6_K) else 1248
    w = _w(fmt, 16, n_in, 7)
    x = torch.randn(3, n_in, generator=torch.Generator().manual_seed(3))
    a = qg.gemm(w, x, bn=16, split=True)
    b = qg.gemm(w, x, bn=16, split=False)
    assert torch.equal(a, b)
    ref = qg.gemm_ref(w, x)
    scale = (x.abs().double() @ w.decode().abs().double().T).to(torch.float32)
    assert ((a - ref).abs() / scale).max().item() <= 2e-7


def test_stack_is_its_members(qg):
    a, b = _w(G.Q4_K, 8, 256, 5), _w(G.Q4_K, 24, 256, 6)
    da, db = a.decode(), b.decode()
    st = qg.stack([a, b])
    assert st.bounds == ((0, 8), (8, 32)) and st.w.n_out == 32
    assert torch.equal(a.decode(), da) and torch.equal(b.decode(), db)  # members are row views
    assert a.fields["qs"].untyped_storage().data_ptr() == st.w.fields["qs"].untyped_storage().data_ptr()
    assert qg.stack([a, _w(G.Q6_K, 8, 256)]) is None  # formats differ


def test_gemm_refuses_bad_shapes(qg):
    w = _w(G.Q8_0, 4, 64)
    with pytest.raises(AssertionError):
        qg.gemm(w, torch.zeros(1, 32))
    with pytest.raises(AssertionError):
        qg.gemm(w, torch.zeros(2, 64, dtype=torch.float64))
