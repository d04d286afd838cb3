"""The DFlash sidecar GGUF, as the pinned llama.cpp reads it (src/models/dflash.cpp,
src/llama-arch.cpp, common/speculative.cpp), loaded strictly (book 8.5) and written by `write_drafter`.

Metadata (architecture `dflash`; every key below is required unless marked optional):
  dflash.context_length, .embedding_length (= the target's hidden), .block_count, .feed_forward_length,
  .attention.head_count, .attention.head_count_kv, .attention.key_length (= .value_length),
  .attention.layer_norm_rms_epsilon, .rope.freq_base, .rope.dimension_count,
  .target_layers        target layers whose INPUT residual is captured (llama.cpp t_layer_inp index,
                        the converter's HF `target_layer_ids` + 1), each in [0, target block_count)
  .block_size           the noise block: [last, <mask> x (block_size - 1)]
  .attention.sliding_window and .attention.sliding_window_pattern (one bool per draft layer): the
                        trained window of the draft context (book 8.4: a missing window is an error)
  tokenizer.ggml.*      the target's tokenizer verbatim, with tokenizer.ggml.mask_token_id
  optional: .embedding_scale, .attention.scale, .attention.value_scale (0/absent = none, as llama.cpp),
  .logit_scale / .final_logit_softcapping (monotone: they do not change greedy proposals).
Tensors: fc.weight [n_cap*H -> H], enc.output_norm.weight, output_norm.weight, per layer blk.N.{attn_norm,
attn_q, attn_k, attn_v, attn_output, attn_q_norm, attn_k_norm, ffn_norm, ffn_gate, ffn_up, ffn_down}.weight;
token_embd.weight / output.weight are optional (absent = the target's, shared through the target context).
Variants this engine does not compute (DFlash2 selector/convolutions, DSpark Markov head, DSV4 stages,
reduced-vocab d2t, shared K/V, attention sinks, post norms, causal blocks, non-SiLU MLPs) are refused by
name rather than run as something else.

The 64-row sink is Muser's context ABI (book 8.3), not GGUF metadata: DFLASH_CONTEXT_SINK.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ContractError, MetadataError, MissingKey, WrongKeyType
from ..gguf.reader import GGUFFile, ValueType, read_gguf
from .net import LAYER_TENSORS, NetGeometry, default_attn_scale

ARCH = "dflash"
DFLASH_CONTEXT_SINK = 64  # rows pinned at the start of the draft context (book 8.3)
VERIFY_LENGTHS = (3, 7, 15)  # proposals per round (book 8.6 item 3)
TOKENIZER_PREFIX = "tokenizer."

_REFUSED_KEYS = {
    f"{ARCH}.conv_kernel_size": "DFlash2 convolutions", f"{ARCH}.selector_rank": "the DFlash2 selector",
    f"{ARCH}.selector_top_k": "the DFlash2 selector", f"{ARCH}.hyper_connection_count": "DSV4 DSpark stages",
    f"{ARCH}.rope.dimension_sections": "M-RoPE sections",
}
_REFUSED_TENSORS = ("d2t", "markov_w1.weight", "selector_hidden.weight")
_REFUSED_LAYER_TENSORS = {"attn_sinks": "attention sinks", "post_attention_norm": "attention post norms",
                          "post_ffw_norm": "FFN post norms", "layer_output_scale": "layer output scales",
                          "rope_freqs": "RoPE frequency factors", "attn_conv_proj": "DFlash2 convolutions"}
_FLOAT_TYPES = {ValueType.FLOAT32, ValueType.FLOAT64}


def _k(name: str) -> str:
    return f"{ARCH}.{name}"


@dataclass(frozen=True)
class DrafterConfig:
    path: str
    hidden: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    context_length: int
    eps: float
    rope_base: float
    n_rot: int
    target_layers: tuple[int, ...]
    block_size: int
    window: int
    swa_pattern: tuple[bool, ...]
    mask_token: int
    attn_scale: float
    embedding_scale: float
    value_scale: float
    own_embedding: bool
    own_head: bool
    vocab: int
    sink: int = DFLASH_CONTEXT_SINK

    @property
    def n_capture(self) -> int:
        return len(self.target_layers)

    @property
    def max_proposals(self) -> int:
        return self.block_size - 1  # [last, mask x (B-1)]: in-place denoising gives B-1 (speculative.cpp)

    def net(self) -> NetGeometry:
        return NetGeometry(self.hidden, self.n_layers, self.n_heads, self.n_kv_heads, self.head_dim, self.ffn,
                           self.n_capture, self.n_rot, self.rope_base, self.eps, self.attn_scale,
                           self.embedding_scale, self.value_scale)

    def to_json(self) -> dict:
        d = asdict(self)
        d["target_layers"] = list(self.target_layers)
        d["swa_pattern"] = list(self.swa_pattern)
        return d

    # -- parsing -------------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, f: GGUFFile) -> DrafterConfig:
        arch = f.get("general.architecture")
        if arch != ARCH:
            raise MetadataError(f"{str(f.path)!r} is not a DFlash drafter: general.architecture is {arch!r}, "
                                f"expected {ARCH!r}")
        for key, what in _REFUSED_KEYS.items():
            if key in f:
                raise ContractError(f"{key!r} is present: {what} are not served by this engine")
        if f.get(_k("attention.causal")):
            raise ContractError(f"{_k('attention.causal')!r} = true: causal DFlash blocks are not served")
        act = f.get(_k("hidden_act"))
        if act is not None and act != "silu":
            raise ContractError(f"{_k('hidden_act')!r} = {act!r}: only the SiLU MLP is served")

        def pos_int(name: str) -> int:
            key = _k(name)
            if key not in f:
                raise MissingKey(f"missing metadata key {key!r}")
            v = f.get_int(key)
            if v <= 0:
                raise MetadataError(f"metadata key {key!r} must be positive, got {v}")
            return v

        def pos_float(name: str) -> float:
            key = _k(name)
            if key not in f:
                raise MissingKey(f"missing metadata key {key!r}")
            v = f.get_float(key)
            if not (math.isfinite(v) and v > 0):
                raise MetadataError(f"metadata key {key!r} must be a finite positive float, got {v!r}")
            return v

        def opt_float(name: str) -> float:
            key = _k(name)
            if key not in f:
                return 0.0
            v = f.get_float(key)
            if not math.isfinite(v) or v < 0:
                raise MetadataError(f"metadata key {key!r} must be finite and >= 0, got {v!r}")
            return v

        hidden, n_layers = pos_int("embedding_length"), pos_int("block_count")
        n_heads, n_kv = pos_int("attention.head_count"), pos_int("attention.head_count_kv")
        hd, hdv = pos_int("attention.key_length"), pos_int("attention.value_length")
        if hd != hdv:
            raise MetadataError(f"key_length {hd} != value_length {hdv} (dflash.cpp asserts them equal)")
        if n_heads % n_kv:
            raise MetadataError(f"head_count {n_heads} is not a multiple of head_count_kv {n_kv}")
        eps, rope_base = pos_float("attention.layer_norm_rms_epsilon"), pos_float("rope.freq_base")
        n_rot = pos_int("rope.dimension_count")
        if n_rot > hd or n_rot % 2:
            raise MetadataError(f"rope.dimension_count {n_rot} must be even and <= key_length {hd}")

        tl_key = _k("target_layers")
        if tl_key not in f:
            raise MissingKey(f"missing metadata key {tl_key!r}: the draft cannot know which target layers feed it")
        layers = f.get_array(tl_key)
        if len(layers) == 0:
            raise MetadataError(f"metadata key {tl_key!r} is empty")
        layers = tuple(int(x) for x in layers)
        if any(x < 0 for x in layers) or len(set(layers)) != len(layers):
            raise MetadataError(f"metadata key {tl_key!r} = {list(layers)} must be distinct non-negative layers")

        block = pos_int("block_size")
        if block < 2 or block - 1 > 16 - 1:
            raise MetadataError(f"dflash.block_size {block} must be in [2, 16] (the verify shape is <= 16 rows)")
        win_key, pat_key = _k("attention.sliding_window"), _k("attention.sliding_window_pattern")
        if win_key not in f:
            raise MissingKey(f"missing metadata key {win_key!r}: the draft's trained context window is unknown "
                             "(book 8.4: never a hard-coded default)")
        window = f.get_int(win_key)
        if window <= 0:
            raise MetadataError(f"metadata key {win_key!r} must be positive, got {window}")
        if pat_key not in f:
            raise MissingKey(f"missing metadata key {pat_key!r} (llama.cpp requires it with a window)")
        fld = f.field(pat_key)
        if fld.vtype != ValueType.ARRAY or fld.elem_type != ValueType.BOOL:
            raise WrongKeyType(f"metadata key {pat_key!r} must be an array of BOOL, got {fld.type_name}")
        pattern = tuple(bool(x) for x in fld.value)
        if len(pattern) != n_layers:
            raise MetadataError(f"metadata key {pat_key!r} has {len(pattern)} entries, block_count is {n_layers}")
        if not all(pattern):
            raise ContractError(f"{pat_key!r} = {list(pattern)}: every draft layer attends through the "
                                "sink + window context (mixed dense draft layers are not served)")

        mkey = "tokenizer.ggml.mask_token_id"
        if mkey not in f:
            raise MissingKey(f"missing metadata key {mkey!r}: the noise block needs the mask token")
        mask = f.get_int(mkey)
        tokens = f.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise MissingKey("missing metadata key 'tokenizer.ggml.tokens' (the draft carries the target's vocab)")
        vocab = len(tokens)
        if not 0 <= mask < vocab:
            raise MetadataError(f"mask token id {mask} is outside the vocab [0, {vocab})")
        scale = opt_float("attention.scale")
        return cls(str(f.path), hidden, n_layers, n_heads, n_kv, hd, pos_int("feed_forward_length"),
                   pos_int("context_length"), eps, rope_base, n_rot, layers, block, window, pattern, mask,
                   scale if scale != 0.0 else default_attn_scale(hd), opt_float("embedding_scale"),
                   opt_float("attention.value_scale"), "token_embd.weight" in f.tensors,
                   "output.weight" in f.tensors, vocab)


def expected_tensors(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """name -> ggml shape (ne0 first) of every tensor the drafter must carry."""
    H, hd = cfg.hidden, cfg.head_dim
    out = {"fc.weight": (cfg.n_capture * H, H), "enc.output_norm.weight": (H,), "output_norm.weight": (H,)}
    if cfg.own_embedding:
        out["token_embd.weight"] = (H, cfg.vocab)
    if cfg.own_head:
        out["output.weight"] = (H, cfg.vocab)
    shapes = {"attn_norm": (H,), "attn_q": (H, hd * cfg.n_heads), "attn_k": (H, hd * cfg.n_kv_heads),
              "attn_v": (H, hd * cfg.n_kv_heads), "attn_output": (hd * cfg.n_heads, H), "attn_q_norm": (hd,),
              "attn_k_norm": (hd,), "ffn_norm": (H,), "ffn_gate": (H, cfg.ffn), "ffn_up": (H, cfg.ffn),
              "ffn_down": (cfg.ffn, H)}
    assert set(shapes) == set(LAYER_TENSORS)
    for il in range(cfg.n_layers):
        for n, s in shapes.items():
            out[f"blk.{il}.{n}.weight"] = s
    return out


def check_tensors(f: GGUFFile, cfg: DrafterConfig) -> None:
    for name in _REFUSED_TENSORS:
        if name in f.tensors:
            raise ContractError(f"tensor {name!r} is present: that DFlash variant is not served by this engine")
    want = expected_tensors(cfg)
    for t in f:
        parts = t.name.split(".")
        if len(parts) >= 3 and parts[0] == "blk" and parts[2] in _REFUSED_LAYER_TENSORS:
            raise ContractError(f"tensor {t.name!r}: {_REFUSED_LAYER_TENSORS[parts[2]]} are not served")
        if t.name not in want:
            raise ContractError(f"unexpected tensor {t.name!r} in the drafter")
        if tuple(t.shape) != want[t.name]:
            raise ContractError(f"tensor {t.name!r} has shape {list(t.shape)}, expected {list(want[t.name])}")
    missing = [n for n in want if n not in f.tensors]
    if missing:
        if any(n.endswith("attn_v.weight") for n in missing):
            raise ContractError(f"missing tensor {missing[0]!r} (shared-K/V drafts are not served)")
        raise ContractError(f"missing tensor {missing[0]!r}")


def check_fits(cfg: DrafterConfig, target_cfg: Any, drafter_tok_sha: str, target_tok_sha: str) -> None:
    """Refuse a drafter whose geometry does not fit the target (before any weights move)."""
    if cfg.hidden != target_cfg.hidden:
        raise ContractError(f"drafter embedding_length {cfg.hidden} != the target's hidden {target_cfg.hidden} "
                            "(fc reads n_capture x the target width and writes the draft width)")
    bad = [x for x in cfg.target_layers if x >= target_cfg.n_layers]
    if bad:
        raise ContractError(f"drafter target layer {bad[0]} is outside the target's layers [0, {target_cfg.n_layers})")
    if cfg.vocab != target_cfg.vocab:
        raise ContractError(f"drafter vocab {cfg.vocab} != the target's {target_cfg.vocab}")
    if drafter_tok_sha != target_tok_sha:
        raise ContractError(f"drafter tokenizer SHA-256 {drafter_tok_sha[:12]}... differs from the target's "
                            f"{target_tok_sha[:12]}...: proposals would be in another vocabulary")


def open_drafter(path: str | os.PathLike) -> tuple[GGUFFile, DrafterConfig]:
    """Read and validate a drafter file (structure, metadata, tensors); nothing moves to a device."""
    f = read_gguf(path)
    try:
        cfg = DrafterConfig.from_gguf(f)
        check_tensors(f, cfg)
        return f, cfg
    except BaseException:
        f.close()
        raise


def drafter_metadata(geo: dict, target: GGUFFile) -> dict:
    """Metadata of a drafter for `target` (geo: hidden, n_layers, n_heads, n_kv_heads, head_dim, ffn,
    context_length, eps, rope_base, target_layers, block_size, window; optional name/provenance)."""
    md: dict[str, Any] = {
        "general.name": geo.get("name", "dflash-drafter"),
        _k("context_length"): int(geo["context_length"]), _k("embedding_length"): int(geo["hidden"]),
        _k("block_count"): int(geo["n_layers"]), _k("feed_forward_length"): int(geo["ffn"]),
        _k("attention.head_count"): int(geo["n_heads"]), _k("attention.head_count_kv"): int(geo["n_kv_heads"]),
        _k("attention.key_length"): int(geo["head_dim"]), _k("attention.value_length"): int(geo["head_dim"]),
        _k("attention.layer_norm_rms_epsilon"): float(geo["eps"]), _k("rope.freq_base"): float(geo["rope_base"]),
        _k("rope.dimension_count"): int(geo["head_dim"]),
        _k("target_layers"): [int(x) for x in geo["target_layers"]], _k("block_size"): int(geo["block_size"]),
        _k("attention.sliding_window"): int(geo["window"]),
        _k("attention.sliding_window_pattern"): [True] * int(geo["n_layers"]),
    }
    for key, fld in target.fields.items():
        if key.startswith(TOKENIZER_PREFIX) and key != "tokenizer.chat_template":
            md[key] = _typed(fld)
    if "provenance" in geo:
        md["muser.drafter.provenance"] = str(geo["provenance"])
    return md


def _typed(fld):
    from gguf import GGUFValueType

    from ..gguf.writer import Typed

    vt = GGUFValueType(int(fld.vtype))
    if fld.vtype == ValueType.ARRAY:
        vals = fld.value.tolist() if isinstance(fld.value, np.ndarray) else list(fld.value)
        return Typed(vals, vt, GGUFValueType(int(fld.elem_type)))
    return Typed(fld.value, vt)


def write_drafter(path: str | os.PathLike, geo: dict, tensors: dict[str, np.ndarray], target: GGUFFile,
                  dtype: str = "F16") -> Path:
    """Write a drafter GGUF: 2-D weights in `dtype` (F16 or F32), norms F32; `tensors` maps GGUF names to
    float32 numpy arrays in numpy order ([out, in] for weights)."""
    from ..gguf.types import GgmlType
    from ..gguf.writer import write_tensors

    if dtype not in ("F16", "F32"):
        raise ContractError(f"drafter weight dtype {dtype!r} must be F16 or F32")
    out = {}
    for name, a in tensors.items():
        a = np.ascontiguousarray(a, dtype=np.float32)
        if not np.isfinite(a).all():
            raise ContractError(f"tensor {name!r} has non-finite values")
        shape = tuple(reversed(a.shape))
        if a.ndim == 2 and dtype == "F16":
            out[name] = (a.astype(np.float16), GgmlType.F16, shape)
        else:
            out[name] = (a, GgmlType.F32, shape)
    return write_tensors(path, ARCH, drafter_metadata(geo, target), out)


__all__ = [
    "ARCH",
    "DFLASH_CONTEXT_SINK",
    "VERIFY_LENGTHS",
    "DrafterConfig",
    "check_fits",
    "check_tensors",
    "drafter_metadata",
    "expected_tensors",
    "open_drafter",
    "write_drafter",
]


def describe_drafter(path: str | os.PathLike, hash_artifact: bool = True) -> dict:
    """`muser inspect` of a drafter: validated config, tensors' dtype mix and bytes, identities."""
    from ..gguf.identity import artifact_sha256, tokenizer_sha256

    f, cfg = open_drafter(path)
    try:
        mix: dict[str, dict] = {}
        for t in f:
            e = mix.setdefault(t.type.ggml_type.name, {"tensors": 0, "bytes": 0})
            e["tensors"] += 1
            e["bytes"] += t.nbytes
        ident: dict[str, str] = {"tokenizer_sha256": tokenizer_sha256(f)}
        if hash_artifact:
            ident["artifact_sha256"] = artifact_sha256(path)
        return {"file": str(path), "file_bytes": f.size, "architecture": ARCH, "drafter": cfg.to_json(),
             "parameters": sum(t.n_elements for t in f), "dtype_mix": mix,
             "context_rows_max": cfg.sink + cfg.window,
             "shares_target": {"embedding": not cfg.own_embedding, "lm_head": not cfg.own_head},
             "identity": ident, "verdict": "valid drafter"}
    finally:
        f.close()


