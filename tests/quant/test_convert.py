"""`muser quantize`: every target from the CLI; metadata and identities preserved; ggml outputs
byte-equal to the codecs and loadable by the pinned llama.cpp; quantized sources (the Q4_K mix)
decoded and re-encoded, the same bytes from the process pool as in one process; refusals before
any work; atomic output (an interrupted or failing run leaves no OUT)."""

from __future__ import annotations

import numpy as np
import pytest

import llama_cpp

from muser.cli import main
from muser.gguf.identity import identity_of, template_sha256, tokenizer_sha256
from muser.gguf.reader import read_gguf
from muser.gguf.types import GgmlType as G
from muser.model.loader import open_model
from muser.model.synth import SynthSpec, q4_k_xl_type
from muser.quant import quantize

from .rewrite import rewrite

TARGETS = ["q8_0", "q4_k", "q4_k_xl", "nvfp4", "nvfp4-w4a4", "nvfp4-ggml"]
CHANGED_KEYS = {"general.file_type", "muser.weight_precision", "muser.activation_precision"}


def expected_type(target: str, name: str, ndim: int) -> G:
    if ndim == 1:
        return G.F32
    if target == "q8_0":
        return G.Q8_0
    if target == "q4_k":
        return G.Q4_K
    if target == "q4_k_xl":
        return q4_k_xl_type(name)
    if name in ("token_embd.weight", "output.weight"):
        return G.F16
    return G.NVFP4 if target == "nvfp4-ggml" else G.NVFP4_E2M1


@pytest.fixture(scope="module")
def converted(tiny_gguf, tmp_path_factory):
    d = tmp_path_factory.mktemp("convert")
    out = {}
    for t in TARGETS:
        out[t] = d / f"{t}.gguf"
        assert main(["quantize", str(tiny_gguf), str(out[t]), "--to", t, "--quiet"]) == 0
    return out


@pytest.mark.parametrize("target", TARGETS)
def test_output_contract_and_identities(target, converted, tiny_gguf):
    p = converted[target]
    m = open_model(p)  # the full loader: contract + NVFP4 pairing
    try:
        with read_gguf(tiny_gguf) as src:
            f = m.gguf
            assert tokenizer_sha256(f) == tokenizer_sha256(src)
            assert template_sha256(f) == template_sha256(src)
            ia, ib = identity_of(f, m.config.eog_ids), identity_of(src, m.config.eog_ids)
            assert (ia.tokenizer_sha256, ia.template_sha256, ia.eog_ids) == (ib.tokenizer_sha256, ib.template_sha256, ib.eog_ids)
            for k, fld in src.fields.items():
                if k in CHANGED_KEYS:
                    continue
                got = f.field(k)
                assert (got.vtype, got.elem_type) == (fld.vtype, fld.elem_type), k
                if isinstance(fld.value, np.ndarray):
                    assert np.array_equal(got.value, fld.value), k
                else:
                    assert got.value == fld.value, k
            assert set(f.fields) - set(src.fields) <= CHANGED_KEYS
            assert f.get_str("muser.weight_precision") == ("nvfp4" if target == "nvfp4-w4a4" else target)
            assert (f.get("muser.activation_precision") == "nvfp4") == (target == "nvfp4-w4a4")
            for name, s in src.tensors.items():
                want = expected_type(target, name, len(s.shape))
                assert f.tensors[name].type.ggml_type == want, name
                assert f.tensors[name].shape == s.shape
                if len(s.shape) == 1:
                    assert np.array_equal(f.raw(name), src.raw(name))
                elif want != G.NVFP4_E2M1:
                    vals = np.ascontiguousarray(src.array(name))
                    ref = np.ascontiguousarray(quantize(vals, want) if want != G.F16 else vals.astype("<f2"))
                    assert np.array_equal(f.raw(name).reshape(-1), ref.view(np.uint8).reshape(-1)), name
    finally:
        m.close()


