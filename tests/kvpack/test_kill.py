"""SIGKILL of a kvpack writer at random points: after every kill each visible entry is complete
and verifies (or is absent), and the next run restores correctly. Up to 1000 kills or 40 s,
whichever comes first; at least 200 are required (the count reached is printed)."""

from __future__ import annotations

import hashlib
import multiprocessing
import signal
import time

import numpy as np

from muser.kvpack import DirectoryBackend, Store, encode_entry, read_manifest
from muser.kvpack.store import audit

from .kill_writer import writer
from .test_store import copy, seeded, warm_prefill  # noqa: F401  (seeded is a fixture)

KILLS, SECONDS, MIN_KILLS = 1000, 40.0, 200


def test_sigkill_writer_entries_complete_or_absent(models, seeded, tmp_path):  # noqa: F811
    d = copy(seeded, tmp_path)
    binding = seeded[2]
    backend = DirectoryBackend(d)
    real = [o.name for o in backend.list()]
    blobs = []
    for name in real:  # the real entries, plus 12 more names carrying the same tiles
        data = backend.get(name)
        blobs.append((name, *name.split("."), bytes(data)))
    m, at = read_manifest(backend.get(real[0]))
    tile = bytes(backend.get(real[0])[at:])
    kind = real[0].split(".")[1]
    for j in range(12):
        address = hashlib.sha256(f"extra {j}".encode()).hexdigest()
        blobs.append((f"{address}.{kind}", address, kind, encode_entry(binding, address, kind, m["chunk"], tile)))
    t0 = time.perf_counter()
    for name, address, kind, blob in blobs[:3]:
        Store(backend, binding).put(name, blob, address, kind)
    t_put = (time.perf_counter() - t0) / 3
    rng = np.random.default_rng(0)
    kills = 0
    t_end = time.perf_counter() + SECONDS
    ctx = multiprocessing.get_context("forkserver")  # small children: the server imports only the store
    ctx.set_forkserver_preload(["tests.kvpack.kill_writer"])
    while kills < KILLS and time.perf_counter() < t_end:
        p = ctx.Process(target=writer, args=(d, binding, blobs))
        p.start()
        time.sleep(float(rng.uniform(0, 2 * t_put)))
        p.kill()
        p.join()
        assert p.exitcode == -signal.SIGKILL, p.exitcode
        kills += 1
        bad = [a for a in audit(backend) if not a.ok]
        assert not bad, (kills, bad[0])  # complete or absent, never torn
    print(f"{kills} SIGKILLs of the writer in {SECONDS - max(0.0, t_end - time.perf_counter()):.1f} s")
    assert kills >= MIN_KILLS
    stale = backend.stale_temps()
    print(f"{len(stale)} kills landed mid-write (temp files left in tmp/)")
    assert all(p.parent == d / "tmp" for p in stale)  # leftovers only in tmp/, never visible
    for p in stale:
        p.unlink()
    _, logits = warm_prefill(models, d, seeded[1])  # the next run: correct, and warm again
    assert np.array_equal(logits, seeded[3])
    w2, logits2 = warm_prefill(models, d, seeded[1])
    assert w2.last["restored"] == 32 and np.array_equal(logits2, seeded[3])
