"""Rows kept on the device (engine/rows.py) and the warm-up at load (engine/warmup.py), on the CPU:
the CPU path is unchanged (host arrays, no warm-up), and the device-row code itself, run here on
CPU tensors, gives the host path's logits and tokens and rolls a non-finite row's call back."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

import muser
from muser.engine import Engine, StepItem
from muser.engine.rows import DeviceRow
from muser.engine.warmup import capacities, plan, run_plan, warm_up
from muser.errors import LaneError, NonFiniteLogits
from muser.generation import generate
from muser.model.synth import SynthSpec
from muser.progress import Progress
from muser.sample import SamplingParams
from muser.text import Tokenizer

PROMPT = [6 + (i * 37) % 370 for i in range(40)]


@pytest.fixture(scope="module")
def eng(make_gguf):
    return Engine.open(make_gguf(SynthSpec(context_length=256)), device="cpu", lane="exact", kv="f32")


def test_cpu_sessions_return_host_rows(eng):
    a, b = eng.session(max_context=64), eng.session(max_context=64)
    la, lb = a.prefill_row(PROMPT[:9]), b.prefill(PROMPT[:9])
    assert isinstance(la, np.ndarray) and np.array_equal(la, lb)
    da, db = a.decode_row(5), b.decode(5)
    assert isinstance(da, np.ndarray) and np.array_equal(da, db)
    res = eng.step([StepItem(a, [7])], device_rows=True)  # kept on the device on CUDA only
    assert res[0].row is None and res[0].logits.shape == (1, eng.cfg.vocab)


def test_row_call_matches_the_host_call(eng):
    a, b = eng.session(max_context=64, chunk=16), eng.session(max_context=64, chunk=16)
    row = a._row_call(a.check(PROMPT, "prefill"), 16)  # three chunks, the last row kept
    assert isinstance(row, DeviceRow) and a.logits is None and a.n_past == len(PROMPT)
    assert np.array_equal(row.host(), b.prefill(PROMPT))
    row = a._row_call(a.check(11, "decode"), 1)
    assert np.array_equal(row.host(), b.decode(11))


def test_a_non_finite_row_rolls_its_call_back(eng):
    s = eng.session(max_context=64)
    s.prefill(PROMPT[:5])
    row = s._row_call(s.check(PROMPT[5:12], "prefill"), 512)
    assert s.n_past == 12
    with torch.inference_mode():
        row.logits[3] = float("inf")
        row._finite = torch.isfinite(row.logits).all()  # as the device computes it with the row
    with pytest.raises(NonFiniteLogits, match="token 3.*rolled back to 5 tokens"):
        row.read(torch.zeros(2, dtype=torch.float64))
    assert s.n_past == 5
    assert np.array_equal(s.prefill(PROMPT[5:12]), eng.session(max_context=64).prefill(PROMPT[:12]))


class RowSession:
    """An engine session whose prefill_row / decode_row return DeviceRows on the CPU (the CUDA
    path's code, run on CPU tensors)."""

    def __init__(self, s):
        self.s = s

    def prefill(self, ids):
        raise AssertionError("the generation loop takes rows")

    decode = prefill

    def prefill_row(self, ids):
        return self.s._row_call(self.s.check(ids, "prefill"), self.s.chunk)

    def decode_row(self, token):
        return self.s._row_call(self.s.check(token, "decode"), 1)


@pytest.mark.parametrize("params", [SamplingParams(seed=3), SamplingParams(temperature=0.0, seed=3),
                                    SamplingParams(top_k=0, top_p=0.9, seed=3),
                                    SamplingParams(repeat_penalty=1.2, seed=3)])
def test_generation_over_device_rows_is_the_host_generation(eng, make_gguf, params):
    from muser.gguf.reader import read_gguf

    tok = Tokenizer.from_gguf(read_gguf(make_gguf(SynthSpec(context_length=256))))
    host = list(generate(eng.session(max_context=64), tok, PROMPT[:8], params, max_tokens=12))
    dev = list(generate(RowSession(eng.session(max_context=64)), tok, PROMPT[:8], params, max_tokens=12))
    assert [e.token for e in dev] == [e.token for e in host]
    assert [e.text for e in dev] == [e.text for e in host]
    assert [e.logprob for e in dev] == pytest.approx([e.logprob for e in host], abs=1e-9)


# -- warm-up --------------------------------------------------------------------------------------


def test_load_on_the_cpu_does_not_warm_up(make_gguf, monkeypatch):
    import muser.engine.warmup as W

    def refuse(*a, **kw):
        raise AssertionError("warm-up ran on the CPU")

    monkeypatch.setattr(W, "warm_up", refuse)
    m = muser.load(make_gguf(SynthSpec(context_length=256)), device="cpu")
    try:
        assert m.warm_record is None and m.engine._graphs == {}
    finally:
        m.close()


def test_warm_up_refuses_an_engine_without_cuda(eng):
    with pytest.raises(LaneError, match="cpu"):
        warm_up(eng)


def test_the_plan_covers_every_row_bucket():
    assert capacities(256) == [256]
    assert capacities(40) == [40]
    assert capacities(131072) == [4096]  # no kernel specializes on the depth (fixed absolute splits)
    calls = plan(4096)
    assert {c for c, _, _ in calls} == set(capacities(4096))
    assert {r for _, w, r in calls if w == "verify"} == {2, 4, 8, 16}
    for t in range(2, 17):  # every prompt length a graph serves, twice: eager, then captured
        assert [r for _, w, r in calls if w == "prompt"].count(t) == 2
    assert any(w == "prefill" and r > 16 for _, w, r in calls)  # the eager chunk (several matvec slices)
    used: dict[int, int] = {}
    for c, _, r in calls:  # every call fits its session
        used[c] = used.get(c, 1) + r
        assert used[c] <= c
    assert len(plan(40)) >= 2  # a short context still runs what fits


def test_the_plan_runs_and_leaves_nothing_behind(eng):
    out = io.StringIO()
    calls = plan(eng.cfg.context_length)
    bar = Progress("warm-up", len(calls), stream=out)
    run_plan(eng, calls, bar)
    assert bar.done == len(calls) and "warm-up: 100.0%" in out.getvalue()
    assert eng._graphs == {}


def test_the_drafter_warm_up_runs_and_leaves_nothing_behind():
    """Model._warm_drafter (what a CUDA load runs for a drafter) on the shipped pair, on the CPU."""
    from muser.api import shipped_drafter

    m = muser.load(device="cpu")
    try:
        d = m.drafter(shipped_drafter(m.path))
        assert m.warm_record is None  # the CPU load warmed nothing, so neither did the drafter's load
        m._warm_drafter(d)
        assert m.engine._graphs == {}
    finally:
        m.close()
