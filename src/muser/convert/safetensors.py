"""A strict, memory-mapped safetensors reader: an 8-byte little-endian header length, a JSON
header {name: {dtype, shape, data_offsets}, "__metadata__": {...}}, then the data. Tensors are
read one at a time (zero-copy views of the map), so a conversion holds one tensor at a time.

Fails closed (FormatError naming the file and the entry): a header past the end or over 100 MB,
malformed JSON, an unknown dtype, offsets that do not match the shape, run past the data or
overlap another tensor."""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import FormatError

MAX_HEADER = 100 << 20
DTYPES = {"F32": (np.float32, 4), "F16": (np.float16, 2), "BF16": (np.uint16, 2)}  # BF16 as raw bits


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute file offset
    nbytes: int


class SafetensorsFile:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            size = self.path.stat().st_size
            if size < 8:
                raise FormatError(f"{self.path}: {size} bytes is too short for a safetensors file")
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        (n,) = struct.unpack("<Q", self._mm[:8])
        if n > MAX_HEADER or 8 + n > size:
            raise FormatError(f"{self.path}: header length {n} runs past the file ({size} bytes) or over {MAX_HEADER}")
        try:
            header = json.loads(bytes(self._mm[8 : 8 + n]))
        except ValueError as e:
            raise FormatError(f"{self.path}: header is not valid JSON: {e}") from None
        if not isinstance(header, dict):
            raise FormatError(f"{self.path}: header is not a JSON object")
        self.metadata = header.pop("__metadata__", None) or {}
        base, data_len = 8 + n, size - 8 - n
        self.entries: dict[str, Entry] = {}
        spans = []
        for name, e in sorted(header.items()):  # by name, as the pinned converter's SafetensorsLocal
            if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
                raise FormatError(f"{self.path}: tensor {name!r} has a malformed entry {e!r}")
            dt, shape, (a, b) = e["dtype"], tuple(e["shape"]), e["data_offsets"]
            if dt not in DTYPES:
                raise FormatError(f"{self.path}: tensor {name!r} has dtype {dt!r} (expected one of {sorted(DTYPES)})")
            if not all(isinstance(d, int) and d >= 0 for d in shape):
                raise FormatError(f"{self.path}: tensor {name!r} has a bad shape {list(shape)}")
            want = int(np.prod(shape, dtype=np.int64)) * DTYPES[dt][1]
            if not (isinstance(a, int) and isinstance(b, int) and 0 <= a <= b <= data_len and b - a == want):
                raise FormatError(f"{self.path}: tensor {name!r} offsets [{a}, {b}) do not hold {dt} "
                                  f"{list(shape)} ({want} bytes) inside {data_len} bytes of data")
            self.entries[name] = Entry(name, dt, shape, base + a, want)
            spans.append((a, b, name))
        spans.sort()
        for (a0, b0, n0), (a1, b1, n1) in zip(spans, spans[1:]):
            if a1 < b0:
                raise FormatError(f"{self.path}: tensors {n0!r} and {n1!r} overlap")

    def names(self) -> list[str]:
        return list(self.entries)

    def array(self, name: str) -> np.ndarray:
        """The stored values, numpy shape, read-only view (BF16 as uint16 bits)."""
        e = self.entries[name]
        dt = DTYPES[e.dtype][0]
        return np.frombuffer(self._mm, dtype=dt, count=e.nbytes // DTYPES[e.dtype][1], offset=e.start).reshape(e.shape)

    def close(self) -> None:
        self._mm.close()
