"""Engine sessions on the CPU backend: invariance of chunking / decode / verify, checkpoints,
snapshot/restore and detached installs (bit-exact replays), bad input, non-finite logits,
hidden capture, the graph step's device-metadata path, and lane refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import muser.oracle as oracle
from muser.errors import (
    CacheDiscontinuity,
    ContextOverflow,
    EmptyInput,
    KvStateError,
    LaneError,
    NonFiniteLogits,
    TokenOutOfRange,
)
from muser.engine import Engine
from muser.gates import GATE_FLOOR, invariance, max_dlsm
from muser.model.synth import SynthSpec

PROMPT = [6 + (i * 37) % 370 for i in range(75)]  # crosses the 32-token window twice


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: intra-op threads only add contention on 2 cores
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def eng32(tiny_gguf):
    return Engine.open(tiny_gguf, device="cpu", lane="exact", kv="f32")


@pytest.fixture(scope="module")
def eng16(tiny_gguf):
    return Engine.open(tiny_gguf, device="cpu", lane="exact", kv="f16")


def test_chunked_prefill_decode_verify_agree(eng32):
    r = invariance(eng32, PROMPT, chunks=(512, 64, 7), verify_from=30)
    assert r["status"] == "pass", r
    assert r["max_dlsm"] <= GATE_FLOOR


def test_invariance_f16_kv_within_twice_noise_floor(eng16, tiny_gguf):
    nf = oracle.load(tiny_gguf, arithmetic="f32", kv="f16").noise_floor(PROMPT[:48]).value
    r = invariance(eng16, PROMPT[:48], chunks=(512, 5), verify_from=20, bound=2 * nf)
    assert r["status"] == "pass", (r, nf)


def test_decoders_waiting_shrinks_chunks(eng32, monkeypatch):
    s = eng32.session(max_context=200)
    seen = []
    orig = s._forward

    def spy(ids, out_rows, capture):
        seen.append(len(ids))
        return orig(ids, out_rows, capture)

    monkeypatch.setattr(s, "_forward", spy)
    a = s.prefill(PROMPT * 2, decoders_waiting=True)
    assert seen == [64, 64, 22]
    b = eng32.session(max_context=200).prefill(PROMPT * 2)
    assert max_dlsm(a, b) <= GATE_FLOOR


def test_rollback_replays_bit_exactly(eng16):
    s = eng16.session(max_context=256)
    s.prefill(PROMPT)
    cp = s.checkpoint()
    first = s.verify(PROMPT[:6])
    d1 = s.decode(9)
    assert s.n_past == len(PROMPT) + 7
    s.rollback(cp)
    assert s.n_past == len(PROMPT)
    assert np.array_equal(s.verify(PROMPT[:6]), first)
    assert np.array_equal(s.decode(9), d1)
    # keep an accepted prefix of 4 of 6 verified rows: the state of 4 processed tokens
    s.rollback(cp)
    s.verify(PROMPT[:6])
    s.rollback(cp, keep=4)
    assert s.n_past == len(PROMPT) + 4
    ref = eng16.session(max_context=256)
    ref.prefill(PROMPT)
    ref.verify(PROMPT[:4])
    assert max_dlsm(s.decode(11), ref.decode(11)) <= 2e-2  # rows written by a 6- vs 4-row verify
    with pytest.raises(KvStateError):
        eng16.session(max_context=256).rollback(cp)  # a checkpoint of another session


def test_snapshot_restore_of_wrapped_rings_is_bit_exact(eng16):
    s = eng16.session(max_context=256)
    s.prefill(PROMPT + PROMPT[:20])  # 95 tokens: every ring (W = 32) has wrapped
    snap = s.snapshot()
    cont = [5, 17, 200, 3, 42]
    a = [s.decode(t) for t in cont]
    r = eng16.session(max_context=256)
    r.restore(snap)
    assert r.n_past == 95
    b = [r.decode(t) for t in cont]
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


def test_detached_install_swaps_atomically(eng16):
    s = eng16.session(max_context=256)
    s.prefill(PROMPT)
    snap = s.snapshot()
    live = eng16.session(max_context=256)
    live.prefill([7, 8, 9])
    inst = live.begin_install(snap.n_tokens)
    for il, ps in enumerate(snap.planes[:-1]):
        inst.put(il, ps.origin_logical, ps.keys, ps.values)
    with pytest.raises(KvStateError, match="incomplete"):
        live.commit(inst)
    assert live.n_past == 3  # untouched
    ps = snap.planes[-1]
    inst.put(len(snap.planes) - 1, ps.origin_logical, ps.keys, ps.values)
    live.commit(inst)
    assert live.n_past == len(PROMPT)
    assert np.array_equal(live.decode(12), s.decode(12))


def _fresh_decode(eng, prefix, tok):
    s = eng.session(max_context=128)
    s.prefill(prefix)
    return s.decode(tok)


def test_bad_input_is_refused_and_session_stays_usable(eng16):
    V = eng16.cfg.vocab
    s = eng16.session(max_context=40)
    s.prefill(PROMPT[:10])
    cases = [
        (TokenOutOfRange, lambda: s.decode(V)),
        (TokenOutOfRange, lambda: s.decode(-1)),
        (TokenOutOfRange, lambda: s.prefill([1, 2, V + 5])),
        (TokenOutOfRange, lambda: s.prefill([1.0, 2.0])),
        (TokenOutOfRange, lambda: s.prefill([[1, 2], [3, 4]])),
        (EmptyInput, lambda: s.prefill([])),
        (EmptyInput, lambda: s.verify([])),
        (ContextOverflow, lambda: s.prefill(list(range(6, 40)))),
        (CacheDiscontinuity, lambda: s.decode(5, position=11)),
        (LaneError, lambda: s.verify(list(range(6, 23)))),
        (TokenOutOfRange, lambda: s.decode([5, 6])),
    ]
    for err, call in cases:
        with pytest.raises(err):
            call()
        assert s.n_past == 10
    assert str(V) in _msg(TokenOutOfRange, lambda: s.decode(V))
    assert np.array_equal(s.decode(5, position=10), _fresh_decode(eng16, PROMPT[:10], 5))


def _msg(err, call) -> str:
    with pytest.raises(err) as e:
        call()
    return str(e.value)


def test_non_finite_logits_install_nothing_and_roll_back(eng16, monkeypatch):
    import muser.engine.forward as fw

    # the forward's last op: the C kernel's softcap on the CPU, the torch one elsewhere
    fw, name = (eng16.forward.tails, "softcap") if eng16.forward.native else (fw, "softcap_logits")
    s = eng16.session(max_context=128)
    s.prefill(PROMPT[:40])  # rings wrapped: a rollback must restore overwritten rows
    good = s.logits.copy()
    orig = getattr(fw, name)
    monkeypatch.setattr(fw, name, lambda l, a, b: orig(l, a, b) * float("nan"))
    with pytest.raises(NonFiniteLogits, match="no distribution"):
        s.decode(7)
    with pytest.raises(NonFiniteLogits):
        s.verify([7, 8, 9])
    with pytest.raises(NonFiniteLogits):
        s.prefill(PROMPT[40:60])
    assert s.n_past == 40
    assert np.array_equal(s.logits, good)  # the installed distribution is unchanged
    monkeypatch.setattr(fw, name, orig)
    assert np.array_equal(s.decode(7), _fresh_decode(eng16, PROMPT[:40], 7))


def test_hidden_capture_matches_oracle(tiny_gguf, eng32):
    L = eng32.cfg.n_layers
    s = eng32.session(max_context=128, capture=(0, 2, L))
    s.prefill(PROMPT[:50])
    o = oracle.load(tiny_gguf, arithmetic="f32", kv="f32").session(max_context=128, capture=(0, 2, L))
    o.prefill(PROMPT[:50])
    assert set(s.captured) == {0, 2, L}
    for il in (0, 2, L):
        a, b = s.captured[il], o.captured[il]
        assert a.shape == b.shape == (50, eng32.cfg.hidden)
        assert np.abs(a - b).max() <= 1e-5 * max(1.0, np.abs(b).max())
    s.decode(5)
    assert s.captured[2].shape == (1, eng32.cfg.hidden)
    with pytest.raises(LaneError):
        eng32.session(max_context=8, capture=(L + 1,))


def test_lane_device_kv_refusals(tiny_gguf, make_gguf):
    for kw, what in ((dict(lane="turbo"), "turbo"), (dict(device="tpu"), "tpu"), (dict(kv="q8_0"), "q8_0")):
        with pytest.raises(LaneError, match=what):
            Engine.open(tiny_gguf, **kw)
    if not torch.cuda.is_available():
        with pytest.raises(LaneError, match="cuda"):
            Engine.open(tiny_gguf, device="cuda")
    with pytest.raises(ContextOverflow):
        Engine.open(tiny_gguf).session(max_context=10 ** 9)


def test_fast_lane_is_the_integer_lane_not_exact(tiny_gguf, make_gguf, eng32):
    # F32 weights: vec_dot_type F32, so x as is and the exact lane's GEMM: the same logits
    fast = Engine.open(tiny_gguf, device="cpu", lane="fast", kv="f32")
    a = eng32.session(max_context=128).prefill(PROMPT, all_logits=True)
    assert np.array_equal(a, fast.session(max_context=128).prefill(PROMPT, all_logits=True))
    # Q4_K: Q8_K activations and integer sums at every row count (decode included), not exact
    q4 = make_gguf(SynthSpec(dtype="Q4_K"))
    fq, eq = (Engine.open(q4, device="cpu", lane=ln, kv="f32") for ln in ("fast", "exact"))
    b = fq.session(max_context=128).prefill(PROMPT, all_logits=True)
    assert max_dlsm(b, eq.session(max_context=128).prefill(PROMPT, all_logits=True)) > 0
    s1, s2 = eq.session(max_context=8), fq.session(max_context=8)
    assert not np.array_equal(s1.decode(5), s2.decode(5))
    from muser.gates import gate2

    with pytest.raises(LaneError, match="arithmetic ggml-cpu"):
        gate2(q4, fq, oracle.load(q4, arithmetic="f32", kv="f32"), "f32", n_gen=1)


def test_graph_step_device_metadata_path(eng16, tiny_gguf, kernels):
    """The CUDA-graph step (device-resident positions, plane metadata and write slots; Triton
    attention; static capture buffers) run without capture on the CPU, against the eager path
    (the C attention kernel: another summation order, so within twice the f16-K/V noise floor)."""
    nf = oracle.load(tiny_gguf, arithmetic="f32", kv="f16").noise_floor(PROMPT[:33]).value

    ref = eng16.session(max_context=64, capture=(1,))
    ref.prefill(PROMPT[:30])
    s = eng16.session(max_context=64, capture=(1,))
    s.prefill(PROMPT[:30])
    for blk in ([5], [9, 10, 11], [12]):  # decode, verify across the 32-row ring wrap, decode
        g = eng16.graph(((len(blk), "all", s.max_context),), s.capture_layers)
        got = g.run([s], [np.array(blk)]).numpy().copy()
        want = ref.verify(blk)
        assert s.n_past == ref.n_past
        assert max_dlsm(got, want) <= max(GATE_FLOOR, 2 * nf)  # summation order only (f16 K/V)
        assert np.abs(g.captured[1].numpy() - ref.captured[1]).max() <= 1e-5
        assert int(g.top[-1]) == int(np.argmax(got[-1])) and bool(g.finite)
    for pa, pb in zip(s.snapshot().planes, ref.snapshot().planes):
        assert pa.origin_logical == pb.origin_logical and pa.len == pb.len
        assert (pa.keys.float() - pb.keys.float()).abs().max() <= 1e-2


def test_cuda_decode_path_with_fused_matvec(make_gguf, kernels):
    """The whole CUDA decode step as the GPU runs it (Triton dequant-matvec for every projection
    and the LM head, Triton attention, device metadata), minus the capture, vs the eager path
    (a narrower Q8_0 fixture keeps the interpreter quick)."""
    path = make_gguf(SynthSpec(hidden=256, ffn=256, n_heads=4, head_dim=32, dtype="Q8_0"))
    eng = Engine.open(path, device="cpu", lane="exact", kv="f16")
    ref = eng.session(max_context=64)
    ref.prefill(PROMPT[:33])
    s = eng.session(max_context=64)
    s.prefill(PROMPT[:33])
    eng.forward.linear.triton_rows = True
    try:
        got = eng.graph(((1, "last", s.max_context),), ()).run([s], [np.array([5])]).numpy().copy()
    finally:
        eng.forward.linear.triton_rows = False
    assert max_dlsm(got, ref.decode(5)) <= GATE_FLOOR


def test_the_attention_scratch_takes_a_prefill_chunk_in_one_launch(eng32):
    """A session's attention scratch holds a verify block at any position and a whole prefill chunk
    over an empty cache (attention.scratch_units), so that chunk's attention is one launch a pass
    and layer (attention.row_groups); a chunk after a long context runs in groups, each within the
    scratch, covering its rows in order."""
    from muser.engine.kernels import attention as att

    s = eng32.session(max_context=200, chunk=64)
    sc = s._scratch()
    units = sc.rows * sc.splits
    assert sc.m.numel() == units * eng32.cfg.n_heads
    for p in s.cache.planes:
        w = p.geometry.window if p.geometry.sliding else 0
        assert att.row_groups(64, 0, w, units) == [(0, 64)]
        assert att.row_groups(16, p.capacity, w, units) == [(0, 16)]
    # the full geometry (window 2,048, 512-row chunks) in a 512-position session, as `muser bench
    # prefill` opens it: a verify-sized scratch took a sliding layer's chunk in 31 launches a pass
    old = 16 * max(att.split_count(16, 512, w) for w in (2048, 0))
    units = max(att.scratch_units(16, 512, 512, w) for w in (2048, 0))
    assert (len(att.row_groups(512, 0, 2048, old)), len(att.row_groups(512, 0, 0, old))) == (31, 10)
    assert units == 4608 and att.row_groups(512, 0, 2048, units) == att.row_groups(512, 0, 0, units) == [(0, 512)]
    deep = att.row_groups(512, 32768, 0, units)  # a full layer's chunk after 32,768 positions
    assert len(deep) > 1 and deep[0][0] == 0 and deep[-1][1] == 512
    assert all(a[1] == b[0] for a, b in zip(deep, deep[1:]))
    assert all((r1 - r0) * att.split_count(r1 - r0, 32768, 0) <= units for r0, r1 in deep)
    with pytest.raises(AssertionError, match="too small"):
        att.row_groups(1, 131072, 0, 16)
