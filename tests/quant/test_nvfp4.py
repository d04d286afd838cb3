"""NVFP4 (book chapter 7): codebooks checked exhaustively, the 7.2 fixture row, the pinned
dequant order over all 254 finite scale bytes, the ModelOpt quantizer, ggml's type 40, the
integer-exact contractions of 7.4, and the load-time pairing refusals of 7.3."""

from __future__ import annotations

import math

import numpy as np
import pytest
from gguf import GGUFValueType
from gguf.quants import NVFP4 as GGUF_NVFP4

from muser.errors import FormatError, MetadataError
from muser.gguf.reader import read_gguf
from muser.gguf.types import GgmlType as G
from muser.gguf.writer import Typed
from muser.model.loader import open_model
from muser.model.synth import SynthSpec
from muser.quant import (
    E2M1_VALUES, E4M3FN_VALUES, NVFP4Weight, dequantize_act_nvfp4, dequantize_nvfp4, dequantize_tensor,
    e2m1_encode, e4m3fn_decode, e4m3fn_encode, matmul_nvfp4_w4a4, matmul_nvfp4_w4a16,
    quantize_act_nvfp4, quantize_nvfp4, quantize_q8_K, read_nvfp4_weight, validate_nvfp4_pairing,
)
from muser.quant.convert import convert
from muser.quant.fp4 import E2M1_Q1, E4M3FN_Q9, UE4M3_HALF_VALUES, ue4m3_encode

from .rewrite import rewrite

F32 = np.float32
SMALL = SynthSpec(hidden=256, n_heads=4, n_kv_heads=2, head_dim=32, ffn=256, vocab_target=300)


def bits(a):
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


# --- tables ---------------------------------------------------------------------------------


