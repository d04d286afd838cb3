"""kvpack store faults: flipped bits and truncated tiles are misses (never served), a full disk
leaves the store unchanged while the request is answered, concurrent writers of one key, foreign
manifests refused by name, LRU eviction, and the `muser kvpack` commands."""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import shutil
import threading

import numpy as np
import pytest

from muser.cli import main
from muser.errors import IdentityMismatch
from muser.kvpack import (
    DirectoryBackend,
    Store,
    decode_entry,
    encode_entry,
    read_manifest,
    warm_session,
)
from muser.kvpack.store import audit

from .conftest import CH, SESSION_CHUNK

MODEL = "oracle-f32-f32"
P = 40  # chunks 0, 1 stored (NoPE) and the SWA tail at 32


def sess(models, n=64):
    return models[MODEL].session(max_context=n, chunk=SESSION_CHUNK)


@pytest.fixture(scope="module")
def seeded(models, prompt, tmp_path_factory):
    """A store holding the entries of one warm run, the prompt, its binding and cold logits."""
    d = tmp_path_factory.mktemp("kvpack-seed")
    w = warm_session(sess(models), d, chunk_tokens=CH)
    w.prefill(prompt[:P])
    w.wait()
    assert sorted(n.split(".")[1] for n in w.persisted) == ["nope", "nope", "swa"]
    cold = sess(models).prefill(prompt[:P])
    return d, prompt[:P], w.store.binding, cold


def copy(seeded, tmp_path):
    d = tmp_path / "store"
    shutil.copytree(seeded[0], d)
    return d


def files(d):
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()
            and p.name != "lock"}


def warm_prefill(models, d, ids):
    w = warm_session(sess(models, len(ids) + 8), d, chunk_tokens=CH)
    logits = w.prefill(ids)
    w.wait()
    return w, logits


def test_hit_is_served_and_equal(models, seeded, tmp_path):
    d = copy(seeded, tmp_path)
    w, logits = warm_prefill(models, d, seeded[1])
    assert w.last["restored"] == 32 and np.array_equal(logits, seeded[3])


@pytest.mark.parametrize("damage", ["flip-nope-tile", "flip-swa-tile", "flip-manifest", "flip-header",
                                    "truncate-nope", "truncate-swa", "empty-nope"])
def test_corrupt_entries_are_misses_not_served(models, seeded, tmp_path, caplog, damage):
    d = copy(seeded, tmp_path)
    objs = {o.name.split(".")[1] + str(i): o.name for i, o in enumerate(DirectoryBackend(d).list())}
    kind = "swa" if "swa" in damage else "nope"
    name = next(n for n in objs.values() if n.endswith(kind))
    path = next(d.rglob(name))
    data = bytearray(path.read_bytes())
    _, tile_at = read_manifest(data)
    rng = np.random.default_rng(len(damage))
    if damage.startswith("flip"):
        lo, hi = {"header": (0, 48), "manifest": (48, tile_at)}.get(damage.split("-")[1], (tile_at, len(data)))
        i = int(rng.integers(lo, hi))
        data[i] ^= 1 << int(rng.integers(0, 8))
    else:
        data = data[: 0 if damage == "empty-nope" else int(rng.integers(1, len(data)))]
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="muser.kvpack"):
        w, logits = warm_prefill(models, d, seeded[1])
    assert w.last["restored"] == 0  # the damaged prefix was not served
    assert np.array_equal(logits, seeded[3])  # the request is answered, correctly
    assert any("kvpack miss" in r.message and name in r.message for r in caplog.records)
    assert all(a.ok for a in audit(DirectoryBackend(d)))  # removed and rewritten by the persist job
    w2, logits2 = warm_prefill(models, d, seeded[1])
    assert w2.last["restored"] == 32 and np.array_equal(logits2, seeded[3])


