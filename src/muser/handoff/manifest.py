"""The Handoff V2 documents: request, sealed manifest, sealed tile descriptors, sealed end,
and the tile plan both sides derive independently (book 10.7, 15.7).

Sealing: tag = HMAC-SHA256(key, DOMAIN | kind u8 | seq u32 | body) over the body's exact bytes;
a sealed payload is tag (32 bytes) | body. Bodies are canonical JSON (sorted keys, no spaces);
the reader verifies the tag on the bytes received, then parses them strictly (no NaN, no
duplicate keys, objects only). The key is the certs dir's hmac.key (muser certs init).

Plan: for a prompt of n tokens of which the decode node already holds the first `cut`, with
tile chunk C (the prefill chunk, 512 by default) and window W, tiles in muser.kv.serial's byte
form (one KV byte format in the project):

  - one NOPE tile per C-token chunk [cC, min((c+1)C, n)) from the chunk holding `cut` on: every
    full (NoPE) layer's K and V rows, sent as soon as the producer's prefill has passed its end;
  - the SWA tile: every sliding layer's logical tail [n - min(n, W), n) with its explicit
    origin, sent after the last chunk (its rows depend on the whole prompt's end);
  - the last row's logits (f32 [vocab]), then the end seal listing every tile's SHA-256.

K/V bytes = (n_full (n - floor(cut / C) C) + n_swa min(n, W)) x 2 x kv_dim x e, e = 2 (f16) or
4 (f32) (book 15.7: NoPE grows with the prompt, SWA is bounded by the window); each tile adds
serial's 64-byte header, layer index and 32-byte digest, each frame its seal.
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


def plan_tiles(layout, max_context: int, cut: int, n: int, vocab: int) -> list[dict]:
    """Every tile of a handoff in wire order (see module doc). `layout`: muser.kv.serial.KvLayout
    (its chunk_tokens is the producer's prefill chunk)."""
    from ..kv.serial import KIND_NOPE, KIND_SWA

    if not 0 <= cut < n <= max_context:
        raise HandoffRefused(f"handoff range: held {cut} of {n} tokens in max_context {max_context} is invalid")
    C = layout.chunk_tokens
    tiles: list[dict] = []
    if layout.full_layers:
        for c in range(cut // C, -(-n // C)):
            a, b = c * C, min((c + 1) * C, n)
            tiles.append({"kind": "nope", "chunk": c, "range": [a, b], "layers": list(layout.full_layers),
                          "dtype": layout.dtype, "nbytes": layout.tile_bytes(KIND_NOPE, b - a)})
    if layout.sliding_layers:
        a = n - min(n, layout.window)
        tiles.append({"kind": "swa", "chunk": None, "range": [a, n], "layers": list(layout.sliding_layers),
                      "dtype": layout.dtype, "nbytes": layout.tile_bytes(KIND_SWA, n - a)})
    tiles.append({"kind": "logits", "chunk": None, "range": [n - 1, n], "layers": [], "dtype": "f32",
                  "nbytes": 4 * vocab})
    for i, t in enumerate(tiles):
        t["seq"] = i + 1  # seq 0 is the manifest
    return tiles


def kv_rows_formula(layout, cut: int, n: int) -> int:
    """Book 15.7's K/V bytes this plan carries: n_full rows from the chunk holding `cut` to n,
    n_swa rows of the last min(n, W) -- (rows) x 2 (K, V) x kv_dim x element bytes."""
    a = (cut // layout.chunk_tokens) * layout.chunk_tokens
    rows = len(layout.full_layers) * (n - a) + len(layout.sliding_layers) * min(n, layout.window)
    return 2 * rows * layout.row_bytes
