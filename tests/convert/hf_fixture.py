"""A synthetic Muse Glimmer Hugging Face checkpoint: config.json, BF16 safetensors (written by
hand: an 8-byte header length, a JSON header, the data), tokenizer.json and tokenizer_config.json.
Deterministic (seeded), small geometry; `write_checkpoint(dir)` is what the tests convert and
what tools/lcp_convert_reference.py hands to the pinned llama.cpp converter."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from muser.model.synth import BOS, CHAT_TEMPLATE, EOS, EOT, MASK, SPECIALS, train_tokenizer

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 4, 64, 4, 2, 32, 128
VOCAB_TARGET, VOCAB_SIZE = 384, 400  # ids past the trained vocab become [PAD{i}] UNUSED
WINDOW = 32


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (round to nearest even), uint16."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def tensors() -> dict[str, np.ndarray]:
    """HF name -> float32 values, in the order the checkpoint stores them."""
    rng = np.random.default_rng(20261201)
    out: dict[str, np.ndarray] = {}

    def w(name: str, *shape: int, scale: float = 0.05, base: float = 0.0) -> None:
        out[name] = (base + scale * rng.standard_normal(shape)).astype(np.float32)

    w("lm_head.weight", VOCAB_SIZE, HIDDEN)
    w("model.language_model.embed_tokens.weight", VOCAB_SIZE, HIDDEN, scale=0.5)
    for il in range(LAYERS):
        p = f"model.language_model.layers.{il}."
        w(p + "input_layernorm.weight", HIDDEN, scale=0.1)
        w(p + "mlp.down_proj.weight", HIDDEN, FFN)
        w(p + "mlp.gate_proj.weight", FFN, HIDDEN)
        w(p + "mlp.up_proj.weight", FFN, HIDDEN)
        w(p + "post_attention_layernorm.weight", HIDDEN, scale=0.1)
        w(p + "post_feedforward_layernorm.weight", HIDDEN, scale=0.1)
        w(p + "pre_feedforward_layernorm.weight", HIDDEN, scale=0.1)
        w(p + "self_attn.gate_proj.weight", HEADS * HEAD_DIM, HIDDEN)
        w(p + "self_attn.k_proj.weight", KV_HEADS * HEAD_DIM, HIDDEN)
        w(p + "self_attn.o_proj.weight", HIDDEN, HEADS * HEAD_DIM)
        w(p + "self_attn.q_proj.weight", HEADS * HEAD_DIM, HIDDEN)
        w(p + "self_attn.v_proj.weight", KV_HEADS * HEAD_DIM, HIDDEN)
    w("model.language_model.norm.weight", HIDDEN, scale=0.1, base=1.0)
    return out


def write_safetensors(path: Path, arrays: dict[str, np.ndarray], dtype: str = "BF16") -> None:
    header: dict = {"__metadata__": {"format": "pt"}}
    blobs, at = [], 0
    for name, a in arrays.items():
        b = (_bf16(a) if dtype == "BF16" else a.astype(np.float16)).tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [at, at + len(b)]}
        blobs.append(b)
        at += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for b in blobs:
            f.write(b)


def config() -> dict:
    layer_types = ["full_attention" if il % 4 == 3 else "sliding_attention" for il in range(LAYERS)]
    return {
        "architectures": ["MuseGlimmerForConditionalGeneration"],
        "model_type": "muse_glimmer",
        "torch_dtype": "bfloat16",
        "text_config": {
            "model_type": "muse_glimmer_text",
            "vocab_size": VOCAB_SIZE,
            "hidden_size": HIDDEN,
            "intermediate_size": FFN,
            "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5,
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
            "layer_types": layer_types,
            "sliding_window": WINDOW,
            "final_logit_softcapping": 20.0,
            "output_multiplier": 0.19611613513818404,
            "qk_scale_factor": 3.87,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "tie_word_embeddings": False,
        },
    }


def write_tokenizer(d: Path, sharded: bool = False) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens, merges = train_tokenizer(VOCAB_TARGET)
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    tc = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "mask_token": MASK,
          "add_bos_token": True, "add_eos_token": False, "model_max_length": 4096}
    if sharded:  # Llama-3 style: BOS from the post-processor, the template in chat_template.jinja
        from tokenizers import processors

        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, vocab[BOS])])
        (d / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    else:
        tc["chat_template"] = CHAT_TEMPLATE
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(tc, indent=1))
    assert EOT in vocab


def write_checkpoint(d: str | Path, sharded: bool = False) -> Path:
    """BF16 in one model.safetensors; or (sharded) F16 in two parts with an index, a
    TemplateProcessing post-processor and chat_template.jinja."""
    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config(), indent=1))
    arrays = tensors()
    if sharded:
        names = list(arrays)
        parts = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
                 "model-00002-of-00002.safetensors": names[len(names) // 2:]}
        for part, ns in parts.items():
            write_safetensors(d / part, {n: arrays[n] for n in ns}, "F16")
        index = {"metadata": {}, "weight_map": {n: part for part, ns in parts.items() for n in ns}}
        (d / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    else:
        write_safetensors(d / "model.safetensors", arrays)
    write_tokenizer(d, sharded)
    return d
