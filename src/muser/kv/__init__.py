"""The two-class KV store (book 15): SWA rings and NoPE planes with explicit origins.

    from muser.kv import KvCache
    cache = KvCache.for_config(cfg, max_context=4096, dtype="f16")         # numpy storage
    cache.append_batch(layer, start, k_rows, v_rows)                          # [T, kv_dim] each
    view = cache.view(layer)                                                  # keys, values, positions
    cp = cache.checkpoint(block=16); ...; cache.rollback(cp, keep=n_accepted)
    snap = cache.snapshot(tokens=ids); other.restore(snap)       # any slot size that fits
    inst = cache.begin_install(n_tokens); inst.put(layer, start, k, v); cache.commit(inst)

Storage is pluggable (`ArrayBackend`): numpy here, torch in the engine.
"""

from .backend import KV_DTYPES, ArrayBackend, NumpyBackend
from .cache import (
    DEFAULT_BLOCK,
    DetachedInstall,
    KvCache,
    KvCheckpoint,
    KvSnapshot,
    PlaneSnapshot,
    geometries,
)
from .plane import BatchPlacement, KvPlane, PlaneGeometry, PlaneLayout, PlaneView

__all__ = [
    "DEFAULT_BLOCK",
    "KV_DTYPES",
    "ArrayBackend",
    "BatchPlacement",
    "DetachedInstall",
    "KvCache",
    "KvCheckpoint",
    "KvPlane",
    "KvSnapshot",
    "NumpyBackend",
    "PlaneGeometry",
    "PlaneLayout",
    "PlaneSnapshot",
    "PlaneView",
    "geometries",
]
