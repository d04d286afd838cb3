"""The writer process killed by test_kill: rewrites a cycle of kvpack entries until killed.
Kept apart so the fork server that spawns it imports only the store."""

from __future__ import annotations

from muser.kvpack.store import DirectoryBackend, Store


def writer(d, binding, blobs) -> None:
    store = Store(DirectoryBackend(d), binding)
    i = 0
    while True:
        name, address, kind, blob = blobs[i % len(blobs)]
        store.backend.delete(name)
        store.put(name, blob, address, kind)
        i += 1
