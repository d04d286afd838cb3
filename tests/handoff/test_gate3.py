"""Gate 3 for the handoff: remote prefill (a prefill-node process on 127.0.0.1) + local decode
gives bitwise the same KV planes, logits and greedy tokens as local prefill + decode, on the same
lane and KV type with the same chunking; the delta handoff sends only the suffix."""

from __future__ import annotations

import numpy as np
import pytest

from muser.handoff import RemotePrefill, tiles
from muser.handoff import manifest as mf
from muser.kv.serial import KvLayout

from .conftest import prompt

N_GREEDY = 16


def _same_planes(a, b) -> None:
    for pa, pb in zip(a.cache.planes, b.cache.planes):
        assert pa.state() == pb.state(), pa.layer
        assert bool((pa.keys == pb.keys).all()) and bool((pa.values == pb.values).all()), pa.layer


def _greedy_lockstep(a, la, b, lb) -> None:
    for _ in range(N_GREEDY):
        assert np.array_equal(la, lb)
        ta, tb = int(np.argmax(la)), int(np.argmax(lb))
        assert ta == tb
        la, lb = a.decode(ta), b.decode(tb)
    assert np.array_equal(la, lb)


@pytest.mark.parametrize("kv", ["f16", "f32"])
def test_remote_equals_local(kv, nodes, models, certs_dir, tmp_path):
    m = models[kv]
    ids = prompt(300)  # 3 NoPE tiles of 128/128/44 tokens; rings of 64 wrapped
    rp = RemotePrefill(nodes[kv].addr, certs_dir, ledger=tmp_path / "ledger.json", fallback=False)
    remote = m.session(max_context=512, chunk=128)
    lr = rp.prefill(remote, ids)
    assert rp.last.path == "remote" and rp.last.reason is None
    assert remote.n_past == len(ids)
    assert rp.last.kv_bytes == KvLayout.of_config(m.config, kv).state_bytes(len(ids))  # book 15.7
    assert [a[1] for a in rp.last.arrivals] == ["manifest"] + ["nope"] * 3 + ["swa", "logits", "end"]
    local = m.session(max_context=512, chunk=128)
    ll = local.prefill(ids)
    _same_planes(remote, local)
    _greedy_lockstep(remote, lr, local, ll)


def test_delta_sends_only_the_suffix(nodes, models, certs_dir, tmp_path):
    m = models["f16"]
    ids = prompt(300, seed=3)
    cut = 200
    rp = RemotePrefill(nodes["f16"].addr, certs_dir, ledger=tmp_path / "ledger.json", fallback=False)
    remote = m.session(max_context=1024, chunk=64)
    remote.prefill(ids[:cut])
    lr = rp.prefill(remote, ids[cut:], history=ids[:cut])
    assert rp.last.path == "remote" and rp.last.cut == cut
    # NoPE rows from the chunk holding the cut (192) on and the ring tail travel, not [0, 192)
    layout = tiles.layout_of(remote)
    held_nope = len(layout.full_layers) * 192 * 2 * layout.row_bytes
    assert rp.last.kv_bytes == mf.kv_rows_formula(layout, cut, len(ids)) == \
        layout.state_bytes(len(ids)) - held_nope
    local = m.session(max_context=1024, chunk=64)
    local.prefill(ids[:cut])
    ll = local.prefill(ids[cut:])
    _same_planes(remote, local)
    _greedy_lockstep(remote, lr, local, ll)
