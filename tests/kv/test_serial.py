"""muser.kv.serial: the version-1 byte form round-trips numpy and torch planes into caches of
other slot sizes at the same rotation; parsing fails closed naming the field."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
import torch

from muser.errors import KvFormatError, KvLayoutMismatch
from muser.kv import KvCache, geometries
from muser.kv.serial import (
    KIND_NOPE,
    KIND_SWA,
    KvLayout,
    assemble,
    decode_snapshot,
    decode_tile,
    encode_snapshot,
    encode_tiles,
    install_tiles,
)
from muser.kv.torch_backend import TorchBackend

W, H, D, CH = 8, 2, 4, 8  # window, KV heads, head_dim, chunk tokens (small so chunks are many)
KINDS = [True, True, True, False, True, True, True, False]


def make(max_context=64, dtype="f16", backend=None):
    return KvCache(geometries(len(KINDS), KINDS, W, max_context, H, D, dtype), backend)


def fill(c, n, seed=0):
    rng = np.random.default_rng(seed)
    for pos in range(n):
        for layer in range(c.n_layers):
            k = rng.standard_normal((1, H * D)).astype(np.float32)
            c.append_batch(layer, pos, k if c.backend.name == "numpy" else torch.from_numpy(k), 
                           -k if c.backend.name == "numpy" else torch.from_numpy(-k))
    return c


def same_planes(a, b):
    def host(x):
        return x.cpu().numpy() if hasattr(x, "cpu") else x

    return all(pa.state() == pb.state() and np.array_equal(host(pa.keys), host(pb.keys))
               and np.array_equal(host(pa.values), host(pb.values)) for pa, pb in zip(a.planes, b.planes))


def layout(dtype="f16"):
    return KvLayout(tuple(KINDS), W, H, D, dtype, CH)


@pytest.mark.parametrize("n", [1, W - 1, W, W + 1, CH, CH + 1, 3 * W + 5, 40])
@pytest.mark.parametrize("dtype", ["f16", "f32"])
def test_round_trip_into_other_slot_sizes(n, dtype):
    src = fill(make(max_context=64, dtype=dtype), n)
    lay = layout(dtype)
    assert KvLayout.of_planes(src.layouts, CH) == lay
    blobs = encode_tiles(src.snapshot(tokens=range(n)), lay)
    n_chunks = -(-n // CH)
    assert len(blobs) == n_chunks + 1
    tiles = [decode_tile(b, lay) for b in blobs]
    assert [t.kind for t in tiles] == [KIND_NOPE] * n_chunks + [KIND_SWA]
    assert tiles[-1].start == n - min(n, W) and tiles[-1].rows == min(n, W)  # explicit origin
    assert sum(t.nbytes for t in tiles) == sum(lay.tile_bytes(t.kind, t.rows) for t in tiles)
    snap = assemble(tiles, lay, tokens=range(n))
    for max_context in (n, 41, 64):  # any slot size that fits n tokens
        dst = make(max_context=max_context, dtype=dtype)
        dst.restore(snap)
        ref = fill(make(max_context=max_context, dtype=dtype), n)
        assert same_planes(dst, ref)  # rows and rotation of a sequential build (book 15.6)
    whole = decode_snapshot(encode_snapshot(src.snapshot(tokens=range(n)), lay), lay)
    assert whole.tokens == tuple(range(n)) and whole.n_tokens == n
    dst = make(max_context=64, dtype=dtype)
    dst.restore(whole)
    assert same_planes(dst, src)


def test_payload_bytes_match_the_state_formula():
    n = 37
    lay = layout()
    tiles = [decode_tile(b, lay) for b in encode_tiles(fill(make(), n).snapshot(), lay)]
    payload = sum(2 * len(t.layers) * t.rows * lay.row_bytes for t in tiles)
    assert payload == lay.state_bytes(n) == (6 * W + 2 * n) * 2 * H * D * 2


def test_torch_planes_both_ways():
    n = 3 * W + 2
    lay = layout()
    tsrc = fill(make(backend=TorchBackend("cpu")), n)
    nsrc = fill(make(), n)
    tb = encode_tiles(tsrc.snapshot(), lay)
    assert tb == encode_tiles(nsrc.snapshot(), lay)  # same bytes from either backend
    snap = assemble([decode_tile(bytearray(b), lay) for b in tb], lay, n_tokens=n)
    tdst = make(max_context=40, backend=TorchBackend("cpu"))
    tdst.restore(snap)
    assert same_planes(tdst, fill(make(max_context=40), n))


def test_truncation_and_bit_flips_fail_closed():
    lay = layout()
    blob = encode_tiles(fill(make(), 11).snapshot(), lay)[0]
    for cut in range(len(blob)):
        with pytest.raises(KvFormatError) as e:
            decode_tile(blob[:cut], lay)
        assert e.value.field == "length"
    for i in range(len(blob)):
        for bit in (0, 7):
            bad = bytearray(blob)
            bad[i] ^= 1 << bit
            with pytest.raises(KvFormatError):
                decode_tile(bad, lay)
    with pytest.raises(KvFormatError, match="field length"):
        decode_tile(blob + b"\0", lay)


def reseal(blob: bytes, offset: int, fmt: str, value) -> bytes:
    """A well-formed tile with one header field changed (digest recomputed)."""
    b = bytearray(blob[:-32])
    struct.pack_into(fmt, b, offset, value)
    return bytes(b) + hashlib.sha256(b).digest()


def test_version_layout_dtype_shape_refused_by_name():
    lay = layout()
    nope, swa = encode_tiles(fill(make(), CH + 3).snapshot(), lay)[0], encode_tiles(fill(make(), 5).snapshot(), lay)[-1]
    cases = [
        (reseal(nope, 8, "<H", 2), KvFormatError, "version"),
        (reseal(nope, 0, "<8s", b"NOTKVTL\0"), KvFormatError, "magic"),
        (reseal(nope, 10, "<B", 9), KvFormatError, "kind"),
        (reseal(nope, 11, "<B", 2), KvLayoutMismatch, "dtype"),
        (reseal(nope, 14, "<H", 4), KvLayoutMismatch, "n_kv_heads"),
        (reseal(nope, 16, "<H", 8), KvLayoutMismatch, "head_dim"),
        (reseal(nope, 24, "<I", 16), KvLayoutMismatch, "chunk_tokens"),
        (reseal(swa, 20, "<I", 16), KvLayoutMismatch, "window"),
        (reseal(nope, 64, "<H", 2), KvLayoutMismatch, "layers"),
        (reseal(nope, 28, "<I", 7), KvFormatError, "payload_bytes"),
        (reseal(nope, 40, "<Q", 3), KvFormatError, "rows"),
        (reseal(reseal(nope, 32, "<Q", 3), 40, "<Q", 11), KvFormatError, "start"),
        (reseal(nope, 18, "<H", 1), KvFormatError, "reserved"),
    ]
    for blob, err, field in cases:
        with pytest.raises(err) as e:
            decode_tile(blob, lay)
        assert e.value.field == field, (field, str(e.value))
        assert field in str(e.value)
    with pytest.raises(KvLayoutMismatch, match="dtype"):
        decode_tile(encode_tiles(fill(make(dtype="f32"), 3).snapshot(), layout("f32"))[0], lay)
    with pytest.raises(KvFormatError, match="expected"):
        decode_tile(nope, lay, kind=KIND_SWA)


def test_assemble_refuses_gaps_and_wrong_tails():
    lay = layout()
    tiles = [decode_tile(b, lay) for b in encode_tiles(fill(make(), 3 * CH).snapshot(), lay)]
    with pytest.raises(KvFormatError, match="expected"):
        assemble([tiles[0], tiles[2], tiles[3]], lay, n_tokens=3 * CH)
    with pytest.raises(KvFormatError, match="cover"):
        assemble(tiles[:2] + [tiles[3]], lay, n_tokens=3 * CH)
    other = decode_tile(encode_tiles(fill(make(), 2 * CH).snapshot(), lay)[-1], lay)
    with pytest.raises(KvFormatError, match="swa tile"):
        assemble(tiles[:3] + [other], lay, n_tokens=3 * CH)
    # a prefix: the first two chunks and the tail taken at 2*CH
    snap = assemble(tiles[:2] + [other], lay, n_tokens=2 * CH)
    dst = make()
    dst.restore(snap)
    assert same_planes(dst, fill(make(), 2 * CH))
    blob = bytearray(encode_snapshot(fill(make(), 5).snapshot(), lay))
    blob[-40] ^= 1
    with pytest.raises(KvFormatError, match="sha256"):
        decode_snapshot(blob, lay)


@pytest.mark.parametrize("n", [1, W - 1, W + 1, CH + 1, 3 * W + 5, 40])
@pytest.mark.parametrize("backend", [None, TorchBackend("cpu")], ids=["numpy", "torch"])
def test_install_tiles_is_restore_of_assemble(n, backend):
    lay = layout()
    tiles = [decode_tile(b, lay) for b in encode_tiles(fill(make(), n).snapshot(), lay)]
    for max_context in (n, 41, 64):
        dst = make(max_context=max_context, backend=backend)
        install_tiles(dst, tiles, lay, n)  # tile by tile, no assembled planes
        ref = make(max_context=max_context, backend=backend)
        ref.restore(assemble(tiles, lay, n_tokens=n))
        assert same_planes(dst, ref) and same_planes(dst, fill(make(max_context=max_context, backend=backend), n))


def test_install_tiles_refuses_gaps_and_leaves_the_live_planes():
    lay = layout()
    tiles = [decode_tile(b, lay) for b in encode_tiles(fill(make(), 3 * CH).snapshot(), lay)]
    live = fill(make(), 5, seed=7)
    before = fill(make(), 5, seed=7)
    with pytest.raises(KvFormatError, match="expected"):
        install_tiles(live, [tiles[0], tiles[2], tiles[3]], lay, 3 * CH)
    with pytest.raises(KvFormatError, match="swa tile"):
        install_tiles(live, tiles[:3], lay, 3 * CH)
    assert same_planes(live, before)
