"""Tile bytes for the wire: muser.kv.serial's NOPE and SWA tiles (the project's one KV byte
format, docs/kvpack.md), cut from a live session's planes without a whole-cache snapshot, and
the logits row (f32 little-endian [vocab]).

A chunk's NOPE tile reads only that chunk's rows; the SWA tile reads only the sliding layers'
tail. Both go through serial's own encoder by way of a KvSnapshot that carries just those
rows (the planes a tile does not read are empty), so the bytes are exactly serial's.
"""

from __future__ import annotations

import numpy as np

from ..errors import HandoffRefused, KvStateError
from ..kv import KvSnapshot, PlaneSnapshot
from ..kv.serial import KvLayout, nope_tile, swa_tile


def layout_of(session) -> KvLayout:
    """The session's tile layout: its model's layer kinds and KV type, chunked like its prefill."""
    base = KvLayout.of_config(session.cfg, session.kv_dtype)
    return KvLayout(base.sliding, base.window, base.n_kv_heads, base.head_dim, base.dtype, session.chunk)


def rows(session, layer: int, a: int, b: int):
    """Logical rows [a, b) of one live plane, token-major [b - a, kv_dim] (a device copy)."""
    p = session.cache.plane(layer)
    return p.read(p.physical_of(np.arange(a, b, dtype=np.int64)))


def _partial(session, layout: KvLayout, n_tokens: int, spans: dict[int, tuple[int, int]]) -> KvSnapshot:
    empty = np.zeros((0, layout.kv_dim), dtype=np.float16 if layout.dtype == "f16" else np.float32)
    planes = []
    for pl in layout.planes():
        if pl.layer in spans:
            a, b = spans[pl.layer]
            k, v = rows(session, pl.layer, a, b)
            planes.append(PlaneSnapshot(pl, a, k, v))
        else:
            planes.append(PlaneSnapshot(pl, n_tokens, empty, empty))
    return KvSnapshot(n_tokens, tuple(planes))


def encode_nope(session, layout: KvLayout, chunk: int) -> bytes:
    """serial's NOPE tile of chunk `chunk` (rows [cC, min((c+1)C, n_past))) from live planes."""
    a = chunk * layout.chunk_tokens
    b = min(a + layout.chunk_tokens, session.n_past)
    if a >= b:
        raise KvStateError(f"chunk {chunk} holds no rows of a {session.n_past}-token session")
    return nope_tile(_partial(session, layout, b, {il: (a, b) for il in layout.full_layers}), chunk, layout)


def encode_swa(session, layout: KvLayout) -> bytes:
    """serial's SWA tile: the sliding layers' tail [n - min(n, W), n) with its origin."""
    n = session.n_past
    a = n - min(n, layout.window)
    return swa_tile(_partial(session, layout, n, {il: (a, n) for il in layout.sliding_layers}), layout)


def same_bits(live, wire: np.ndarray) -> bool:
    """Bit equality of live plane rows (a torch tensor) and wire rows (numpy, same dtype)."""
    host = live.detach().to("cpu").contiguous().numpy() if hasattr(live, "detach") else np.asarray(live)
    return host.shape == wire.shape and host.tobytes() == np.ascontiguousarray(wire).tobytes()


def encode_logits(logits: np.ndarray) -> bytes:
    return np.ascontiguousarray(logits, dtype="<f4").tobytes()


def decode_logits(data, vocab: int) -> np.ndarray:
    if len(data) != 4 * vocab:
        raise HandoffRefused(f"logits tile: {len(data)} bytes, expected {4 * vocab}")
    return np.frombuffer(data, dtype="<f4").astype(np.float32)  # a copy the caller owns
