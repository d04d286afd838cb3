"""NVFP4 on the engine: the torch decoder and the Triton tile decoder (interpreter) bit-exact with
muser.quant's dequantizers on every E2M1 code and every scale byte, NaN scale bytes refused, the
Triton matvec against the reference, and NVFP4 files loaded through muser.load."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from muser.errors import FormatError
from muser.gguf.types import GgmlType as G
from muser.engine.nvfp4 import NVFP4_FORMATS, random_bytes
from muser.engine.weights import repack, validate
from muser.quant import dequantize, dequantize_nvfp4

IDS = {G.NVFP4_E2M1: "companion", G.NVFP4: "ggml40"}


def _every_byte_weight(fmt: G):
    """Payload and scale bytes covering every E2M1 code in every nibble position against every
    valid scale byte: (QWeight, numpy reference f32 [n_out, n_in])."""
    if fmt == G.NVFP4_E2M1:
        sbytes = np.array([b for b in range(256) if (b & 0x7F) != 0x7F], dtype=np.uint8)  # 254 valid
        n_out, n_in = len(sbytes), 512  # one row per scale byte; 32 blocks of 16 per row
        payload = np.tile(np.arange(256, dtype=np.uint8), (n_out, 1))  # every (low, high) code pair
        sc = np.repeat(sbytes[:, None], n_in // 16, 1)
        sc[:, 1::2] = sbytes[::-1][:, None]  # the same rows also see the bytes in another order
        s2 = float(np.float32(0.0123))
        ref = dequantize_nvfp4(payload, sc, s2)
        w = repack("t.weight", fmt, n_out, n_in, torch.from_numpy(payload.copy()), torch.from_numpy(sc.copy()), s2)
        return w, ref
    # ggml: 256 blocks of 64, block i has all 4 scale bytes = i, payload bytes 0..255 cycling
    nb = 256
    blocks = np.zeros((nb, 36), dtype=np.uint8)
    blocks[:, 0:4] = np.arange(256, dtype=np.uint8)[:, None]
    blocks[:, 4:] = (np.arange(nb)[:, None] * 32 + np.arange(32)[None, :]) % 256
    n_out, n_in = 64, 256  # 4 blocks a row
    raw = blocks.reshape(n_out, -1)
    ref = dequantize(raw.reshape(-1), G.NVFP4, n_out * n_in).reshape(n_out, n_in)
    return repack("t.weight", fmt, n_out, n_in, torch.from_numpy(raw.copy())), ref


def _bits(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float32).view(np.int32)


@pytest.mark.parametrize("fmt", NVFP4_FORMATS, ids=IDS.get)
def test_torch_decoder_bit_exact_every_code_and_scale_byte(fmt):
    w, ref = _every_byte_weight(fmt)
    assert np.array_equal(_bits(w.decode().numpy()), _bits(ref))
    rows = torch.tensor([3, 0, 17])
    assert np.array_equal(_bits(w.decode(rows).numpy()), _bits(ref[[3, 0, 17]]))


@pytest.mark.parametrize("fmt", NVFP4_FORMATS, ids=IDS.get)
def test_torch_decoder_bit_exact_random(fmt):
    n_out, n_in = 5, 320
    payload, sc, s2 = random_bytes(fmt, n_out, n_in, 3)
    if fmt == G.NVFP4_E2M1:
        ref = dequantize_nvfp4(payload, sc, s2)
        w = repack("t.weight", fmt, n_out, n_in, torch.from_numpy(payload), torch.from_numpy(sc), s2)
    else:
        ref = dequantize(payload.reshape(-1), fmt, n_out * n_in).reshape(n_out, n_in)
        w = repack("t.weight", fmt, n_out, n_in, torch.from_numpy(payload))
    assert np.array_equal(_bits(w.decode().numpy()), _bits(ref))
    assert w.nbytes == payload.nbytes + (sc.nbytes + 4 * n_out if sc is not None else 0)  # NVFP4 bytes resident


@pytest.mark.parametrize("byte", [0x7F, 0xFF])
def test_nan_scale_byte_refused_naming_tensor_and_block(byte):
    payload, sc, s2 = random_bytes(G.NVFP4_E2M1, 3, 64, 1)
    sc[2, 3] = byte
    w = repack("blk.0.ffn_up.weight", G.NVFP4_E2M1, 3, 64, torch.from_numpy(payload), torch.from_numpy(sc), s2)
    with pytest.raises(FormatError, match=rf"'blk.0.ffn_up.weight'.*{byte:#04x} at row 2, block 3"):
        validate(w)


def test_companion_form_needs_its_scales():
    from muser.errors import LaneError

    payload, _, _ = random_bytes(G.NVFP4_E2M1, 2, 32, 0)
    with pytest.raises(LaneError, match="companions"):
        repack("t.weight", G.NVFP4_E2M1, 2, 32, torch.from_numpy(payload))


@pytest.mark.parametrize("fmt", NVFP4_FORMATS, ids=IDS.get)
def test_triton_tile_decoder_bit_exact_every_code_and_scale_byte(kernels, fmt):
    from muser.engine.kernels.nvfp4 import dequant_nvfp4_triton

    w, ref = _every_byte_weight(fmt)
    assert np.array_equal(_bits(dequant_nvfp4_triton(w).numpy()), _bits(ref))


@pytest.mark.parametrize("fmt", NVFP4_FORMATS, ids=IDS.get)
def test_triton_tile_decoder_partial_tile(kernels, fmt):
    from muser.engine.kernels.nvfp4 import dequant_nvfp4_triton

    n_in = 320  # a partial last 256-tile
    payload, sc, s2 = random_bytes(fmt, 3, n_in, 5)
    args = (torch.from_numpy(sc), s2) if sc is not None else ()
    w = repack("t", fmt, 3, n_in, torch.from_numpy(payload), *args)
    assert torch.equal(dequant_nvfp4_triton(w).view(torch.int32), w.decode().view(torch.int32))


@pytest.mark.parametrize("fmt", NVFP4_FORMATS, ids=IDS.get)
@pytest.mark.parametrize("T", [1, 5])
def test_triton_matvec_vs_reference(kernels, fmt, T):
    qmv, _ = kernels
    payload, sc, s2 = random_bytes(fmt, 7, 512, 2)
    args = (torch.from_numpy(sc), s2) if sc is not None else ()
    w = repack("t", fmt, 7, 512, torch.from_numpy(payload), *args)
    x = torch.randn(T, 512, generator=torch.Generator().manual_seed(T))
    got = qmv.matvec(w, x)  # the engine's CUDA entry point routes NVFP4 to kernels/nvfp4.py
    ref = qmv.matvec_ref(w, x)
    scale = x.abs() @ w.decode().abs().T  # f32 accumulation in another order: relative bound
    assert torch.all((got - ref).abs() <= 1e-6 * scale + 1e-30)


@pytest.mark.parametrize("fmt", NVFP4_FORMATS, ids=IDS.get)
def test_triton_matvec_rows_are_bitwise_invariant(kernels, fmt):
    """A row's outputs are the same bits alone and inside every row bucket (row invariance)."""
    qmv, _ = kernels
    payload, sc, s2 = random_bytes(fmt, 5, 512, 3)
    args = (torch.from_numpy(sc), s2) if sc is not None else ()
    w = repack("t", fmt, 5, 512, torch.from_numpy(payload), *args)
    x = torch.randn(16, 512, generator=torch.Generator().manual_seed(4))
    alone = torch.cat([qmv.matvec(w, x[i:i + 1]) for i in range(16)])
    for T in (2, 5, 16):
        assert torch.equal(qmv.matvec(w, x[:T]).view(torch.int32), alone[:T].view(torch.int32)), T


