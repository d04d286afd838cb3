"""MuseConfig: the model contract read from GGUF metadata (book Table 9.1), failing closed.

Key names are those the pinned llama.cpp `muse-glimmer` loader reads
(src/models/muse-glimmer.cpp load_arch_hparams; src/llama-arch.cpp LLM_KV_*).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import numpy as np

from ..errors import MetadataError, MissingKey, WrongKeyType
from ..gguf.reader import GGUFFile, ValueType

ARCH = "muse-glimmer"

# Post-attention / post-FFN RMSNorm epsilon: a llama.cpp graph constant, not GGUF metadata
# (muse-glimmer.cpp: `const float post_norm_eps = 1e-8f;`; book 9.9).
POST_NORM_EPS = np.float32(1e-8)

# The collar: [sliding, sliding, sliding, full] repeated; layer % 4 == 3 is full (book 9.4).
COLLAR = 4


class LayerKind(Enum):
    SLIDING_ROPE = "swa"  # sliding window, RoPE applied
    FULL_NOPE = "full"  # full causal attention, no rotation

    @property
    def uses_rope(self) -> bool:
        # muse-glimmer.cpp: `const bool use_rope = hparams.is_swa(il);`
        return self is LayerKind.SLIDING_ROPE


_INTS = {
    ValueType.UINT8, ValueType.INT8, ValueType.UINT16, ValueType.INT16,
    ValueType.UINT32, ValueType.INT32, ValueType.UINT64, ValueType.INT64,
}


def _k(name: str) -> str:
    return f"{ARCH}.{name}"


def _pos_int(f: GGUFFile, key: str) -> int:
    v = f.get_int(key)
    if v <= 0:
        raise MetadataError(f"metadata key {key!r} must be positive, got {v}")
    return v


def _pos_float(f: GGUFFile, key: str, allow_zero: bool = False) -> float:
    v = f.get_float(key)
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        raise MetadataError(f"metadata key {key!r} must be a finite positive float, got {v!r}")
    return v


def swa_pattern_from_gguf(f: GGUFFile, n_layers: int) -> tuple[bool, ...]:
    """Per-layer is-sliding flags from `muse-glimmer.attention.sliding_window_pattern`.

    llama.cpp accepts a bool array (one per layer) or a u32 period n (layer il is sliding iff
    il % n < n - 1; llama_hparams::set_swa_pattern). A missing key is an error: an all-full model
    runs and emits plausible text while being wrong (book 9.4)."""
    key = _k("attention.sliding_window_pattern")
    fld = f.fields.get(key)
    if fld is None:
        raise MissingKey(
            f"missing metadata key {key!r}: the layer kinds cannot be inferred (refusing to assume all-full)"
        )
    if fld.vtype == ValueType.ARRAY:
        if fld.elem_type != ValueType.BOOL:
            raise WrongKeyType(f"metadata key {key!r} must be an array of BOOL, got {fld.type_name}")
        pat = tuple(bool(x) for x in fld.value)
        if len(pat) != n_layers:
            raise MetadataError(
                f"metadata key {key!r} has {len(pat)} entries, block_count is {n_layers}"
            )
        return pat
    if fld.vtype in _INTS:
        n = int(fld.value)
        if n <= 0:
            raise MetadataError(f"metadata key {key!r}: period {n} must be positive")
        return tuple(il % n < n - 1 for il in range(n_layers))
    raise WrongKeyType(f"metadata key {key!r} must be a BOOL array or an integer, got {fld.type_name}")


@dataclass(frozen=True)
class MuseConfig:
    context_length: int
    hidden: int
    n_layers: int
    ffn: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_eps: float
    sliding_window: int
    swa_pattern: tuple[bool, ...]
    rope_base: float
    rope_base_swa: float
    logit_scale: float
    softcap: float
    vocab: int
    bos_id: int
    eos_id: int
    eot_id: int
    eog_ids: frozenset[int]
    post_norm_eps: float = float(POST_NORM_EPS)

    # -- derived (book 9.2) --------------------------------------------------------------------
    @property
    def attn_dim(self) -> int:  # Q, gate, o_proj input width
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:  # K, V width
        return self.n_kv_heads * self.head_dim

    @property
    def heads_per_kv(self) -> int:
        return self.n_heads // self.n_kv_heads

    @property
    def attn_scale(self) -> float:
        # kq_scale = 1.0f / sqrtf(float(n_embd_head)) (muse-glimmer.cpp), in f32
        return float(np.float32(1.0) / np.sqrt(np.float32(self.head_dim)))

    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        return tuple(LayerKind.SLIDING_ROPE if s else LayerKind.FULL_NOPE for s in self.swa_pattern)

    @property
    def n_swa(self) -> int:
        return sum(self.swa_pattern)

    @property
    def n_full(self) -> int:
        return self.n_layers - self.n_swa

    def kv_rows(self, context: int) -> int:
        """KV rows one slot holds across all layers at `context` (two classes, book 9.7)."""
        return self.n_swa * min(context, self.sliding_window) + self.n_full * context

    def kv_bytes(self, context: int, bytes_per_elem: int = 2) -> int:
        """(n_swa·min(C, W) + n_full·C) · n_kv · head_dim · 2 (K, V) · bytes (f16 = 2)."""
        return self.kv_rows(context) * self.n_kv_heads * self.head_dim * 2 * bytes_per_elem

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, f: GGUFFile) -> "MuseConfig":
        arch = f.get_str("general.architecture")
        if arch != ARCH:
            raise MetadataError(f"general.architecture is {arch!r}, expected {ARCH!r}")
        n_layers = _pos_int(f, _k("block_count"))
        hidden = _pos_int(f, _k("embedding_length"))
        n_heads = _pos_int(f, _k("attention.head_count"))
        n_kv = _pos_int(f, _k("attention.head_count_kv"))
        head_dim = _pos_int(f, _k("attention.key_length"))
        v_len = _pos_int(f, _k("attention.value_length"))
        if v_len != head_dim:
            raise MetadataError(
                f"attention.value_length {v_len} != attention.key_length {head_dim} "
                "(muse-glimmer requires equal K and V head sizes)"
            )
        if head_dim % 2:
            raise MetadataError(f"attention.key_length {head_dim} must be even for RoPE pairs")
        if n_heads % n_kv:
            raise MetadataError(f"head_count {n_heads} is not a multiple of head_count_kv {n_kv}")
        rot_key = _k("rope.dimension_count")
        if rot_key in f and f.get_int(rot_key) != head_dim:
            raise MetadataError(
                f"{rot_key} = {f.get_int(rot_key)}: partial rotary is not Muse Glimmer "
                f"(expected {head_dim})"
            )
        pattern = swa_pattern_from_gguf(f, n_layers)
        expected = tuple(il % COLLAR != COLLAR - 1 for il in range(n_layers))
        if n_layers % COLLAR or pattern != expected:
            shown = "".join("S" if s else "F" for s in pattern)
            raise MetadataError(
                f"sliding_window_pattern {shown} is not the Muse Glimmer collar [S,S,S,F] x n "
                f"(block_count {n_layers})"
            )
        tokens = f.get_array("tokenizer.ggml.tokens", ValueType.STRING)
        vocab = len(tokens)
        if vocab == 0:
            raise MetadataError("tokenizer.ggml.tokens is empty")

        def tok_id(key: str) -> int:
            v = f.get_int(key)
            if not 0 <= v < vocab:
                raise MetadataError(f"metadata key {key!r} = {v} is outside the vocab [0, {vocab})")
            return v

        bos = tok_id("tokenizer.ggml.bos_token_id")
        eos = tok_id("tokenizer.ggml.eos_token_id")
        eot = tok_id("tokenizer.ggml.eot_token_id")
        eog = {eos, eot}
        if "tokenizer.ggml.eom_token_id" in f:
            eog.add(tok_id("tokenizer.ggml.eom_token_id"))
        return cls(
            context_length=_pos_int(f, _k("context_length")),
            hidden=hidden,
            n_layers=n_layers,
            ffn=_pos_int(f, _k("feed_forward_length")),
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            rms_eps=_pos_float(f, _k("attention.layer_norm_rms_epsilon")),
            sliding_window=_pos_int(f, _k("attention.sliding_window")),
            swa_pattern=pattern,
            rope_base=_pos_float(f, _k("rope.freq_base")),
            rope_base_swa=_pos_float(f, _k("rope.freq_base_swa")),
            logit_scale=_pos_float(f, _k("logit_scale")),
            softcap=_pos_float(f, _k("final_logit_softcapping")),
            vocab=vocab,
            bos_id=bos,
            eos_id=eos,
            eot_id=eot,
            eog_ids=frozenset(eog),
        )

    def describe(self) -> dict:
        return {
            "context_length": self.context_length,
            "hidden": self.hidden,
            "n_layers": self.n_layers,
            "ffn": self.ffn,
            "n_heads": self.n_heads,
            "n_kv_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "attn_dim": self.attn_dim,
            "kv_dim": self.kv_dim,
            "heads_per_kv": self.heads_per_kv,
            "attn_scale": self.attn_scale,
            "rms_eps": self.rms_eps,
            "post_norm_eps": self.post_norm_eps,
            "sliding_window": self.sliding_window,
            "collar": "".join("S" if s else "F" for s in self.swa_pattern[:COLLAR]) + f" x {self.n_layers // COLLAR}",
            "n_swa": self.n_swa,
            "n_full": self.n_full,
            "rope_base": self.rope_base,
            "rope_base_swa": self.rope_base_swa,
            "logit_scale": self.logit_scale,
            "softcap": self.softcap,
            "vocab": self.vocab,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
            "eot_id": self.eot_id,
            "eog_ids": sorted(self.eog_ids),
        }
