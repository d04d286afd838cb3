"""`muser convert`: a synthetic Muse Glimmer HF checkpoint (tests/convert/hf_fixture.py) converts
to GGUFs byte-identical to the pinned llama.cpp converter's, whose SHA-256s were recorded by
running tools/lcp_convert_reference.py on the same checkpoint (docs/convert.md); the result loads
in Muser and tokenizes as the HF tokenizer does; unknown keys and tensors are refused with nothing
written."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest

from muser.cli import main
from muser.errors import FormatError, MetadataError

from .hf_fixture import write_checkpoint

# sha256 of the pinned converter's output (llama-cpp-python 0.3.36, `--outtype T`, --pre gpt-2)
PINNED = {
    "auto": "2fd6923d16c789282e5d07bd294edd2c23208d19cd534b464ae07087f1da30e3",
    "f32": "e1d92e560c9debc1d5b65fd3edc71847cb557ce3fd0a1c7ff5fea9daca9c37f5",
    "f16": "893959a38f6a3d786913d759674a8b5b0383d86ad2cbe916910a6992698c6795",
    "q8_0": "14b622eb4b23cb9807d7d7c7d4f8df3697050a5c43d0218e9afedcdc6ff2a401",
}

# the sharded F16 variant (two parts + index, TemplateProcessing post-processor, chat_template.jinja)
PINNED_SHARDED = {
    "auto": "76eae1b8d802f4fad9ffea2e2fdc4a15b262824956f28018cf4cd13e3538d79b",
    "q8_0": "7fb4f2aa55b7ed76924f35297206cb3fb97229dfb32f86f6c880e7ae522e9827",
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # the folder name is the model name the converter writes (general.name "Muse Glimmer Synth")
    return write_checkpoint(tmp_path_factory.mktemp("hf") / "Muse-Glimmer-Synth")


def _sha(p) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.mark.parametrize("to", sorted(PINNED))
def test_byte_identical_to_the_pinned_converter(ckpt, tmp_path, to, capsys):
    out = tmp_path / f"m-{to}.gguf"
    assert main(["convert", str(ckpt), str(out), "--to", to, "--pre", "gpt-2"]) == 0
    assert _sha(out) == PINNED[to]
    assert "convert" in capsys.readouterr().err  # the progress bar


@pytest.mark.parametrize("to", sorted(PINNED_SHARDED))
def test_sharded_f16_checkpoint_is_byte_identical_too(tmp_path_factory, tmp_path, to):
    from muser.convert import convert_hf
    from muser.gguf.reader import read_gguf

    d = write_checkpoint(tmp_path_factory.mktemp("hf2") / "Muse-Glimmer-Synth", sharded=True)
    out = convert_hf(d, tmp_path / "m.gguf", target=to, pre="gpt-2", progress=False)
    assert _sha(out) == PINNED_SHARDED[to]
    f = read_gguf(out)
    assert f.get("tokenizer.ggml.add_bos_token") is True and f.get("tokenizer.ggml.add_sep_token") is False


def test_converted_file_loads_and_tokenizes_like_hf(ckpt, tmp_path):
    from tokenizers import Tokenizer as HFTokenizer

    from muser.commands.inspect import describe
    from muser.gguf.reader import read_gguf
    from muser.text import Tokenizer

    out = tmp_path / "m.gguf"
    assert main(["convert", str(ckpt), str(out), "--pre", "gpt-2"]) == 0
    d = describe(str(out), check=True, progress=False)
    assert d["verdict"] == "valid" and d["config"]["n_layers"] == 4
    tok = Tokenizer.from_gguf(read_gguf(out))
    hf = HFTokenizer.from_file(str(ckpt / "tokenizer.json"))
    for text in ("def main():\n    return 0\n", "Beautiful is better than ugly.", "x<|eot|>  y"):
        assert tok.encode(text, parse_special=True) == hf.encode(text, add_special_tokens=False).ids


def test_unknown_config_key_is_refused_before_writing(ckpt, tmp_path):
    bad = tmp_path / "Muse-Glimmer-Synth"
    bad.mkdir()
    for f in ckpt.iterdir():
        (bad / f.name).symlink_to(f)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["text_config"]["num_experts"] = 8
    (bad / "config.json").unlink()
    (bad / "config.json").write_text(json.dumps(cfg))
    from muser.convert import convert_hf

    with pytest.raises(MetadataError, match="num_experts"):
        convert_hf(bad, tmp_path / "o.gguf", pre="gpt-2", progress=False)
    assert not (tmp_path / "o.gguf").exists() and not list(tmp_path.glob(".o.gguf*"))


def test_unknown_tensor_is_refused(tmp_path):
    from muser.convert import convert_hf

    from . import hf_fixture as F

    d = tmp_path / "ck"
    write_checkpoint(d)
    arrays = F.tensors()
    arrays["model.language_model.layers.0.self_attn.rotary_emb.scale"] = arrays["model.language_model.norm.weight"]
    F.write_safetensors(d / "model.safetensors", arrays)
    with pytest.raises(FormatError, match="rotary_emb.scale"):
        convert_hf(d, tmp_path / "o.gguf", pre="gpt-2", progress=False)
    assert not (tmp_path / "o.gguf").exists()


def test_bad_inputs_are_one_line(ckpt, tmp_path, capsys):
    assert main(["convert", str(tmp_path / "nope"), str(tmp_path / "o.gguf"), "--pre", "gpt-2"]) == 2
    assert "not a Hugging Face checkpoint folder" in capsys.readouterr().err
    assert main(["convert", str(ckpt), str(tmp_path / "o.gguf"), "--pre", "no-such-pre"]) == 2
    assert "no-such-pre" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["convert", str(ckpt), str(tmp_path / "o.gguf"), "--pre", "gpt-2", "--to", "q4_k"])
    (tmp_path / "o.gguf").write_bytes(b"keep")
    assert main(["convert", str(ckpt), str(tmp_path / "o.gguf"), "--pre", "gpt-2"]) == 2
    assert (tmp_path / "o.gguf").read_bytes() == b"keep"


def test_safetensors_offsets_are_checked(tmp_path):
    from muser.convert.safetensors import SafetensorsFile

    h = json.dumps({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                    "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}).encode()
    p = tmp_path / "x.safetensors"
    p.write_bytes(struct.pack("<Q", len(h)) + h + bytes(24))
    with pytest.raises(FormatError, match="overlap"):
        SafetensorsFile(p)
    h = json.dumps({"a": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}}).encode()
    p.write_bytes(struct.pack("<Q", len(h)) + h + bytes(16))
    with pytest.raises(FormatError, match="do not hold F32"):
        SafetensorsFile(p)
