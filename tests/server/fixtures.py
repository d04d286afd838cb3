"""A tiny synthetic Muse Glimmer GGUF speaking the turn protocol: the synthetic tokenizer with
<|start|>, <|message|> and <|eom|> as control tokens and the ATEM template beside this file."""

from __future__ import annotations

from pathlib import Path

from muser.model.synth import SynthSpec, tokenizer_metadata, vocab_size, write_fixture

ATEM_TEMPLATE = Path(__file__).with_name("atem.jinja")
ATEM_SPECIALS = ("<|start|>", "<|message|>", "<|eom|>")
SPEC = SynthSpec(hidden=128, ffn=256, n_heads=4, n_kv_heads=2, head_dim=32, context_length=512,
                 sliding_window=32, seed=7)


def write_atem_fixture(path: Path) -> Path:
    base = vocab_size(SPEC)
    spec = SPEC.with_(vocab_pad_to=base + len(ATEM_SPECIALS))
    md = tokenizer_metadata(spec)
    tokens = list(md["tokenizer.ggml.tokens"])
    tokens[base:] = ATEM_SPECIALS  # reserved control tokens renamed: the protocol's markers
    return write_fixture(path, spec, extra_metadata={"tokenizer.ggml.tokens": tokens,
                                                     "tokenizer.chat_template": ATEM_TEMPLATE.read_text()})
