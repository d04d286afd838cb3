"""The llama.cpp comparator runner (llama-cpp-python 0.3.36): settings, feeding schedules,
refusals, and thread-count invariance of its logits."""

from __future__ import annotations

import llama_cpp  # the pinned comparator is part of the test environment: no skip
import numpy as np
import pytest

from muser.bench.llamacpp import GGML_TYPE, PINNED_VERSION, LlamaCppRunner, schedule_for
from muser.errors import ComparatorError


def test_pinned_version_and_type_ids():
    assert llama_cpp.__version__ == PINNED_VERSION
    assert GGML_TYPE == {"f32": 0, "f16": 1}
    assert llama_cpp.GGML_TYPE_F32 == 0 and llama_cpp.GGML_TYPE_F16 == 1


def test_schedules():
    assert schedule_for("prefill", 5) == [5]
    assert schedule_for("decode", 3) == [1, 1, 1]
    assert schedule_for(2, 5) == [2, 1, 1, 1]
    for bad in ("beam", 0, 6):
        with pytest.raises(ComparatorError):
            schedule_for(bad, 5)


def test_runner_settings_and_refusals(semantic_gguf, runner_cache):
    r = runner_cache(semantic_gguf, "f32")
    st = r.settings()
    assert st["type_k"] == st["type_v"] == 0 and st["flash_attn"] is False
    with pytest.raises(ComparatorError, match="outside the vocab"):
        r.logits([1, r.n_vocab])
    with pytest.raises(ComparatorError, match="n_ctx"):
        r.logits(list(range(10)) * 30)
    with pytest.raises(ComparatorError, match="kv 'q8'"):
        LlamaCppRunner(semantic_gguf, kv="q8")
    with pytest.raises(ComparatorError, match="could not load"):
        LlamaCppRunner(__file__, kv="f16")


def test_runner_resets_between_sequences_and_feeding_matters(semantic_gguf, runner_cache):
    r = runner_cache(semantic_gguf, "f16")
    t = [int(x) for x in np.random.default_rng(0).integers(0, r.n_vocab, 40)]
    a = r.logits(t)
    assert a.shape == (40, r.n_vocab) and a.dtype == np.float32
    assert np.array_equal(r.logits(t), a)  # a fresh sequence each call
    d = r.logits(t, "decode")
    assert np.allclose(a, d, atol=0.5) and not np.array_equal(a, d)  # gemm vs gemv rounding


def test_thread_count_does_not_change_logits(make_gguf):
    from .conftest import rounding_spec

    path = make_gguf(rounding_spec("Q4_K"))
    t = [int(x) for x in np.random.default_rng(1).integers(0, 384, 24)]
    out = []
    for n in (1, 2):  # ggml splits rows across threads; each output is computed by one thread
        r = LlamaCppRunner(path, kv="f16", n_ctx=64, n_threads=n)
        out.append(r.logits(t))
        r.close()
    assert np.array_equal(out[0], out[1])