@pytest.mark.comparator
@pytest.mark.parametrize("target", ["q8_0", "q4_k", "q4_k_xl", "nvfp4-ggml"])
def test_ggml_outputs_run_in_pinned_llama_cpp(target, converted):
    llm = llama_cpp.Llama(str(converted[target]), n_ctx=64, n_threads=2, verbose=False, logits_all=True)
    try:
        llm.eval([0, 10, 20, 30, 40])
        logits = np.array(llm.scores[:5, : llm.n_vocab()])
        assert np.isfinite(logits).all() and np.abs(logits).max() > 1.0
    finally:
        llm.close()


def test_progress_on_stderr(tiny_gguf, tmp_path, capsys):
    assert main(["quantize", str(tiny_gguf), str(tmp_path / "o.gguf"), "--to", "q8_0"]) == 0
    err = capsys.readouterr().err
    assert "blk.0.attn_q.weight" in err and "F32 -> Q8_0" in err and "wrote" in err


def test_f16_source(make_gguf, tmp_path):
    src = make_gguf(SynthSpec(dtype="F16"))
    out = tmp_path / "q.gguf"
    assert main(["quantize", str(src), str(out), "--to", "q8_0", "--quiet"]) == 0
    with read_gguf(src) as s, read_gguf(out) as q:
        name = "blk.1.ffn_down.weight"
        vals = np.ascontiguousarray(s.array(name)).astype(np.float32)
        assert np.array_equal(q.raw(name).reshape(-1), quantize(vals, G.Q8_0).reshape(-1))


