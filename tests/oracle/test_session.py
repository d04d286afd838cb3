"""muser.oracle's Session surface: chunk invariance, capture, checkpoint/rollback, snapshot replay
of a wrapped session, and typed refusals that leave the session usable."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import muser
from muser.errors import (
    CacheDiscontinuity,
    ContextOverflow,
    EmptyInput,
    KvStateError,
    LaneError,
    NonFiniteLogits,
    TokenOutOfRange,
)
from muser.gguf.reader import read_gguf
from muser.oracle import numerics as nm

from .conftest import SEMANTIC, rounding_spec

W = SEMANTIC.sliding_window


def toks(n: int, seed: int = 7, vocab: int = 384) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, n)]


def test_public_surface(semantic_gguf, oracle_cache):
    m = oracle_cache(semantic_gguf)
    assert muser.oracle.load is not None and m.config.n_layers == 4 and m.kv == "f32"
    assert m.identity.artifact_sha256
    s = m.session(max_context=128)
    out = s.prefill(toks(10))
    assert out.shape == (m.config.vocab,) and out.dtype == np.float32 and s.n_past == 10
    allr = m.session(max_context=128).prefill(toks(10), all_logits=True)
    assert allr.shape == (10, m.config.vocab) and np.array_equal(allr[-1], out)
    nxt = s.decode(5)
    assert nxt.shape == (m.config.vocab,) and s.n_past == 11
    assert muser.oracle.load(semantic_gguf, arithmetic="ggml-cpu").kv == "f16"  # llama.cpp's default


@pytest.mark.parametrize("spec,arith", [(SEMANTIC, "f32"), (SEMANTIC, "ggml-cpu"), (rounding_spec("q4_k_xl"), "ggml-cpu"),
                                        (rounding_spec("Q8_0"), "ggml-cpu"), (rounding_spec("BF16"), "ggml-cpu")])
def test_chunk_invariance_bit_exact(make_gguf, oracle_cache, spec, arith):
    """prefill == token-by-token decode == prefill then decode == any chunk size, bit for bit,
    across the ring's fill, first wrap and later wraps (positions up to 3W + 8)."""
    m = oracle_cache(make_gguf(spec), arith)
    t = toks(3 * W + 8)
    ref = m.logits(t)
    assert np.array_equal(m.logits(t, "decode"), ref)
    assert np.array_equal(m.logits(t, W + 1), ref)
    assert np.array_equal(m.logits(t, chunk=7), ref)
    assert np.array_equal(m.logits(t, chunk=W), ref)
    assert np.array_equal(m.logits(t[:W + 2]), ref[:W + 2])  # causal: a prefix gives the same rows


@pytest.mark.parametrize("arith", ["f32", "ggml-cpu"])
def test_noise_runs_from_a_row_are_those_rows_bits(semantic_gguf, oracle_cache, arith):
    """The gate's floor reads only the rows after the prompt: the chunks before them skip the LM
    head, and the unperturbed run, the all-up and all-down jitters and another f32 order keep the
    same bits (a random-sign trial draws its signs in the order computed: another sample)."""
    m = oracle_cache(semantic_gguf, arith)
    t = toks(3 * W + 8)
    orders = ("f32-seq",) if arith == "f32" else ()
    base, runs = m.noise_runs(t, trials=3, chunk=7, orders=orders)
    for r0 in (0, 6, 7, 2 * W + 3, len(t) - 1):
        b, r = m.noise_runs(t, trials=3, chunk=7, orders=orders, rows_from=r0)
        assert b.shape == (len(t) - r0, m.config.vocab) and np.array_equal(b, base[r0:])
        assert r.keys() == runs.keys()
        assert all(np.array_equal(r[k], runs[k][r0:]) for k in r if k != "jitter:rng2"), r0
        assert np.isfinite(r["jitter:rng2"]).all() and not np.array_equal(r["jitter:rng2"], b)
    for mode, r0 in (("decode", 3), ("prefill", len(t)), ("prefill", -1)):
        with pytest.raises(LaneError, match="rows_from"):
            m.logits(t, mode, rows_from=r0)
    # the forwards on threads, each its own arithmetic over the shared weights: the same bits, the
    # random-sign trial included, and the model's own arithmetic untouched
    b, r = m.noise_runs(t, trials=3, chunk=7, orders=orders, workers=3)
    assert np.array_equal(b, base) and r.keys() == runs.keys() and all(np.array_equal(r[k], runs[k]) for k in r)
    assert m.forward.arith.jitter is None and m.forward.arith.reduction == "f64"
    with pytest.raises(LaneError, match="workers"):
        m.noise_runs(t, workers=0)


