"""Synthetic Muse Glimmer GGUFs: the real key and tensor names, any geometry, any dtype mix.

A fixture is fully determined by its SynthSpec (seeded). Weights start as an f32 master drawn
from N(0, gain²/n_in); quantized tensors are either the master quantized with Muser's reference
quantizers (`source="master"`) or random *valid* blocks of the format with the master's scale
(`source="blocks"`, what the 16.75 GB full-geometry benchmark file uses). The tokenizer is a
byte-level BPE trained by `tokenizers` on a fixed text, with BOS/EOS/EOT, a mask token and a
chat template.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Callable

import numpy as np

from ..gguf.types import GgmlType as G
from ..gguf.types import type_info
from ..gguf.writer import TensorSpec, Typed, write_gguf
from .config import ARCH, COLLAR
from .contract import expected_tensors

# NVFP4 mixes (muser.quant.convert targets of the same names): the projections in the format, the
# embedding and LM head F16 (book 7.5's mix), norms F32.
NVFP4_MIXES = ("nvfp4", "nvfp4-ggml")

# Special tokens of the synthetic tokenizer (ids 0..5, in this order).
BOS, EOS, EOT, MASK, START_HEADER, END_HEADER = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|eot|>", "<|mask|>", "<|start_header|>", "<|end_header|>",
)
SPECIALS = (BOS, EOS, EOT, MASK, START_HEADER, END_HEADER)

CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header|>' + message['role'] + '<|end_header|>\\n\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] | trim }}"
    "{%- else %}{%- for part in message['content'] %}{%- if part['type'] == 'text' %}"
    "{{- part['text'] | trim }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|eot|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header|>assistant<|end_header|>\\n\\n' }}{%- endif %}"
)

# A fixed training text for the fixture tokenizer: prose, code and numbers, so merges are varied.
_TEXT = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Beautiful is better than ugly. Explicit is better than implicit. Simple is better than complex.
Complex is better than complicated. Flat is better than nested. Sparse is better than dense.
Readability counts. Special cases aren't special enough to break the rules.
Although practicality beats purity. Errors should never pass silently. Unless explicitly silenced.
In the face of ambiguity, refuse the temptation to guess.
There should be one-- and preferably only one --obvious way to do it.
Now is better than never. Although never is often better than *right* now.
If the implementation is hard to explain, it's a bad idea.
Namespaces are one honking great idea -- let's do more of those!
def fibonacci(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from empty stack")
        return self.items.pop()

for i in range(10):
    print(f"{i:3d} squared is {i * i:5d}")
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 65536 3.14159 2.71828 1e-5 1e-8
Weights stream from memory for every token; decode is a bandwidth problem, prefill is compute.
"""


@dataclass(frozen=True)
class SynthSpec:
    n_layers: int = 4
    hidden: int = 512
    n_heads: int = 8
    n_kv_heads: int = 2
    head_dim: int = 32  # deliberately != hidden / n_heads (= 64); attn_dim 256
    ffn: int = 512
    vocab_target: int = 384  # BPE size asked of the trainer (specials included)
    vocab_pad_to: int | None = None  # pad with reserved control tokens up to this many
    sliding_window: int = 32
    context_length: int = 4096
    rms_eps: float = 1e-5
    rope_base: float = 1_000_000.0
    rope_base_swa: float = 10_000.0
    logit_scale: float = 1.0 / math.sqrt(26.0)
    softcap: float = 20.0
    q_scale: float = 3.87  # qk_scale_factor broadcast into attn_q_norm (book 9.9)
    dtype: str = "F32"  # one type for every 2-D weight, or a mix: "q4_k_xl" (Figure 6.6), "nvfp4" /
    # "nvfp4-ggml" (projections native NVFP4 + companions / ggml NVFP4 type 40, embedding and LM head F16)
    overrides: tuple[tuple[str, str], ...] = ()  # (tensor name, dtype) pairs
    source: str = "master"  # "master" | "blocks" (quantized bytes)
    seed: int = 0
    gain: float = 1.0  # projection std = gain / sqrt(n_in)
    gains: tuple[tuple[str, float], ...] = ()  # (tensor role, e.g. "ffn_up", gain) overriding gain
    lm_gain: float = 25.0  # LM-head std = lm_gain / sqrt(hidden): peaky logits
    norm_jitter: float = 0.1  # norm weights = 1 + jitter * N(0, 1)
    embd_std: float = 1.0

    def __post_init__(self) -> None:
        if self.n_layers % COLLAR:
            raise ValueError(f"n_layers {self.n_layers} must be a multiple of {COLLAR}")
        if self.source not in ("master", "blocks"):
            raise ValueError(f"source must be 'master' or 'blocks', got {self.source!r}")
        if self.dtype.lower() in NVFP4_MIXES and self.source != "blocks":
            raise ValueError(f"dtype {self.dtype!r} is written from random blocks (source='blocks'); an NVFP4 file "
                             f"of master values is `muser quantize --to {self.dtype.lower()}` of an F16 fixture")

    def with_(self, **kw) -> "SynthSpec":
        return replace(self, **kw)


