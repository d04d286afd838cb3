"""`muser quantize IN OUT --to FORMAT`: re-encode the 2-D weights of any loadable Muse Glimmer
GGUF (F32/F16/BF16, or quantized: every weight is decoded to f32 by muser.quant.dequant, tensor
by tensor, then encoded in the target type).

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
              bits); NVFP4 companions are folded into their weight. The other targets decode
              the same values themselves: quantizing this copy or its source gives one file.
A weight already stored in its target type is copied byte for byte (a native NVFP4 weight with
its scale companions): quantizing decoded blocks into their own format again only adds error.

Work is spread over a pool of processes (`threads`, default one per core) in tasks of whole
tensors (native NVFP4: the tensor amax fixes scale2) or row ranges of at most _TASK_ELEMS
values; results come back in file order with at most 2 * threads tasks in flight, so memory is
bounded by a few tasks plus the tensor being written, never the model.
The output is written atomically (gguf.writer.write_gguf: temp file + rename).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from collections import Counter, deque
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from ..cores import default_threads
from ..errors import FormatError, MuserError
from ..gguf.reader import GGUFFile, ValueType, read_gguf
from ..gguf.types import GgmlType as G
from ..gguf.types import type_info
from ..gguf.writer import TensorSpec, Typed, write_gguf
from .common import F32, f32_to_f16
from .dequant import DEQUANT_TYPES, dequantize_rows
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
    read_nvfp4_weight,
)
from .quantize import quantize

TARGETS = ("q8_0", "q4_k", "q4_k_xl", "nvfp4", "nvfp4-w4a4", "nvfp4-ggml", "f32")
# 2-D weight types the source may hold: every type dequant decodes (F8_E4M3FN only ever as a
# native NVFP4 scale companion, read with its weight).
SOURCE_TYPES = frozenset((DEQUANT_TYPES - {G.F8_E4M3FN}) | {G.NVFP4_E2M1})
# llama.h llama_ftype of each ggml output (general.file_type).
FILE_TYPE = {"q8_0": 7, "q4_k": 14, "q4_k_xl": 15, "nvfp4-ggml": 39, "f32": 0}
_ROW_CHUNK_ELEMS = 1 << 18  # values decoded at a time inside a task (cache-sized: ~3x faster than 4M)
_TASK_ELEMS = 1 << 26  # values per pool task (a split tensor is reassembled in the writer)


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
        if t.name.endswith(COMPANION_SUFFIXES):
            continue  # read with its NVFP4_E2M1 weight (copied with it, or folded into its decode)
        if len(t.shape) == 1:
            out.append(_Plan(t.name, t.shape, src, src))
            continue
        if src not in SOURCE_TYPES:
            raise FormatError(
                f"input tensor {t.name!r} is {src.name}, which muser quantize cannot decode "
                f"(decodable: {', '.join(sorted(x.name for x in SOURCE_TYPES))})"
            )
        dst = target_type(target, t.name)
        block = 16 if dst == G.NVFP4_E2M1 else type_info(dst).block_elems
        if t.shape[0] % block:
            raise FormatError(
                f"tensor {t.name!r}: row length {t.shape[0]} is not a multiple of the {dst.name} "
                f"block of {block} (no silent fallback type)"
            )
        out.append(_Plan(t.name, t.shape, src, dst))
    return out


def _row_chunks(r0: int, r1: int, ne0: int):
    step = max(1, _ROW_CHUNK_ELEMS // ne0)
    for a in range(r0, r1, step):
        yield np.arange(a, min(r1, a + step))


def _encode(f: GGUFFile, p: _Plan, r0: int, r1: int) -> np.ndarray:
    """Rows [r0, r1) of one tensor in a ggml type: uint8 [r1 - r0, row_bytes], decoded and
    encoded chunk by chunk of rows (bounded memory)."""
    ne0 = p.shape[0]
    ti = type_info(p.dst)
    out = np.empty((r1 - r0, ti.nbytes(ne0)), dtype=np.uint8)
    for rows in _row_chunks(r0, r1, ne0):
        vals = dequantize_rows(f, p.name, rows)
        at = slice(int(rows[0]) - r0, int(rows[-1]) + 1 - r0)
        if p.dst == G.F32:
            out[at] = vals.astype("<f4", copy=False).view(np.uint8).reshape(rows.size, -1)
        elif p.dst == G.F16:
            enc = f32_to_f16(vals)
            if not np.isfinite(enc.view("<f2")).all():
                raise FormatError(f"tensor {p.name!r} overflows F16 (|x| > 65504)")
            out[at] = enc.view(np.uint8).reshape(rows.size, -1)
        else:
            out[at] = np.asarray(quantize(vals, p.dst)).view(np.uint8).reshape(rows.size, -1)
    return out


def _encode_nvfp4(f: GGUFFile, p: _Plan, input_scale_inv: float | None) -> NVFP4Weight:
    isi = None if input_scale_inv is None else F32(input_scale_inv)
    if p.src == G.NVFP4_E2M1:  # already native: payload and scales as stored
        return replace(read_nvfp4_weight(f, p.name), input_scale_inv=isi)
    ne0 = p.shape[0]
    n_rows = p.shape[1]
    amax = F32(0)
    for rows in _row_chunks(0, n_rows, ne0):  # pass 1: the tensor amax fixes scale2
        amax = max(amax, F32(np.abs(dequantize_rows(f, p.name, rows)).max()))
    s2 = nvfp4_scale2(np.array([amax], dtype=F32))
    packed = np.empty((n_rows, ne0 // 2), dtype=np.uint8)
    scales = np.empty((n_rows, ne0 // 16), dtype=np.uint8)
    for rows in _row_chunks(0, n_rows, ne0):
        codes, sb = quantize_groups(dequantize_rows(f, p.name, rows), s2)
        packed[rows] = pack_codes(codes)
        scales[rows] = sb
    return NVFP4Weight(packed, scales, s2, isi)


@dataclass(frozen=True)
class _Task:
    plan: _Plan
    r0: int
    r1: int
    input_scale_inv: float | None  # native NVFP4 W4A4 only


def _tasks(plans: list[_Plan], input_scale_inv: float | None) -> list[_Task]:
    """The work, in file order: nothing for a byte copy, one task per native NVFP4 weight,
    row ranges of at most _TASK_ELEMS values otherwise."""
    out: list[_Task] = []
    for p in plans:
        if p.dst == p.src and p.dst != G.NVFP4_E2M1:
            continue
        n_rows = int(np.prod(p.shape[1:]))
        if p.dst == G.NVFP4_E2M1:
            out.append(_Task(p, 0, n_rows, input_scale_inv))
            continue
        step = max(1, _TASK_ELEMS // p.shape[0])
        out += [_Task(p, r, min(n_rows, r + step), None) for r in range(0, n_rows, step)]
    return out


def _run_task(f: GGUFFile, t: _Task) -> tuple[np.ndarray | NVFP4Weight, float]:
    t0 = time.perf_counter()
    if t.plan.dst == G.NVFP4_E2M1:
        data: np.ndarray | NVFP4Weight = _encode_nvfp4(f, t.plan, t.input_scale_inv)
    else:
        data = _encode(f, t.plan, t.r0, t.r1)
    return data, time.perf_counter() - t0


_WORKER_SOURCE: GGUFFile | None = None  # the source, opened once per pool process


def _worker_open(path: str) -> None:
    import signal

    global _WORKER_SOURCE
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops the pool and removes the temp file
    _WORKER_SOURCE = read_gguf(path)


def _worker_task(t: _Task) -> tuple[np.ndarray | NVFP4Weight, float]:
    assert _WORKER_SOURCE is not None, "pool process without its source"
    return _run_task(_WORKER_SOURCE, t)


def _processes(threads: int, tasks: list[_Task]) -> int:
    return 1 if threads == 1 or len(tasks) <= 1 else min(threads, len(tasks))


def _results(f: GGUFFile, src: Path, tasks: list[_Task], threads: int) -> Iterator[tuple[np.ndarray | NVFP4Weight, float]]:
    """Each task's (data, seconds) in task order; with threads > 1 from a process pool with at
    most 2 * threads tasks in flight (the bound on memory held by finished, unwritten tasks)."""
    if _processes(threads, tasks) == 1:
        for t in tasks:
            yield _run_task(f, t)
        return
    # spawn: a fresh interpreter per process, whatever threads the parent has started
    ctx = multiprocessing.get_context("spawn")
    ex = ProcessPoolExecutor(_processes(threads, tasks), mp_context=ctx, initializer=_worker_open,
                             initargs=(str(src),))
    pending: deque[Future] = deque()
    try:
        for t in tasks:
            pending.append(ex.submit(_worker_task, t))
            if len(pending) >= 2 * threads:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        ex.shutdown(wait=True, cancel_futures=True)


def convert(src: str | os.PathLike, dst: str | os.PathLike, target: str,
            input_scale_inv: float = 1.0,
            progress: Callable[[str], None] | None = None,
            threads: int | None = None) -> Path:
    """Quantize `src` into `dst` (atomic) with `threads` processes (default: one per core).
    Raises a MuserError before any work on bad input."""
    from ..model.loader import open_model

    src, dst = Path(src), Path(dst)
    if target not in TARGETS:
        raise MuserError(f"unknown target {target!r} (choose from {', '.join(TARGETS)})")
    if target == "nvfp4-w4a4" and not (np.isfinite(input_scale_inv) and input_scale_inv > 0):
        raise MuserError(f"--input-scale-inv must be finite and positive, got {input_scale_inv!r}")
    threads = default_threads() if threads is None else threads
    if threads < 1:
        raise MuserError(f"--threads must be at least 1, got {threads}")
    if dst.exists() and dst.resolve() == src.resolve():
        raise MuserError(f"output {str(dst)!r} is the input file")
    if not dst.parent.resolve().is_dir():
        raise MuserError(f"output directory {str(dst.parent)!r} does not exist")
    m = open_model(src)  # the full contract, fail closed, before any work
    results = None
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
        tasks = _tasks(plans, input_scale_inv if target == "nvfp4-w4a4" else None)
        results = _results(f, src, tasks, threads)
        by_name = {p.name: p for p in plans}
        cache: dict[str, NVFP4Weight] = {}
        t0 = time.perf_counter()
        done = [0]
        n_main = len(plans)

        def produce(s: TensorSpec) -> np.ndarray:
            if s.name in by_name:
                p = by_name[s.name]
                secs = 0.0
                if p.dst == p.src and p.dst != G.NVFP4_E2M1:
                    data = f.raw(p.name)  # byte copy (1-D tensors, weights already in the target type)
                elif p.dst == G.NVFP4_E2M1:
                    w, secs = next(results)
                    assert isinstance(w, NVFP4Weight)
                    cache.clear()
                    cache[p.name] = w
                    data = w.packed
                else:
                    n_rows = int(np.prod(p.shape[1:]))
                    data = np.empty((n_rows, type_info(p.dst).nbytes(p.shape[0])), dtype=np.uint8)
                    r = 0
                    while r < n_rows:  # the tensor's row ranges, in order
                        part, dt = next(results)
                        assert isinstance(part, np.ndarray)
                        data[r : r + part.shape[0]] = part
                        r += part.shape[0]
                        secs += dt
                done[0] += 1
                if progress is not None:
                    how = "copy" if p.dst == p.src else f"{secs:6.2f} s"
                    progress(f"[{done[0]:>4}/{n_main}] {p.name:<36} {p.src.name:>10} -> {p.dst.name:<10} {how}")
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
            mix = Counter(f"{p.src.name} -> {p.dst.name}" for p in plans if len(p.shape) == 2)
            progress("source -> output types of the 2-D weights: "
                     + ", ".join(f"{k} x{n}" for k, n in sorted(mix.items())))
            n_proc = _processes(threads, tasks)
            progress(f"wrote {dst} ({out.stat().st_size:,} B) in {time.perf_counter() - t0:.1f} s "
                     f"({len(tasks)} tasks, {n_proc} process{'es' if n_proc > 1 else ''})")
        return out
    finally:
        if results is not None:
            results.close()  # a failed write stops the pool (queued tasks cancelled)
        m.close()


def stderr_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
