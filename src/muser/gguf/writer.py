"""GGUF writing helpers on top of the `gguf` package's GGUFWriter.

Files are written atomically: into a temporary file beside OUT, fsynced, then renamed, so an
interrupted write never leaves a partial OUT. Tensors can be streamed one at a time (the
full-geometry fixture is ~16.75 GB and never sits in memory).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
from gguf import GGUFValueType, GGUFWriter
from gguf.constants import GGMLQuantizationType

from .types import GgmlType, type_info


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # ggml order: ne0 (row length) first
    ggml_type: GgmlType

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return type_info(self.ggml_type).nbytes(n)


def _vtype(value: Any) -> tuple[GGUFValueType, GGUFValueType | None]:
    if isinstance(value, bool):
        return GGUFValueType.BOOL, None
    if isinstance(value, int):
        return GGUFValueType.UINT32 if 0 <= value < 2**32 else GGUFValueType.INT64, None
    if isinstance(value, float):
        return GGUFValueType.FLOAT32, None
    if isinstance(value, str):
        return GGUFValueType.STRING, None
    if isinstance(value, (list, tuple)):
        if not value:
            return GGUFValueType.ARRAY, GGUFValueType.INT32
        return GGUFValueType.ARRAY, _vtype(value[0])[0]
    raise TypeError(f"cannot infer a GGUF value type for {type(value).__name__}")


class Typed:
    """A metadata value with an explicit GGUF type (for wrong-type fixtures and exact widths)."""

    def __init__(self, value: Any, vtype: GGUFValueType, sub_type: GGUFValueType | None = None):
        self.value, self.vtype, self.sub_type = value, vtype, sub_type


def _raw_dtype(t: GgmlType) -> Any:
    # The gguf package knows ggml's ids; Muser's own ids (1000/1001) go through as plain ints.
    try:
        return GGMLQuantizationType(int(t))
    except ValueError:
        return int(t)


def _np_view(data: np.ndarray, spec: TensorSpec) -> np.ndarray:
    """Bytes (or f32/f16 values) of a tensor as the array GGUFWriter should write verbatim."""
    buf = np.ascontiguousarray(data)
    if buf.nbytes != spec.nbytes:
        raise ValueError(
            f"tensor {spec.name!r}: {buf.nbytes} bytes given, {spec.nbytes} expected for "
            f"{spec.ggml_type.name} {list(spec.shape)}"
        )
    return buf.reshape(-1).view(np.uint8)


def write_gguf(
    path: str | os.PathLike,
    arch: str,
    metadata: dict[str, Any],
    specs: Iterable[TensorSpec],
    produce: Callable[[TensorSpec], np.ndarray],
    alignment: int | None = None,
    progress: Callable[[TensorSpec], None] | None = None,
) -> Path:
    """Write a GGUF: `metadata` (key -> python value or Typed), tensors in `specs` order whose
    bytes come from `produce(spec)` one at a time. Atomic (temp file + rename)."""
    path = Path(path)
    specs = list(specs)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent or ".")
    os.close(fd)
    try:
        w = GGUFWriter(tmp, arch)
        if alignment is not None:
            w.add_custom_alignment(alignment)
        for key, value in metadata.items():
            if isinstance(value, Typed):
                w.add_key_value(key, value.value, value.vtype, value.sub_type)
            else:
                vt, st = _vtype(value)
                if isinstance(value, tuple):
                    value = list(value)
                w.add_key_value(key, value, vt, st)
        for s in specs:
            # GGUFWriter wants the numpy shape of the *values*; for byte payloads we hand it an
            # int8 view with the logical shape so it does not re-derive the block geometry.
            w.add_tensor_info(
                s.name, list(reversed(s.shape)), np.dtype(np.int8), s.nbytes, raw_dtype=_raw_dtype(s.ggml_type)
            )
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for s in specs:
            w.write_tensor_data(_np_view(produce(s), s))
            if progress is not None:
                progress(s)
        w.close()
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def write_tensors(
    path: str | os.PathLike,
    arch: str,
    metadata: dict[str, Any],
    tensors: dict[str, tuple[np.ndarray, GgmlType, tuple[int, ...]]],
    alignment: int | None = None,
) -> Path:
    """Convenience: tensors given in memory as name -> (data, ggml_type, ggml_shape)."""
    specs = [TensorSpec(n, tuple(int(d) for d in shp), t) for n, (_, t, shp) in tensors.items()]
    return write_gguf(path, arch, metadata, specs, lambda s: tensors[s.name][0], alignment)