def test_full_disk_answers_and_leaves_store_unchanged(models, seeded, prompt, tmp_path, monkeypatch, caplog):
    d = copy(seeded, tmp_path)
    before = files(d)
    real_write = os.write
    tmpdir = str(d / "tmp")

    def write(fd, data):  # ENOSPC for files in this store's temp folder only
        if os.readlink(f"/proc/self/fd/{fd}").startswith(tmpdir):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    ids = prompt[:P] + prompt[100:130]  # shares chunks 0-1, needs new chunks 2-3 and a tail at 64
    with caplog.at_level(logging.WARNING, logger="muser.kvpack"):
        w, logits = warm_prefill(models, d, ids)
    monkeypatch.setattr(os, "write", real_write)
    assert w.last["restored"] == 32 and not w.persisted
    assert np.array_equal(logits, sess(models, 80).prefill(ids))
    assert files(d) == before  # no entry, no temp file
    assert any("disk full" in r.message for r in caplog.records)


def test_concurrent_writers_of_one_key(seeded, tmp_path):
    d = copy(seeded, tmp_path)
    backend = DirectoryBackend(d)
    name = next(o.name for o in backend.list() if o.name.endswith(".nope"))
    blob = bytes(backend.get(name))
    backend.delete(name)
    store = Store(backend, seeded[2])
    address, kind = name.split(".")
    pids = []
    for _ in range(4):  # processes
        pid = os.fork()
        if pid == 0:
            try:
                ok = all(Store(DirectoryBackend(d), seeded[2]).put(name, blob, address, kind) for _ in range(10))
            finally:
                os._exit(0 if ok else 1)
        pids.append(pid)
    results = []
    threads = [threading.Thread(target=lambda: results.append(store.put(name, blob, address, kind)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(os.waitpid(p, 0)[1] == 0 for p in pids) and all(results)
    assert bytes(backend.get(name)) == blob
    assert all(a.ok for a in audit(backend)) and not list((d / "tmp").iterdir())


def test_foreign_manifests_refused_by_name(models, seeded, tmp_path, caplog):
    d = copy(seeded, tmp_path)
    ids, binding = seeded[1], seeded[2]
    backend = DirectoryBackend(d)
    name = next(o.name for o in backend.list() if o.name.endswith(".swa"))
    data = backend.get(name)
    manifest, at = read_manifest(data)
    address = name.split(".")[0]
    tile = bytes(data[at:])
    for field, other in (("artifact_sha256", dataclasses.replace(binding, artifact_sha256="0" * 64)),
                         ("kv", dataclasses.replace(binding, kv="f16")),
                         ("lane", dataclasses.replace(binding, lane="engine-exact-cpu"))):
        foreign = encode_entry(other, address, "swa", manifest["chunk"], tile)  # planted at our address
        with pytest.raises(IdentityMismatch, match=field):
            decode_entry(foreign, binding, address, "swa")
        backend.put(name, foreign)
        store = Store(backend, binding)
        with caplog.at_level(logging.WARNING, logger="muser.kvpack"):
            assert store.lookup(ids) is None
        assert field in store.misses[-1] and backend.exists(name)  # refused, kept for its owner
    w, logits = warm_prefill(models, d, ids)
    assert w.last["restored"] == 0 and np.array_equal(logits, seeded[3])


def test_lru_budget_evicts_least_recently_used(seeded, tmp_path):
    d = copy(seeded, tmp_path)
    backend = DirectoryBackend(d)
    objs = sorted(backend.list(), key=lambda o: o.name)
    for i, o in enumerate(objs):
        os.utime(next(d.rglob(o.name)), (1000 + i, 1000 + i))
    backend.touch(objs[0].name)  # most recent now
    keep = objs[0].size + objs[-1].size
    gone = backend.evict(keep)
    assert gone == [o.name for o in objs[1:-1]]
    assert sum(o.size for o in backend.list()) <= keep


def test_cli_ls_verify_gc(seeded, tmp_path, capsys):
    d = copy(seeded, tmp_path)
    assert main(["kvpack", "ls", str(d)]) == 0
    assert "3 entries" in capsys.readouterr().out
    assert main(["kvpack", "verify", str(d)]) == 0
    assert "0 failing" in capsys.readouterr().out
    name = next(o.name for o in DirectoryBackend(d).list() if o.name.endswith(".nope"))
    p = next(d.rglob(name))
    p.write_bytes(p.read_bytes()[:-5])
    (d / "tmp" / f"{name}.999999999.abcd.tmp").write_bytes(b"partial")  # a dead writer's leftover
    assert main(["kvpack", "verify", str(d), "--json"]) == 1
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    bad = [r for r in rows if not r["ok"]]
    assert [r["name"] for r in bad] == [name] and "tile_bytes" in bad[0]["reason"]
    assert main(["kvpack", "gc", str(d), "--json", "--budget", "0"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["removed_bad"] == [name] and len(summary["removed_temps"]) == 1
    assert summary["bytes"] == 0 and not list(DirectoryBackend(d).list())
    assert main(["kvpack", "ls", str(tmp_path / "nothing")]) == 2
    assert "not a kvpack directory" in capsys.readouterr().err


def test_restore_installs_as_tiles_verify_and_falls_back_whole(models, prompt, tmp_path, caplog):
    """Store.restore (the warm path: tiles installed as they verify) leaves the state lookup +
    install_tiles leaves; an entry that fails verification after earlier tiles were installed
    abandons that install (nothing committed) and the next shorter prefix is served whole."""
    from muser.kv.serial import encode_tiles, install_tiles

    d = tmp_path / "store"
    for n in (20, P):  # SWA tails at 16 and 32, NoPE chunks 0 and 1
        w = warm_session(sess(models), d, chunk_tokens=CH)
        w.prefill(prompt[:n])
        w.wait()
    store, ids = w.store, prompt[:P]
    a, b = sess(models), sess(models)
    hit, ref = store.restore(a, ids), store.lookup(ids)
    assert hit is not None and ref is not None and hit.n_tokens == ref.n_tokens == 32 and hit.names == ref.names
    install_tiles(b, ref.tiles, store.binding.layout, ref.n_tokens)
    assert a.n_past == 32 and encode_tiles(a.snapshot()) == encode_tiles(b.snapshot())
    # chunk 1's NoPE entry damaged: chunk 0's tile is installed before it is met
    name = store.name(store.binding.addresses(ids)[1], "nope")
    path = next(d.rglob(name))
    data = bytearray(path.read_bytes())
    data[-40] ^= 1  # a payload byte: the tile's SHA-256 no longer matches
    path.write_bytes(bytes(data))
    c = sess(models)
    with caplog.at_level(logging.WARNING, logger="muser.kvpack"):
        hit = store.restore(c, ids)
    assert any("kvpack miss" in r.message and name in r.message for r in caplog.records)
    assert hit is not None and hit.n_tokens == 16 and c.n_past == 16
    assert np.array_equal(c.prefill(ids[16:]), sess(models).prefill(ids))


class _Recording(DirectoryBackend):
    """Records prefetch hints and, for each NOPE read, whether the SWA tail's read had begun
    (a NOPE read waits up to 5 s for it)."""

    def __init__(self, root):
        super().__init__(root, create=False)
        self.prefetched: list[list[str]] = []
        self.swa_begun = threading.Event()
        self.nope_after_swa: list[bool] = []

    def prefetch(self, names):
        self.prefetched.append(list(names))
        super().prefetch(names)

    def get(self, name):
        if name.endswith(".swa"):
            self.swa_begun.set()
        else:
            self.nope_after_swa.append(self.swa_begun.wait(5.0))
        return super().get(name)


def test_restore_reads_the_swa_tail_first_and_prefetches(models, seeded, tmp_path, monkeypatch):
    """The SWA tail (the largest entry) is read before the NOPE chunks even with one reader,
    the backend is asked to prefetch every entry (the tail first), and the restored state is
    lookup + install_tiles'."""
    import muser.kvpack.store as S
    from muser.kv.serial import encode_tiles, install_tiles

    d = copy(seeded, tmp_path)
    ids, binding = seeded[1], seeded[2]
    monkeypatch.setattr(S, "LOAD_THREADS", 1)
    backend = _Recording(d)
    store = Store(backend, binding)
    a, b = sess(models), sess(models)
    hit = store.restore(a, ids)
    assert hit is not None and hit.n_tokens == 32
    assert backend.nope_after_swa == [True, True]
    assert backend.prefetched == [[hit.names[-1], *hit.names[:-1]]] and hit.names[-1].endswith(".swa")
    ref = Store(DirectoryBackend(d), binding).lookup(ids)
    assert ref is not None and ref.names == hit.names
    install_tiles(b, ref.tiles, binding.layout, ref.n_tokens)
    assert encode_tiles(a.snapshot()) == encode_tiles(b.snapshot())
    assert np.array_equal(a.prefill(ids[32:]), seeded[3])
