"""Tokenizer fixtures: vocab-only GGUFs for the three tokenizer kinds, and the pinned llama.cpp
opened on each (vocab_only=True). Imports llama_cpp directly: the comparator must be present."""

from __future__ import annotations

from pathlib import Path

import llama_cpp
import pytest

from muser.gguf.reader import read_gguf
from muser.model import synth as msynth
from muser.text import Tokenizer
from muser.text import synth as tsynth


@pytest.fixture(scope="session")
def vocab_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vocabs")


@pytest.fixture(scope="session")
def gpt2_gguf(vocab_dir) -> Path:
    """The synthetic fixture's tokenizer (byte-level BPE, pre gpt-2)."""
    return tsynth.write_vocab_gguf(vocab_dir / "gpt2.gguf", msynth.tokenizer_metadata(msynth.SynthSpec()))


@pytest.fixture(scope="session")
def llama4_md() -> dict:
    """A byte-level BPE trained on part of the stdlib with the GPT-4o split, pre llama4."""
    texts = tsynth.read_texts(tsynth.stdlib_files()[::41], max_bytes=1_500_000)
    return tsynth.gpt4o_tokenizer_metadata(texts, 3000)


@pytest.fixture(scope="session")
def llama4_gguf(vocab_dir, llama4_md) -> Path:
    return tsynth.write_vocab_gguf(vocab_dir / "llama4.gguf", llama4_md)


MUSE_GLIMMER_VOCAB = 202_048


@pytest.fixture(scope="session")
def glimmer_shape_gguf(vocab_dir, llama4_md) -> Path:
    """Muse Glimmer's vocabulary shape: the llama4 vocab grown to 202,048 ids, about 200,000
    ordinary tokens (the extra ones unreachable by any merge) then reserved control tokens."""
    from gguf import GGUFValueType as V

    from muser.gguf.writer import Typed

    md = dict(llama4_md)
    tokens = list(md["tokenizer.ggml.tokens"])
    types = list(md["tokenizer.ggml.token_type"].value)
    n_normal = 200_000 - len(tokens)
    seen = set(tokens)
    filler = [t for t in (f"\u0120\u0120fill{i:x}" for i in range(n_normal)) if t not in seen]
    assert len(filler) == n_normal
    reserved = [f"<|reserved_special_token_{k}|>" for k in range(MUSE_GLIMMER_VOCAB - 200_000)]
    md["tokenizer.ggml.tokens"] = tokens + filler + reserved
    md["tokenizer.ggml.token_type"] = Typed(types + [1] * len(filler) + [3] * len(reserved), V.ARRAY, V.INT32)
    return tsynth.write_vocab_gguf(vocab_dir / "glimmer-shape.gguf", md)


@pytest.fixture(scope="session")
def spm_gguf(vocab_dir) -> Path:
    """A SentencePiece-style vocabulary (tokenizer.ggml.model llama) with byte fallback."""
    texts = tsynth.read_texts(tsynth.stdlib_files()[5::53], max_bytes=400_000)
    return tsynth.write_vocab_gguf(vocab_dir / "spm.gguf", tsynth.spm_tokenizer_metadata(texts, 1500))


@pytest.fixture(scope="session")
def default_gguf(vocab_dir) -> Path:
    """The fixture's vocabulary under pre "default" (llama.cpp's four-regex default split)."""
    md = msynth.tokenizer_metadata(msynth.SynthSpec())
    md["tokenizer.ggml.pre"] = "default"
    return tsynth.write_vocab_gguf(vocab_dir / "default.gguf", md)


@pytest.fixture(scope="session", params=["gpt2", "llama4", "spm", "default"])
def kind(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def vocab_path(kind, gpt2_gguf, llama4_gguf, spm_gguf, default_gguf) -> Path:
    return {"gpt2": gpt2_gguf, "llama4": llama4_gguf, "spm": spm_gguf, "default": default_gguf}[kind]


_cache: dict = {}


def open_pair(path: Path):
    """(Muser Tokenizer, llama.cpp vocab-only Llama) for a GGUF, cached per session."""
    if path not in _cache:
        tok = Tokenizer.from_gguf(read_gguf(path))
        llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        _cache[path] = (tok, llm)
    return _cache[path]


@pytest.fixture(scope="session")
def pair(vocab_path):
    return open_pair(vocab_path)


def specials_longest_first(tok) -> list[str]:
    return [tok.vocab.tokens[i] for i in sorted(tok.vocab.special_ids, key=lambda i: -len(tok.vocab.tokens[i]))]
