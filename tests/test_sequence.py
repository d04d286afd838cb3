"""One session protocol (muser.sequence) on the oracle and on the engine: the same bad input
raises the same error class with the same message on both, nothing is half-written, and the
transactions (non-finite logits, foreign checkpoints) behave alike."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import muser.oracle as oracle
from muser.engine import Engine
from muser.errors import (
    CacheDiscontinuity,
    ContextOverflow,
    EmptyInput,
    KvStateError,
    LaneError,
    NonFiniteLogits,
    TokenOutOfRange,
)
from muser.gates import GATE_FLOOR, max_dlsm
from muser.sequence import MAX_VERIFY, Sequence

PROMPT = [6 + (i * 37) % 370 for i in range(40)]


@pytest.fixture(scope="module")
def models(tiny_gguf):
    torch.set_num_threads(1)
    return {"engine": Engine.open(tiny_gguf, device="cpu", lane="exact", kv="f32"),
            "oracle": oracle.load(tiny_gguf, arithmetic="f32", kv="f32")}


def _cases(V: int, L: int):
    return [
        (TokenOutOfRange, lambda s: s.decode(V)),
        (TokenOutOfRange, lambda s: s.decode(-1)),
        (TokenOutOfRange, lambda s: s.prefill([1, 2, V + 5])),
        (TokenOutOfRange, lambda s: s.prefill([1.0, 2.0])),
        (TokenOutOfRange, lambda s: s.prefill([[1, 2], [3, 4]])),
        (TokenOutOfRange, lambda s: s.decode([5, 6])),
        (EmptyInput, lambda s: s.prefill([])),
        (EmptyInput, lambda s: s.verify([])),
        (ContextOverflow, lambda s: s.prefill(list(range(6, 40)))),
        (CacheDiscontinuity, lambda s: s.decode(5, position=11)),
        (CacheDiscontinuity, lambda s: s.verify([5, 6], position=9)),
        (LaneError, lambda s: s.verify(list(range(6, 6 + MAX_VERIFY + 1)))),
        (LaneError, lambda s: s.prefill([5], capture=(L + 1,))),
    ]


def _raised(call) -> tuple[type, str]:
    with pytest.raises(Exception) as e:
        call()
    return type(e.value), str(e.value)


def test_both_sessions_are_one_protocol(models):
    for m in models.values():
        assert isinstance(m.session(max_context=8), Sequence)


def test_bad_input_same_error_and_message_on_both(models):
    cfg = models["engine"].cfg
    sessions = {}
    for name, m in models.items():
        s = m.session(max_context=40)
        s.prefill(PROMPT[:10])
        sessions[name] = s
    for err, call in _cases(cfg.vocab, cfg.n_layers):
        got = {name: _raised(lambda: call(s)) for name, s in sessions.items()}
        assert got["engine"] == got["oracle"], got
        assert got["engine"][0] is err, got
        assert all(s.n_past == 10 for s in sessions.values())
    # construction refusals
    for kw in (dict(max_context=0), dict(max_context=cfg.context_length + 1), dict(max_context=8, chunk=0),
               dict(max_context=8, capture=(-1,))):
        got = {name: _raised(lambda: m.session(**kw)) for name, m in models.items()}
        assert got["engine"] == got["oracle"], (kw, got)
    # a checkpoint of another session
    other = {name: m.session(max_context=8) for name, m in models.items()}
    got = {name: _raised(lambda: sessions[name].rollback(other[name].checkpoint())) for name in models}
    assert got["engine"] == got["oracle"] and got["engine"][0] is KvStateError
    # the sessions are intact and agree with each other
    lg = {name: s.decode(PROMPT[10], position=10) for name, s in sessions.items()}
    assert max_dlsm(lg["engine"], lg["oracle"]) <= GATE_FLOOR


def test_verify_checkpoint_rollback_keep_alike(models):
    """verify = every row's logits of one block; rollback(keep) keeps an accepted prefix."""
    out = {}
    for name, m in models.items():
        s = m.session(max_context=64)
        s.prefill(PROMPT[:20])
        cp = s.checkpoint()
        v = s.verify(PROMPT[20:26])
        s.rollback(cp, keep=2)
        assert s.n_past == 22 and s.logits is None
        after = s.decode(PROMPT[22])
        ref = m.session(max_context=64)
        full = ref.prefill(PROMPT[:23], all_logits=True)
        out[name] = (v, after)
        assert max_dlsm(v[:3], full[20:23]) <= GATE_FLOOR
        assert max_dlsm(after, full[22]) <= GATE_FLOOR
    assert max_dlsm(out["engine"][0], out["oracle"][0]) <= GATE_FLOOR


def test_non_finite_logits_same_error_and_rollback_on_both(models, monkeypatch):
    import muser.engine.forward as fw
    import muser.oracle.forward as ofw

    sessions = {}
    for name, m in models.items():
        s = m.session(max_context=64)
        s.prefill(PROMPT[:35])  # the 32-token rings have wrapped
        sessions[name] = s
    orig_e, orig_o = fw.softcap_logits, ofw.OracleForward.chunk

    def nan_chunk(self, *a, **k):
        out = orig_o(self, *a, **k)
        if out.logits is not None:
            out.logits[...] = np.nan
        return out

    monkeypatch.setattr(fw, "softcap_logits", lambda lg, a, b: orig_e(lg, a, b) * float("nan"))
    from muser.engine.kernels import cpu_native  # the CPU forward's last op is the C kernel's softcap

    orig_c = cpu_native.softcap
    monkeypatch.setattr(cpu_native, "softcap", lambda lg, a, b: orig_c(lg, a, b) * float("nan"))
    monkeypatch.setattr(ofw.OracleForward, "chunk", nan_chunk)
    for call in (lambda s: s.decode(7), lambda s: s.verify([7, 8, 9]), lambda s: s.prefill(PROMPT[:20])):
        got = {name: _raised(lambda: call(s)) for name, s in sessions.items()}
        assert got["engine"] == got["oracle"] and got["engine"][0] is NonFiniteLogits, got
        assert "no distribution installed" in got["engine"][1]
        assert all(s.n_past == 35 for s in sessions.values())
    monkeypatch.undo()
    for name, m in models.items():
        ref = m.session(max_context=64)
        ref.prefill(PROMPT[:35])
        assert np.array_equal(sessions[name].decode(7), ref.decode(7)), name


def test_logits_known_finite_are_not_scanned_again(models, monkeypatch):
    """The engine reduces its logits' finiteness where they lie (step.finite_flags: on CUDA before
    the copy) and the host does not scan logits known finite; a sequence that does not know (the
    oracle) is scanned: every call's logits, every row, once. A false flag is scanned, to name the
    offender."""
    import muser.sequence as seq

    scanned = []
    orig = seq.first_non_finite
    monkeypatch.setattr(seq, "first_non_finite", lambda lg: scanned.append(lg.shape) or orig(lg))
    o = models["oracle"].session(max_context=64)
    assert o._rows_finite() is False
    o.prefill(PROMPT[:5])
    o.verify([7, 8, 9])
    assert scanned == [(1, o.vocab), (3, o.vocab)]
    s = models["engine"].session(max_context=64)
    assert s._rows_finite() is False  # no forward yet
    s.prefill(PROMPT[:5])
    assert s._rows_finite() is True
    s.verify([7, 8, 9])
    s.decode(4)
    assert len(scanned) == 2
    monkeypatch.setattr(s, "_rows_finite", lambda: False)
    s.verify([5, 6])
    assert scanned[2:] == [(2, s.vocab)]
