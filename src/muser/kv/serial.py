"""The byte form of KV state, version 1 (little-endian; every byte in docs/kvpack.md).

    from muser.kv.serial import KvLayout, encode_tiles, decode_tile, assemble, encode_snapshot
    layout = KvLayout.of_cache(cache)                 # layout keys; no slot size in them
    blobs = encode_tiles(cache.snapshot(tokens=ids))  # NoPE chunk tiles, then the SWA tail tile
    tiles = [decode_tile(b, layout) for b in blobs]   # strict: KvFormatError / KvLayoutMismatch
    other.restore(assemble(tiles, layout, ids))       # any cache with the same layouts that fits
    install_tiles(other, tiles, layout, len(ids))     # the same, tile by tile (no assembled copy)

Two tile kinds (book 9.7, 14.6, 15.6):
- NOPE: the full-attention layers' K and V rows of one CHUNK_TOKENS-token chunk. NoPE rows carry
  no position, so a tile is valid wherever its chunk lands (relocate = copy).
- SWA: the sliding layers' logical tail after n_tokens tokens: rows [n - min(n, W), n) with that
  explicit origin. Restore puts row `origin` at slot origin % capacity, the rotation a sequential
  build holds, because physical scan order is numerically observable (book 15.6).

Every tile ends in the SHA-256 of its bytes; parsing checks magic, version, every count against
the layout and the byte length, reserved fields, and the digest, before building any array.
Rows are numpy views of the input buffer (pass a bytearray to get writable arrays).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import KvFormatError, KvLayoutMismatch
from .cache import KvSnapshot, PlaneSnapshot
from .plane import PlaneLayout

FORMAT_VERSION = 1
CHUNK_TOKENS = 512  # tile granularity (book 9.7: 512-token NoPE tiles)
TILE_MAGIC = b"MUSKVTL\x00"
SNAP_MAGIC = b"MUSKVSN\x00"
KIND_NOPE, KIND_SWA = 1, 2
KIND_NAMES = {KIND_NOPE: "nope", KIND_SWA: "swa"}
DTYPE_CODES = {"f16": 1, "f32": 2}
_LE = {"f16": np.dtype("<f2"), "f32": np.dtype("<f4")}
DIGEST = 32

# magic, version, kind, dtype, n_layers, n_kv_heads, head_dim, reserved16, window, chunk_tokens,
# rows, start, n_tokens, payload_bytes, reserved64
_TILE = struct.Struct("<8sHBBHHHHIIIQQQQ")
# magic, version, reserved16, n_tiles, n_tokens, n_ids, dtype, reserved8, n_layers, n_kv_heads,
# head_dim, window, chunk_tokens, reserved64
_SNAP = struct.Struct("<8sHHIQQBBHHHIIQ")
assert _TILE.size == 64 and _SNAP.size == 56


def _pad8(n: int) -> int:
    return (n + 7) & ~7


@dataclass(frozen=True)
class KvLayout:
    """Layout keys of a whole cache: layer kinds, window, KV heads, head_dim, KV type, chunk size.
    Two caches whose layouts are equal exchange tiles, whatever their max_context."""

    sliding: tuple[bool, ...]  # per layer: SWA ring (RoPE) vs NoPE plane
    window: int
    n_kv_heads: int
    head_dim: int
    dtype: str
    chunk_tokens: int = CHUNK_TOKENS

    @classmethod
    def of_planes(cls, layouts: Sequence[PlaneLayout], chunk_tokens: int = CHUNK_TOKENS) -> KvLayout:
        ls = tuple(layouts)
        if not ls:
            raise KvLayoutMismatch("a KV layout needs at least one layer")
        first = ls[0]
        windows = {p.window for p in ls if p.sliding}
        if len(windows) > 1:
            raise KvLayoutMismatch(f"sliding layers disagree on the window: {sorted(windows)}")
        for i, p in enumerate(ls):
            if p.layer != i or (p.n_kv_heads, p.head_dim, p.dtype) != (first.n_kv_heads, first.head_dim, first.dtype):
                raise KvLayoutMismatch(f"layer {i}: layout {p} does not share layer 0's heads/head_dim/dtype")
        if chunk_tokens < 1:
            raise KvLayoutMismatch(f"chunk_tokens must be >= 1, got {chunk_tokens}", field="chunk_tokens")
        return cls(tuple(p.sliding for p in ls), windows.pop() if windows else 0, first.n_kv_heads,
                   first.head_dim, first.dtype, chunk_tokens)

    @classmethod
    def of_cache(cls, cache: Any, chunk_tokens: int = CHUNK_TOKENS) -> KvLayout:
        return cls.of_planes(cache.layouts, chunk_tokens)

    @classmethod
    def of_config(cls, config: Any, dtype: str) -> KvLayout:
        return cls(tuple(bool(s) for s in config.swa_pattern), int(config.sliding_window),
                   int(config.n_kv_heads), int(config.head_dim), dtype)

    def planes(self) -> tuple[PlaneLayout, ...]:
        return tuple(PlaneLayout(i, s, self.window if s else 0, self.n_kv_heads, self.head_dim, self.dtype)
                     for i, s in enumerate(self.sliding))

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, s in enumerate(self.sliding) if not s)

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i, s in enumerate(self.sliding) if s)

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def row_bytes(self) -> int:
        """Bytes of one K (or V) row of one layer."""
        return self.kv_dim * _LE[self.dtype].itemsize

    def tile_bytes(self, kind: int, rows: int) -> int:
        layers = self.full_layers if kind == KIND_NOPE else self.sliding_layers
        return _TILE.size + _pad8(2 * len(layers)) + 2 * len(layers) * rows * self.row_bytes + DIGEST

    def state_bytes(self, n_tokens: int) -> int:
        """K/V payload of n_tokens tokens: (n_swa·min(n, W) + n_full·n) · 2 rows (MuseConfig.kv_bytes)."""
        rows = len(self.sliding_layers) * min(n_tokens, self.window) + len(self.full_layers) * n_tokens
        return 2 * rows * self.row_bytes

    def to_json(self) -> dict:
        return {"sliding": [int(s) for s in self.sliding], "window": self.window, "n_kv_heads": self.n_kv_heads,
                "head_dim": self.head_dim, "dtype": self.dtype, "chunk_tokens": self.chunk_tokens,
                "format_version": FORMAT_VERSION}

    @classmethod
    def from_json(cls, d: Any) -> KvLayout:
        """The layout a manifest records (to_json), every key checked."""
        try:
            if d["format_version"] != FORMAT_VERSION:
                raise KvFormatError(f"layout format_version {d['format_version']!r} is not {FORMAT_VERSION}",
                                    field="format_version")
            sliding = tuple(bool(x) for x in d["sliding"] if x in (0, 1))
            if len(sliding) != len(d["sliding"]) or d["dtype"] not in DTYPE_CODES:
                raise ValueError
            ints = [int(d[k]) for k in ("window", "n_kv_heads", "head_dim", "chunk_tokens")]
        except (KeyError, TypeError, ValueError):
            raise KvFormatError(f"layout record {d!r} is malformed", field="layout") from None
        return cls(sliding, ints[0], ints[1], ints[2], d["dtype"], ints[3])

    def check_equal(self, other: KvLayout, what: str) -> None:
        """Refuse `other` (from `what`) naming the first differing key and both values."""
        for key in ("dtype", "sliding", "window", "n_kv_heads", "head_dim", "chunk_tokens"):
            a, b = getattr(self, key), getattr(other, key)
            if a != b:
                raise KvLayoutMismatch(f"{what}: layout key {key} is {b!r}, this cache has {a!r}", field=key)


@dataclass(frozen=True)
class Tile:
    """A parsed tile: rows [start, start + rows) of each of `layers` (token-major [rows, kv_dim])."""

    kind: int
    start: int
    rows: int
    n_tokens: int
    layers: tuple[int, ...]
    keys: tuple[np.ndarray, ...]
    values: tuple[np.ndarray, ...]
    sha256: str
    nbytes: int
    payload: np.ndarray  # [2 x layers, rows, kv_dim]: K, V of each layer in turn (keys/values are views of it)

    @property
    def kind_name(self) -> str:
        return KIND_NAMES[self.kind]



def _host(rows: Any, dtype: str) -> np.ndarray:
    """Host little-endian array of token-major rows (numpy, or a torch tensor on any device)."""
    if hasattr(rows, "detach"):  # torch: one device-to-host copy
        rows = rows.detach().to("cpu").numpy()
    a = np.asarray(rows)
    if a.dtype.kind != "f" or a.dtype.itemsize != _LE[dtype].itemsize:
        raise KvLayoutMismatch(f"rows of dtype {a.dtype} in a {dtype} KV state", field="dtype")
    return np.ascontiguousarray(a, dtype=_LE[dtype])


def encode_tile(layout: KvLayout, kind: int, start: int, n_tokens: int, keys: Sequence[Any],
                values: Sequence[Any]) -> bytes:
    """One tile from per-layer token-major rows [n_tokens - start, kv_dim] (numpy or torch) of
    the layout's full layers (KIND_NOPE) or sliding layers (KIND_SWA), in layer order."""
    layers = layout.full_layers if kind == KIND_NOPE else layout.sliding_layers
    rows = n_tokens - start
    if len(keys) != len(layers) or len(values) != len(layers):
        raise KvLayoutMismatch(f"{len(keys)} key / {len(values)} value row sets for {len(layers)} layers",
                               field="layers")
    payload = 2 * len(layers) * rows * layout.row_bytes
    head = _TILE.pack(TILE_MAGIC, FORMAT_VERSION, kind, DTYPE_CODES[layout.dtype], len(layers),
                      layout.n_kv_heads, layout.head_dim, 0, layout.window if kind == KIND_SWA else 0,
                      layout.chunk_tokens, rows, start, n_tokens, payload, 0)
    idx = struct.pack(f"<{len(layers)}H", *layers).ljust(_pad8(2 * len(layers)), b"\0")
    parts = [head, idx]
    for k, v in zip(keys, values):
        for a in (_host(k, layout.dtype), _host(v, layout.dtype)):
            if a.shape != (rows, layout.kv_dim):
                raise KvLayoutMismatch(f"tile rows have shape {list(a.shape)}, expected {[rows, layout.kv_dim]}",
                                       field="rows")
            parts.append(a.tobytes())
    body = b"".join(parts)
    return body + hashlib.sha256(body).digest()