def test_hidden_capture_is_layer_input(semantic_gguf, oracle_cache):
    m = oracle_cache(semantic_gguf)
    t = toks(40)
    s = m.session(max_context=64, capture=(0, 2, 4))
    s.prefill(t[:30])
    first = dict(s.captured)
    s.decode(t[30])
    assert set(first) == {0, 2, 4} and first[2].shape == (30, m.config.hidden)
    assert s.captured[0].shape == (1, m.config.hidden)
    # layer 0's input is the weightless entry norm of the embedding rows (muse-glimmer.cpp)
    emb = m.weights.embed(np.array(t[:30]))
    assert np.array_equal(first[0], nm.rms_norm(emb, None, m.config.rms_eps))
    # capture does not change logits and is chunk-invariant
    s2 = m.session(max_context=64)
    per_call = s2.prefill(t[:31], capture=(2,))
    assert np.array_equal(s2.captured[2][:30], first[2])
    with pytest.raises(LaneError):
        m.session(capture=(9,))
    assert np.array_equal(per_call, m.session(max_context=64).prefill(t[:31]))


def test_checkpoint_rollback_and_keep(semantic_gguf, oracle_cache):
    m = oracle_cache(semantic_gguf)
    t = toks(W + 20)
    s = m.session(max_context=128)
    s.prefill(t[: W + 8])  # rings wrapped
    cp = s.checkpoint(block=6)
    spec = [s.decode(x) for x in t[W + 8: W + 14]]  # a speculative block of 6
    s.rollback(cp)
    assert s.n_past == W + 8
    again = [s.decode(x) for x in t[W + 8: W + 14]]
    assert all(np.array_equal(a, b) for a, b in zip(spec, again))
    s.rollback(cp, keep=2)  # accept two drafted tokens
    assert s.n_past == W + 10
    assert np.array_equal(s.decode(t[W + 10]), spec[2])
    s.rollback(cp)
    for x in t[W + 8: W + 15]:
        s.decode(x)
    with pytest.raises(KvStateError, match="block of 6"):
        s.rollback(cp)  # 7 > 6 rows appended: the overwritten ring rows are gone
    assert s.n_past == W + 15
    other = m.session(max_context=128)
    with pytest.raises(KvStateError):
        other.rollback(cp)


def test_snapshot_restore_replays_wrapped_session_bit_exactly(make_gguf, oracle_cache):
    m = oracle_cache(make_gguf(rounding_spec("Q4_K")), "ggml-cpu")  # f16 KV planes
    t = toks(3 * W + 5 + 2 * W, seed=3)
    a = m.session(max_context=256)
    a.prefill(t[: 3 * W + 5])  # several wraps
    snap = a.snapshot()
    la = [a.decode(x) for x in t[3 * W + 5:]]  # continue across two more wraps
    b = m.session(max_context=256)
    b.prefill(t[:3])  # whatever b held is replaced
    b.restore(snap)
    assert b.n_past == 3 * W + 5
    lb = [b.decode(x) for x in t[3 * W + 5:]]
    assert all(np.array_equal(x, y) for x, y in zip(la, lb))
    for pa, pb in zip(a.cache.planes, b.cache.planes):  # same rows at the same physical slots
        assert pa.state() == pb.state() and np.array_equal(pa.keys, pb.keys)


