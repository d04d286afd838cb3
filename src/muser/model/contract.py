"""The per-tensor contract (book Table 9.2), per-class dtype admission (6.1), the QK-norm probe (9.9).

Shapes are written the GGUF way, [in, out] (ggml ne0 first). Every listed tensor must exist with
exactly its shape; any other tensor is refused, except the NVFP4 companions of a native NVFP4
weight (book 7.3), whose pairing rules live in `muser.quant.nvfp4`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from ..errors import ContractError
from ..gguf.reader import GGUFFile
from ..gguf.types import GgmlType as G
from .config import MuseConfig


class TensorClass(Enum):
    NORM = "norm"
    QK_NORM = "qk_norm"
    EMBEDDING = "embedding"
    PROJECTION = "projection"
    LM_HEAD = "lm_head"


# Which stored dtypes each class admits. Norms stay F32 (the converter keeps 1-D tensors F32;
# llama-quant.cpp never quantizes them); projections take every format Muser decodes exactly.
ADMITTED: dict[TensorClass, frozenset[G]] = {
    TensorClass.NORM: frozenset({G.F32}),
    TensorClass.QK_NORM: frozenset({G.F32}),
    TensorClass.EMBEDDING: frozenset({G.F32, G.F16, G.BF16, G.Q8_0, G.Q4_0, G.Q4_K, G.Q5_K, G.Q6_K}),
    TensorClass.PROJECTION: frozenset(
        {G.F32, G.F16, G.BF16, G.Q8_0, G.Q4_0, G.Q4_K, G.Q5_K, G.Q6_K, G.NVFP4_E2M1, G.NVFP4}
    ),
    TensorClass.LM_HEAD: frozenset(
        {G.F32, G.F16, G.BF16, G.Q8_0, G.Q4_0, G.Q4_K, G.Q5_K, G.Q6_K, G.NVFP4_E2M1, G.NVFP4}
    ),
}

NVFP4_COMPANION_SUFFIXES = (".nvfp4_scale", ".nvfp4_scale2", ".nvfp4_input_scale_inv")

LAYER_NORMS = ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm")
LAYER_PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_gate", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@dataclass(frozen=True)
class TensorRule:
    name: str
    shape: tuple[int, ...]
    cls: TensorClass


def expected_tensors(cfg: MuseConfig) -> list[TensorRule]:
    """Every tensor the model must carry, in file order of the converter."""
    h, a, kv, ff, v, hd = cfg.hidden, cfg.attn_dim, cfg.kv_dim, cfg.ffn, cfg.vocab, cfg.head_dim
    P, N = TensorClass.PROJECTION, TensorClass.NORM
    rules = [
        TensorRule("token_embd.weight", (h, v), TensorClass.EMBEDDING),
        TensorRule("output_norm.weight", (h,), N),
        TensorRule("output.weight", (h, v), TensorClass.LM_HEAD),  # untied (book 9.11)
    ]
    for il in range(cfg.n_layers):
        b = f"blk.{il}."
        rules += [
            TensorRule(b + "attn_norm.weight", (h,), N),
            TensorRule(b + "attn_q.weight", (h, a), P),
            TensorRule(b + "attn_k.weight", (h, kv), P),
            TensorRule(b + "attn_v.weight", (h, kv), P),
            TensorRule(b + "attn_q_norm.weight", (hd,), TensorClass.QK_NORM),
            TensorRule(b + "attn_k_norm.weight", (hd,), TensorClass.QK_NORM),
            TensorRule(b + "attn_gate.weight", (h, a), P),
            TensorRule(b + "attn_output.weight", (a, h), P),
            TensorRule(b + "post_attention_norm.weight", (h,), N),
            TensorRule(b + "ffn_norm.weight", (h,), N),
            TensorRule(b + "ffn_gate.weight", (h, ff), P),
            TensorRule(b + "ffn_up.weight", (h, ff), P),
            TensorRule(b + "ffn_down.weight", (ff, h), P),
            TensorRule(b + "post_ffw_norm.weight", (h,), N),
        ]
    return rules


def parameter_count(cfg: MuseConfig) -> int:
    n = 0
    for r in expected_tensors(cfg):
        p = 1
        for d in r.shape:
            p *= d
        n += p
    return n


@dataclass
class ContractReport:
    q_scale: float  # the constant the converter broadcast into every attn_q_norm (qk_scale_factor)
    dtypes: dict[str, str] = field(default_factory=dict)  # tensor -> dtype name
    classes: dict[str, TensorClass] = field(default_factory=dict)
    nvfp4: list[str] = field(default_factory=list)  # native NVFP4 weights (with companions)


def _finite(f: GGUFFile, name: str) -> np.ndarray:
    a = np.asarray(f.array(name), dtype=np.float32)
    if not np.all(np.isfinite(a)):
        bad = int(np.flatnonzero(~np.isfinite(a))[0])
        raise ContractError(f"tensor {name!r} holds a non-finite value at index {bad}: {a.reshape(-1)[bad]}")
    return a


def check_contract(f: GGUFFile, cfg: MuseConfig) -> ContractReport:
    """Validate every tensor's presence, shape and dtype, and probe the QK-norm constants."""
    rules = expected_tensors(cfg)
    by_name = {r.name: r for r in rules}
    report = ContractReport(q_scale=float("nan"))
    for r in rules:
        t = f.tensors.get(r.name)
        if t is None:
            raise ContractError(f"missing tensor {r.name!r} (expected shape {list(r.shape)})")
        if tuple(t.shape) != r.shape:
            raise ContractError(
                f"tensor {r.name!r} has shape {list(t.shape)}, expected {list(r.shape)}"
            )
        gt = t.type.ggml_type
        if gt not in ADMITTED[r.cls]:
            allowed = ", ".join(sorted(x.name for x in ADMITTED[r.cls]))
            raise ContractError(
                f"tensor {r.name!r}: dtype {gt.name} is not admitted for class {r.cls.value} "
                f"(admitted: {allowed})"
            )
        report.dtypes[r.name] = gt.name
        report.classes[r.name] = r.cls
        if gt == G.NVFP4_E2M1:
            report.nvfp4.append(r.name)
    for name in f.tensors:
        if name in by_name:
            continue
        base = next((name[: -len(s)] for s in NVFP4_COMPANION_SUFFIXES if name.endswith(s)), None)
        if base is not None and base in report.nvfp4:
            continue
        raise ContractError(f"unknown tensor {name!r} (not in the Muse Glimmer contract)")

    # Norm weights must be finite (a NaN norm poisons every logit silently).
    for r in rules:
        if r.cls is TensorClass.NORM:
            _finite(f, r.name)

    # QK-norm probe (book 9.9): q_norm is the converter's constant broadcast of qk_scale_factor,
    # identical in every layer; k_norm is exactly ones. A learned norm is refused.
    q_scale = None
    for il in range(cfg.n_layers):
        qn = _finite(f, f"blk.{il}.attn_q_norm.weight")
        kn = _finite(f, f"blk.{il}.attn_k_norm.weight")
        if not np.all(qn == qn[0]):
            j = int(np.flatnonzero(qn != qn[0])[0])
            raise ContractError(
                f"blk.{il}.attn_q_norm.weight is a learned norm (element {j} = {float(qn[j])!r} != "
                f"element 0 = {float(qn[0])!r}); Muse Glimmer's is a constant broadcast"
            )
        if q_scale is None:
            q_scale = float(qn[0])
            if not q_scale > 0:
                raise ContractError(f"blk.{il}.attn_q_norm.weight constant {q_scale!r} is not positive")
        elif float(qn[0]) != q_scale:
            raise ContractError(
                f"blk.{il}.attn_q_norm.weight constant {float(qn[0])!r} differs from layer 0's {q_scale!r}"
            )
        if not np.all(kn == 1.0):
            j = int(np.flatnonzero(kn != 1.0)[0])
            raise ContractError(
                f"blk.{il}.attn_k_norm.weight is a learned norm (element {j} = {float(kn[j])!r}, expected 1.0)"
            )
    report.q_scale = float(q_scale) if q_scale is not None else float("nan")

    if report.nvfp4 or "muser.weight_precision" in f or "muser.activation_precision" in f:
        from ..quant.nvfp4 import validate_nvfp4_pairing  # rules of book 7.3

        validate_nvfp4_pairing(f, report.nvfp4)
    return report