def test_e2m1_codebook_figure_7_1():
    assert E2M1_VALUES[:8].tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert E2M1_VALUES[8:].tolist() == [-0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    assert math.copysign(1, E2M1_VALUES[8]) == -1  # code 8 is -0.0
    assert np.array_equal(E2M1_Q1, (E2M1_VALUES * 2).astype(np.int8))
    assert E2M1_Q1.tolist() == list(GGUF_NVFP4.kvalues)  # ggml's kvalues_fp4 (doubled)


def _e4m3fn_reference(b: int) -> float:
    s = -1.0 if b & 0x80 else 1.0
    e, m = (b >> 3) & 0xF, b & 7
    if e == 15 and m == 7:
        return math.nan
    return s * (m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


def test_e4m3fn_all_256_bytes():
    ref = [_e4m3fn_reference(b) for b in range(256)]
    finite = [b for b in range(256) if not math.isnan(ref[b])]
    assert len(finite) == 254 and sorted(set(range(256)) - set(finite)) == [0x7F, 0xFF]
    for b in range(256):
        v = E4M3FN_VALUES[b]
        if b in (0x7F, 0xFF):
            assert np.isnan(v)
        else:
            assert float(v) == ref[b] and math.copysign(1, v) == math.copysign(1, ref[b]), hex(b)
            assert E4M3FN_Q9[b] * 2.0**-9 == ref[b]  # the integer twin of 7.4.2 is exact
    assert E4M3FN_VALUES[0x38] == 1.0 and E4M3FN_VALUES[0x7E] == 448.0 and E4M3FN_VALUES[0xFE] == -448.0
    assert E4M3FN_VALUES[0x01] == 2.0**-9 and E4M3FN_VALUES[0x08] == 2.0**-6
    with pytest.raises(FormatError, match=r"NaN scale byte 0xff at index 2"):
        e4m3fn_decode(np.array([0x38, 0x01, 0xFF], np.uint8))


def test_e4m3fn_encode_nearest_even_exhaustive():
    pos = np.arange(0x7F, dtype=np.uint8)  # the 127 non-negative finite bytes
    vals = E4M3FN_VALUES[pos]
    assert np.array_equal(e4m3fn_encode(vals), pos)  # every value encodes to itself
    mid = ((vals[:-1].astype(np.float64) + vals[1:]) / 2).astype(F32)
    enc = e4m3fn_encode(mid)
    lo = pos[:-1]
    assert np.array_equal(enc, np.where(lo % 2 == 0, lo, lo + 1))  # ties -> even mantissa
    above = np.nextafter(mid, F32(np.inf))
    below = np.nextafter(mid, F32(0))
    assert np.array_equal(e4m3fn_encode(above), lo + 1)
    assert np.array_equal(e4m3fn_encode(below), lo)
    assert e4m3fn_encode(np.float32([1e6, 448.0, 460.0]))[0] == 0x7E


def test_e2m1_encode_modelopt_boundaries():
    x = np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert e2m1_encode(x).tolist() == [0, 2, 2, 4, 4, 6, 6]  # ties to the even code
    assert e2m1_encode(np.nextafter(x, F32(9))).tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert e2m1_encode(np.nextafter(x, F32(0))).tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert e2m1_encode(-x).tolist() == [8, 10, 10, 12, 12, 14, 14]
    assert e2m1_encode(np.float32([0.0, -0.0, 6.0, 100.0, -7.0])).tolist() == [0, 0, 7, 7, 15]
    # round trip of the codebook itself (-0 encodes as +0)
    assert e2m1_encode(E2M1_VALUES).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 9, 10, 11, 12, 13, 14, 15]


def test_e2m1_encode_equals_the_sorted_search_on_every_kind_of_float():
    """The bound counting equals searchsorted(bounds, |x|, 'left') + the odd-bound ties (the
    ModelOpt rule as first written) on random bit patterns (NaN, inf, subnormals included) and
    every bound, one ulp either side."""
    from muser.quant.fp4 import E2M1_BOUNDS

    def sorted_search(x):
        a = np.abs(x)
        code = np.searchsorted(E2M1_BOUNDS, a, side="left").astype(np.uint8)
        tie_up = np.zeros(a.shape, dtype=bool)
        for i in (1, 3, 5):
            tie_up |= a == E2M1_BOUNDS[i]
        return ((code + tie_up) | np.where(x < 0, 8, 0)).astype(np.uint8)

    rng = np.random.default_rng(3)
    x = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(F32)
    b = np.concatenate([E2M1_BOUNDS, -E2M1_BOUNDS])
    x = np.concatenate([x, b, np.nextafter(b, F32(np.inf)), np.nextafter(b, F32(-np.inf)),
                        F32([0, -0.0, np.inf, -np.inf, np.nan, 6, -6, 1e-45])])
    x = np.concatenate([x, rng.standard_normal(100_000).astype(F32) * F32(3)])
    assert np.array_equal(e2m1_encode(x), sorted_search(x))


def test_ue4m3_tables_match_gguf_and_ggml_rounding():
    b = np.arange(256, dtype=np.uint8)
    assert np.array_equal(bits(UE4M3_HALF_VALUES), bits(GGUF_NVFP4.ue4m3_to_fp32(b).astype(F32)))
    rng = np.random.default_rng(0)
    x = (np.abs(rng.standard_normal(50000)) * 10.0 ** rng.uniform(-5, 3, 50000)).astype(F32)
    x = np.concatenate([x, F32([0, -1, 448, 500, 2.0**-10, 2.0**-9 * 7.5, 2.0**-9 * 0.49])])
    assert np.array_equal(ue4m3_encode(x), GGUF_NVFP4.fp32_to_ue4m3(x))


# --- Muser's format -------------------------------------------------------------------------


def test_book_7_2_fixture_row():
    packed = np.array([[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]], np.uint8)
    row = dequantize_nvfp4(packed, np.array([[0x38]], np.uint8), F32(0.25))[0]
    want = [0, 0.125, 0.25, 0.375, 0.5, 0.75, 1.0, 1.5, -0.0, -0.125, -0.25, -0.375, -0.5, -0.75, -1.0, -1.5]
    assert row.tolist() == want
    assert [math.copysign(1, v) for v in row[8:9]] == [-1]  # -0.0 survives, bit for bit
    assert np.array_equal(bits(row), bits(np.float32(want)))


def test_dequant_order_pinned_over_all_254_finite_scale_bytes():
    """(e2m1 * e4m3fn) * scale2 for every finite scale byte and every code; a scale2 that is not
    a power of two makes the other grouping e2m1 * (e4m3fn * scale2) differ somewhere."""
    finite = np.array([b for b in range(256) if b not in (0x7F, 0xFF)], np.uint8)
    codes = np.arange(16, dtype=np.uint8)
    packed = np.tile((codes[0::2] | (codes[1::2] << 4))[None], (finite.size, 1))
    s2 = F32(0.1)
    got = dequantize_nvfp4(packed, finite[:, None], s2)  # [254, 16]
    e = E2M1_VALUES[codes][None, :]
    s = E4M3FN_VALUES[finite][:, None]
    pinned = ((e * s).astype(F32) * s2).astype(F32)
    other = (e * (s * s2).astype(F32)).astype(F32)
    assert np.array_equal(bits(got), bits(pinned))
    assert not np.array_equal(bits(got), bits(other))
    # and each product is the exactly rounded value of the real product
    exact = np.array([[float(F32(float(E2M1_VALUES[c]) * _e4m3fn_reference(int(b)))) * float(s2)
                       for c in codes] for b in finite])
    assert np.array_equal(bits(got), bits(exact.astype(F32)))


def test_quantize_nvfp4_modelopt_recipe():
    rng = np.random.default_rng(3)
    W = (rng.standard_t(4, (64, 256)) * 0.02).astype(F32)
    w = quantize_nvfp4(W)
    amax = F32(np.abs(W).max())
    assert w.scale2 == F32(amax / F32(2688))  # amax / (6 * 448)
    r, c = np.unravel_index(np.abs(W).argmax(), W.shape)
    assert w.scales[r, c // 16] == 0x7E  # the amax group's scale lands on 448
    Wd = w.dequantize()
    assert abs(Wd[r, c]) == pytest.approx(float(amax), rel=1e-6)  # 6 * 448 * scale2
    assert np.array_equal(w.codes()[:, 0::2], w.packed & 0xF)  # low nibble = even index
    # every value within half a grid step of its group's scale
    step = E4M3FN_VALUES[w.scales].astype(np.float64)[..., None] * float(w.scale2) * 2.0  # largest E2M1 gap is 2
    err = np.abs(Wd.astype(np.float64) - W).reshape(64, 16, 16)
    assert (err <= step / 2 * (1 + 1e-6)).all()


def test_all_zero_tensor_and_zero_groups():
    W = np.zeros((4, 32), F32)
    W[1, :16] = 1.0
    w = quantize_nvfp4(W)
    assert w.scales[0, 0] == 0x38  # ModelOpt: a zero group's scale becomes 1.0
    assert np.array_equal(w.dequantize(), W)
    z = quantize_nvfp4(np.zeros((2, 16), F32))
    assert z.scale2 == 1.0 and np.array_equal(z.dequantize(), np.zeros((2, 16), F32))


# --- ggml's NVFP4 (type 40) quantizer --------------------------------------------------------


def _nvfp4_ggml_transcription(x: np.ndarray) -> np.ndarray:
    """quantize_row_nvfp4_ref as written in ggml-quants.c: every value scans all 16 codes of
    kvalues_fp4 for the first minimum of fabsf(kvalues[i] * d - x)."""
    nb = x.shape[0]
    sub = x.reshape(nb, 4, 16)
    ue = ue4m3_encode((np.abs(sub).max(axis=-1) / F32(6.0)).astype(F32))
    d = UE4M3_HALF_VALUES[ue]
    grid = (E2M1_Q1.astype(F32)[None, None, :] * d[..., None]).astype(F32)  # [nb, 4, 16 codes]
    with np.errstate(invalid="ignore"):
        err = np.abs(grid[:, :, None, :] - sub[..., None])  # [nb, 4, 16 values, 16 codes]
    idx = err.argmin(axis=-1).astype(np.uint8)  # first minimum = the strict '<' scan
    out = np.empty((nb, 36), dtype=np.uint8)
    out[:, 0:4] = ue
    out[:, 4:36] = (idx[..., :8] | (idx[..., 8:] << 4)).reshape(nb, 32)
    return out


def _nvfp4_ggml_edge_blocks(seed: int) -> np.ndarray:
    """[nb, 64]: zeros and signed zeros, every grid point and every midpoint between neighbours
    (ties) at exact power-of-two scales, one ulp either side of them, subnormal and tiny
    blocks (d rounds to 0 or a UE4M3 subnormal), huge blocks (d saturates at 448 and the
    errors of neighbouring codes round to the same float), heavy tails, one-signed blocks."""
    rng = np.random.default_rng(seed)
    k = E2M1_Q1[:8].astype(np.float64)
    mids = (k[:-1] + k[1:]) / 2
    rows = [np.zeros(64), np.where(rng.random(64) < 0.5, -0.0, 0.0)]
    for e in (-12, -9, -3, 0, 4, 8):
        d = 2.0**e  # amax 12 d: ue encodes 2 d exactly, so the grid is k * d
        for pts in (k, mids):
            v = rng.choice(pts, 64) * d * rng.choice([-1.0, 1.0], 64)
            v[0] = 12 * d
            rows.append(v)
            f = v.astype(F32)
            rows.append(np.nextafter(f, F32(np.inf)).astype(np.float64))
            rows.append(np.nextafter(f, F32(-np.inf)).astype(np.float64))
    for scale in (1e-45, 1e-41, 1e-38, 1e-6, 1e4, 3e6, 1e12, 1e30, 5e37):
        rows.append(rng.standard_normal(64) * scale)
    rows.append(rng.standard_t(1.2, 64) * 100)
    rows.append(np.abs(rng.standard_normal(64)) + 5)
    rows.append(-np.abs(rng.standard_normal(64)) - 5)
    rows.append(np.repeat(rng.standard_normal(4), 16))
    spread = rng.standard_normal(64)
    spread[rng.integers(0, 64, 4)] = 3e38
    rows.append(spread)
    return np.array(rows).astype(F32)


@pytest.mark.parametrize("seed", range(4))
def test_ggml_nvfp4_quantizer_matches_the_transcription_and_ggml(seed):
    from muser.quant.nvfp4 import quantize_nvfp4_ggml

    from . import ggml_ref

    rng = np.random.default_rng(100 + seed)
    x = np.concatenate([
        _nvfp4_ggml_edge_blocks(seed),
        (rng.standard_normal((3000, 64)) * 10.0 ** rng.uniform(-8, 8, (3000, 1))).astype(F32),
        rng.integers(-12, 13, (200, 64)).astype(F32) * F32(0.25),  # many exact ties
    ])
    got = quantize_nvfp4_ggml(x)
    want = _nvfp4_ggml_transcription(x)
    diff = (got != want).any(axis=1)
    assert not diff.any(), f"blocks {np.flatnonzero(diff)[:8].tolist()} differ"
    assert np.array_equal(got, ggml_ref.quantize_chunk(int(G.NVFP4), x.reshape(-1, 256)).reshape(-1, 36))
    # the blocks above straddle the pass slices (1024 blocks): the slicing is invisible
    assert np.array_equal(quantize_nvfp4_ggml(x[5:]), want[5:])


# --- 7.4 contractions -----------------------------------------------------------------------


def _w4a16_scalar(w: NVFP4Weight, x: np.ndarray) -> np.ndarray:
    """Book 7.4.2 written as plain loops over ints and np.float32 scalars."""
    a = quantize_q8_K(x)
    codes = w.codes()
    out = np.zeros((x.shape[0], w.n_out), F32)
    for t in range(x.shape[0]):
        for o in range(w.n_out):
            total = F32(0)
            for b in range(w.n_in // 256):
                integer_total = 0
                for g in range(16):
                    dot = 0
                    for k in range(16):
                        i = b * 256 + g * 16 + k
                        dot += int(E2M1_Q1[codes[o, i]]) * int(a.qs[t, b, g * 16 + k])
                    integer_total += dot * int(E4M3FN_Q9[w.scales[o, b * 16 + g]])
                c = F32(F32(integer_total) * F32(2.0**-10))
                c = F32(c * a.d[t, b])
                c = F32(c * w.scale2)
                total = F32(total + c)
            out[t, o] = F32(np.float16(total))
    return out


def _w4a4_scalar(w: NVFP4Weight, x: np.ndarray) -> np.ndarray:
    ac, asb = quantize_act_nvfp4(x, w.input_scale_inv)
    codes = w.codes()
    out = np.zeros((x.shape[0], w.n_out), F32)
    for t in range(x.shape[0]):
        for o in range(w.n_out):
            total = 0
            for g in range(w.n_in // 16):
                dot = sum(int(E2M1_Q1[codes[o, g * 16 + k]]) * int(E2M1_Q1[ac[t, g * 16 + k]]) for k in range(16))
                total += dot * int(E4M3FN_Q9[w.scales[o, g]]) * int(E4M3FN_Q9[asb[t, g]])
            y = F32(F32(total) * F32(2.0**-20))
            y = F32(y * w.scale2)
            y = F32(y * F32(F32(1.0) / w.input_scale_inv))
            out[t, o] = F32(np.float16(y))
    return out


def test_w4a16_and_w4a4_match_scalar_definitions():
    rng = np.random.default_rng(9)
    W = (rng.standard_normal((6, 512)) * 0.05).astype(F32)
    x = (rng.standard_normal((2, 512)) * 2).astype(F32)
    w = quantize_nvfp4(W, input_scale_inv=3.0)
    y16 = matmul_nvfp4_w4a16(w, x)
    assert np.array_equal(bits(y16), bits(_w4a16_scalar(w, x)))
    y4 = matmul_nvfp4_w4a4(w, x)
    assert np.array_equal(bits(y4), bits(_w4a4_scalar(w, x)))
    ref = x.astype(np.float64) @ w.dequantize().T.astype(np.float64)
    assert np.abs(y16 - ref).max() < 0.02 * np.abs(ref).max()  # the Q8-K grid + f16 output
    ac, asb = quantize_act_nvfp4(x, 3.0)
    ref4 = dequantize_act_nvfp4(ac, asb, 3.0).astype(np.float64) @ w.dequantize().T.astype(np.float64)
    assert np.abs(y4 - ref4).max() <= 1e-3 * np.abs(ref4).max()  # only the f16 output rounding
    with pytest.raises(FormatError, match="input_scale_inv"):
        matmul_nvfp4_w4a4(quantize_nvfp4(W), x)


# --- 7.3 pairing, through the real loader -----------------------------------------------------


@pytest.fixture(scope="module")
def nvfp4_files(tmp_path_factory):
    from muser.model.synth import write_fixture

    d = tmp_path_factory.mktemp("nvfp4")
    src = write_fixture(d / "src.gguf", SMALL)
    return d, convert(src, d / "a16.gguf", "nvfp4"), convert(src, d / "a4.gguf", "nvfp4-w4a4", input_scale_inv=2.0)


def test_loader_accepts_and_decodes_native_files(nvfp4_files):
    d, a16, a4 = nvfp4_files
    for p in (a16, a4):
        m = open_model(p)
        try:
            assert len(m.contract.nvfp4) == 8 * SMALL.n_layers
            w = read_nvfp4_weight(m.gguf, "blk.0.attn_q.weight")
            assert (w.input_scale_inv is not None) == (p == a4)
            assert np.array_equal(dequantize_tensor(m.gguf, "blk.0.attn_q.weight"), w.dequantize())
        finally:
            m.close()


Q = "blk.0.attn_q.weight"
STR = GGUFValueType.STRING


def _cases(d, a16, a4):
    f = read_gguf(a16)
    scales = np.array(f.raw(Q + ".nvfp4_scale"))
    n_in, n_out = f.tensors[Q].shape
    f.close()
    nan = scales.copy()
    nan.reshape(-1)[37] = 0x7F
    scalar = lambda v: (np.array([v], "<f4"), G.F32, (1,))  # noqa: E731
    return [
        ("missing scale", a16, dict(drop={Q + ".nvfp4_scale"}), FormatError, "missing NVFP4 companion tensor 'blk.0.attn_q.weight.nvfp4_scale'"),
        ("missing scale2", a16, dict(drop={Q + ".nvfp4_scale2"}), FormatError, "nvfp4_scale2"),
        ("scale wrong type", a16, dict(replace={Q + ".nvfp4_scale": (scales, G.I8, (n_in // 16, n_out))}), FormatError, "must be F8_E4M3FN"),
        ("scale wrong shape", a16, dict(replace={Q + ".nvfp4_scale": (scales, G.F8_E4M3FN, (n_out, n_in // 16))}), FormatError, f"[{n_in // 16}, {n_out}]"),
        ("NaN scale byte", a16, dict(replace={Q + ".nvfp4_scale": (nan, G.F8_E4M3FN, (n_in // 16, n_out))}), FormatError, "NaN scale byte 0x7f at index 37"),
        ("scale2 zero", a16, dict(replace={Q + ".nvfp4_scale2": scalar(0.0)}), FormatError, "finite and positive, got 0.0"),
        ("scale2 negative", a16, dict(replace={Q + ".nvfp4_scale2": scalar(-1.0)}), FormatError, "got -1.0"),
        ("scale2 inf", a16, dict(replace={Q + ".nvfp4_scale2": scalar(np.inf)}), FormatError, "got inf"),
        ("scale2 nan", a16, dict(replace={Q + ".nvfp4_scale2": scalar(np.nan)}), FormatError, "got nan"),
        ("scale2 not scalar", a16, dict(replace={Q + ".nvfp4_scale2": (np.ones(2, "<f4"), G.F32, (2,))}), FormatError, "F32 scalar [1]"),
        ("precision missing", a16, dict(md_drop={"muser.weight_precision"}), FormatError, "is None, must be 'nvfp4'"),
        ("precision says q4_k_xl", a16, dict(md_set={"muser.weight_precision": Typed("q4_k_xl", STR)}), FormatError, "is 'q4_k_xl', must be 'nvfp4'"),
        ("precision unknown", a16, dict(md_set={"muser.weight_precision": Typed("int3", STR)}), MetadataError, "unknown value 'int3'"),
        ("input_scale_inv without activation precision", a4, dict(md_drop={"muser.activation_precision"}), FormatError, "W4A16 has no input scale"),
        ("activation precision without input_scale_inv", a4, dict(drop={Q + ".nvfp4_input_scale_inv"}), FormatError, "'blk.0.attn_q.weight.nvfp4_input_scale_inv' is missing"),
        ("activation precision on W4A16", a16, dict(md_set={"muser.activation_precision": Typed("nvfp4", STR)}), FormatError, "is missing"),
        ("input_scale_inv negative", a4, dict(replace={Q + ".nvfp4_input_scale_inv": scalar(-2.0)}), FormatError, "got -2.0"),
    ]


def test_pairing_refusals(nvfp4_files):
    d, a16, a4 = nvfp4_files
    for i, (label, src, edits, err, needle) in enumerate(_cases(d, a16, a4)):
        p = rewrite(src, d / f"bad{i}.gguf", **edits)
        with pytest.raises(err) as e:
            open_model(p).close()
        assert needle in str(e.value), f"{label}: {e.value}"


def test_pairing_without_native_tensors(nvfp4_files, tiny_gguf, tmp_path):
    # 'nvfp4' declared on a kquant/F32 file; activation precision without native tensors
    for md, needle in [({"muser.weight_precision": Typed("nvfp4", STR)}, "has no NVFP4_E2M1 tensors"),
                       ({"muser.weight_precision": Typed("f32", STR), "muser.activation_precision": Typed("nvfp4", STR)},
                        "has no NVFP4_E2M1 tensors"),
                       ({"muser.weight_precision": Typed("nvfp4-ggml", STR)}, "no NVFP4 (type 40) tensors")]:
        p = rewrite(tiny_gguf, tmp_path / "x.gguf", md_set=md)
        with pytest.raises(FormatError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            open_model(p).close()
    ok = rewrite(tiny_gguf, tmp_path / "ok.gguf", md_set={"muser.weight_precision": Typed("f32", STR)})
    open_model(ok).close()


def test_validate_pairing_orphans_called_directly(nvfp4_files):
    d, a16, _ = nvfp4_files
    with read_gguf(a16) as f:
        names = [n for n, t in f.tensors.items() if t.type.ggml_type == G.NVFP4_E2M1]
        validate_nvfp4_pairing(f, names)
        with pytest.raises(FormatError, match="is not a recognised native weight"):
            validate_nvfp4_pairing(f, names[1:])
