"""kvpack: durable, identity-bound, content-addressed KV (book 1.4, 9.7, 14.6, 15.6).

    from muser.kvpack import warm_session, Store, Binding
    s = warm_session(model.session(max_context=4096), "/var/cache/muser/kvpack")
    s.prefill(ids)            # restores the longest verified stored prefix, prefills the suffix
    # or: model.session(max_context=4096, kvpack="/var/cache/muser/kvpack")

Entries (muser.kvpack.entry) are single tiles of muser.kv.serial behind a manifest that binds the
model identity, lane, KV type and layout; addresses are SHA-256(binding ‖ token ids up to the
chunk end). The store (muser.kvpack.store) verifies every read; a corrupt, truncated or foreign
entry is a logged miss. Byte layout and backends: docs/kvpack.md.
"""

from .entry import Binding, Entry, decode_entry, encode_entry, read_manifest
from .reuse import WarmSession, warm_session
from .store import DirectoryBackend, Hit, ObjectInfo, Store, StoreBackend

__all__ = [
           "Binding",
           "DirectoryBackend",
           "Entry",
           "Hit",
           "ObjectInfo",
           "Store",
           "StoreBackend",
           "WarmSession",
           "decode_entry",
           "encode_entry",
           "read_manifest",
           "warm_session",
]
