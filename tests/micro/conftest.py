"""Fixtures for the micro model: the tools/ modules, the corpus (read once per session), a small corpus,
a smoke-trained run and its GGUFs, and the shipped models."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOLS = REPO / "tools"


def _load(name: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def corpus_mod():
    return _load("corpus")


@pytest.fixture(scope="session")
def corpus_pkgs():
    return _load("corpus_packages")


@pytest.fixture(scope="session")
def corpus_write():
    return _load("corpus_write")


@pytest.fixture(scope="session")
def corpus_carry():
    return _load("corpus_carry")


@pytest.fixture(scope="session")
def train_mod():
    return _load("train_micro")


@pytest.fixture(scope="session")
def export_mod(corpus_mod):
    return _load("export_micro")


@pytest.fixture(scope="session")
def all_docs(corpus_mod):
    """Every corpus file (the full CPython 3.11 rule), read once per session."""
    return corpus_mod.load_docs()


@pytest.fixture(scope="session")
def heldout_docs(corpus_mod, all_docs):
    return corpus_mod.split_docs(all_docs, "heldout")


@pytest.fixture(scope="session")
def small_corpus(corpus_mod, tmp_path_factory) -> Path:
    """The corpus rule on the first 24 files of each split, a 512-token BPE: seconds to build."""
    out = tmp_path_factory.mktemp("micro-corpus")
    corpus_mod.build(out=out, vocab_size=512, max_files=24, log=lambda *_: None)
    return out


@pytest.fixture(scope="session")
def smoke_run(train_mod, small_corpus, tmp_path_factory) -> Path:
    """tools/train_micro.py --smoke: tiny geometry (8 layers, window 16, context 64), CPU, 12 steps."""
    import torch

    out = tmp_path_factory.mktemp("micro-run")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 0.5M-parameter model: intra-op threads only spin (58 s -> 8 s on 2 busy cores)
    try:
        rc = train_mod.main(["--data", str(small_corpus), "--out", str(out), "--smoke"])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    return out


@pytest.fixture(scope="session")
def smoke_ggufs(export_mod, small_corpus, smoke_run, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("micro-gguf")
    return export_mod.export(smoke_run, small_corpus / "tokenizer.json", out, ("F32", "F16", "Q8_0"), quant="gguf",
                             log=lambda *_: None)


SHIPPED = REPO / "models"
NAME = "muse-glimmer-micro"


@pytest.fixture(scope="session")
def shipped() -> dict:
    """The shipped GGUF: {"Q8_0": path} (the F16 master lives outside the repository)."""
    return {"Q8_0": SHIPPED / f"{NAME}-q8_0.gguf"}
