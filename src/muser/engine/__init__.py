"""The accelerated forward on torch (CUDA + CPU): weights kept quantized on the device, sessions
on muser.kv planes with device storage, CUDA graphs for decode/verify, two lanes.

    from muser.engine import Engine
    eng = Engine.open(path, device="cuda", lane="exact", kv="f16")
    s = eng.session(max_context=4096)
    s.prefill(ids); s.decode(tok); s.verify(block); cp = s.checkpoint(); s.rollback(cp)
    eng.step([StepItem(s, [tok]), StepItem(s2, block, logits="all")])  # several sequences, one forward
"""

from __future__ import annotations

import os
from typing import Iterable


from ..model.loader import ModelFile, open_model
from .forward import Forward, ModelWeights
from ..errors import LaneError
from .lanes import Lane, parse_device, parse_kv, resolve_lane
from .session import MAX_VERIFY, PREFILL_CHUNK, WAITING_CHUNK, Session, SessionCheckpoint
from .step import StepItem, StepResult, step as _step


class Engine:
    """One model on one device, one lane, one KV element type; sessions share its weights."""

    def __init__(self, mf: ModelFile, device: str = "cpu", lane: str | None = None, kv: str = "f16",
                 progress=None):
        self.lane = Lane.parse(resolve_lane(lane, device))  # None: the device's default lane
        self.kv = parse_kv(kv)
        self.device = parse_device(device)
        if self.lane is Lane.SPLIT:  # every projection through the split GEMM, or refuse before any upload
            from ..gguf.types import GgmlType
            from .kernels.qgemm_split import FORMATS as SPLIT_FORMATS

            off = {n: GgmlType(mf.gguf.tensors[n].type.ggml_type) for n in mf.contract.dtypes
                   if len(mf.gguf.tensors[n].shape) == 2 and n != "token_embd.weight"
                   and GgmlType(mf.gguf.tensors[n].type.ggml_type) not in SPLIT_FORMATS}
            if off:
                n, f = next(iter(off.items()))
                raise LaneError(f"lane 'split': tensor {n!r} is {f.name}; the split GEMM serves "
                                f"{', '.join(x.name for x in SPLIT_FORMATS)} only ({len(off)} such tensors); "
                                f"use lane 'exact'")
        if self.lane is Lane.SPLIT and self.device.type != "cuda":
            raise LaneError("lane 'split' runs on cuda only (the CPU's exact lane is row-invariant at every "
                            "row count already); use lane 'exact' on the cpu")
        self.model_file = mf
        self.cfg = mf.config
        if self.lane is Lane.W4A4 and mf.gguf.tensors.keys().isdisjoint(
                n + ".nvfp4_input_scale_inv" for n in mf.contract.nvfp4):
            raise LaneError(f"lane 'w4a4' needs a W4A4 file (muser.activation_precision = nvfp4); "
                            f"{str(mf.path)!r} has no '.nvfp4_input_scale_inv' weights")
        self.weights = ModelWeights.load(mf, self.device, progress=progress, lane=self.lane)
        self.forward = Forward(self.cfg, self.weights, self.lane, self.device)
        # RoPE table for every position the model admits, built once (graphs read it by address)
        self.forward.ensure_positions(self.cfg.context_length)
        self._graphs: dict = {}  # step shape -> StepGraph (CUDA)

    @classmethod
    def open(cls, path: str | os.PathLike, device: str = "cpu", lane: str | None = None, kv: str = "f16",
             pin=None, progress=None) -> "Engine":
        # Cheap refusals first: unknown lane/device/kv before the file is even read.
        if lane is not None:
            Lane.parse(lane)
        parse_kv(kv)
        parse_device(device)
        return cls(open_model(path, pin=pin), device, lane, kv, progress=progress)

    @property
    def weight_bytes(self) -> int:
        return self.weights.nbytes

    def session(self, max_context: int | None = None, chunk: int = PREFILL_CHUNK,
                capture: Iterable[int] = (), graphs: bool | None = None) -> Session:
        """A new sequence with its own KV planes (max_context defaults to context_length)."""
        return Session(self, self.cfg.context_length if max_context is None else max_context,
                       chunk, capture, graphs)

    def graph(self, shape: tuple[tuple[int, str, int], ...], capture: tuple[int, ...]):
        """The CUDA graph of a step shape (engine/graphs.py), built on first use."""
        from .graphs import StepGraph

        key = (shape, capture)
        g = self._graphs.get(key)
        if g is None:
            g = self._graphs[key] = StepGraph(self, shape, capture)
        return g

    def step(self, batch: list[StepItem], device_rows: bool = False) -> list[StepResult]:
        """Advance several sessions in one forward (engine/step.py): per item its tokens and
        which rows' logits to return; all-or-nothing across the batch. `device_rows`: on CUDA
        each item's last row stays on the device (StepResult.row)."""
        return _step(self, batch, device_rows)


__all__ = ["Engine", "Lane", "Session", "SessionCheckpoint", "StepItem", "StepResult", "MAX_VERIFY",
           "PREFILL_CHUNK", "WAITING_CHUNK"]