FULL_GEOMETRY = SynthSpec(
    n_layers=52, hidden=6656, n_heads=32, n_kv_heads=2, head_dim=128, ffn=19968,
    vocab_target=8192, vocab_pad_to=202048, sliding_window=2048, context_length=131072,
    rope_base=500_000.0, rope_base_swa=500_000.0, logit_scale=0.196116,
    dtype="q4_k_xl", source="blocks", lm_gain=25.0,
)


# ---------------------------------------------------------------------------------------------
# tokenizer


@lru_cache(maxsize=8)
def train_tokenizer(vocab_target: int, text: str = _TEXT) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Byte-level BPE trained on `text`: (tokens by id, merges "a b" in priority order)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_target,
        min_frequency=2,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([text] * 4, trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    merges = [m if isinstance(m, str) else f"{m[0]} {m[1]}" for m in model["merges"]]
    return tuple(tokens), tuple(merges)


def tokenizer_metadata(spec: SynthSpec) -> dict:
    tokens, merges = train_tokenizer(spec.vocab_target)
    tokens = list(tokens)
    types = [3 if t in SPECIALS else 1 for t in tokens]  # 3 = CONTROL, 1 = NORMAL (llama_token_type)
    if spec.vocab_pad_to is not None:
        if spec.vocab_pad_to < len(tokens):
            raise ValueError(f"vocab_pad_to {spec.vocab_pad_to} < trained vocab {len(tokens)}")
        for i in range(len(tokens), spec.vocab_pad_to):
            tokens.append(f"<|reserved_{i}|>")
            types.append(3)
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": Typed(types, _gv().ARRAY, _gv().INT32),
        "tokenizer.ggml.merges": list(merges),
        "tokenizer.ggml.bos_token_id": Typed(tokens.index(BOS), _gv().UINT32),
        "tokenizer.ggml.eos_token_id": Typed(tokens.index(EOS), _gv().UINT32),
        "tokenizer.ggml.eot_token_id": Typed(tokens.index(EOT), _gv().UINT32),
        "tokenizer.ggml.mask_token_id": Typed(tokens.index(MASK), _gv().UINT32),
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }


def _gv():
    from gguf import GGUFValueType

    return GGUFValueType


def vocab_size(spec: SynthSpec) -> int:
    if spec.vocab_pad_to is not None:
        return spec.vocab_pad_to
    return len(train_tokenizer(spec.vocab_target)[0])


# ---------------------------------------------------------------------------------------------
# metadata


def model_metadata(spec: SynthSpec) -> dict:
    V = _gv()
    k = lambda s: f"{ARCH}.{s}"  # noqa: E731
    md = {
        "general.name": "muse-glimmer-synthetic",
        "general.file_type": Typed(_FILE_TYPE.get(spec.dtype.lower(), 0 if spec.dtype == "F32" else 1), V.UINT32),
        k("context_length"): Typed(spec.context_length, V.UINT32),
        k("embedding_length"): Typed(spec.hidden, V.UINT32),
        k("block_count"): Typed(spec.n_layers, V.UINT32),
        k("feed_forward_length"): Typed(spec.ffn, V.UINT32),
        k("attention.head_count"): Typed(spec.n_heads, V.UINT32),
        k("attention.head_count_kv"): Typed(spec.n_kv_heads, V.UINT32),
        k("attention.key_length"): Typed(spec.head_dim, V.UINT32),
        k("attention.value_length"): Typed(spec.head_dim, V.UINT32),
        k("attention.layer_norm_rms_epsilon"): Typed(spec.rms_eps, V.FLOAT32),
        k("attention.sliding_window"): Typed(spec.sliding_window, V.UINT32),
        k("attention.sliding_window_pattern"): Typed(
            [il % COLLAR != COLLAR - 1 for il in range(spec.n_layers)], V.ARRAY, V.BOOL
        ),
        k("rope.freq_base"): Typed(spec.rope_base, V.FLOAT32),
        k("rope.freq_base_swa"): Typed(spec.rope_base_swa, V.FLOAT32),
        k("logit_scale"): Typed(spec.logit_scale, V.FLOAT32),
        k("final_logit_softcapping"): Typed(spec.softcap, V.FLOAT32),
    }
    if spec.dtype.lower() in NVFP4_MIXES:  # book 7.3: the pairing rule the loader checks
        from ..quant.nvfp4 import WEIGHT_PRECISION_KEY

        md[WEIGHT_PRECISION_KEY] = spec.dtype.lower()
    md.update(tokenizer_metadata(spec))
    return md