def _nvfp4_mats(fmt: G):
    """(QWeight, the C GEMM's native form of it) on every code and scale byte: the stored bytes
    resident (0.5625 B a weight, + 4 B a row of the companion's scale2), not an expansion."""
    from muser.engine.kernels import cpu_native as C

    w, _ = _every_byte_weight(fmt)
    m = C.CpuMat.of(w)
    assert m.fmt == (C.FMT_NVFP4 if fmt == G.NVFP4_E2M1 else C.FMT_NVFP4_GGML) and m.w.dtype == torch.uint8
    assert m.nbytes == w.n_out * w.n_in * 9 // 16 + (4 * w.n_out if fmt == G.NVFP4_E2M1 else 0)
    assert C.CpuMat.resident_bytes(w) == m.nbytes  # the cache's budget check counts what it will hold
    return w, m


@pytest.mark.parametrize("fmt", NVFP4_FORMATS, ids=IDS.get)
def test_cpu_nvfp4_scale_table_is_the_decoders(fmt):
    """cpu.c's byte -> f32 table of each form has the bits of engine/nvfp4.py's (NaN where it has NaN)."""
    from muser.engine.kernels import cpu_native as C
    from muser.engine.nvfp4 import _tables

    t = _tables("cpu")
    ref = t["e4m3"] * 0.5 if fmt == G.NVFP4_E2M1 else t["ue4m3"]
    got = C.nvfp4_scale_table(C.FMT_NVFP4 if fmt == G.NVFP4_E2M1 else C.FMT_NVFP4_GGML)
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(got), nan) and int(nan.sum()) == (2 if fmt == G.NVFP4_E2M1 else 0)
    assert torch.equal(got[~nan].view(torch.int32), ref[~nan].view(torch.int32))