def drafter_lines(d: dict) -> str:
    c = d["drafter"]
    lines = [f"file            {d['file']} ({d['file_bytes']:,} B), DFlash drafter",
             (f"geometry        {c['n_layers']} layers, hidden {c['hidden']}, {c['n_heads']} q heads / "
              f"{c['n_kv_heads']} kv heads, head_dim {c['head_dim']}, ffn {c['ffn']}, vocab {c['vocab']}"),
             (f"target layers   {c['target_layers']} (their input residuals, fc "
              f"{len(c['target_layers']) * c['hidden']} -> {c['hidden']})"),
             f"block           {c['block_size']} rows: [last, mask {c['mask_token']} x {c['block_size'] - 1}]",
             f"context         sink {c['sink']} + window {c['window']} rows (pattern {c['swa_pattern']})",
             f"rope            NEOX, freq_base {c['rope_base']:g}, {c['n_rot']} dims; eps {c['eps']:g}",
             f"shares target   embedding {d['shares_target']['embedding']}, LM head {d['shares_target']['lm_head']}",
             f"parameters      {d['parameters']:,}"]
    for dt, e in sorted(d["dtype_mix"].items()):
        lines.append(f"  {dt:<11} {e['tensors']:>5} tensors  {e['bytes']:>16,} B")
    for k, v in d["identity"].items():
        lines.append(f"{k.split('_')[0]:<15} sha256 {v}")
    lines.append(f"verdict         {d['verdict']}")
    return "\n".join(lines)