def _check_snapshot(snap: KvSnapshot, layout: KvLayout) -> None:
    layout.check_equal(KvLayout.of_planes(snap.layouts, layout.chunk_tokens), "snapshot")


def nope_tile(snap: KvSnapshot, chunk: int, layout: KvLayout | None = None) -> bytes:
    """The NOPE tile of chunk `chunk`: rows [c·512, min((c+1)·512, n)) of every full layer."""
    layout = layout or KvLayout.of_planes(snap.layouts)
    _check_snapshot(snap, layout)
    a = chunk * layout.chunk_tokens
    b = min(a + layout.chunk_tokens, snap.n_tokens)
    if chunk < 0 or a >= b:
        raise KvFormatError(f"chunk {chunk} holds no rows of a {snap.n_tokens}-token state", field="chunk")
    full = layout.full_layers
    ps = [snap.planes[i] for i in full]
    return encode_tile(layout, KIND_NOPE, a, b, [p.keys[a - p.origin_logical:b - p.origin_logical] for p in ps],
                       [p.values[a - p.origin_logical:b - p.origin_logical] for p in ps])


def swa_tile(snap: KvSnapshot, layout: KvLayout | None = None) -> bytes:
    """The SWA tile: the sliding layers' last min(n, W) rows with their explicit origin."""
    layout = layout or KvLayout.of_planes(snap.layouts)
    _check_snapshot(snap, layout)
    n = snap.n_tokens
    rows = min(n, layout.window)
    origin = n - rows
    sl = layout.sliding_layers
    ps = [snap.planes[i] for i in sl]
    for p in ps:
        if p.origin_logical > origin or p.origin_logical + p.len != n:
            raise KvFormatError(f"layer {p.layer}: snapshot rows [{p.origin_logical}, {p.origin_logical + p.len}) "
                                f"do not hold the tail [{origin}, {n})", field="origin")
    return encode_tile(layout, KIND_SWA, origin, n, [p.keys[origin - p.origin_logical:] for p in ps],
                       [p.values[origin - p.origin_logical:] for p in ps])