@pytest.mark.parametrize("fmt", NVFP4_FORMATS, ids=IDS.get)
def test_cpu_gemm_reads_nvfp4_codes_bit_exact(fmt):
    """The C GEMM's NVFP4 form (stored codes and scale bytes, (kvalues_fp4 * scale/2) * scale2
    decoded in registers) gives the bits of the GEMM over the torch decoder's f32 matrix, for
    every row count, both ISA builds and both thread counts, on every code against every scale
    byte and on odd row counts; stacked with another NVFP4 weight of another scale2 as well."""
    from muser.engine.kernels import cpu_native as C

    w, m = _nvfp4_mats(fmt)
    ref_w = w.decode()
    assert torch.equal(m.decode(), ref_w)  # the same values (a -0 decode may read +0: same sums)
    nz = ref_w != 0
    assert torch.equal(m.decode()[nz].view(torch.int32), ref_w[nz].view(torch.int32))
    g = torch.Generator().manual_seed(7)
    x = torch.randn(17, w.n_in, generator=g)
    odd = C.CpuMat.of(repack("o.weight", fmt, 13, w.n_in, *_rows(w, [5, 0, 63, 2, 9, 1, 33, 4, 8, 7, 40, 3, 11])))
    cases = [(m, ref_w), (odd, odd.decode())]
    n = torch.get_num_threads()
    try:
        for mat, wf in cases:
            y = C.gemm(C.CpuMat(C.FMT_F32, wf.contiguous(), None, mat.n_out, mat.n_in), x)
            for threads in (1, 2):
                C.set_threads(threads)
                for base in (False, True):
                    C.gemm_baseline(base)
                    try:
                        for T in (1, 2, 3, 5, 16, 17):
                            assert torch.equal(C.gemm(mat, x[:T]), y[:T]), (mat.n_out, threads, base, T)
                        assert torch.equal(C.gemm(mat, x[9:10]), y[9:10])
                    finally:
                        C.gemm_baseline(False)
    finally:
        C.set_threads(n)
    assert torch.equal(odd.decode(), w.decode(torch.tensor([5, 0, 63, 2, 9, 1, 33, 4, 8, 7, 40, 3, 11])))
    payload, sc, s2 = random_bytes(fmt, 24, w.n_in, 5)
    w2 = repack("u.weight", fmt, 24, w.n_in, torch.from_numpy(payload),
                None if sc is None else torch.from_numpy(sc), None if s2 is None else s2 * 3.7)
    st = C.stack([w, w2])
    assert st.mat.fmt == m.fmt and st.mat.nbytes == m.nbytes + C.CpuMat.resident_bytes(w2)  # one form: native
    ref2 = C.gemm(C.CpuMat(C.FMT_F32, torch.cat([ref_w, w2.decode()]).contiguous(), None, w.n_out + 24, w.n_in), x)
    for T in (1, 3, 4, 16, 17):
        assert torch.equal(C.gemm(st.mat, x[:T]), ref2[:T]), T


def _rows(w, rows: list[int]) -> tuple:
    """repack's stored-byte arguments for the given rows of an NVFP4 QWeight (payload in the file's
    row layout, then the companion's scale bytes and scale2)."""
    f, idx = w.fields, torch.tensor(rows)
    if w.fmt == G.NVFP4:  # the file's block_nvfp4 rows: 4 scale bytes then 32 code bytes a block
        nb = w.n_in // 64
        raw = torch.cat([f["d"][idx].view(-1, nb, 4), f["qs"][idx].view(-1, nb, 32)], -1).view(len(rows), -1)
        return (raw,)
    return f["qs"][idx], f["sc"][idx], float(f["s2"][0])
