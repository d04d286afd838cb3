"""kvpack fixtures: the tiny synthetic model (window 32) on the oracle and the CPU engine, with
16-token tiles so a short prompt crosses many chunk boundaries and several ring wraps."""

from __future__ import annotations

import numpy as np
import pytest

CH = 16  # tile tokens in these tests (the format's default is 512)
SESSION_CHUNK = 16  # prefill rows per forward; must divide CH (warm reuse checks it)


@pytest.fixture(scope="session")
def models(tiny_gguf):
    """name -> loaded model with a .session(max_context, chunk) surface."""
    import muser.oracle as O
    from muser.engine import Engine

    out = {
        "oracle-ggml-cpu-f16": O.load(tiny_gguf, arithmetic="ggml-cpu", kv="f16"),
        "oracle-f32-f32": O.load(tiny_gguf, arithmetic="f32", kv="f32"),
        "engine-exact-cpu-f16": Engine.open(tiny_gguf, device="cpu", lane="exact", kv="f16"),
    }
    yield out
    for m in out.values():
        getattr(m, "close", lambda: None)()


@pytest.fixture(scope="session")
def prompt(models):
    rng = np.random.default_rng(7)
    vocab = models["oracle-f32-f32"].config.vocab
    return [int(t) for t in rng.integers(3, vocab, 160)]
