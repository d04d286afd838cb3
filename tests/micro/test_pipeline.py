"""Smoke run of the whole micro pipeline on the CPU: corpus -> train (tiny) -> GGUF -> Muser + llama.cpp.

The f32 torch forward of tools/train_micro.py and the pinned llama.cpp on the exported F32 GGUF (F32 KV)
agree to the noise floor: the training graph IS the GGUF's graph (norm convention, interleaved RoPE on
sliding layers with freq_base_swa, NoPE full layers, window, gate, GQA mapping, logit scale + softcap).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch

import llama_cpp

from muser.gguf.reader import read_gguf
from muser.gguf.types import GgmlType as G
from muser.model.loader import open_model


def _model(train_mod, export_mod, run, **geo):
    man, arrays = export_mod.load_weights(run)
    g = replace(train_mod.Geometry(**man["geometry"]), **geo)
    m = train_mod.MicroGlimmer(g)
    train_mod.load_gguf_state(m, {k: torch.from_numpy(v) for k, v in arrays.items()})
    return m.eval()


def _logprobs(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _ids(small_corpus, n: int) -> list[int]:
    stream = np.fromfile(small_corpus / "heldout.u16", dtype="<u2")
    return [int(t) for t in stream[7 : 7 + n]]


@pytest.fixture(scope="module")
def llama_f32_logprobs(smoke_ggufs, small_corpus):
    ids = _ids(small_corpus, 64)  # context 64, window 16: crosses 1, W-1, W, W+1, 2W+1, > 3W
    ll = llama_cpp.Llama(str(smoke_ggufs["F32"]), n_ctx=64, n_batch=64, n_ubatch=64, logits_all=True,
                         type_k=0, type_v=0, verbose=False)  # GGML_TYPE_F32 K/V: no rounding points
    ll.eval(ids)
    return ids, _logprobs(np.array(ll.scores[: len(ids)]))


def _torch_logprobs(m, ids) -> np.ndarray:
    with torch.no_grad():
        return _logprobs(m(torch.tensor([ids]))[0].numpy())


def test_run_outputs_fit_the_device_return(smoke_run):
    files = sorted(p for p in smoke_run.iterdir() if not p.name.startswith("."))
    assert {p.name for p in files} == {"micro-run.json", "micro-weights-0.npz"}
    assert len(files) <= 8 and all(p.stat().st_size <= 16 << 20 for p in files)
    run = json.loads((smoke_run / "micro-run.json").read_text())
    assert run["status"] == "done" and run["main"]["steps"] == 12
    curve = run["main"]["curve"]
    assert np.isfinite(run["main"]["best"]["heldout_loss"]) and curve[-1]["train_loss"] < curve[0]["train_loss"]


def test_exports_validate(smoke_ggufs, train_mod):
    g = train_mod.Geometry(vocab=512, **train_mod.SMOKE)
    for dtype, path in smoke_ggufs.items():
        m = open_model(path, pin=path.with_suffix(".pin.json"))
        try:
            c = m.config
            assert (c.n_layers, c.hidden, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn, c.vocab) == \
                (g.n_layers, g.hidden, g.n_heads, g.n_kv_heads, g.head_dim, g.ffn, g.vocab)
            assert c.sliding_window == g.window and c.context_length == g.seq_len
            assert c.rope_base_swa == 10000.0 and c.rope_base == 1e6 and c.softcap == 20.0
            assert np.float32(c.logit_scale) == np.float32(1 / np.sqrt(26))
            assert m.contract.q_scale == np.float32(3.87)
            for name, dt in m.contract.dtypes.items():
                one_d = len(m.gguf.tensors[name].shape) == 1
                assert dt == ("F32" if one_d else dtype), name
            assert m.gguf.get_str("tokenizer.ggml.pre") == "llama4"
            assert m.gguf.get_int("tokenizer.ggml.mask_token_id") == 3
            prov = json.loads(m.gguf.get_str("muser.micro.provenance"))
            assert set(prov["corpus"]) == set(prov["streams"]) == {"val", "heldout"}  # what bench ppl measures
            assert set(prov["training_corpus"]["streams"]) == {"train", "val", "heldout"}
        finally:
            m.close()
    r = subprocess.run([sys.executable, "-m", "muser", "inspect", str(smoke_ggufs["Q8_0"])],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "valid" in r.stdout


def test_q8_0_is_the_f16_master_quantized(smoke_ggufs):
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import quantize

    f16, q8 = read_gguf(smoke_ggufs["F16"]), read_gguf(smoke_ggufs["Q8_0"])
    try:
        for name, t in q8.tensors.items():
            if t.type.ggml_type == G.Q8_0:
                master = np.asarray(f16.array(name), dtype=np.float32)
                want = quantize(master, GGMLQuantizationType.Q8_0).reshape(-1)
                assert np.array_equal(np.asarray(q8.raw(name)).reshape(-1), want), name
            else:
                assert np.array_equal(np.asarray(q8.array(name)), np.asarray(f16.array(name))), name
    finally:
        f16.close()
        q8.close()


def test_torch_forward_equals_llama_cpp(train_mod, export_mod, smoke_run, llama_f32_logprobs):
    ids, ref = llama_f32_logprobs
    ours = _torch_logprobs(_model(train_mod, export_mod, smoke_run), ids)
    d = np.abs(ours - ref)
    assert d.max() <= 1e-4, d.max()
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("wrong", ["rope_theta", "window", "q_scale", "neox_rope", "rope_on_full"])
def test_parity_check_catches_each_trap(train_mod, export_mod, smoke_run, llama_f32_logprobs, monkeypatch, wrong):
    """Each architectural trap, got wrong on the torch side, moves log-probs far past the 1e-4 gate."""
    ids, ref = llama_f32_logprobs
    geo = {"rope_theta": dict(rope_base_swa=1e6), "window": dict(window=17), "q_scale": dict(q_scale=1.0)}
    m = _model(train_mod, export_mod, smoke_run, **geo.get(wrong, {}))
    if wrong == "neox_rope":
        def neox(x, cos, sin):
            B, T, H, D = x.shape
            x0, x1 = x[..., : D // 2], x[..., D // 2 :]
            c, s = cos[:T].view(1, T, 1, D // 2), sin[:T].view(1, T, 1, D // 2)
            return torch.cat((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1)
        monkeypatch.setattr(sys.modules["micro_net"], "rope_interleaved", neox)
    if wrong == "rope_on_full":
        for b in m.blocks:
            b.use_rope = True  # rotate the full layers too (their mask stays full causal)
    d = np.abs(_torch_logprobs(m, ids) - ref).max()
    assert d > 1e-3, (wrong, d)


def test_f16_and_q8_0_run_in_llama_cpp(smoke_ggufs, small_corpus, llama_f32_logprobs):
    ids, ref = llama_f32_logprobs
    for dtype, tol in (("F16", 0.1), ("Q8_0", 1.0)):
        ll = llama_cpp.Llama(str(smoke_ggufs[dtype]), n_ctx=64, n_batch=64, n_ubatch=64, logits_all=True,
                             verbose=False)
        ll.eval(ids)
        lp = _logprobs(np.array(ll.scores[: len(ids)]))
        assert np.isfinite(lp).all() and np.abs(lp - ref).max() < tol, dtype


def test_export_refuses_a_corrupt_shard(export_mod, smoke_run, small_corpus, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(smoke_run, run)
    p = run / "micro-weights-0.npz"
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 1
    p.write_bytes(bytes(b))
    with pytest.raises(export_mod.ExportError, match="micro-weights-0.npz.*sha256"):
        export_mod.export(run, small_corpus / "tokenizer.json", tmp_path / "out", ("F16",), quant="gguf",
                          log=lambda *_: None)
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("*.gguf"))


def test_export_refuses_another_tokenizer(export_mod, smoke_run, corpus_mod, tmp_path):
    other = tmp_path / "corpus"
    corpus_mod.build(out=other, vocab_size=400, max_files=24, log=lambda *_: None)
    with pytest.raises(export_mod.ExportError, match="vocab_sha256"):
        export_mod.export(smoke_run, other / "tokenizer.json", tmp_path / "out", ("F16",), quant="gguf",
                          log=lambda *_: None)
