"""Synthetic fixtures: the pinned llama.cpp loads and runs them, for every dtype and the 6.6 mix."""

from __future__ import annotations

import numpy as np
import pytest

from muser.model.loader import open_model
from muser.model.synth import FULL_GEOMETRY, SynthSpec, q4_k_xl_type, tensor_specs

DTYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "q4_k_xl"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_fixture_loads_and_runs_in_llama_cpp(make_gguf, dtype):
    import llama_cpp

    path = make_gguf(SynthSpec(dtype=dtype, source="blocks"))
    m = open_model(path)
    want = {"F32": {"F32"}, "q4_k_xl": {"F32", "Q4_K", "Q5_K", "Q6_K"}}.get(dtype, {"F32", dtype})
    assert set(m.identity.dtype_mix) == want
    m.close()
    llm = llama_cpp.Llama(str(path), n_ctx=128, n_threads=2, logits_all=True, verbose=False)
    toks = llm.tokenize(b"def fibonacci(n):\n    return n", add_bos=True)
    llm.eval(toks)
    scores = np.array(llm.scores[: len(toks)])
    assert scores.shape == (len(toks), 384) and np.all(np.isfinite(scores))
    assert np.all(np.abs(scores) < 20.0)  # softcap 20
    llm.close()


def test_fixture_is_deterministic(tmp_path):
    from muser.model.synth import write_fixture

    a = write_fixture(tmp_path / "a.gguf", SynthSpec(dtype="Q4_K", source="blocks", seed=3))
    b = write_fixture(tmp_path / "b.gguf", SynthSpec(dtype="Q4_K", source="blocks", seed=3))
    assert a.read_bytes() == b.read_bytes()


def test_full_geometry_mix_is_figure_6_6():
    specs = {s.name: s for s in tensor_specs(FULL_GEOMETRY)}
    counts = {}
    for s in specs.values():
        if len(s.shape) == 2:
            counts[s.ggml_type.name] = counts.get(s.ggml_type.name, 0) + 1
    # 26 attn_v + 26 ffn_down promoted to Q6_K, the LM head Q5_K, everything else 2-D Q4_K.
    assert counts == {"Q4_K": 52 * 8 + 1 - 52, "Q6_K": 52, "Q5_K": 1}
    assert q4_k_xl_type("token_embd.weight").name == "Q4_K"
    weights = sum(s.nbytes for s in specs.values())
    assert weights == 16_743_567_360  # the 16,756,681,056 B artifact less its metadata


@pytest.mark.parametrize("mix,weight_type", [("nvfp4", "NVFP4_E2M1"), ("nvfp4-ggml", "NVFP4")])
def test_nvfp4_random_blocks_carry_the_master_std_and_load(tmp_path, mix, weight_type):
    import muser
    from muser.model.synth import _std, write_fixture
    from muser.quant.dequant import dequantize_tensor

    spec = SynthSpec(dtype=mix, source="blocks")
    path = write_fixture(tmp_path / f"{mix}.gguf", spec)
    m = open_model(path)
    f = m.gguf
    assert {"F32", "F16", weight_type} <= set(m.identity.dtype_mix)
    assert f.tensor_info("token_embd.weight").type.name == "F16"
    assert f.tensor_info("output.weight").type.name == "F16"
    name = "blk.0.ffn_up.weight"
    shape = tuple(f.tensor_info(name).shape)
    got = float(dequantize_tensor(f, name).std())
    assert abs(got / _std(spec, name, shape) - 1.0) < 0.1  # scales chosen for the master's std
    m.close()
    model = muser.load(path, device="cpu")
    logits = model.session(max_context=32).prefill(list(range(2, 18)))
    assert logits.shape == (384,) and np.all(np.isfinite(logits))
    model.close()


def test_nvfp4_master_source_is_refused():
    with pytest.raises(ValueError, match="muser quantize --to nvfp4"):
        SynthSpec(dtype="nvfp4", source="master")


def test_nvfp4_ggml_fixture_runs_in_llama_cpp(make_gguf):
    import llama_cpp

    path = make_gguf(SynthSpec(dtype="nvfp4-ggml", source="blocks"))
    llm = llama_cpp.Llama(str(path), n_ctx=128, n_threads=2, logits_all=True, verbose=False)
    toks = llm.tokenize(b"def fibonacci(n):\n    return n", add_bos=True)
    llm.eval(toks)
    scores = np.array(llm.scores[: len(toks)])
    assert scores.shape == (len(toks), 384) and np.all(np.isfinite(scores))
    llm.close()
