"""Strict, memory-mapped GGUF reader.

Everything is validated against the bytes that are actually there *before* anything is
allocated: a count is compared with the bytes left (each element needs at least its minimum
encoded size), a string length with the bytes left, every tensor with the file's extent and with
its neighbours. Tensor data is handed out as zero-copy read-only numpy views of the mapping.

Format facts (GGUF v2/v3, little-endian): magic "GGUF", u32 version, u64 tensor_count,
u64 kv_count, key/value pairs, tensor infos, padding to `general.alignment`, tensor data
(ggml/docs/gguf.md; ggml/src/gguf.cpp).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from ..errors import GGUFError, GGUFLimitError, GGUFTruncated, MissingKey, WrongKeyType
from .types import GgmlType, TypeInfo, type_info

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
_INT64_MAX = (1 << 63) - 1


class ValueType(IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


_SCALAR_FMT = {
    ValueType.UINT8: ("<B", 1, np.uint8),
    ValueType.INT8: ("<b", 1, np.int8),
    ValueType.UINT16: ("<H", 2, np.uint16),
    ValueType.INT16: ("<h", 2, np.int16),
    ValueType.UINT32: ("<I", 4, np.uint32),
    ValueType.INT32: ("<i", 4, np.int32),
    ValueType.FLOAT32: ("<f", 4, np.float32),
    ValueType.BOOL: ("<B", 1, np.uint8),
    ValueType.UINT64: ("<Q", 8, np.uint64),
    ValueType.INT64: ("<q", 8, np.int64),
    ValueType.FLOAT64: ("<d", 8, np.float64),
}
_INT_TYPES = {
    ValueType.UINT8, ValueType.INT8, ValueType.UINT16, ValueType.INT16,
    ValueType.UINT32, ValueType.INT32, ValueType.UINT64, ValueType.INT64,
}
_FLOAT_TYPES = {ValueType.FLOAT32, ValueType.FLOAT64}
# Smallest encoded size of one element of each type (strings: the u64 length prefix).
_MIN_SIZE = {**{t: s for t, (_, s, _) in _SCALAR_FMT.items()}, ValueType.STRING: 8}


@dataclass(frozen=True)
class Field:
    key: str
    vtype: ValueType
    value: Any  # int | float | bool | str | np.ndarray (numeric arrays) | list[str]
    elem_type: ValueType | None = None  # for arrays

    @property
    def type_name(self) -> str:
        if self.vtype == ValueType.ARRAY:
            return f"ARRAY[{self.elem_type.name}]"
        return self.vtype.name


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: ne0 (row length, contiguous) first
    type: TypeInfo
    offset: int  # absolute file offset of the first byte
    nbytes: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def np_shape(self) -> tuple[int, ...]:
        """numpy (row-major) shape: ggml dims reversed, e.g. [n_out, n_in] for a 2-D weight."""
        return tuple(reversed(self.shape))

    @property
    def n_rows(self) -> int:
        return self.n_elements // self.shape[0]

    @property
    def row_bytes(self) -> int:
        return self.type.nbytes(self.shape[0])


class _Cursor:
    """Bounds-checked little-endian reads over the mapped bytes."""

    def __init__(self, buf: memoryview, size: int):
        self.buf, self.size, self.pos = buf, size, 0

    @property
    def left(self) -> int:
        return self.size - self.pos

    def need(self, n: int, what: str) -> None:
        if n > self.left:
            raise GGUFTruncated(
                f"truncated GGUF: {what} needs {n} bytes at offset {self.pos}, only {self.left} left"
            )

    def scalar(self, vt: ValueType, what: str) -> Any:
        fmt, size, _ = _SCALAR_FMT[vt]
        self.need(size, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v

    def u32(self, what: str) -> int:
        return self.scalar(ValueType.UINT32, what)

    def u64(self, what: str) -> int:
        return self.scalar(ValueType.UINT64, what)

    def string(self, what: str) -> str:
        n = self.u64(f"{what} length")
        if n > self.left:
            raise GGUFLimitError(
                f"{what}: string length {n} exceeds the {self.left} bytes left at offset {self.pos}"
            )
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"{what}: invalid UTF-8 at byte {e.start}") from None


class GGUFFile:
    """An open, fully validated GGUF file. Use as a context manager or call close()."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise GGUFError(f"cannot open {str(path)!r}: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            self.size = st.st_size
            self.mtime_ns = st.st_mtime_ns
            if self.size < 24:
                raise GGUFTruncated(f"truncated GGUF: file is {self.size} bytes, header needs 24")
            self._mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        try:
            self._buf = memoryview(self._mm)
            self._parse()
        except BaseException:
            self.close()
            raise

    # -- parsing -------------------------------------------------------------------------------

    def _parse(self) -> None:
        c = _Cursor(self._buf, self.size)
        c.need(4, "magic")
        magic = bytes(self._buf[0:4])
        c.pos = 4
        if magic != GGUF_MAGIC:
            raise GGUFError(f"not a GGUF file: magic {magic!r}, expected b'GGUF'")
        version = c.u32("version")
        if version in (2, 3):
            pass
        elif version & 0xFFFF == 0 and version >> 16:
            raise GGUFError(f"big-endian GGUF (version bytes {version:#010x}) is not supported")
        else:
            raise GGUFError(f"unsupported GGUF version {version} (supported: 2, 3)")
        self.version = version
        n_tensors = c.u64("tensor count")
        n_kv = c.u64("metadata count")
        # A kv pair is at least key length (8) + value type (4) + 1 byte; a tensor info at least
        # name length (8) + n_dims (4) + one dim (8) + type (4) + offset (8).
        if n_kv > c.left // 13:
            raise GGUFLimitError(f"metadata count {n_kv} cannot fit in the {c.left} bytes left")
        if n_tensors > c.left // 32:
            raise GGUFLimitError(f"tensor count {n_tensors} cannot fit in the {c.left} bytes left")

        fields: dict[str, Field] = {}
        for i in range(n_kv):
            key = c.string(f"metadata key #{i}")
            if key in fields:
                raise GGUFError(f"duplicate metadata key {key!r}")
            vt_raw = c.u32(f"value type of {key!r}")
            vt = self._value_type(vt_raw, key)
            if vt == ValueType.ARRAY:
                et_raw = c.u32(f"array element type of {key!r}")
                et = self._value_type(et_raw, key)
                if et == ValueType.ARRAY:
                    raise GGUFError(f"metadata key {key!r}: nested arrays are not supported")
                count = c.u64(f"array count of {key!r}")
                if count > c.left // _MIN_SIZE[et]:
                    raise GGUFLimitError(
                        f"metadata key {key!r}: array count {count} of {et.name} cannot fit in "
                        f"the {c.left} bytes left"
                    )
                value = self._read_array(c, et, count, key)
                fields[key] = Field(key, vt, value, et)
            else:
                fields[key] = Field(key, vt, self._read_value(c, vt, key))
        self.fields = fields

        align_field = fields.get("general.alignment")
        alignment = DEFAULT_ALIGNMENT
        if align_field is not None:
            if align_field.vtype != ValueType.UINT32:
                raise WrongKeyType(
                    f"general.alignment must be UINT32, got {align_field.type_name}"
                )
            alignment = align_field.value
            if alignment == 0 or alignment & (alignment - 1):
                raise GGUFError(f"general.alignment {alignment} is not a power of two")
        self.alignment = alignment

        infos: list[tuple[str, tuple[int, ...], TypeInfo, int]] = []
        seen: set[str] = set()
        for i in range(n_tensors):
            name = c.string(f"tensor #{i} name")
            if name in seen:
                raise GGUFError(f"duplicate tensor name {name!r}")
            seen.add(name)
            n_dims = c.u32(f"n_dims of tensor {name!r}")
            if not 1 <= n_dims <= MAX_DIMS:
                raise GGUFError(f"tensor {name!r}: n_dims {n_dims} outside 1..{MAX_DIMS}")
            dims = tuple(c.u64(f"dim {d} of tensor {name!r}") for d in range(n_dims))
            n = 1
            for d in dims:
                if d == 0:
                    raise GGUFError(f"tensor {name!r}: zero-sized dimension in shape {list(dims)}")
                if d > _INT64_MAX // n:
                    raise GGUFLimitError(
                        f"tensor {name!r}: element count of shape {list(dims)} overflows int64"
                    )
                n *= d
            type_id = c.u32(f"dtype of tensor {name!r}")
            try:
                ti = type_info(type_id)
            except GGUFError:
                raise GGUFError(f"tensor {name!r}: unknown dtype id {type_id}") from None
            if dims[0] % ti.block_elems:
                raise GGUFError(
                    f"tensor {name!r}: row length {dims[0]} is not a multiple of the "
                    f"{ti.name} block of {ti.block_elems}"
                )
            offset = c.u64(f"offset of tensor {name!r}")
            if offset % alignment:
                raise GGUFError(
                    f"tensor {name!r}: offset {offset} is not aligned to {alignment}"
                )
            infos.append((name, dims, ti, offset))

        data_start = -(-c.pos // alignment) * alignment
        if n_tensors and data_start > self.size:
            raise GGUFTruncated(
                f"truncated GGUF: data section would start at {data_start}, file is {self.size} bytes"
            )
        self.data_offset = data_start

        tensors: dict[str, TensorInfo] = {}
        for name, dims, ti, off in infos:
            n = 1
            for d in dims:
                n *= d
            nbytes = ti.nbytes(n)
            start = data_start + off
            if start + nbytes > self.size:
                raise GGUFTruncated(
                    f"tensor {name!r}: bytes [{start}, {start + nbytes}) run past the end of the "
                    f"file ({self.size} bytes)"
                )
            tensors[name] = TensorInfo(name, dims, ti, start, nbytes)
        ordered = sorted(tensors.values(), key=lambda t: t.offset)
        for a, b in zip(ordered, ordered[1:]):
            if b.offset < a.offset + a.nbytes:
                raise GGUFError(
                    f"tensors {a.name!r} and {b.name!r} overlap: [{a.offset}, {a.offset + a.nbytes}) "
                    f"and [{b.offset}, {b.offset + b.nbytes})"
                )
        self.tensors = tensors

    @staticmethod
    def _value_type(raw: int, key: str) -> ValueType:
        try:
            return ValueType(raw)
        except ValueError:
            raise GGUFError(f"metadata key {key!r}: unknown value type {raw}") from None

    def _read_value(self, c: _Cursor, vt: ValueType, key: str) -> Any:
        if vt == ValueType.STRING:
            return c.string(f"value of {key!r}")
        v = c.scalar(vt, f"value of {key!r}")
        if vt == ValueType.BOOL:
            if v > 1:
                raise GGUFError(f"metadata key {key!r}: bool byte {v} is neither 0 nor 1")
            return bool(v)
        return v

    def _read_array(self, c: _Cursor, et: ValueType, count: int, key: str) -> Any:
        if et == ValueType.STRING:
            out: list[str] = []
            for j in range(count):
                out.append(c.string(f"{key!r}[{j}]"))
            return out
        _, size, dt = _SCALAR_FMT[et]
        n = count * size
        c.need(n, f"array {key!r}")
        arr = np.frombuffer(self._mm, dtype=np.dtype(dt).newbyteorder("<"), count=count, offset=c.pos)
        c.pos += n
        if et == ValueType.BOOL:
            if count and int(arr.max()) > 1:
                raise GGUFError(f"metadata key {key!r}: bool array holds a byte other than 0/1")
            return arr.astype(bool)
        return arr

    # -- metadata access -----------------------------------------------------------------------

    def __contains__(self, key: str) -> bool:
        return key in self.fields

    def field(self, key: str) -> Field:
        f = self.fields.get(key)
        if f is None:
            raise MissingKey(f"missing metadata key {key!r}")
        return f

    def get(self, key: str, default: Any = None) -> Any:
        f = self.fields.get(key)
        return default if f is None else f.value

    def get_int(self, key: str) -> int:
        f = self.field(key)
        if f.vtype not in _INT_TYPES:
            raise WrongKeyType(f"metadata key {key!r} must be an integer, got {f.type_name}")
        return int(f.value)

    def get_float(self, key: str) -> float:
        f = self.field(key)
        if f.vtype not in _FLOAT_TYPES:
            raise WrongKeyType(f"metadata key {key!r} must be a float, got {f.type_name}")
        return float(f.value)

    def get_str(self, key: str) -> str:
        f = self.field(key)
        if f.vtype != ValueType.STRING:
            raise WrongKeyType(f"metadata key {key!r} must be a string, got {f.type_name}")
        return f.value

    def get_bool(self, key: str) -> bool:
        f = self.field(key)
        if f.vtype != ValueType.BOOL:
            raise WrongKeyType(f"metadata key {key!r} must be a bool, got {f.type_name}")
        return bool(f.value)

    def get_array(self, key: str, elem: set[ValueType] | ValueType | None = None) -> Any:
        f = self.field(key)
        if f.vtype != ValueType.ARRAY:
            raise WrongKeyType(f"metadata key {key!r} must be an array, got {f.type_name}")
        if elem is not None:
            allowed = {elem} if isinstance(elem, ValueType) else elem
            if f.elem_type not in allowed:
                names = "/".join(sorted(t.name for t in allowed))
                raise WrongKeyType(
                    f"metadata key {key!r} must be an array of {names}, got {f.type_name}"
                )
        return f.value

    @property
    def architecture(self) -> str:
        return self.get_str("general.architecture")

    # -- tensor access -------------------------------------------------------------------------

    def tensor_info(self, name: str) -> TensorInfo:
        t = self.tensors.get(name)
        if t is None:
            from ..errors import ContractError

            raise ContractError(f"missing tensor {name!r}")
        return t

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a zero-copy read-only uint8 view, shaped [n_rows, row_bytes]."""
        t = self.tensor_info(name)
        a = np.frombuffer(self._mm, dtype=np.uint8, count=t.nbytes, offset=t.offset)
        return a.reshape(t.n_rows, t.row_bytes)

    def array(self, name: str) -> np.ndarray:
        """Zero-copy typed view for plain types (F32, F16, F64, I*, BF16 as uint16), numpy shape;
        quantized types come back as raw bytes [n_rows, row_bytes]."""
        t = self.tensor_info(name)
        dt = {
            GgmlType.F32: "<f4", GgmlType.F16: "<f2", GgmlType.F64: "<f8",
            GgmlType.BF16: "<u2", GgmlType.I8: "i1", GgmlType.I16: "<i2",
            GgmlType.I32: "<i4", GgmlType.I64: "<i8", GgmlType.F8_E4M3FN: "u1",
        }.get(t.type.ggml_type)
        if dt is None:
            return self.raw(name)
        a = np.frombuffer(self._mm, dtype=np.dtype(dt), count=t.n_elements, offset=t.offset)
        return a.reshape(t.np_shape)

    def __iter__(self) -> Iterator[TensorInfo]:
        return iter(self.tensors.values())

    # -- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        mm = getattr(self, "_mm", None)
        if mm is None:
            return
        buf = getattr(self, "_buf", None)
        if buf is not None:
            buf.release()
        self._buf = None
        self.fields = getattr(self, "fields", {})
        try:
            mm.close()
        except BufferError:
            # numpy views handed out still reference the map; it is released when they are.
            pass
        self._mm = None

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Open and validate a GGUF file (raises a GGUFError subclass naming the bad value)."""
    return GGUFFile(path)
