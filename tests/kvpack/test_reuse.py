"""Gate 3 for kvpack: restored prefix + prefilled suffix gives logits bitwise identical to a cold
prefill with the same chunk boundaries, at every chunk boundary and across SWA wraps (W = 32,
16-token tiles), on the oracle and on the CPU engine; a cold prefill in one forward is measured."""

from __future__ import annotations

import numpy as np
import pytest

from muser.errors import IdentityMismatch, LaneError
from muser.kvpack import Binding, Store, warm_session

from .conftest import CH, SESSION_CHUNK

LENGTHS = [17, 33, 50, 65, 81, 100]  # each restores the previous boundary: 0, 16, 32, 48, 64, 80
CONT = [5, 200]


def session(m, max_context, chunk=SESSION_CHUNK):
    return m.session(max_context=max_context, chunk=chunk)


@pytest.mark.parametrize("name", ["oracle-ggml-cpu-f16", "oracle-f32-f32", "engine-exact-cpu-f16"])
def test_restored_equals_cold_bitwise_at_every_boundary(models, prompt, name, tmp_path):
    m = models[name]
    prev_end = 0
    lengths = LENGTHS if name.startswith("oracle") else LENGTHS[::2] + [LENGTHS[-1]]  # engine: 17, 50, 81, 100
    for i, P in enumerate(lengths):
        ids = prompt[:P]
        max_context = P + len(CONT) + 7 * i  # a different slot size every time
        warm = warm_session(session(m, max_context), tmp_path, chunk_tokens=CH)
        got = warm.prefill(ids)
        warm.wait()
        assert warm.last["restored"] == prev_end, (P, warm.last)
        assert warm.last["restored"] + warm.last["prefilled"] == P
        cold = session(m, P + len(CONT))
        want = cold.prefill(ids)
        assert np.array_equal(got, want), (name, P, float(np.abs(got - want).max()))
        for t in CONT:  # decoding on from the restored state stays bitwise
            assert np.array_equal(warm.decode(t), cold.decode(t)), (name, P, t)
        prev_end = (P - 1) // CH * CH
    assert not Store.open(tmp_path, warm.store.binding).misses


def test_warm_against_one_forward_cold(models, prompt, tmp_path):
    """A cold prefill in one 512-row forward against restore + 16-row chunks: the CPU exact lane
    is row-invariant (engine/kernels/cpu.c), so the chunking does not matter and the logits are
    bitwise the same, for the prompt's last row and 4 greedy steps."""
    m = models["engine-exact-cpu-f16"]
    ids = prompt[:100]
    first = warm_session(session(m, 120), tmp_path, chunk_tokens=CH)
    first.prefill(ids)
    first.wait()
    warm = warm_session(session(m, 120), tmp_path, chunk_tokens=CH)
    a = [warm.prefill(ids)]
    assert warm.last["restored"] == 96
    one = session(m, 120, chunk=512)
    b = [one.prefill(ids)]
    for _ in range(4):  # greedy continuation on both
        t = int(np.argmax(a[-1]))
        assert t == int(np.argmax(b[-1]))
        a.append(warm.decode(t))
        b.append(one.decode(t))
    for i, (x, y) in enumerate(zip(a, b)):
        assert np.array_equal(x, y), (i, float(np.abs(x - y).max()))


def test_binding_and_chunk_refusals(models, tmp_path):
    m16, m32 = models["oracle-ggml-cpu-f16"], models["oracle-f32-f32"]
    s16 = session(m16, 64)
    store = Store.open(tmp_path, Binding.of_session(s16, CH))
    with pytest.raises(IdentityMismatch, match="lane"):
        warm_session(session(m32, 64), store)
    with pytest.raises(LaneError, match="divides 16"):
        warm_session(session(m16, 64, chunk=5), tmp_path, chunk_tokens=CH)
    b16, b32 = Binding.of_session(s16, CH), Binding.of_session(session(m32, 64), CH)
    assert b16.addresses(list(range(40))) != b32.addresses(list(range(40)))
    assert len(b16.addresses(list(range(40)))) == 2


def test_bad_input_refused_before_any_restore(models, prompt, tmp_path):
    from muser.errors import ContextOverflow, TokenOutOfRange

    m = models["oracle-f32-f32"]
    first = warm_session(session(m, 64), tmp_path, chunk_tokens=CH)
    first.prefill(prompt[:40])
    first.wait()
    w = warm_session(session(m, 64), tmp_path, chunk_tokens=CH)
    with pytest.raises(TokenOutOfRange, match="index 39"):
        w.prefill(prompt[:39] + [10**6])
    with pytest.raises(ContextOverflow, match="max_context 64"):
        w.prefill(prompt[:65] + prompt[:5])
    assert w.n_past == 0 and not w.last and not w.store.misses
    assert np.array_equal(w.prefill(prompt[:40]), session(m, 64).prefill(prompt[:40]))
    assert w.last["restored"] == 32
