"""Fixture families for the oracle and Gate 1 (tiny geometry: 4 layers [S,S,S,F], hidden 512,
8 q heads / 2 KV heads, head_dim 32, ffn 512, vocab 384, window W = 32; every K-quant row length
is a multiple of 256, so llama.cpp never falls back to Q5_0/Q8_0).

- SEMANTIC: SynthSpec() (gain 1, lm_gain 25): every layer carries full weight, logits peaky.
  Gate 1a runs here; a 1-ulp change moves log-probs by ~5e-5, a semantic slip by >= 1e-3.
- ROUNDING: gain 2e-3, lm_gain 25. Quantized activations turn ulp differences into rounding
  flips, and with full-weight layers those cascade through the sandwich norms (on SEMANTIC a
  1-ulp jitter moves log-probs by ~0.6 and flips ~3% of top-1s, for any non-bit-identical
  implementation). At gain 2e-3 the attention path still contributes a few percent and the FFN
  path ~1e-4 after the 1e-8 post-norms, so flips stay isolated: top-1 is stable (peaky logits,
  median gap ~0.7 nats); the global ablations of test_gate1.py fail here. Each rounding point
  on its own is shown needed in test_rounding_points.py, on fixtures built for that point.
- WELL: gain 1e-3, lm_gain 0.01: 1-ulp noise floor <= 1e-5 for every dtype; Gate 1 holds outright.
"""

from __future__ import annotations

import pytest

from muser.model.synth import SynthSpec

DTYPES_1B = ("F32", "F16", "BF16", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "q4_k_xl")

SEMANTIC = SynthSpec()
ROUNDING_GAIN = 2e-3
WELL_GAIN, WELL_LM_GAIN = 1e-3, 0.01


def rounding_spec(dtype: str) -> SynthSpec:
    return SynthSpec(dtype=dtype, gain=ROUNDING_GAIN)


def well_spec(dtype: str) -> SynthSpec:
    return SynthSpec(dtype=dtype, gain=WELL_GAIN, lm_gain=WELL_LM_GAIN)


@pytest.fixture(scope="session")
def semantic_gguf(make_gguf):
    return make_gguf(SEMANTIC)


@pytest.fixture(scope="session")
def oracle_cache():
    """Loaded oracles shared across tests: (path, arithmetic, kv) -> OracleModel."""
    import muser.oracle as O

    cache: dict = {}

    def get(path, arithmetic="f32", kv=None):
        key = (str(path), arithmetic, kv)
        if key not in cache:
            cache[key] = O.load(path, arithmetic=arithmetic, kv=kv)
        return cache[key]

    yield get
    for m in cache.values():
        m.close()


@pytest.fixture(scope="session")
def runner_cache():
    """Loaded llama.cpp comparators: (path, kv) -> LlamaCppRunner."""
    from muser.bench.llamacpp import LlamaCppRunner

    cache: dict = {}

    def get(path, kv):
        key = (str(path), kv)
        if key not in cache:
            cache[key] = LlamaCppRunner(path, kv=kv, n_ctx=256)
        return cache[key]

    yield get
    for r in cache.values():
        r.close()
