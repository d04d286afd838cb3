"""SamplingParams validation: every bad value is a SamplingError naming the field and value."""

from __future__ import annotations

import math

import pytest

import muser
from muser.errors import SamplingError
from muser.sample import SamplingParams


@pytest.mark.parametrize("kw,msg", [
    ({"temperature": float("nan")}, "temperature must be finite, got nan"),
    ({"temperature": -0.5}, "temperature must be >= 0 .*-0.5"),
    ({"temperature": math.inf}, "temperature must be finite"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
    ({"typical_p": -1.0}, "typical_p"),
    ({"min_p": 1.01}, r"min_p must be in \[0, 1\], got 1.01"),
    ({"repeat_penalty": 0.0}, "repeat_penalty must be > 0, got 0.0"),
    ({"presence_penalty": float("nan")}, "presence_penalty must be finite"),
    ({"frequency_penalty": "x"}, "frequency_penalty must be a number, got 'x'"),
    ({"top_k": -1}, "top_k must be >= 0, got -1"),
    ({"top_k": 2.5}, "top_k must be an integer, got 2.5"),
    ({"penalty_last_n": -1}, "penalty_last_n must be >= 0, got -1"),
    ({"min_keep": -2}, "min_keep"),
    ({"seed": -1}, "seed must be >= 0, got -1"),
    ({"seed": 0xFFFFFFFF}, "seed must be in"),
    ({"seed": True}, "seed must be an integer"),
    ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
    ({"stop": ("ok", "")}, "stop strings must be non-empty"),
    ({"logit_bias": {5: float("nan")}}, r"logit_bias\[5\] must be a finite number or -inf, got nan"),
    ({"logit_bias": {5: math.inf}}, r"logit_bias\[5\]"),
    ({"logit_bias": {-3: 1.0}}, "logit_bias token must be >= 0, got -3"),
    ({"logit_bias": [1, 2]}, "logit_bias must be a mapping"),
])
def test_refusals(kw, msg):
    with pytest.raises(SamplingError, match=msg):
        SamplingParams(**kw)


def test_defaults_are_llama_cpp_common_defaults():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.typical_p) == (0.8, 40, 0.95, 0.05, 1.0)
    assert (p.repeat_penalty, p.presence_penalty, p.frequency_penalty, p.penalty_last_n) == (1.0, 0.0, 0.0, 64)
    assert muser.SamplingParams is SamplingParams


def test_banning_a_token_is_allowed_and_vocab_checked():
    p = SamplingParams(logit_bias={3: -math.inf}, stop="x")
    assert p.stop == ("x",) and p.logit_bias[3] == -math.inf
    with pytest.raises(SamplingError, match="logit_bias token 500 is outside the vocab"):
        p.replace(logit_bias={500: 1.0}).check_vocab(384)
    with pytest.raises(TypeError):
        p.logit_bias[4] = 1.0  # frozen
