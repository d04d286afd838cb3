"""Row invariance of the CPU exact and fast lanes (DESIGN.md "Exactness contract"): the logits of a token at
a position are bitwise identical whether it is decoded alone, verified in a block of 2, 7 or 16,
or prefilled in chunks of 1, 5, 16 or 33 rows; on every weight format the engine serves, with
f16 and f32 K/V, over a sequence that wraps the sliding-window ring more than twice."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from muser.engine import Engine
from muser.model.synth import SynthSpec

DTYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "q4_k_xl"]
N = 80  # positions: > 2 x the fixture's window (32), so every sliding ring wraps


def _ids(vocab: int) -> list[int]:
    return [3 + (i * 37 + (i * i) % 11) % (vocab - 3) for i in range(N)]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():  # the thread count cannot change results (test_cpu_native.py); 1 keeps CI fast
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def engines(make_gguf):
    cache = {}

    def get(dtype: str, kv: str, lane: str) -> Engine:
        if (dtype, kv, lane) not in cache:
            cache[(dtype, kv, lane)] = Engine.open(make_gguf(SynthSpec(dtype=dtype)), device="cpu", lane=lane, kv=kv)
        return cache[(dtype, kv, lane)]

    return get


def _decoded_alone(eng: Engine, ids: list[int]) -> np.ndarray:
    s = eng.session(max_context=N)
    return np.stack([s.decode(t) for t in ids])  # [N, vocab], one row per forward


@pytest.mark.parametrize("lane", ["exact", "fast"])
@pytest.mark.parametrize("kv", ["f16", "f32"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_logits_do_not_depend_on_batching(engines, dtype, kv, lane):
    eng = engines(dtype, kv, lane)
    ids = _ids(eng.cfg.vocab)
    ref = _decoded_alone(eng, ids)
    assert np.isfinite(ref).all()
    assert len({int(np.argmax(r)) for r in ref}) > 1  # the rows differ: the check can fail
    for chunk in (1, 5, 16, 33):
        got = eng.session(max_context=N, chunk=chunk).prefill(ids, all_logits=True)
        bad = np.flatnonzero((got != ref).any(-1))
        assert bad.size == 0, f"prefill chunk {chunk}: rows {bad[:8].tolist()} differ from decode-alone"
    for block in (2, 7, 16):
        s = eng.session(max_context=N)
        s.prefill(ids[:3])  # verify blocks start mid-sequence, ending past the window wraps
        rows = [ref[:3]]
        for b0 in range(3, N, block):
            rows.append(s.verify(ids[b0:b0 + block]))
        got = np.concatenate(rows)
        bad = np.flatnonzero((got != ref).any(-1))
        assert bad.size == 0, f"verify block {block}: rows {bad[:8].tolist()} differ from decode-alone"
