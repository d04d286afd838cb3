"""Model identity (book 9.13): SHA-256 of the artifact, of the tokenizer surface, of the chat
template; the dual EOG set; pin files that refuse a mismatch naming the field and both values.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import IdentityMismatch, MuserError
from .reader import GGUFFile

TOKENIZER_KEYS = (
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.token_type",
)
TEMPLATE_KEY = "tokenizer.chat_template"
_CHUNK = 16 << 20


def _cache_path() -> Path:
    base = os.environ.get("MUSER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "muser"
    )
    return Path(base) / "artifact-sha256.json"


def artifact_sha256(path: str | os.PathLike, use_cache: bool = True) -> str:
    """Streamed SHA-256 of the whole file; cached by (realpath, size, mtime_ns)."""
    p = Path(path).resolve()
    st = p.stat()
    key = f"{p}|{st.st_size}|{st.st_mtime_ns}"
    cache = _cache_path()
    table: dict[str, str] = {}
    if use_cache:
        try:
            table = json.loads(cache.read_text())
            if key in table:
                return table[key]
        except (OSError, ValueError):
            table = {}
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    digest = h.hexdigest()
    if use_cache:
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            table[key] = digest
            tmp = cache.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(table))
            os.replace(tmp, cache)
        except OSError:
            pass  # the cache is an optimisation; the digest stands without it
    return digest


def _feed(h: "hashlib._Hash", value: Any) -> None:
    """Canonical, length-prefixed encoding of a metadata value into a hash."""
    if value is None:
        h.update(b"N")
    elif isinstance(value, str):
        b = value.encode("utf-8")
        h.update(b"S" + struct.pack("<Q", len(b)) + b)
    elif isinstance(value, (list, tuple)):
        h.update(b"L" + struct.pack("<Q", len(value)))
        for v in value:
            _feed(h, v)
    elif isinstance(value, np.ndarray):
        a = np.ascontiguousarray(value)
        h.update(b"A" + a.dtype.str.encode() + struct.pack("<Q", a.size) + a.tobytes())
    elif isinstance(value, bool):
        h.update(b"B1" if value else b"B0")
    elif isinstance(value, int):
        h.update(b"I" + struct.pack("<q", value))
    elif isinstance(value, float):
        h.update(b"F" + struct.pack("<d", value))
    else:
        raise TypeError(f"cannot hash {type(value).__name__}")


def tokenizer_sha256(f: GGUFFile) -> str:
    """One SHA-256 over the tokenizer surface: model, pre, tokens, merges, token types."""
    h = hashlib.sha256()
    for key in TOKENIZER_KEYS:
        _feed(h, key)
        _feed(h, f.get(key))
    return h.hexdigest()


def template_sha256(f: GGUFFile) -> str | None:
    t = f.get(TEMPLATE_KEY)
    if t is None:
        return None
    return hashlib.sha256(t.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Identity:
    artifact_sha256: str
    size: int
    architecture: str
    tokenizer_sha256: str
    template_sha256: str | None
    template_bytes: int | None
    eog_ids: tuple[int, ...]
    dtype_mix: dict[str, int]  # dtype name -> tensor count

    def to_json(self) -> dict:
        d = asdict(self)
        d["eog_ids"] = list(self.eog_ids)
        return d


def identity_of(f: GGUFFile, eog_ids: frozenset[int] | tuple[int, ...] = (), use_cache: bool = True) -> Identity:
    mix: dict[str, int] = {}
    for t in f.tensors.values():
        mix[t.type.name] = mix.get(t.type.name, 0) + 1
    tpl = f.get(TEMPLATE_KEY)
    return Identity(
        artifact_sha256=artifact_sha256(f.path, use_cache),
        size=f.size,
        architecture=str(f.get("general.architecture")),
        tokenizer_sha256=tokenizer_sha256(f),
        template_sha256=template_sha256(f),
        template_bytes=None if tpl is None else len(tpl.encode("utf-8")),
        eog_ids=tuple(sorted(eog_ids)),
        dtype_mix=dict(sorted(mix.items())),
    )


PIN_FIELDS = ("artifact_sha256", "size", "architecture", "tokenizer_sha256", "template_sha256", "eog_ids")


def write_pin(identity: Identity, path: str | os.PathLike) -> Path:
    pin = {k: identity.to_json()[k] for k in PIN_FIELDS}
    p = Path(path)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(pin, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, p)
    return p


def load_pin(pin: str | os.PathLike | dict) -> dict:
    if isinstance(pin, dict):
        data = pin
    else:
        try:
            data = json.loads(Path(pin).read_text())
        except OSError as e:
            raise MuserError(f"cannot read pin file {str(pin)!r}: {e.strerror}") from None
        except ValueError as e:
            raise IdentityMismatch(f"pin file {str(pin)!r} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise IdentityMismatch(f"pin must be a JSON object, got {type(data).__name__}")
    unknown = set(data) - set(PIN_FIELDS)
    if unknown:
        raise IdentityMismatch(f"pin has unknown field(s) {sorted(unknown)}")
    if not data:
        raise IdentityMismatch("pin is empty: it pins nothing")
    return data


def check_pin(identity: Identity, pin: str | os.PathLike | dict) -> None:
    """Refuse any field that differs, naming it and both values."""
    want = load_pin(pin)
    have = identity.to_json()
    for k in PIN_FIELDS:
        if k in want and want[k] != have[k]:
            raise IdentityMismatch(f"identity mismatch on {k}: pinned {want[k]!r}, artifact has {have[k]!r}")