def encode_tiles(snap: KvSnapshot, layout: KvLayout | None = None) -> list[bytes]:
    """Every tile of a snapshot: NOPE chunks 0 .. ceil(n/512)-1 in order, then the SWA tile."""
    layout = layout or KvLayout.of_planes(snap.layouts)
    n_chunks = -(-snap.n_tokens // layout.chunk_tokens)
    out = [nope_tile(snap, c, layout) for c in range(n_chunks)] if layout.full_layers else []
    if layout.sliding_layers and snap.n_tokens:
        out.append(swa_tile(snap, layout))
    return out


def _fail(field: str, msg: str) -> KvFormatError:
    return KvFormatError(f"KV tile field {field}: {msg}", field=field)


def decode_tile(data: bytes | bytearray | memoryview, layout: KvLayout, kind: int | None = None) -> Tile:
    """Parse and verify one tile against `layout` (fail closed: KvFormatError for bytes that do
    not parse or verify, KvLayoutMismatch for a well-formed tile of another layout)."""
    buf = memoryview(data).cast("B")
    if len(buf) < _TILE.size + DIGEST:
        raise _fail("length", f"{len(buf)} bytes is shorter than a header and digest ({_TILE.size + DIGEST})")
    (magic, version, k, dcode, n_layers, n_kv, hd, r16, window, chunk, rows, start, n_tokens,
     payload, r64) = _TILE.unpack_from(buf, 0)
    if magic != TILE_MAGIC:
        raise _fail("magic", f"{bytes(magic)!r} is not {TILE_MAGIC!r}")
    if version != FORMAT_VERSION:
        raise _fail("version", f"{version} is not the supported version {FORMAT_VERSION}")
    if k not in KIND_NAMES:
        raise _fail("kind", f"{k} is not one of {sorted(KIND_NAMES)}")
    if kind is not None and k != kind:
        raise _fail("kind", f"{KIND_NAMES[k]} where a {KIND_NAMES[kind]} tile was expected")
    if r16 or r64:
        raise _fail("reserved", f"reserved fields must be zero, got {r16}, {r64}")
    dtypes = {v: n for n, v in DTYPE_CODES.items()}
    if dcode not in dtypes:
        raise _fail("dtype", f"code {dcode} is not one of {sorted(dtypes)}")
    idx_len = _pad8(2 * n_layers)
    want_len = _TILE.size + idx_len + payload + DIGEST
    if len(buf) != want_len:
        raise _fail("length", f"{len(buf)} bytes, the header describes {want_len} (truncated or padded)")
    body = buf[: len(buf) - DIGEST]
    digest = hashlib.sha256(body).digest()
    if digest != bytes(buf[len(buf) - DIGEST:]):
        raise _fail("sha256", f"digest {bytes(buf[len(buf) - DIGEST:]).hex()[:16]}... does not match the "
                              f"bytes ({digest.hex()[:16]}...)")
    # Well-formed and intact: now the layout keys, each by name.
    got = {"dtype": dtypes[dcode], "n_kv_heads": n_kv, "head_dim": hd, "chunk_tokens": chunk}
    for key, val in got.items():
        if getattr(layout, key) != val:
            raise KvLayoutMismatch(f"KV tile layout key {key} is {val!r}, this cache has {getattr(layout, key)!r}",
                                   field=key)
    layers = struct.unpack_from(f"<{n_layers}H", buf, _TILE.size)
    if bytes(buf[_TILE.size + 2 * n_layers:_TILE.size + idx_len]).strip(b"\0"):
        raise _fail("reserved", "layer index padding must be zero")
    want_layers = layout.full_layers if k == KIND_NOPE else layout.sliding_layers
    if layers != want_layers:
        raise KvLayoutMismatch(f"KV tile field layers: a {KIND_NAMES[k]} tile of layers {list(layers)}, this "
                               f"cache's {KIND_NAMES[k]} layers are {list(want_layers)}", field="layers")
    if k == KIND_SWA and window != layout.window:
        raise KvLayoutMismatch(f"KV tile layout key window is {window}, this cache has {layout.window}",
                               field="window")
    if k == KIND_NOPE and window != 0:
        raise _fail("window", f"a nope tile must carry window 0, got {window}")
    if payload != 2 * n_layers * rows * layout.row_bytes:
        raise _fail("payload_bytes", f"{payload} != 2 x {n_layers} layers x {rows} rows x {layout.row_bytes} B")
    if rows == 0 or n_tokens != start + rows:
        raise _fail("rows", f"{rows} rows from {start} do not end at n_tokens {n_tokens}")
    if k == KIND_NOPE and (start % chunk or rows > chunk):
        raise _fail("start", f"a nope tile starts at {start} with {rows} rows: not one {chunk}-token chunk")
    if k == KIND_SWA and rows != min(n_tokens, window):
        raise _fail("rows", f"a swa tail of {n_tokens} tokens holds min(n, {window}) rows, not {rows}")
    dt = _LE[layout.dtype]
    flat = np.frombuffer(buf, dtype=dt, count=2 * n_layers * rows * layout.kv_dim, offset=_TILE.size + idx_len)
    payload = flat.reshape(2 * n_layers, rows, layout.kv_dim)  # K0, V0, K1, V1, ...
    return Tile(k, start, rows, n_tokens, layers, tuple(payload[0::2]), tuple(payload[1::2]), digest.hex(), len(buf),
                payload)


def cover(tiles: Sequence[Tile], layout: KvLayout, n_tokens: int) -> tuple[list[Tile], Tile | None]:
    """NOPE chunk tiles covering [0, n) in order and the one SWA tile at n; refuses gaps,
    overlaps, a tail of another length, or missing kinds."""
    nope = sorted((t for t in tiles if t.kind == KIND_NOPE), key=lambda t: t.start)
    swa = [t for t in tiles if t.kind == KIND_SWA]
    pos = 0
    for t in nope:
        if t.start != pos:
            raise KvFormatError(f"nope tiles: chunk at {t.start} where position {pos} was expected", field="start")
        pos = t.n_tokens
    if layout.full_layers and pos != n_tokens:
        raise KvFormatError(f"nope tiles cover [0, {pos}), the state has {n_tokens} tokens", field="n_tokens")
    if layout.sliding_layers and n_tokens and (len(swa) != 1 or swa[0].n_tokens != n_tokens):
        raise KvFormatError(f"need one swa tile at {n_tokens} tokens, got {[t.n_tokens for t in swa]}",
                            field="n_tokens")
    return nope, (swa[0] if swa else None)


def assemble(tiles: Sequence[Tile], layout: KvLayout, tokens: Sequence[int] | None = None,
             n_tokens: int | None = None) -> KvSnapshot:
    """A KvSnapshot from NOPE chunk tiles covering [0, n) in order and the SWA tile at n.
    Refuses gaps, overlaps, a tail of another length, or missing kinds."""
    if n_tokens is None:
        if tokens is None:
            raise KvFormatError("assemble needs tokens or n_tokens", field="n_tokens")
        n_tokens = len(tokens)
    nope, swa_tile = cover(tiles, layout, n_tokens)
    swa = [swa_tile] if swa_tile is not None else []
    planes = []
    for pl in layout.planes():
        if pl.sliding:
            t = swa[0] if swa else None
            j = t.layers.index(pl.layer) if t else 0
            k = t.keys[j] if t else np.zeros((0, layout.kv_dim), _LE[layout.dtype])
            v = t.values[j] if t else k
            planes.append(PlaneSnapshot(pl, n_tokens - len(k), k, v))
        else:
            j = nope[0].layers.index(pl.layer) if nope else 0
            ks = [t.keys[j] for t in nope]
            vs = [t.values[j] for t in nope]
            k = ks[0] if len(ks) == 1 else (np.concatenate(ks) if ks else np.zeros((0, layout.kv_dim), _LE[layout.dtype]))
            v = vs[0] if len(vs) == 1 else (np.concatenate(vs) if vs else k)
            planes.append(PlaneSnapshot(pl, 0, k, v))
    return KvSnapshot(n_tokens, tuple(planes), None if tokens is None else tuple(int(t) for t in tokens))


def install_tile(inst: Any, tile: Tile) -> None:
    """Put one verified tile's rows into a DetachedInstall: a NOPE chunk's rows as they are, the
    SWA tail's only from where each ring's live window starts (rows before it are not needed).
    The payload reaches the planes' device in one copy (inst.stage), and every layer's K and V
    are put from views of it: on CUDA one host-to-device transfer per tile, not four per layer."""
    rows = inst.stage(tile.payload)  # [2 x layers, rows, kv_dim]
    if tile.kind == KIND_NOPE:
        for j, layer in enumerate(tile.layers):
            inst.put(layer, tile.start, rows[2 * j], rows[2 * j + 1])  # [rows, kv_dim] views
        return
    origin = tile.start  # the tile's explicit origin (book 15.6)
    for j, layer in enumerate(tile.layers):
        a, _ = inst.expected(layer)
        if a < inst.n_tokens:
            inst.put(layer, a, rows[2 * j][a - origin:], rows[2 * j + 1][a - origin:])


def install_tiles(target: Any, tiles: Sequence[Tile], layout: KvLayout, n_tokens: int) -> None:
    """Restore `tiles` (the state after n_tokens tokens) into `target` (a KvCache or a session:
    anything with begin_install/commit) tile by tile: each tile's rows go from the entry's bytes
    straight into detached planes, swapped in whole at the end (book 10.7). Same result as
    target.restore(assemble(...)) without the assembled copy of every NoPE plane on the host."""
    nope, swa = cover(tiles, layout, n_tokens)
    inst = target.begin_install(n_tokens)
    for t in nope + ([swa] if swa is not None else []):
        install_tile(inst, t)
    target.commit(inst)


def encode_snapshot(snap: KvSnapshot, layout: KvLayout | None = None) -> bytes:
    """One self-contained blob: header, token ids (u32, if the snapshot carries them), a tile
    table (length u64 + SHA-256 each), the tiles, and the SHA-256 of all that."""
    layout = layout or KvLayout.of_planes(snap.layouts)
    tiles = encode_tiles(snap, layout)
    ids = snap.tokens or ()
    head = _SNAP.pack(SNAP_MAGIC, FORMAT_VERSION, 0, len(tiles), snap.n_tokens, len(ids),
                      DTYPE_CODES[layout.dtype], 0, len(layout.sliding), layout.n_kv_heads, layout.head_dim,
                      layout.window, layout.chunk_tokens, 0)
    kinds = bytes(int(s) for s in layout.sliding).ljust(_pad8(len(layout.sliding)), b"\0")
    id_bytes = np.asarray(ids, dtype="<u4").tobytes().ljust(_pad8(4 * len(ids)), b"\0")
    table = b"".join(struct.pack("<Q", len(t)) + t[-DIGEST:] for t in tiles)  # each tile's own digest
    body = b"".join([head, kinds, id_bytes, table, *tiles])
    return body + hashlib.sha256(body).digest()


def decode_snapshot(data: bytes | bytearray | memoryview, layout: KvLayout) -> KvSnapshot:
    """Parse and verify an encode_snapshot blob against `layout` (fail closed, field named)."""
    buf = memoryview(data).cast("B")
    if len(buf) < _SNAP.size + DIGEST:
        raise KvFormatError(f"KV snapshot field length: {len(buf)} bytes is shorter than a header", field="length")
    (magic, version, r16, n_tiles, n_tokens, n_ids, dcode, r8, n_layers, n_kv, hd, window, chunk,
     r32) = _SNAP.unpack_from(buf, 0)
    if magic != SNAP_MAGIC:
        raise KvFormatError(f"KV snapshot field magic: {bytes(magic)!r} is not {SNAP_MAGIC!r}", field="magic")
    if version != FORMAT_VERSION:
        raise KvFormatError(f"KV snapshot field version: {version} is not {FORMAT_VERSION}", field="version")
    if r16 or r8 or r32:
        raise KvFormatError("KV snapshot field reserved: must be zero", field="reserved")
    if n_ids not in (0, n_tokens):
        raise KvFormatError(f"KV snapshot field n_ids: {n_ids} ids for {n_tokens} tokens", field="n_ids")
    off = _SNAP.size
    fixed = off + _pad8(n_layers) + _pad8(4 * n_ids) + 40 * n_tiles + DIGEST
    if fixed > len(buf):
        raise KvFormatError(f"KV snapshot field length: {len(buf)} bytes, the header needs {fixed} at least",
                            field="length")
    body = buf[: len(buf) - DIGEST]
    if hashlib.sha256(body).digest() != bytes(buf[len(buf) - DIGEST:]):
        raise KvFormatError("KV snapshot field sha256: the digest does not match the bytes", field="sha256")
    kinds = tuple(bool(b) for b in bytes(buf[off:off + n_layers]))
    if any(b > 1 for b in bytes(buf[off:off + n_layers])):
        raise KvFormatError("KV snapshot field sliding: layer kinds must be 0 or 1", field="sliding")
    dtypes = {v: n for n, v in DTYPE_CODES.items()}
    if dcode not in dtypes:
        raise KvFormatError(f"KV snapshot field dtype: code {dcode} is unknown", field="dtype")
    layout.check_equal(KvLayout(kinds, window, n_kv, hd, dtypes[dcode], chunk), "KV snapshot")
    off += _pad8(n_layers)
    ids = np.frombuffer(buf, dtype="<u4", count=n_ids, offset=off)
    off += _pad8(4 * n_ids)
    table = [struct.unpack_from("<Q32s", buf, off + 40 * i) for i in range(n_tiles)]
    off += 40 * n_tiles
    if off + sum(n for n, _ in table) != len(body):
        raise KvFormatError("KV snapshot field tile_table: tile lengths do not add up to the blob", field="tile_table")
    tiles = []
    for i, (n, sha) in enumerate(table):
        t = decode_tile(buf[off:off + n], layout)
        if bytes.fromhex(t.sha256) != sha:
            raise KvFormatError(f"KV snapshot field tile_table: tile {i} digest differs from the table",
                                field="tile_table")
        tiles.append(t)
        off += n
    return assemble(tiles, layout, [int(x) for x in ids] if n_ids else None, n_tokens)


__all__ = [
    "CHUNK_TOKENS",
    "FORMAT_VERSION",
    "KIND_NOPE",
    "KIND_SWA",
    "KvLayout",
    "Tile",
    "assemble",
    "decode_snapshot",
    "decode_tile",
    "encode_snapshot",
    "encode_tile",
    "encode_tiles",
    "install_tile",
    "install_tiles",
    "nope_tile",
    "swa_tile",
]