def test_bad_input_is_refused_and_session_stays_usable(semantic_gguf, oracle_cache):
    m = oracle_cache(semantic_gguf)
    t = toks(12)
    s = m.session(max_context=16)
    s.prefill(t[:8])
    ref = m.session(max_context=16)
    ref.prefill(t[:8])
    with pytest.raises(TokenOutOfRange, match=f"token id {m.config.vocab} at index 1"):
        s.prefill([3, m.config.vocab, 4])
    with pytest.raises(TokenOutOfRange, match="-1"):
        s.decode(-1)
    with pytest.raises(TokenOutOfRange):
        s.prefill([1.5, 2.0])
    with pytest.raises(EmptyInput):
        s.prefill([])
    with pytest.raises(ContextOverflow, match="max_context 16"):
        s.prefill(t[:9])  # 8 + 9 > 16
    with pytest.raises(CacheDiscontinuity) as e:
        s.prefill(t[8:10], position=9)
    assert (e.value.expected, e.value.got) == (8, 9)
    with pytest.raises(ContextOverflow):
        m.session(max_context=m.config.context_length + 1)
    assert s.n_past == 8
    assert np.array_equal(s.decode(t[8]), ref.decode(t[8]))  # nothing was half-written
    with pytest.raises(CacheDiscontinuity):
        s.cache.append(0, 3, np.zeros((1, m.config.kv_dim), np.float32), np.zeros((1, m.config.kv_dim), np.float32))


def test_load_refusals(semantic_gguf):
    with pytest.raises(LaneError, match="arithmetic 'fast'"):
        muser.oracle.load(semantic_gguf, arithmetic="fast")
    with pytest.raises(LaneError, match="kv 'q8_0'"):
        muser.oracle.load(semantic_gguf, kv="q8_0")


def _continue_matches(m, good, s, t):
    after = [s.decode(x) for x in t[3:]]
    clean = good.session(max_context=32)
    clean.prefill(t[:3])
    return all(np.array_equal(a, clean.decode(x)) for a, x in zip(after, t[3:]))


@pytest.mark.parametrize("arith", ["f32", "ggml-cpu"])
def test_nan_logits_refused_and_rolled_back(semantic_gguf, oracle_cache, monkeypatch, arith):
    """A non-finite value reaching the logits is refused with NonFiniteLogits (book 10.9), and
    the KV rows of that forward are undone: the session continues as if it never happened."""
    bad_tok = 17
    m = muser.oracle.load(semantic_gguf, arithmetic=arith)
    good = oracle_cache(semantic_gguf, arith)
    embed = m.weights.embed

    def poisoned(tokens):
        rows = embed(tokens)
        rows[np.asarray(tokens) == bad_tok, 5] = np.nan
        return rows

    monkeypatch.setattr(m.weights, "embed", poisoned)
    t = [5, 9, 200, 31, 77]
    s = m.session(max_context=32)
    s.prefill(t[:3])
    with pytest.raises(NonFiniteLogits, match="non-finite logit nan"):
        s.decode(bad_tok)
    with pytest.raises(NonFiniteLogits):
        s.prefill([1, bad_tok, 2], all_logits=True)
    assert s.n_past == 3 and s.cache.n_tokens == 3
    assert _continue_matches(m, good, s, t)
    m.close()


def test_nan_weight_row_refused_before_use(semantic_gguf, tmp_path, oracle_cache):
    """A NaN stored in an embedding row is refused by muser.quant's row validation (a typed
    FormatError naming the tensor and row) when the token is looked up; the session is intact."""
    from muser.errors import FormatError

    bad_tok = 17
    path = tmp_path / "nan.gguf"
    shutil.copy(semantic_gguf, path)
    with read_gguf(path) as f:
        info = f.tensor_info("token_embd.weight")
        off = info.offset + bad_tok * info.row_bytes + 4 * 5
    with open(path, "r+b") as fh:
        fh.seek(off)
        fh.write(np.float32(np.nan).tobytes())
    m = muser.oracle.load(path)
    t = [5, 9, 200, 31, 77]
    s = m.session(max_context=32)
    s.prefill(t[:3])
    with pytest.raises(FormatError, match="token_embd.weight"):
        s.decode(bad_tok)
    assert s.n_past == 3
    assert _continue_matches(m, oracle_cache(semantic_gguf), s, t)
    m.close()
