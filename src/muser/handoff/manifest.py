"""The Handoff V2 documents: request, sealed manifest, sealed tile descriptors, sealed end,
and the tile plan both sides derive independently (book 10.7, 15.7).

Sealing: tag = HMAC-SHA256(key, DOMAIN | kind u8 | seq u32 | body) over the body's exact bytes;
a sealed payload is tag (32 bytes) | body. Bodies are canonical JSON (sorted keys, no spaces);
the reader verifies the tag on the bytes received, then parses them strictly (no NaN, no
duplicate keys, objects only). The key is the certs dir's hmac.key (muser certs init).

Plan: for a prompt of n tokens of which the decode node already holds the first `cut`, with
prefill chunk C and window W (the SWA ring capacity is min(max_context, W)):

  - one NoPE tile per producer chunk [c, min(c + C, n)), c = cut, cut + C, ... : every full
    (NoPE) layer's K and V rows for that range, sent as soon as the chunk is computed;
  - one SWA tile per collar slot (sliding layers il % 4 == 0, 1, 2): rows
    [max(cut, n - cap), n), the retained logical tail, sent after the last chunk;
  - the last row's logits (f32 [vocab]), then the end seal listing every tile's SHA-256.

Wire payload = n_full (n - cut) 2 kv_dim e + n_swa min(n - cut, cap) 2 kv_dim e + 4 vocab bytes,
e = 2 (f16) or 4 (f32) (book 15.7's per-token formula, NoPE growing, SWA bounded).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

from ..errors import HandoffRefused

VERSION = 2
DOMAIN = b"muser-handoff-v2\0"
TAG_BYTES = 32
KV_ELEM = {"f16": 2, "f32": 4}


def canonical(doc: dict) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode("ascii")


def _no_dupes(pairs: list[tuple[str, Any]]) -> dict:
    d: dict = {}
    for k, v in pairs:
        if k in d:
            raise HandoffRefused(f"duplicate key {k!r} in a handoff document")
        d[k] = v
    return d


def _no_constant(name: str):
    raise HandoffRefused(f"non-finite number {name} in a handoff document")


def parse(body: bytes, what: str) -> dict:
    try:
        doc = json.loads(body.decode("utf-8"), object_pairs_hook=_no_dupes, parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError) as e:
        raise HandoffRefused(f"{what} is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise HandoffRefused(f"{what} must be a JSON object, got {type(doc).__name__}")
    return doc


def tag(key: bytes, kind: int, seq: int, body: bytes) -> bytes:
    return hmac.new(key, DOMAIN + bytes([kind]) + seq.to_bytes(4, "big") + body, hashlib.sha256).digest()


def seal(key: bytes, kind: int, seq: int, doc: dict) -> bytes:
    body = canonical(doc)
    return tag(key, kind, seq, body) + body


def open_sealed(key: bytes, kind: int, seq: int, payload: bytes, what: str) -> tuple[dict, bytes]:
    """Verify the tag over the exact body bytes, then parse: (document, body bytes)."""
    if len(payload) <= TAG_BYTES:
        raise HandoffRefused(f"{what} is {len(payload)} bytes: too short to carry a seal")
    t, body = payload[:TAG_BYTES], payload[TAG_BYTES:]
    if not hmac.compare_digest(t, tag(key, kind, seq, body)):
        raise HandoffRefused(f"{what} (seq {seq}) fails its HMAC-SHA256 seal: tampered, reordered or "
                             "sealed with another key")
    return parse(body, what), body


def seal_tile(key: bytes, kind: int, seq: int, desc: dict, data: bytes) -> bytes:
    """Tile payload: tag | u32 descriptor length | descriptor JSON | raw bytes; the sealed
    descriptor carries the raw bytes' SHA-256."""
    body = canonical(desc)
    return tag(key, kind, seq, body) + len(body).to_bytes(4, "big") + body + data


def open_tile(key: bytes, kind: int, seq: int, payload: bytes, what: str) -> tuple[dict, memoryview]:
    if len(payload) < TAG_BYTES + 4:
        raise HandoffRefused(f"{what} is {len(payload)} bytes: too short to carry a seal")
    n = int.from_bytes(payload[TAG_BYTES:TAG_BYTES + 4], "big")
    if TAG_BYTES + 4 + n > len(payload):
        raise HandoffRefused(f"{what}: descriptor length {n} runs past the frame ({len(payload)} bytes)")
    body = payload[TAG_BYTES + 4:TAG_BYTES + 4 + n]
    if not hmac.compare_digest(payload[:TAG_BYTES], tag(key, kind, seq, body)):
        raise HandoffRefused(f"{what} (seq {seq}) fails its HMAC-SHA256 seal: tampered, reordered or "
                             "sealed with another key")
    data = memoryview(payload)[TAG_BYTES + 4 + n:]
    return parse(body, what), data


def sha256(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


# --- model identity ------------------------------------------------------------------------


def model_identity(identity) -> dict:
    """The identity fields a handoff binds (muser.gguf.identity): artifact, tokenizer, template."""
    return {"artifact_sha256": identity.artifact_sha256, "tokenizer_sha256": identity.tokenizer_sha256,
            "template_sha256": identity.template_sha256, "architecture": identity.architecture}


def ids_sha256(ids) -> str:
    h = hashlib.sha256()
    for t in ids:
        h.update(int(t).to_bytes(4, "little"))
    return h.hexdigest()


# --- the tile plan -------------------------------------------------------------------------


def plan_tiles(cfg, max_context: int, cut: int, n: int, chunk: int, kv: str) -> list[dict]:
    """Every tile of a handoff in wire order (see module doc). `cfg`: a MuseConfig."""
    from ..model.config import COLLAR

    if not 0 <= cut < n <= max_context:
        raise HandoffRefused(f"handoff range: held {cut} of {n} tokens in max_context {max_context} is invalid")
    if chunk < 1:
        raise HandoffRefused(f"prefill chunk {chunk} must be >= 1")
    kv_dim, e = cfg.kv_dim, KV_ELEM[kv]
    full = [il for il, s in enumerate(cfg.swa_pattern) if not s]
    tiles: list[dict] = []
    for c in range(cut, n, chunk):
        a, b = c, min(c + chunk, n)
        tiles.append({"kind": "nope", "layers": full, "range": [a, b], "dtype": kv,
                      "shape": [len(full), 2, b - a, kv_dim], "nbytes": len(full) * 2 * (b - a) * kv_dim * e})
    cap = min(max_context, cfg.sliding_window)
    a = max(cut, n - cap)
    for slot in range(COLLAR):
        layers = [il for il, s in enumerate(cfg.swa_pattern) if s and il % COLLAR == slot]
        if layers:
            tiles.append({"kind": "swa", "layers": layers, "range": [a, n], "dtype": kv,
                          "shape": [len(layers), 2, n - a, kv_dim],
                          "nbytes": len(layers) * 2 * (n - a) * kv_dim * e})
    tiles.append({"kind": "logits", "layers": [], "range": [n - 1, n], "dtype": "f32",
                  "shape": [cfg.vocab], "nbytes": 4 * cfg.vocab})
    for i, t in enumerate(tiles):
        t["seq"] = i + 1  # seq 0 is the manifest
    return tiles


def payload_formula(cfg, max_context: int, cut: int, n: int, kv: str) -> int:
    """Book 15.7's bytes for this handoff (module doc), independent of the plan's tiling."""
    e = KV_ELEM[kv]
    cap = min(max_context, cfg.sliding_window)
    return (cfg.n_full * (n - cut) + cfg.n_swa * min(n - cut, cap)) * 2 * cfg.kv_dim * e + 4 * cfg.vocab
