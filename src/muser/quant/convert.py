"""`muser quantize IN OUT --to FORMAT`: re-encode an F32/F16/BF16 Muse Glimmer GGUF, or write
the F32 copy of any loadable one (`--to f32`).

Every metadata key is copied verbatim with its exact GGUF type (tokenizer, chat template and
identity surfaces untouched) except: `muser.weight_precision` is set to the target,
`muser.activation_precision` is set to "nvfp4" for nvfp4-w4a4 (and dropped otherwise), and
`general.file_type` is set to the llama.cpp ftype describing the output (dropped for Muser's
native NVFP4, which no llama.cpp ftype describes). 1-D tensors (norms) are copied byte for byte.

Targets (2-D weights; book 6.5, 7.3, 7.5):
  q8_0        every weight Q8_0
  q4_k        every weight Q4_K
  q4_k_xl     Figure 6.6 mix (model.synth.q4_k_xl_type): Q4_K bulk, Q6_K attn_v / ffn_down on
              even layers, Q5_K LM head, Q4_K embedding
  nvfp4       projections NVFP4_E2M1 + companions (W4A16); embedding and LM head F16
  nvfp4-w4a4  as nvfp4, plus `.nvfp4_input_scale_inv` on every projection
  nvfp4-ggml  projections ggml NVFP4 (type 40, runs in the pinned llama.cpp); embedding and
              LM head F16
  f32         every 2-D weight dequantized to F32 from any stored type (the values the ggml
              dequantizers produce: exact for Q8_0, whose d * q needs at most 19 significant
              bits); NVFP4 companions are folded into their weight. This is the source the other
              targets need when only a quantized file ships.
The output is written atomically (gguf.writer.write_gguf: temp file + rename).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import FormatError, MuserError
from ..gguf.reader import GGUFFile, ValueType
from ..gguf.types import GgmlType as G
from ..gguf.types import type_info
from ..gguf.writer import TensorSpec, Typed, write_gguf
from .common import F32, f32_to_f16
from .dequant import dequantize_rows
from .nvfp4 import (
    ACTIVATION_PRECISION_KEY,
    COMPANION_SUFFIXES,
    INPUT_SCALE_INV_SUFFIX,
    SCALE2_SUFFIX,
    SCALE_SUFFIX,
    WEIGHT_PRECISION_KEY,
    NVFP4Weight,
    nvfp4_scale2,
    pack_codes,
    quantize_groups,
)
from .quantize import quantize

TARGETS = ("q8_0", "q4_k", "q4_k_xl", "nvfp4", "nvfp4-w4a4", "nvfp4-ggml", "f32")
SOURCE_TYPES = frozenset({G.F32, G.F16, G.BF16})
# llama.h llama_ftype of each ggml output (general.file_type).
FILE_TYPE = {"q8_0": 7, "q4_k": 14, "q4_k_xl": 15, "nvfp4-ggml": 39, "f32": 0}
_ROW_CHUNK_ELEMS = 1 << 22


def target_type(target: str, name: str) -> G:
    """The stored dtype of 2-D weight `name` under `target` (NVFP4_E2M1 for native NVFP4)."""
    if target == "f32":
        return G.F32
    if target == "q8_0":
        return G.Q8_0
    if target == "q4_k":
        return G.Q4_K
    if target == "q4_k_xl":
        from ..model.synth import q4_k_xl_type  # Figure 6.6, one definition

        return q4_k_xl_type(name)
    if name in ("token_embd.weight", "output.weight"):
        return G.F16  # book 7.5: the checkpoint mandates an unquantized F16 LM head (and embedding)
    return G.NVFP4 if target == "nvfp4-ggml" else G.NVFP4_E2M1


@dataclass(frozen=True)
class _Plan:
    name: str
    shape: tuple[int, ...]
    src: G
    dst: G  # F32 for a byte copy of a 1-D tensor


def _metadata(f: GGUFFile, target: str) -> tuple[dict, int | None]:
    md: dict = {}
    for key, fld in f.fields.items():
        if key in ("general.architecture", "general.alignment", "general.file_type",
                   WEIGHT_PRECISION_KEY, ACTIVATION_PRECISION_KEY):
            continue
        val = fld.value
        if fld.vtype == ValueType.ARRAY:
            if len(val) == 0:
                raise FormatError(f"metadata key {key!r} is an empty array, which GGUFWriter cannot copy")
            val = val.tolist() if isinstance(val, np.ndarray) else list(val)
            md[key] = Typed(val, _gv(fld.vtype), _gv(fld.elem_type))
        else:
            md[key] = Typed(val, _gv(fld.vtype))
    if target in FILE_TYPE:
        md["general.file_type"] = Typed(FILE_TYPE[target], _gv(ValueType.UINT32))
    md[WEIGHT_PRECISION_KEY] = Typed("nvfp4" if target == "nvfp4-w4a4" else target, _gv(ValueType.STRING))
    if target == "nvfp4-w4a4":
        md[ACTIVATION_PRECISION_KEY] = Typed("nvfp4", _gv(ValueType.STRING))
    align = f.get("general.alignment")
    return md, (int(align) if align is not None else None)


def _gv(vt: ValueType):
    from gguf import GGUFValueType

    return GGUFValueType(int(vt))


def plan(f: GGUFFile, target: str) -> list[_Plan]:
    """Check everything before any work: source dtypes, block divisibility."""
    if target not in TARGETS:
        raise MuserError(f"unknown target {target!r} (choose from {', '.join(TARGETS)})")
    out: list[_Plan] = []
    for t in f.tensors.values():
        src = t.type.ggml_type
        if target == "f32" and t.name.endswith(COMPANION_SUFFIXES):
            continue  # folded into its NVFP4_E2M1 weight by dequantize_rows
        if src not in SOURCE_TYPES and not (target == "f32" and len(t.shape) == 2):
            raise FormatError(
                f"input tensor {t.name!r} is already {src.name}: muser quantize takes an "
                f"F32/F16/BF16 GGUF (quantizing quantized weights again compounds the error)"
            )
        if len(t.shape) == 1:
            out.append(_Plan(t.name, t.shape, src, src))
            continue
        dst = target_type(target, t.name)
        block = 16 if dst == G.NVFP4_E2M1 else type_info(dst).block_elems
        if t.shape[0] % block:
            raise FormatError(
                f"tensor {t.name!r}: row length {t.shape[0]} is not a multiple of the {dst.name} "
                f"block of {block} (no silent fallback type)"
            )
        out.append(_Plan(t.name, t.shape, src, dst))
    return out


def _row_chunks(n_rows: int, ne0: int):
    step = max(1, _ROW_CHUNK_ELEMS // ne0)
    for r0 in range(0, n_rows, step):
        yield np.arange(r0, min(n_rows, r0 + step))


def _encode(f: GGUFFile, p: _Plan) -> np.ndarray:
    """One tensor of a ggml type, quantized chunk by chunk of rows (bounded memory)."""
    ne0 = p.shape[0]
    n_rows = int(np.prod(p.shape[1:]))
    ti = type_info(p.dst)
    out = np.empty((n_rows, ti.nbytes(ne0)), dtype=np.uint8)
    for rows in _row_chunks(n_rows, ne0):
        vals = dequantize_rows(f, p.name, rows)
        if p.dst == G.F32:
            out[rows] = vals.astype("<f4", copy=False).view(np.uint8).reshape(rows.size, -1)
        elif p.dst == G.F16:
            enc = f32_to_f16(vals)
            if not np.isfinite(enc.view("<f2")).all():
                raise FormatError(f"tensor {p.name!r} overflows F16 (|x| > 65504)")
            out[rows] = enc.view(np.uint8).reshape(rows.size, -1)
        else:
            out[rows] = np.asarray(quantize(vals, p.dst)).view(np.uint8).reshape(rows.size, -1)
    return out


def _encode_nvfp4(f: GGUFFile, p: _Plan, input_scale_inv: float | None) -> NVFP4Weight:
    ne0 = p.shape[0]
    n_rows = p.shape[1]
    amax = F32(0)
    for rows in _row_chunks(n_rows, ne0):  # pass 1: the tensor amax fixes scale2
        amax = max(amax, F32(np.abs(dequantize_rows(f, p.name, rows)).max()))
    s2 = nvfp4_scale2(np.array([amax], dtype=F32))
    packed = np.empty((n_rows, ne0 // 2), dtype=np.uint8)
    scales = np.empty((n_rows, ne0 // 16), dtype=np.uint8)
    for rows in _row_chunks(n_rows, ne0):
        codes, sb = quantize_groups(dequantize_rows(f, p.name, rows), s2)
        packed[rows] = pack_codes(codes)
        scales[rows] = sb
    isi = None if input_scale_inv is None else F32(input_scale_inv)
    return NVFP4Weight(packed, scales, s2, isi)


def convert(src: str | os.PathLike, dst: str | os.PathLike, target: str,
            input_scale_inv: float = 1.0,
            progress: Callable[[str], None] | None = None) -> Path:
    """Quantize `src` into `dst` (atomic). Raises a MuserError before any work on bad input."""
    from ..model.loader import open_model

    src, dst = Path(src), Path(dst)
    if target not in TARGETS:
        raise MuserError(f"unknown target {target!r} (choose from {', '.join(TARGETS)})")
    if target == "nvfp4-w4a4" and not (np.isfinite(input_scale_inv) and input_scale_inv > 0):
        raise MuserError(f"--input-scale-inv must be finite and positive, got {input_scale_inv!r}")
    if dst.exists() and dst.resolve() == src.resolve():
        raise MuserError(f"output {str(dst)!r} is the input file")
    if not dst.parent.resolve().is_dir():
        raise MuserError(f"output directory {str(dst.parent)!r} does not exist")
    m = open_model(src)  # the full contract, fail closed, before any work
    try:
        f = m.gguf
        plans = plan(f, target)
        md, align = _metadata(f, target)
        specs: list[TensorSpec] = []
        for p in plans:
            if p.dst == G.NVFP4_E2M1:
                n_in, n_out = p.shape
                specs += [
                    TensorSpec(p.name, p.shape, G.NVFP4_E2M1),
                    TensorSpec(p.name + SCALE_SUFFIX, (n_in // 16, n_out), G.F8_E4M3FN),
                    TensorSpec(p.name + SCALE2_SUFFIX, (1,), G.F32),
                ]
                if target == "nvfp4-w4a4":
                    specs.append(TensorSpec(p.name + INPUT_SCALE_INV_SUFFIX, (1,), G.F32))
            else:
                specs.append(TensorSpec(p.name, p.shape, p.dst))
        by_name = {p.name: p for p in plans}
        cache: dict[str, NVFP4Weight] = {}
        t0 = time.perf_counter()
        done = [0]
        n_main = len(plans)

        def produce(s: TensorSpec) -> np.ndarray:
            if s.name in by_name:
                p = by_name[s.name]
                tt = time.perf_counter()
                if p.dst == p.src and len(p.shape) == 1:
                    data = f.raw(p.name)  # byte copy
                elif p.dst == G.NVFP4_E2M1:
                    w = _encode_nvfp4(f, p, input_scale_inv if target == "nvfp4-w4a4" else None)
                    cache.clear()
                    cache[p.name] = w
                    data = w.packed
                elif p.dst == p.src:
                    data = f.raw(p.name)
                else:
                    data = _encode(f, p)
                done[0] += 1
                if progress is not None:
                    progress(
                        f"[{done[0]:>4}/{n_main}] {p.name:<36} {p.src.name:>4} -> {p.dst.name:<10} "
                        f"{time.perf_counter() - tt:6.2f} s"
                    )
                return data
            base = next(b for b in cache if s.name.startswith(b + "."))
            w = cache[base]
            if s.name.endswith(SCALE_SUFFIX):
                return w.scales
            if s.name.endswith(SCALE2_SUFFIX):
                return np.array([w.scale2], dtype="<f4")
            return np.array([w.input_scale_inv], dtype="<f4")

        out = write_gguf(dst, f.architecture, md, specs, produce, alignment=align)
        if progress is not None:
            progress(f"wrote {dst} ({out.stat().st_size:,} B) in {time.perf_counter() - t0:.1f} s")
        return out
    finally:
        m.close()


def stderr_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