_FILE_TYPE = {"q4_k_xl": 15, "nvfp4-ggml": 39}  # llama.h llama_ftype (MOSTLY_Q4_K_M, MOSTLY_NVFP4)


# ---------------------------------------------------------------------------------------------
# dtypes


def q4_k_xl_type(name: str) -> G:
    """Figure 6.6: Q4_K bulk, Q6_K on attn_v and ffn_down of every other layer, Q5_K LM head,
    Q4_K embedding; norms F32."""
    if name == "output.weight":
        return G.Q5_K
    if name.startswith("blk."):
        il = int(name.split(".")[1])
        if name.endswith(("attn_v.weight", "ffn_down.weight")) and il % 2 == 0:
            return G.Q6_K
    return G.Q4_K


def tensor_types(spec: SynthSpec) -> dict[str, G]:
    from .contract import TensorClass

    cfg = _config_like(spec)
    over = dict(spec.overrides)
    out: dict[str, G] = {}
    for r in expected_tensors(cfg):
        if r.cls in (TensorClass.NORM, TensorClass.QK_NORM):
            t = G.F32
        elif spec.dtype.lower() == "q4_k_xl":
            t = q4_k_xl_type(r.name)
        elif spec.dtype.lower() in NVFP4_MIXES:
            if r.name in ("token_embd.weight", "output.weight"):
                t = G.F16
            else:
                t = G.NVFP4 if spec.dtype.lower() == "nvfp4-ggml" else G.NVFP4_E2M1
        else:
            t = G[spec.dtype.upper()]
        if r.name in over:
            t = G[over[r.name].upper()]
        out[r.name] = t
    return out


@dataclass(frozen=True)
class _Geo:
    hidden: int
    attn_dim: int
    kv_dim: int
    ffn: int
    vocab: int
    head_dim: int
    n_layers: int


def _config_like(spec: SynthSpec) -> _Geo:
    return _Geo(
        spec.hidden, spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim,
        spec.ffn, vocab_size(spec), spec.head_dim, spec.n_layers,
    )


# ---------------------------------------------------------------------------------------------
# values


def _rng(spec: SynthSpec, name: str) -> np.random.Generator:
    # Per-tensor stream: a tensor's values do not depend on which other tensors exist.
    h = int.from_bytes(name.encode()[:32].ljust(32, b"\0"), "little") % (1 << 63)
    return np.random.Generator(np.random.PCG64([spec.seed, h, len(name)]))


