"""Gate 3 on the shipped pair: the micro model and its DFlash drafter give identical greedy tokens with
speculation on and off, for 5 held-out prompts x 128 tokens, with f16 and f32 K/V."""

from __future__ import annotations

from pathlib import Path

import pytest

import muser
from muser.bench.kinds.spec import mid_cut, natural_mid_prompts, natural_prompts, prompt_text
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


def test_natural_mid_prompts_micro():
    """natural-mid: for the natural class's files, windows that end at the first line boundary at or
    after the token midpoint, the same on every call, and that tokenize back to exactly their ids."""
    m = muser.load(TARGET, pin=TARGET.with_name(TARGET.stem + ".pin.json"))
    try:
        tok = m.tokenizer
        names = [name for name, _ in natural_prompts(m, 5, 256, None)]
        mid, cuts = natural_mid_prompts(m, names, 256, None)
        assert (mid, cuts) == natural_mid_prompts(m, names, 256, None)
        assert [c["file"] for c in cuts] == names and len(mid) == 5  # none of these files is skipped
        nat = dict(natural_prompts(m, 5, 256, None))
        for (name, ids), cut in zip(mid, cuts):
            assert name == f"{cut['file']}@{cut['end']}" and len(ids) == 257 and ids[0] == tok.bos_id
            assert ids != nat[cut["file"]]  # not the file's start
            assert cut["end"] >= cut["midpoint"] >= 256
            assert tok.decode_bytes([ids[-1]]).endswith(b"\n")  # ends at a line boundary
            if cut["line_boundaries_tried"] == 1:  # and at the first one from the midpoint
                before = ids[1 + 256 - (cut["end"] - cut["midpoint"]):-1]  # file tokens midpoint..end-2
                assert not any(tok.decode_bytes([t]).endswith(b"\n") for t in before)
            assert prompt_text(tok, name, ids)  # raises unless the text gives back exactly ids
    finally:
        m.close()


def test_mid_cut_skips_and_moves_to_a_round_tripping_boundary():
    m = muser.load(TARGET, pin=TARGET.with_name(TARGET.stem + ".pin.json"))
    try:
        tok = m.tokenizer
        short = mid_cut(tok, "x = 1\n" * 10, 256)
        assert short["file_tokens"] == 50 and "fewer than --prompt-tokens 256" in short["skipped"]
        assert "no line boundary" in mid_cut(tok, "abc " * 100, 8)["skipped"]
        # a window of 8 ending at the first boundary starts inside the 2-byte 'ü': its text is not its ids
        text = "x = 'ü'\n" * 5 + "y = 10\n" * 5
        cut = mid_cut(tok, text, 8)
        ids = tok.encode(text)
        first = next(e for e in range(cut["midpoint"], len(ids) + 1) if tok.decode_bytes([ids[e - 1]]).endswith(b"\n"))
        assert first < cut["end"] and cut["line_boundaries_tried"] == 2
        assert tok.encode(tok.decode(ids[first - 8:first])) != ids[first - 8:first]
        window = ids[cut["end"] - 8:cut["end"]]
        assert tok.encode(tok.decode(window)) == window and tok.decode(window).endswith("\n")
    finally:
        m.close()
