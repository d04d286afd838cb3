"""Gate 3 on the shipped pair: the micro model and its DFlash drafter give identical greedy tokens with
speculation on and off, for 5 held-out prompts x 128 tokens, with f16 and f32 K/V."""

from __future__ import annotations

from pathlib import Path

import pytest

import muser
from muser.bench.kinds.spec import natural_prompts
from muser.sample import SamplingParams

GREEDY = SamplingParams(temperature=0.0)  # the API default samples at 0.8

MODELS = Path(__file__).resolve().parents[2] / "models"
TARGET = MODELS / "muse-glimmer-micro-q8_0.gguf"
DRAFT = MODELS / "muse-glimmer-micro-dflash.gguf"


@pytest.mark.parametrize("kv", ["f16", "f32"])
def test_spec_on_off_identical_micro(kv):
    m = muser.load(TARGET, kv=kv, pin=TARGET.with_name(TARGET.stem + ".pin.json"))
    try:
        prompts = natural_prompts(m, 5, 64, None)
        assert len(prompts) == 5
        proposals = 0
        for name, ids in prompts:
            plain = [(e.token, e.logprob) for e in m.stream(ids, 128, GREEDY)]
            gen = m.stream(ids, 128, GREEDY, draft=DRAFT, verify_len=7)
            # identical tokens, and logprobs bit for bit (the CPU exact lane is row-invariant)
            assert [(e.token, e.logprob) for e in gen] == plain, name
            proposals += gen.spec.stats()["proposals"]
        assert proposals > 0  # the speculative path ran
    finally:
        m.close()


def test_shipped_drafter_is_the_default():
    from muser.api import shipped_drafter

    assert shipped_drafter(TARGET) == DRAFT
    assert shipped_drafter(DRAFT) is None