def master_values(spec: SynthSpec, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """f32 master values in numpy order (rows = out, cols = in)."""
    rng = _rng(spec, name)
    np_shape = tuple(reversed(shape))
    if name.endswith("attn_q_norm.weight"):
        return np.full(np_shape, spec.q_scale, dtype=np.float32)
    if name.endswith("attn_k_norm.weight"):
        return np.ones(np_shape, dtype=np.float32)
    if len(shape) == 1:  # norms near 1
        return (1.0 + spec.norm_jitter * rng.standard_normal(np_shape)).astype(np.float32)
    return (rng.standard_normal(np_shape, dtype=np.float32) * np.float32(_std(spec, name, shape))).astype(np.float32)


def _std(spec: SynthSpec, name: str, shape: tuple[int, ...]) -> float:
    if name == "token_embd.weight":
        return spec.embd_std
    if name == "output.weight":
        return spec.lm_gain / math.sqrt(shape[0])
    for role, g in spec.gains:
        if f".{role}.weight" in name:
            return g / math.sqrt(shape[0])
    return spec.gain / math.sqrt(shape[0])


def _f16_field(blocks: np.ndarray, at: int, values: np.ndarray) -> None:
    blocks[..., at : at + 2] = values.astype("<f2").view(np.uint8).reshape(values.shape + (2,))


# Byte offsets of the f16 scale fields in each block (ggml-common.h block_* structs).
_D_FIELDS = {
    G.Q8_0: ((0, 1.0),),
    G.Q4_0: ((0, 1.0),),
    G.Q4_K: ((0, 1.0), (2, 7.5)),  # d, dmin = 7.5 d: sub-block means roughly centred
    G.Q5_K: ((0, 1.0), (2, 15.5)),
    G.Q6_K: ((208, 1.0),),
}
# Empirical std of a block's values at d = 1 (dmin = ratio · d), measured once per type.
_UNIT_STD: dict[G, float] = {}


def _unit_std(t: G) -> float:
    if t not in _UNIT_STD:
        from gguf.quants import dequantize

        rng = np.random.Generator(np.random.PCG64(1234))
        b = _random_blocks(rng, t, 4096, np.ones(4096, dtype=np.float32))
        vals = dequantize(b.reshape(-1), t.value)
        _UNIT_STD[t] = float(np.std(vals))
    return _UNIT_STD[t]


def _random_blocks(rng: np.random.Generator, t: G, n_blocks: int, d: np.ndarray) -> np.ndarray:
    ti = type_info(t)
    b = np.frombuffer(rng.bytes(n_blocks * ti.block_bytes), dtype=np.uint8).reshape(n_blocks, ti.block_bytes).copy()
    for at, ratio in _D_FIELDS[t]:
        _f16_field(b, at, d * np.float32(ratio))
    return b


def random_block_bytes(spec: SynthSpec, name: str, shape: tuple[int, ...], t: G) -> np.ndarray:
    """Random valid blocks of type t whose values have the master's std (f16 d jittered ±50%)."""
    rng = _rng(spec, name)
    ti = type_info(t)
    n = 1
    for s in shape:
        n *= s
    n_blocks = n // ti.block_elems
    d0 = _std(spec, name, shape) / _unit_std(t)
    d = (d0 * rng.uniform(0.5, 1.5, size=n_blocks)).astype(np.float32)
    return _random_blocks(rng, t, n_blocks, d)


# NVFP4 (book 7.1): every byte of an E2M1 payload is two valid codes, so random bytes are valid
# blocks; the scales carry the master's std. RMS of an E2M1 value over the 16 codes uniformly:
# sqrt(mean(E2M1_VALUES^2)) = sqrt(8.5625). ggml's type 40 stores doubled codes and halves its
# UE4M3 scale (ggml_ue4m3_to_fp32), so the same d gives the same values.
_E2M1_RMS = math.sqrt(8.5625)


def _scale_codes(table: np.ndarray, d0: float, rng: np.random.Generator, n: int) -> np.ndarray:
    """n scale bytes drawn uniformly from the codes whose value lies in [d0/2, 3 d0/2] (the ±50%
    jitter of the K-quant blocks' d, as bytes: no per-value encode over billions of scales)."""
    codes = np.flatnonzero((table >= 0.5 * d0) & (table <= 1.5 * d0)).astype(np.uint8)  # NaN compares False
    if codes.size == 0:
        raise ValueError(f"no scale code within [{0.5 * d0:g}, {1.5 * d0:g}]")
    return codes[rng.integers(0, codes.size, size=n)]


def nvfp4_ggml_block_bytes(spec: SynthSpec, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Random valid ggml NVFP4 blocks (type 40: 4 UE4M3 sub-block scales + 32 payload bytes)."""
    from ..quant.fp4 import UE4M3_HALF_VALUES

    rng = _rng(spec, name)
    n_blocks = math.prod(shape) // 64
    b = np.frombuffer(rng.bytes(n_blocks * 36), dtype=np.uint8).reshape(n_blocks, 36).copy()
    # value = kvalues[q] (doubled E2M1) x UE4M3/2 = E2M1 x UE4M3 (ggml_ue4m3_to_fp32)
    table = UE4M3_HALF_VALUES * np.float32(2.0)
    table[0x80:] = np.nan  # bit 7 is ignored: draw from the canonical codes only
    d0 = _std(spec, name, shape) / _E2M1_RMS
    b[:, 0:4] = _scale_codes(table, d0, rng, n_blocks * 4).reshape(n_blocks, 4)
    return b


def nvfp4_native_parts(spec: SynthSpec, name: str, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Random native NVFP4: payload uint8 [n_out, n_in/2] and E4M3FN scales uint8 [n_out, n_in/16]
    (scale2 = 1). Recomputed per call from the tensor's seed, so payload and scales agree."""
    from ..quant.fp4 import E4M3FN_VALUES

    rng = _rng(spec, name)
    n_in, n_out = shape
    packed = np.frombuffer(rng.bytes(n_out * n_in // 2), dtype=np.uint8).reshape(n_out, n_in // 2)
    d0 = _std(spec, name, shape) / _E2M1_RMS
    scales = _scale_codes(E4M3FN_VALUES, d0, rng, n_out * n_in // 16).reshape(n_out, n_in // 16)
    return packed, scales


def _companion_base(specs_by_name: dict[str, TensorSpec], name: str) -> tuple[str, str] | None:
    from ..quant.nvfp4 import SCALE2_SUFFIX, SCALE_SUFFIX

    for suf in (SCALE_SUFFIX, SCALE2_SUFFIX):
        if name.endswith(suf) and name[: -len(suf)] in specs_by_name:
            return name[: -len(suf)], suf
    return None


def tensor_bytes(spec: SynthSpec, s: TensorSpec) -> np.ndarray:
    t = s.ggml_type
    if t in (G.F32, G.F16, G.BF16) or spec.source == "master" or len(s.shape) == 1:
        vals = master_values(spec, s.name, s.shape)
        return encode(vals, t)
    if t in _D_FIELDS:
        return random_block_bytes(spec, s.name, s.shape, t)
    if t == G.NVFP4:
        return nvfp4_ggml_block_bytes(spec, s.name, s.shape)
    if t == G.NVFP4_E2M1:
        return nvfp4_native_parts(spec, s.name, s.shape)[0]
    raise ValueError(f"no random-block generator for {t.name}")


def f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even f32 -> bf16 bits, NaN kept quiet (ggml_compute_fp32_to_bf16)."""
    u = np.ascontiguousarray(values, dtype="<f4").view("<u4").astype(np.uint64)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype("<u2")
    r[nan] = ((u[nan] >> 16) | 64).astype("<u2")
    return r


def encode(values: np.ndarray, t: G) -> np.ndarray:
    """f32 values (numpy order, rows contiguous) -> stored bytes of type t."""
    if t == G.F32:
        return np.ascontiguousarray(values, dtype="<f4")
    if t == G.F16:
        return np.ascontiguousarray(values.astype("<f2"))
    if t == G.BF16:
        return f32_to_bf16(values)
    from ..quant import quantize  # Muser's reference quantizers (bit-identical to ggml's)

    return quantize(values, t)


# ---------------------------------------------------------------------------------------------
# writing


def tensor_specs(spec: SynthSpec) -> list[TensorSpec]:
    """Every tensor in file order; a native NVFP4 weight is followed by its companions (book 7.3)."""
    from ..quant.nvfp4 import GROUP, SCALE2_SUFFIX, SCALE_SUFFIX

    types = tensor_types(spec)
    out: list[TensorSpec] = []
    for r in expected_tensors(_config_like(spec)):
        out.append(TensorSpec(r.name, r.shape, types[r.name]))
        if types[r.name] == G.NVFP4_E2M1:
            n_in, n_out = r.shape
            out += [TensorSpec(r.name + SCALE_SUFFIX, (n_in // GROUP, n_out), G.F8_E4M3FN),
                    TensorSpec(r.name + SCALE2_SUFFIX, (1,), G.F32)]
    return out


def write_fixture(
    path: str | Path,
    spec: SynthSpec = SynthSpec(),
    extra_metadata: dict | None = None,
    drop_metadata: tuple[str, ...] = (),
    progress: Callable[[TensorSpec], None] | None = None,
) -> Path:
    """Write the fixture described by `spec` to `path` (atomically)."""
    md = model_metadata(spec)
    md["muser.synth_spec"] = json.dumps(asdict(spec), sort_keys=True)
    if extra_metadata:
        md.update(extra_metadata)
    for key in drop_metadata:
        md.pop(key, None)
    specs = tensor_specs(spec)
    by_name = {s.name: s for s in specs}

    def produce(s: TensorSpec) -> np.ndarray:
        comp = _companion_base(by_name, s.name) if s.ggml_type in (G.F8_E4M3FN, G.F32) else None
        if comp is None:
            return tensor_bytes(spec, s)
        base, suf = comp
        if suf.endswith("scale2"):
            return np.array([1.0], dtype="<f4")  # scale2 = 1: the E4M3FN scales carry the magnitude
        return nvfp4_native_parts(spec, base, by_name[base].shape)[1]

    return write_gguf(path, ARCH, md, specs, produce, progress=progress)