def _one_line_error(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("muser: error:") and needle in err[0], err


def test_refusals_before_any_work(converted, tiny_gguf, make_gguf, tmp_path, capsys):
    out = tmp_path / "never.gguf"
    _one_line_error(capsys, ["quantize", str(tiny_gguf), str(tiny_gguf), "--to", "q8_0"], "is the input file")
    narrow = make_gguf(SynthSpec(hidden=256, n_heads=4, n_kv_heads=2, head_dim=32, ffn=256, vocab_target=300))
    _one_line_error(capsys, ["quantize", str(narrow), str(out), "--to", "q4_k"],
                    "tensor 'blk.0.attn_output.weight': row length 128 is not a multiple of the Q4_K block of 256")
    _one_line_error(capsys, ["quantize", str(tiny_gguf), str(out), "--to", "q8_0", "--input-scale-inv", "2"],
                    "applies only to --to nvfp4-w4a4")
    _one_line_error(capsys, ["quantize", str(tiny_gguf), str(tmp_path / "no" / "x.gguf"), "--to", "q8_0"],
                    "does not exist")
    _one_line_error(capsys, ["quantize", str(tmp_path / "missing.gguf"), str(out), "--to", "q8_0"], "missing.gguf")
    _one_line_error(capsys, ["quantize", str(tiny_gguf), str(out), "--to", "q8_0", "--threads", "0"],
                    "--threads must be at least 1, got 0")
    assert not out.exists()
    with pytest.raises(SystemExit):
        main(["quantize", str(tiny_gguf), str(out), "--to", "q3_k"])


def test_interrupted_run_leaves_no_output(tiny_gguf, tmp_path, monkeypatch, capsys):
    import muser.quant.convert as conv

    calls = {"n": 0}
    real = conv.quantize

    def flaky(values, t):
        calls["n"] += 1
        if calls["n"] == 6:
            raise KeyboardInterrupt
        return real(values, t)

    monkeypatch.setattr(conv, "quantize", flaky)
    out = tmp_path / "out.gguf"
    assert main(["quantize", str(tiny_gguf), str(out), "--to", "q8_0", "--quiet", "--threads", "1"]) == 130
    assert calls["n"] == 6
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # the temp file is gone too


@pytest.mark.parametrize("source", ["q8_0", "q4_k_xl", "nvfp4", "nvfp4-ggml"])
def test_f32_copy_of_a_quantized_file(source, converted, tmp_path):
    """--to f32 takes any loadable file: every 2-D weight is the ggml decode of its stored blocks
    (NVFP4 companions folded in and dropped), 1-D tensors and metadata copied unchanged."""
    from muser.quant.dequant import dequantize_rows

    out = tmp_path / "f32.gguf"
    assert main(["quantize", str(converted[source]), str(out), "--to", "f32", "--quiet"]) == 0
    m = open_model(out)
    try:
        with read_gguf(converted[source]) as src:
            f = m.gguf
            assert f.get_str("muser.weight_precision") == "f32" and f.get("general.file_type") == 0
            assert tokenizer_sha256(f) == tokenizer_sha256(src) and template_sha256(f) == template_sha256(src)
            assert not any(n.endswith(".nvfp4_scale") or n.endswith(".nvfp4_scale2") for n in f.tensors)
            for name, t in f.tensors.items():
                s = src.tensors[name]
                assert t.shape == s.shape, name
                if len(s.shape) == 1:
                    assert np.array_equal(f.raw(name), src.raw(name)), name
                    continue
                assert t.type.ggml_type == G.F32, name
                want = dequantize_rows(src, name, np.arange(s.shape[1]))
                assert np.array_equal(f.raw(name).reshape(-1), want.view(np.uint8).reshape(-1)), name
            assert set(f.tensors) == {n for n in src.tensors if not n.endswith((".nvfp4_scale", ".nvfp4_scale2"))}
    finally:
        m.close()


def test_q8_0_through_f32_is_lossless(converted, tmp_path):
    """Q8_0 -> F32 is exact, so quantizing that copy again gives the Q8_0 bytes back."""
    f32, back = tmp_path / "f32.gguf", tmp_path / "back.gguf"
    assert main(["quantize", str(converted["q8_0"]), str(f32), "--to", "f32", "--quiet"]) == 0
    assert main(["quantize", str(f32), str(back), "--to", "q8_0", "--quiet"]) == 0
    with read_gguf(converted["q8_0"]) as a, read_gguf(back) as b:
        assert set(a.tensors) == set(b.tensors)
        for name in a.tensors:
            assert np.array_equal(a.raw(name), b.raw(name)), name


# --- quantized sources -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def q4_source(make_gguf):
    """The full fixture's Q4_K mix (Figure 6.6: Q4_K bulk, Q6_K attn_v / ffn_down on even
    layers, Q5_K LM head) at the tiny widths, random valid blocks, written with the gguf package."""
    return make_gguf(SynthSpec(dtype="q4_k_xl", source="blocks"))


@pytest.mark.parametrize("target", ["nvfp4-ggml", "nvfp4"])
def test_q4_k_source_equals_quantizing_its_decode(target, q4_source, tmp_path):
    """Q4_K mix -> NVFP4: each weight is the quantizer applied to the ggml decode of its source
    blocks, bit for bit; embedding and LM head F16; the pool and one process write the same
    file; muser.load opens it."""
    import muser
    from muser.quant import quantize_nvfp4
    from muser.quant.dequant import dequantize_rows

    pooled, single = tmp_path / "pool.gguf", tmp_path / "one.gguf"
    assert main(["quantize", str(q4_source), str(pooled), "--to", target, "--quiet", "--threads", "2"]) == 0
    assert main(["quantize", str(q4_source), str(single), "--to", target, "--quiet", "--threads", "1"]) == 0
    assert pooled.read_bytes() == single.read_bytes()
    with read_gguf(q4_source) as src, read_gguf(pooled) as f:
        kinds = set()
        for name, s in src.tensors.items():
            if len(s.shape) == 1:
                assert np.array_equal(f.raw(name), src.raw(name)), name
                continue
            kinds.add(s.type.ggml_type)
            vals = dequantize_rows(src, name, np.arange(s.shape[1]))  # f32 [n_out, n_in]
            want = expected_type(target, name, 2)
            assert f.tensors[name].type.ggml_type == want, name
            if want == G.F16:
                ref = vals.astype("<f2").view(np.uint8)
            elif want == G.NVFP4:
                ref = quantize(vals, G.NVFP4)
            else:
                w = quantize_nvfp4(vals)
                assert np.array_equal(f.raw(name + ".nvfp4_scale"), w.scales), name
                assert f.array(name + ".nvfp4_scale2").tolist() == [w.scale2], name
                ref = w.packed
            assert np.array_equal(f.raw(name), ref.reshape(f.raw(name).shape)), name
        assert kinds == {G.Q4_K, G.Q5_K, G.Q6_K}
    m = muser.load(pooled)
    try:
        assert m.config.n_layers == 4
    finally:
        m.close()


def test_undecodable_source_type_refused(q4_source, tmp_path, capsys):
    """A 2-D weight of a type with no decoder: a typed error naming the tensor and its type,
    from the loader's contract through the CLI and from plan() on the raw file, no output."""
    from muser.errors import FormatError
    from muser.quant.convert import plan

    name = "blk.2.ffn_up.weight"
    with read_gguf(q4_source) as f:
        shape = f.tensors[name].shape
    n_blocks = shape[0] * shape[1] // 256
    q2 = np.zeros((n_blocks, 84), dtype=np.uint8)  # block_q2_K: 84 bytes per 256 values
    bad = rewrite(q4_source, tmp_path / "q2.gguf", replace={name: (q2, G.Q2_K, shape)})
    out = tmp_path / "never.gguf"
    _one_line_error(capsys, ["quantize", str(bad), str(out), "--to", "nvfp4-ggml"], f"{name!r}: dtype Q2_K")
    with read_gguf(bad) as f, pytest.raises(FormatError, match=f"input tensor {name!r} is Q2_K, which muser quantize cannot decode"):
        plan(f, "nvfp4-ggml")
    assert not out.exists()


def test_failing_pool_task_leaves_no_output(q4_source, tmp_path, capsys):
    """A block scale that decodes to inf in a late tensor: the pool process's typed error names
    the tensor, the run stops, and neither OUT nor its temp file is left."""
    name = "blk.3.ffn_gate.weight"
    with read_gguf(q4_source) as f:
        blocks = np.array(f.raw(name)).reshape(-1, 144)
        shape = f.tensors[name].shape
    blocks[7, 0:2] = np.float16(np.inf).reshape(1).view(np.uint8)  # d of block 7
    bad = rewrite(q4_source, tmp_path / "inf.gguf", replace={name: (blocks, G.Q4_K, shape)})
    d = tmp_path / "out"
    d.mkdir()
    _one_line_error(capsys, ["quantize", str(bad), str(d / "x.gguf"), "--to", "nvfp4-ggml", "--threads", "2",
                             "--quiet"], f"tensor {name!r}")
    assert list(d.iterdir()) == []


def test_weights_already_in_their_target_type_are_copied(q4_source, converted, tmp_path):
    """Q4_K mix -> q4_k_xl: every tensor's bytes as stored; native NVFP4 -> nvfp4-w4a4: payload,
    scale bytes and scale2 as stored, the input scale added."""
    same, w4a4 = tmp_path / "xl.gguf", tmp_path / "w4a4.gguf"
    assert main(["quantize", str(q4_source), str(same), "--to", "q4_k_xl", "--quiet"]) == 0
    with read_gguf(q4_source) as a, read_gguf(same) as b:
        assert list(a.tensors) == list(b.tensors)
        for name in a.tensors:
            assert np.array_equal(a.raw(name), b.raw(name)), name
    assert main(["quantize", str(converted["nvfp4"]), str(w4a4), "--to", "nvfp4-w4a4", "--quiet",
                 "--input-scale-inv", "0.5"]) == 0
    with read_gguf(converted["nvfp4"]) as a, read_gguf(w4a4) as b:
        assert set(b.tensors) - set(a.tensors) == {n + ".nvfp4_input_scale_inv" for n in a.tensors
                                                   if a.tensors[n].type.ggml_type == G.NVFP4_E2M1}
        for name in a.tensors:
            assert np.array_equal(a.raw(name), b.raw(name)), name
        assert b.array("blk.0.attn_q.weight.nvfp4_input_scale_inv").tolist() == [0.5]
