"""Copy a GGUF with edits (metadata set/drop, tensors dropped/replaced/added), via write_gguf."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFValueType

from muser.gguf.reader import ValueType, read_gguf
from muser.gguf.types import GgmlType as G
from muser.gguf.writer import TensorSpec, Typed, write_gguf


def rewrite(src: Path, dst: Path, md_set: dict | None = None, md_drop=(), drop=(),
            replace: dict | None = None, add: dict | None = None) -> Path:
    """replace/add: name -> (data, GgmlType, ggml shape)."""
    replace, add = dict(replace or {}), dict(add or {})
    with read_gguf(src) as f:
        md = {}
        for k, fld in f.fields.items():
            if k in ("general.architecture", "general.alignment") or k in md_drop:
                continue
            if fld.vtype == ValueType.ARRAY:
                v = fld.value.tolist() if isinstance(fld.value, np.ndarray) else list(fld.value)
                md[k] = Typed(v, GGUFValueType(int(fld.vtype)), GGUFValueType(int(fld.elem_type)))
            else:
                md[k] = Typed(fld.value, GGUFValueType(int(fld.vtype)))
        md.update(md_set or {})
        data, specs = {}, []
        for t in f.tensors.values():
            if t.name in drop:
                continue
            if t.name in replace:
                d, gt, shape = replace.pop(t.name)
            else:
                d, gt, shape = np.array(f.raw(t.name)), t.type.ggml_type, t.shape
            data[t.name] = d
            specs.append(TensorSpec(t.name, tuple(shape), G(gt)))
        for name, (d, gt, shape) in {**replace, **add}.items():
            data[name] = d
            specs.append(TensorSpec(name, tuple(shape), G(gt)))
        return write_gguf(dst, f.architecture, md, specs, lambda s: data[s.name])
