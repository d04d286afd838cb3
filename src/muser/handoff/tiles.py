"""Tile payload bytes: the K/V rows of a group of layers for one logical range.

    payload = for each layer in tile order: K rows [n, kv_dim] then V rows [n, kv_dim],
              token-major (each row head by head, muser.kv's row convention), little-endian,
              in the plane element type (f16 | f32); logits tiles are f32 [vocab].

This is the only place that turns plane rows into wire bytes and back; the descriptor
(muser.handoff.manifest.plan_tiles) fixes layers, range, dtype and shape before the bytes are
read, so decoding is a bounds-checked view, never a parse.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ..errors import HandoffRefused

NP_DTYPE = {"f16": np.dtype("<f2"), "f32": np.dtype("<f4")}


def _host_bytes(t) -> bytes:
    if isinstance(t, torch.Tensor):
        t = t.detach().to("cpu").contiguous().numpy()
    return np.ascontiguousarray(t).astype(t.dtype.newbyteorder("<"), copy=False).tobytes()


def encode_rows(rows: Sequence[tuple[object, object]]) -> bytes:
    """[(keys [n, kv_dim], values [n, kv_dim]) per layer] -> payload bytes."""
    return b"".join(_host_bytes(k) + _host_bytes(v) for k, v in rows)


def decode_rows(data: memoryview | bytes, desc: dict) -> list[tuple[np.ndarray, np.ndarray]]:
    """Payload bytes -> [(keys, values) per layer of desc["layers"]], views of `data`."""
    n_layers, two, n, kv_dim = desc["shape"]
    dt = NP_DTYPE[desc["dtype"]]
    if len(data) != n_layers * two * n * kv_dim * dt.itemsize:
        raise HandoffRefused(f"tile seq {desc['seq']}: {len(data)} bytes, expected "
                             f"{n_layers * two * n * kv_dim * dt.itemsize} for shape {desc['shape']}")
    a = np.frombuffer(data, dtype=dt).reshape(n_layers, two, n, kv_dim)  # [L, K|V, n, kv_dim]
    return [(a[i, 0], a[i, 1]) for i in range(n_layers)]


def encode_logits(logits: np.ndarray) -> bytes:
    return np.ascontiguousarray(logits, dtype="<f4").tobytes()


def decode_logits(data: memoryview | bytes, vocab: int) -> np.ndarray:
    if len(data) != 4 * vocab:
        raise HandoffRefused(f"logits tile: {len(data)} bytes, expected {4 * vocab}")
    return np.frombuffer(data, dtype="<f4").astype(np.float32)  # a copy the caller owns
