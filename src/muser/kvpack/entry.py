"""kvpack entries: the model binding, content addresses, and the entry file (version 1).

    binding = Binding.of_session(session)                 # identity SHA-256s, lane, KV type, layout
    addrs = binding.addresses(ids)                        # SHA-256(binding ‖ ids[:end]) per chunk end
    blob = encode_entry(binding, addrs[c], "nope", c, tile, chunk_ids)
    entry = decode_entry(blob, binding, addrs[c], "nope")  # verifies everything or raises

An entry file is one tile (muser.kv.serial) behind a JSON manifest (docs/kvpack.md):

    magic "MUSKVPK\\0" | u16 version | u16 reserved | u32 manifest_len | u8[32] SHA-256(manifest)
    | manifest (UTF-8 JSON, manifest_len bytes) | zero padding to 8 | tile bytes

The manifest binds the model (artifact / tokenizer / template SHA-256 from muser.gguf.identity),
the lane, the KV type, the layout keys, the address, the chunk's token ids, and the tile's
SHA-256 and length. A reader refuses any difference by name (typed errors) before building rows.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import IdentityMismatch, KvFormatError
from ..kv.serial import (
    CHUNK_TOKENS,
    FORMAT_VERSION,
    KIND_NOPE,
    KIND_SWA,
    KvLayout,
    Tile,
    decode_tile,
)

ENTRY_MAGIC = b"MUSKVPK\x00"
ENTRY_VERSION = 1
_HEAD = struct.Struct("<8sHHI32s")  # 48 bytes
KINDS = {"nope": KIND_NOPE, "swa": KIND_SWA}
BINDING_FIELDS = ("artifact_sha256", "tokenizer_sha256", "template_sha256", "lane", "kv", "layout")
MAX_MANIFEST = 1 << 20


@dataclass(frozen=True)
class Binding:
    """What a stored KV tile is valid for: one model file, one lane, one KV type, one layout."""

    artifact_sha256: str
    tokenizer_sha256: str
    template_sha256: str | None
    lane: str  # e.g. "engine-exact-cpu", "oracle-ggml-cpu": bitwise reuse holds within one lane
    kv: str
    layout: KvLayout

    @classmethod
    def of_session(cls, session: Any, chunk_tokens: int = CHUNK_TOKENS) -> Binding:
        """The binding of an engine session (muser.engine) or an oracle session (muser.oracle)."""
        layout = KvLayout.of_cache(session.cache, chunk_tokens)
        engine = getattr(session, "engine", None)
        if engine is not None:
            ident = engine.model_file.identity
            lane = f"engine-{engine.lane.value}-{engine.device.type}"
            kv = engine.kv
        else:
            model = session.model
            ident = model.identity
            lane = f"oracle-{model.arithmetic}"
            kv = model.kv
        return cls(ident.artifact_sha256, ident.tokenizer_sha256, ident.template_sha256, lane, kv, layout)

    @classmethod
    def from_json(cls, d: Any) -> Binding:
        """The binding a manifest records (to_json); malformed records are KvFormatError."""
        if not isinstance(d, dict) or set(d) != set(BINDING_FIELDS):
            raise KvFormatError(f"binding record has fields {sorted(d) if isinstance(d, dict) else d!r}, expected "
                                f"{sorted(BINDING_FIELDS)}", field="binding")
        return cls(d["artifact_sha256"], d["tokenizer_sha256"], d["template_sha256"], d["lane"], d["kv"],
                   KvLayout.from_json(d["layout"]))

    def to_json(self) -> dict:
        return {"artifact_sha256": self.artifact_sha256, "tokenizer_sha256": self.tokenizer_sha256,
                "template_sha256": self.template_sha256, "lane": self.lane, "kv": self.kv,
                "layout": self.layout.to_json()}

    @property
    def canonical(self) -> bytes:
        """The identity bytes hashed into every address (sorted-key compact JSON, UTF-8)."""
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":")).encode()

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.canonical).hexdigest()

    def addresses(self, ids: Sequence[int]) -> list[str]:
        """Content address of each complete chunk of `ids`: SHA-256(binding ‖ u32le ids[:end])
        for end = 512, 1024, ... <= len(ids) (one incremental hash, copied at each chunk end)."""
        ch = self.layout.chunk_tokens
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= 1 << 32):
            raise KvFormatError(f"token ids must fit u32, got range [{arr.min()}, {arr.max()}]", field="tokens")
        h = hashlib.sha256(self.canonical)
        out = []
        for end in range(ch, len(arr) + 1, ch):
            h.update(arr[end - ch:end].astype("<u4").tobytes())
            out.append(h.copy().hexdigest())
        return out

    def check(self, other: dict, where: str) -> None:
        """Refuse a manifest binding that differs, naming the field and both values."""
        mine = self.to_json()
        if not isinstance(other, dict):
            raise IdentityMismatch(f"{where}: binding is not an object")
        for key in BINDING_FIELDS:
            if other.get(key) != mine[key]:
                raise IdentityMismatch(f"{where}: {key} is {other.get(key)!r}, this model has {mine[key]!r}")


@dataclass(frozen=True)
class Entry:
    manifest: dict
    tile: Tile


def encode_entry(binding: Binding, address: str, kind: str, chunk: int, tile: bytes,
                 chunk_ids: Sequence[int] = ()) -> bytes:
    """One entry file: header, manifest, padding, tile (see module doc)."""
    manifest = {
        "format": "muser-kvpack", "entry_version": ENTRY_VERSION, "tile_version": FORMAT_VERSION,
        "address": address, "kind": kind, "chunk": int(chunk),
        "n_tokens": (int(chunk) + 1) * binding.layout.chunk_tokens,
        "binding": binding.to_json(),
        "chunk_ids": [int(t) for t in chunk_ids],
        "tile_bytes": len(tile), "tile_sha256": bytes(tile[-32:]).hex(),
    }
    body = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    head = _HEAD.pack(ENTRY_MAGIC, ENTRY_VERSION, 0, len(body), hashlib.sha256(body).digest())
    pad = b"\0" * ((-(len(head) + len(body))) % 8)
    return b"".join([head, body, pad, tile])


def read_manifest(data: bytes | bytearray | memoryview) -> tuple[dict, int]:
    """The verified manifest of an entry and the offset of its tile (structure only, no binding)."""
    buf = memoryview(data).cast("B")
    if len(buf) < _HEAD.size:
        raise KvFormatError(f"entry field length: {len(buf)} bytes is shorter than the {_HEAD.size}-byte header",
                            field="length")
    magic, version, reserved, mlen, msha = _HEAD.unpack_from(buf, 0)
    if magic != ENTRY_MAGIC:
        raise KvFormatError(f"entry field magic: {bytes(magic)!r} is not {ENTRY_MAGIC!r}", field="magic")
    if version != ENTRY_VERSION:
        raise KvFormatError(f"entry field version: {version} is not {ENTRY_VERSION}", field="version")
    if reserved:
        raise KvFormatError(f"entry field reserved: {reserved} must be 0", field="reserved")
    if mlen > MAX_MANIFEST or _HEAD.size + mlen > len(buf):
        raise KvFormatError(f"entry field manifest_len: {mlen} runs past the {len(buf)}-byte file",
                            field="manifest_len")
    body = bytes(buf[_HEAD.size:_HEAD.size + mlen])
    if hashlib.sha256(body).digest() != msha:
        raise KvFormatError("entry field manifest_sha256: the manifest does not match its digest",
                            field="manifest_sha256")
    try:
        manifest = json.loads(body)
    except ValueError as e:
        raise KvFormatError(f"entry field manifest: not JSON ({e})", field="manifest") from None
    if not isinstance(manifest, dict) or manifest.get("format") != "muser-kvpack":
        raise KvFormatError("entry field format: not a muser-kvpack manifest", field="format")
    off = _HEAD.size + mlen
    pad = (-off) % 8
    if bytes(buf[off:off + pad]).strip(b"\0"):
        raise KvFormatError("entry field padding: the bytes after the manifest must be zero", field="padding")
    off += pad
    if manifest.get("tile_bytes") != len(buf) - off:
        raise KvFormatError(f"entry field tile_bytes: manifest says {manifest.get('tile_bytes')!r}, the file "
                            f"holds {len(buf) - off} (truncated?)", field="tile_bytes")
    return manifest, off


def decode_entry(data: bytes | bytearray | memoryview, binding: Binding, address: str, kind: str,
                 chunk_ids: Sequence[int] | None = None) -> Entry:
    """Parse and verify an entry for `address`: structure, binding (IdentityMismatch by field),
    address, kind, chunk ids, tile digest and layout. Raises; never returns unverified rows."""
    manifest, off = read_manifest(data)
    where = f"kvpack entry {address[:16]}"
    binding.check(manifest.get("binding"), where)
    for key, want in (("address", address), ("kind", kind), ("tile_version", FORMAT_VERSION)):
        if manifest.get(key) != want:
            raise KvFormatError(f"{where}: field {key} is {manifest.get(key)!r}, expected {want!r}", field=key)
    if chunk_ids is not None and manifest.get("chunk_ids") != [int(t) for t in chunk_ids]:
        raise KvFormatError(f"{where}: field chunk_ids differ from the prompt's", field="chunk_ids")
    buf = memoryview(data).cast("B")
    tile = decode_tile(buf[off:], binding.layout, KINDS[kind])
    if tile.sha256 != manifest.get("tile_sha256"):
        raise KvFormatError(f"{where}: field tile_sha256 {manifest.get('tile_sha256')!r} != the tile's {tile.sha256!r}",
                            field="tile_sha256")
    chunk = manifest.get("chunk")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
        raise KvFormatError(f"{where}: field chunk is {chunk!r}, not a chunk index", field="chunk")
    end = (chunk + 1) * binding.layout.chunk_tokens
    if tile.n_tokens != end or manifest.get("n_tokens") != end:
        raise KvFormatError(f"{where}: field n_tokens: the tile ends at {tile.n_tokens}, chunk end {end}",
                            field="n_tokens")
    return Entry(manifest, tile)
