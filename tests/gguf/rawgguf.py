"""Hand-built GGUF bytes for malformed-input tests (the gguf package refuses to write most of these)."""

from __future__ import annotations

import struct

U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
_FMT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<B",
        U64: "<Q", I64: "<q", F64: "<d"}


def s(text: str | bytes) -> bytes:
    b = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(b)) + b


def val(vtype: int, value) -> bytes:
    if vtype == STR:
        return s(value)
    return struct.pack(_FMT[vtype], value)


def kv(key: str | bytes, vtype: int, value) -> bytes:
    return s(key) + struct.pack("<I", vtype) + val(vtype, value)


def kv_array(key: str, etype: int, values, count: int | None = None) -> bytes:
    body = b"".join(val(etype, v) for v in values)
    n = len(values) if count is None else count
    return s(key) + struct.pack("<I", ARR) + struct.pack("<I", etype) + struct.pack("<Q", n) + body


def tinfo(name: str, dims: list[int], dtype: int, offset: int) -> bytes:
    return s(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims) + \
        struct.pack("<I", dtype) + struct.pack("<Q", offset)


def header(n_tensors: int, n_kv: int, version: int = 3, magic: bytes = b"GGUF") -> bytes:
    return magic + struct.pack("<I", version) + struct.pack("<Q", n_tensors) + struct.pack("<Q", n_kv)


def gguf(kvs: list[bytes], infos: list[bytes], data: bytes = b"", align: int = 32,
         n_tensors: int | None = None, n_kv: int | None = None) -> bytes:
    head = header(len(infos) if n_tensors is None else n_tensors, len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(infos)
    pad = (-len(body)) % align
    return body + b"\0" * pad + data
