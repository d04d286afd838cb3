"""The integer lane's wide GEMM (kernels/qwide_i8.py) under the Triton interpreter: Q4_K and Q5_K
products bitwise muser.quant.dot.matmul_ggml (and so the reference qmatmul_i8) at any row count
and tiling, the scale-digit and bsum-digit identities exact at their extremes, and bad calls
refused before any launch (compiled for sm_90 by tools/triton_aot_check.py)."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from muser.engine.weights import random_bytes, repack
from muser.errors import LaneError
from muser.gguf.types import GgmlType as G
from muser.quant.dot import matmul_ggml


@pytest.fixture(scope="module")
def kw(kernels):
    """qwide_i8 and qmatmul_i8 re-imported while the `kernels` fixture holds TRITON_INTERPRET=1."""
    from muser.engine.kernels import qmatmul_i8, qwide_i8

    yield importlib.reload(qwide_i8), importlib.reload(qmatmul_i8)
    importlib.reload(qwide_i8)
    importlib.reload(qmatmul_i8)


def _x(T: int, K: int, seed: int) -> np.ndarray:
    """Normal rows, one all zero, one at full scale in every block (|bsum32| near its 4,064 bound:
    the bsum digits' extremes), one negative at full scale."""
    x = np.random.default_rng(seed).standard_normal((T, K)).astype(np.float32)
    x[0] = 0.0
    if T > 2:
        x[1] = 3.0  # every code 127: bsum32 = 4,064
        x[2] = -3.0  # every code -127: bsum32 = -4,064
    return x


def _weight(fmt: G, n_out: int, n_in: int, seed: int, extreme: bool = False):
    """(GGUF bytes, repacked weight). extreme: row 0 has every code and scale at its top (q 15 / 31,
    sc and m 63: every byte after each block's d and dmin set)."""
    raw = random_bytes(fmt, n_out, n_in, seed)
    if extreme:
        blk = {G.Q4_K: 144, G.Q5_K: 176}[fmt]
        row = raw[0].reshape(-1, blk)
        row[:, 4:] = 0xFF
    return raw, repack("t", fmt, n_out, n_in, torch.from_numpy(raw.copy()))


def _bits(t) -> np.ndarray:
    a = t.numpy() if isinstance(t, torch.Tensor) else t
    return np.ascontiguousarray(a, dtype=np.float32).view(np.int32)


@pytest.mark.parametrize("fmt", [G.Q4_K, G.Q5_K], ids=lambda f: f.name)
@pytest.mark.parametrize("n_in", [512, 1024, 1280])  # part of a chunk; one whole chunk; a chunk of 4 blocks and one of 1
def test_wide_gemm_is_matmul_ggml_bitwise(kw, fmt, n_in):
    qwide, i8 = kw
    raw, w = _weight(fmt, 40, n_in, 5, extreme=True)
    assert int(w.fields["sc"][0].min()) == 63 and int(w.fields["m"][0].min()) == 63
    x = _x(19, n_in, 1)
    act = i8.quantize_act(torch.from_numpy(x), G.Q8_K)
    want = matmul_ggml(raw, fmt, x)
    got = qwide.matmul_wide(w, act, config=(16, 32, 4, 1))  # partial tiles on both sides
    assert np.array_equal(_bits(got), _bits(want))
    assert torch.equal(got, i8.matmul_i8_act(w, act))


@pytest.mark.parametrize("fmt", [G.Q4_K, G.Q5_K], ids=lambda f: f.name)
def test_a_rows_bits_do_not_depend_on_the_call(kw, fmt):
    """Row invariance: a row's outputs alone, in a 3-row call and in 33 rows under two tilings, and
    written into a column slice of a wider output."""
    qwide, i8 = kw
    _, w = _weight(fmt, 24, 768, 9)
    x = torch.from_numpy(_x(33, 768, 2))
    full = qwide.matmul_wide(w, i8.quantize_act(x, G.Q8_K), config=(16, 16, 4, 1))
    other = qwide.matmul_wide(w, i8.quantize_act(x, G.Q8_K), config=(32, 16, 2, 1))
    assert torch.equal(full, other)
    for t0, t1 in ((5, 6), (30, 33)):
        part = qwide.matmul_wide(w, i8.quantize_act(x[t0:t1].contiguous(), G.Q8_K), config=(16, 16, 4, 1))
        assert torch.equal(part, full[t0:t1])
    wide = torch.zeros(33, 40)
    qwide.matmul_wide(w, i8.quantize_act(x, G.Q8_K), wide[:, 8:32], config=(16, 16, 4, 1))
    assert torch.equal(wide[:, 8:32], full) and not wide[:, :8].any() and not wide[:, 32:].any()


def test_the_digit_identities_are_exact_at_their_extremes():
    """sc = 8 sh + sl keeps every code x digit in int8 (Q4_K q 0..15, Q5_K q - 16 in -16..15), and
    bsum32 = 64 bh + bl keeps both digits in int8 over |bsum32| <= 4,064 (32 codes of +-127)."""
    sc = np.arange(64)
    sh, sl = sc >> 3, sc & 7
    assert np.array_equal(8 * sh + sl, sc) and sh.max() <= 7 and sl.max() <= 7
    for q in (np.arange(16), np.arange(32) - 16):
        prods = np.concatenate([np.outer(q, sh).ravel(), np.outer(q, sl).ravel()])
        assert prods.min() >= -128 and prods.max() <= 127
    bs = np.arange(-4064, 4065)
    bl, bh = bs & 63, bs >> 6
    assert np.array_equal(64 * bh + bl, bs)
    assert bl.min() == 0 and bl.max() == 63 and bh.min() >= -128 and bh.max() <= 127


def test_bad_calls_are_refused_before_any_launch(kw):
    qwide, i8 = kw
    for bad in [(48, 16, 4, 1), (16, 8, 4, 1), (16, 16, 3, 1), (16, 16, 4, 0), (16, 16, 4), "wide"]:
        with pytest.raises(ValueError, match="config"):
            qwide.check_config(bad)
    w6 = repack("t", G.Q6_K, 8, 256, torch.from_numpy(random_bytes(G.Q6_K, 8, 256, 1).copy()))
    act = i8.quantize_act(torch.zeros(2, 256), G.Q8_K)
    with pytest.raises(LaneError, match="Q6_K has no wide integer GEMM"):
        qwide.matmul_wide(w6, act)
    _, w = _weight(G.Q4_K, 8, 512, 1)
    with pytest.raises(ValueError, match="512 columns"):
        qwide.matmul_wide(w, act)


def test_the_lane_routes_the_tables_wide_shapes_to_it(kw, monkeypatch):
    """A tuning-table entry routing a Q4_K shape's 64-row bucket to the wide GEMM: the integer lane's
    CUDA path (here on the CPU, interpreted; the tile's place taken by its reference, gluon has no
    interpreter) sends that shape's calls of more than 16 rows there with the entry's tiling, its
    narrower calls and other shapes to the tile, with the same bits."""
    from muser.engine.kernels import qtile_i8
    from muser.engine.lanes import Lane, Linear

    qwide, i8 = kw
    raw, w = _weight(G.Q4_K, 24, 512, 3)
    _, other = _weight(G.Q4_K, 16, 512, 4)
    lin = Linear(Lane.FAST, torch.device("cpu"))
    lin.cuda = True  # the CUDA path: quantized activations into the integer GEMMs
    lin.tile_formats = qtile_i8.FORMATS
    calls: list[tuple] = []
    real = qwide.matmul_wide
    monkeypatch.setattr(qwide, "matmul_wide", lambda w, act, out=None, config=None: calls.append(
        ("wide", w.n_out, act.rows, config)) or real(w, act, out, config))
    monkeypatch.setattr(qtile_i8, "matmul_tile", lambda w, act, out=None, config=None, split=None: calls.append(
        ("tile", w.n_out, act.rows, config)) or i8.matmul_i8_act(w, act, out))
    monkeypatch.setattr(qtile_i8, "TUNED", {})
    cfg = [32, 32, 4, 1]
    entry = {"fmt": "Q4_K", "rows": 64, "n_out": 24, "n_in": 512, "path": "wide", "config": cfg}
    qtile_i8.TUNED.update([qtile_i8._parse_route(entry)])
    assert qtile_i8.routes_wide()
    x = _x(17, 512, 4)
    wide = lin(w, torch.from_numpy(x))
    narrow = lin(w, torch.from_numpy(x[:16].copy()))
    lin(other, torch.from_numpy(x))
    assert calls == [("wide", 24, 17, (32, 32, 4, 1)), ("tile", 24, 16, None), ("tile", 16, 17, None)]
    assert np.array_equal(_bits(wide), _bits(matmul_ggml(raw, G.Q4_K, x)))
    assert torch.equal(narrow, wide[:16])


def test_the_load_check_passes_the_wide_gemm_and_refuses_a_wrong_bit(kw):
    """qmatmul_i8.check_against_reference (what the lane runs at load for the tile and, when routed,
    the wide GEMM): the wide GEMM passes it; a kernel one ulp off in one output is refused with a
    LaneError naming the kernel, format, rows and output."""
    qwide, i8 = kw
    i8.check_against_reference("wide integer GEMM", qwide.FORMATS, (1, 17), qwide.matmul_wide, "cpu")

    def off(w, act):
        y = qwide.matmul_wide(w, act)
        y.view(torch.int32)[act.rows - 1, 5] += 1
        return y

    with pytest.raises(LaneError, match=r"the off kernel's Q4_K output \[16, 5\] of a 17-row call"):
        i8.check_against_reference("off kernel", qwide.FORMATS, (17,), off, "cpu")


def test_the_lane_routes_the_tables_ring_shapes_to_it(kw, monkeypatch):
    """A tuning-table entry routing a Q4_K shape's 16-row bucket to the tile's ring variant: the
    integer lane's CUDA path sends that shape's 9-16-row calls there with the entry's tiling, split
    and stream-K walk, its other buckets and other shapes to the tile (both replaced by the reference here:
    gluon has no interpreter), with the same bits."""
    from muser.engine.kernels import qtile_i8
    from muser.engine.lanes import Lane, Linear

    _, i8 = kw
    raw, w = _weight(G.Q4_K, 24, 512, 3)
    _, other = _weight(G.Q4_K, 16, 512, 4)
    lin = Linear(Lane.FAST, torch.device("cpu"))
    lin.cuda = True
    lin.tile_formats = qtile_i8.FORMATS
    calls: list[tuple] = []
    monkeypatch.setattr(qtile_i8, "matmul_ring", lambda w, act, out=None, config=None, split=None, group=1, stream=0:
                        calls.append(("ring", w.n_out, act.rows, config, split, group, stream))
                        or i8.matmul_i8_act(w, act, out))
    monkeypatch.setattr(qtile_i8, "matmul_tile", lambda w, act, out=None, config=None, split=None: calls.append(
        ("tile", w.n_out, act.rows, config, split)) or i8.matmul_i8_act(w, act, out))
    monkeypatch.setattr(qtile_i8, "TUNED", {})
    entry = {"fmt": "Q4_K", "rows": 16, "n_out": 24, "n_in": 512, "path": "ring", "config": [64, 16, 4, 4],
             "split": False, "stream": 3}
    grouped = {**entry, "rows": 8, "config": [32, 8, 2, 4], "split": None, "group": 4, "stream": 0}
    qtile_i8.TUNED.update([qtile_i8._parse_route(entry), qtile_i8._parse_route(grouped)])
    assert qtile_i8.ring_routes() == [("Q4_K", (32, 8, 2, 4), None, 4, 0), ("Q4_K", (64, 16, 4, 4), False, 1, 3)]
    x = _x(16, 512, 5)
    ring = lin(w, torch.from_numpy(x))
    one = lin(w, torch.from_numpy(x[:1].copy()))
    lin(other, torch.from_numpy(x))
    assert calls == [("ring", 24, 16, (64, 16, 4, 4), False, 1, 3), ("ring", 24, 1, (32, 8, 2, 4), None, 4, 0),
                     ("tile", 16, 16, None, None)]
    assert np.array_equal(_bits(ring), _bits(matmul_ggml(raw, G.Q4_K, x)))
    assert torch.equal(one, ring[:1])
