"""The W4A4 contraction with FP4 activations (book 7.4.3) on torch against the numpy reference
(muser.quant.matmul_nvfp4_w4a4 / quantize_act_nvfp4): bit-identical, and its gate on a file."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from muser.engine.w4a4 import matmul_w4a4, quantize_act, w4a4_gate
from muser.engine.weights import repack
from muser.errors import LaneError
from muser.gguf.types import GgmlType as G
from muser.model.synth import SynthSpec
from muser.quant import NVFP4Weight, matmul_nvfp4_w4a4, quantize_act_nvfp4, quantize_nvfp4
from muser.quant.convert import convert
from muser.quant.fp4 import E2M1_BOUNDS


def _acts(T, n, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((T, n)) * np.exp(rng.uniform(-6, 6, (T, 1)))).astype(np.float32)
    x[0, :16] = 0.0  # an all-zero group (scale 1.0)
    x[1, :16] = np.array([6.0, -6.0, *E2M1_BOUNDS, *(-E2M1_BOUNDS)], dtype=np.float32)  # every tie
    x[1, 16:32] = np.float32(1e-30)  # a scale that rounds to an E4M3FN subnormal / zero
    return x


def test_activation_quantizer_bit_exact():
    x = _acts(6, 256, 0)
    isi = np.float32(0.37)
    want_c, want_s = quantize_act_nvfp4(x, isi)
    got_c, got_s = quantize_act(torch.from_numpy(x), torch.tensor([np.float32(1.0) / isi]))
    assert np.array_equal(got_s.numpy(), want_s)
    assert np.array_equal(got_c.numpy(), want_c)


@pytest.mark.parametrize("T", [1, 5, 16])
def test_matmul_w4a4_bit_identical_to_reference(T):
    rng = np.random.default_rng(T)
    wf = rng.standard_normal((24, 512)).astype(np.float32)
    nw = quantize_nvfp4(wf, input_scale_inv=0.5)
    w = repack("t.weight", G.NVFP4_E2M1, 24, 512, torch.from_numpy(nw.packed.copy()),
               torch.from_numpy(nw.scales.copy()), float(nw.scale2), float(nw.input_scale_inv))
    x = _acts(max(T, 2), 512, T + 10)[:T]
    got = matmul_w4a4(w, torch.from_numpy(x)).numpy()
    ref = matmul_nvfp4_w4a4(nw, x)
    assert np.array_equal(got.view(np.int32), ref.view(np.int32))


def test_w4a16_weight_has_no_w4a4_path():
    nw = quantize_nvfp4(np.ones((2, 32), dtype=np.float32))
    w = repack("t.weight", G.NVFP4_E2M1, 2, 32, torch.from_numpy(nw.packed.copy()),
               torch.from_numpy(nw.scales.copy()), float(nw.scale2))
    with pytest.raises(LaneError, match="input_scale_inv"):
        matmul_w4a4(w, torch.zeros(1, 32))


def test_w4a4_gate_on_a_quantized_file(make_gguf, tmp_path):
    master = make_gguf(SynthSpec(dtype="F32"))
    r = w4a4_gate(convert(master, tmp_path / "w4a4.gguf", "nvfp4-w4a4"), n_rows=4)
    assert r["status"] == "pass" and r["weights"] > 0 and r["max_mismatched_values"] == 0, r
    with pytest.raises(LaneError, match="no W4A4 weights"):
        w4a4_gate(convert(master, tmp_path / "w4a16.gguf", "nvfp4"))


def test_w4a4_lane_applies_fp4_activations_to_verify_rows_only(make_gguf, tmp_path, monkeypatch):
    from muser.engine import Engine
    from muser.engine import w4a4 as mod
    from muser.gates import max_dlsm

    master = make_gguf(SynthSpec(dtype="F32"))
    with pytest.raises(LaneError, match="needs a W4A4 file"):
        Engine.open(convert(master, tmp_path / "w4a16.gguf", "nvfp4"), lane="w4a4")
    path = convert(master, tmp_path / "w4a4.gguf", "nvfp4-w4a4")
    ex = Engine.open(path, device="cpu", lane="exact", kv="f32")
    fp4 = Engine.open(path, device="cpu", lane="w4a4", kv="f32")
    calls, mismatched = [], []
    real = mod.matmul_w4a4

    def checked(w, x):  # each call against the numpy reference on the forward's own activations
        y = real(w, x)
        nw = NVFP4Weight(w.fields["qs"].numpy(), w.fields["sc"].numpy(), np.float32(w.fields["s2"][0]),
                         np.float32(w.fields["isi"][0]))
        ref = matmul_nvfp4_w4a4(nw, x.contiguous().numpy())
        calls.append(x.shape[0])
        mismatched.append(int(np.count_nonzero(y.numpy().view(np.int32) != ref.view(np.int32))))
        return y

    monkeypatch.setattr(mod, "matmul_w4a4", checked)
    prompt = [6 + (i * 37) % 370 for i in range(20)]
    a, b = ex.session(max_context=64), fp4.session(max_context=64)
    la, lb = a.prefill(prompt), b.prefill(prompt)  # 20 rows: the exact path on both
    assert np.array_equal(la, lb) and not calls
    da, db = a.decode(7), b.decode(7)  # one row: W4A16, exact
    assert np.array_equal(da, db) and not calls
    va, vb = a.prefill([8, 9, 10, 11], all_logits=True), b.prefill([8, 9, 10, 11], all_logits=True)
    n_proj = 8 * ex.cfg.n_layers
    assert calls == [4] * n_proj  # every projection of the 4-row verify forward took FP4 activations
    assert not any(mismatched)  # bit-identical to book 7.4.3's reference, projection by projection
    assert np.isfinite(vb).all() and max_dlsm(va, vb) > 0  # FP4 activations move logprobs: not exact
