"""Tokenizer fixtures for parity work: vocabularies trained with `tokenizers`, written into
vocab-only Muse Glimmer GGUFs (architecture keys + tokenizer keys, no tensors) that the pinned
llama.cpp loads with `vocab_only=True`.

* `train_gpt4o_bpe`: byte-level BPE split by the GPT-4o regex, pre "llama4" (the type llama.cpp
  assigns Muse Glimmer's 202,048-token vocabulary), specials appended after the merges as
  Llama-4-style vocabularies do, plus one user-defined and one unused token.
* `train_spm`: a SentencePiece-style vocabulary for tokenizer.ggml.model "llama": <unk>, <s>,
  </s>, 256 byte tokens <0xXX>, then pieces (spaces as U+2581) scored by merge order.
"""

from __future__ import annotations

import glob
import json
import os
import sysconfig
from pathlib import Path
from typing import Iterable

# The running interpreter's standard library (here /root/.pyenv/versions/3.11.7/lib/python3.11).
STDLIB = sysconfig.get_path("stdlib")

# The GPT-4o split as tokenizer.json states it (Unicode-aware); used only to train.
GPT4O_HF_REGEX = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

LLAMA4_SPECIALS = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
    "<|header_start|>", "<|header_end|>", "<|eom|>", "<|eot|>", "<|step|>",
    "<|python_start|>", "<|python_end|>", "<|finetune_right_pad|>",
)
USER_DEFINED = "<|tool_marker|>"  # partitioned even when special tokens are not parsed
# Two equal-length control tokens that can overlap ("<|ab|ab|>" holds both): their order in
# llama.cpp's special-token cache decides which one a text gets.
OVERLAPPING = ("<|ab|ab", "ab|ab|>")
# Reserved control tokens of the same length, as Llama-4-style vocabularies carry; with them
# introsort puts the second overlapping token first (a plain by-length-then-id order would not).
RESERVED = tuple(f"<|r{k:02d}|>" for k in range(16))
UNUSED = "[PAD_UNUSED]"

LLAMA4_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if tools %}{{- '<|header_start|>system<|header_end|>\\n\\nTools: ' + (tools | tojson) + '<|eot|>' }}{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|header_start|>' + message['role'] + '<|header_end|>\\n\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] | trim }}"
    "{%- else %}{%- for part in message['content'] %}{%- if part['type'] == 'text' %}"
    "{{- part['text'] | trim }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|eot|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|header_start|>assistant<|header_end|>\\n\\n' }}{%- endif %}"
)


# Third-party packages installed into the interpreter live under the stdlib folder too; they are
# not CPython's sources and differ between machines.
_NOT_STDLIB = ("site-packages", "dist-packages")


def stdlib_files(root: str = STDLIB) -> list[str]:
    """Every .py file of the CPython standard library (third-party package folders excluded),
    in a fixed (sorted) order."""
    files = sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True))
    return [f for f in files if os.path.isfile(f)
            and not any(part in _NOT_STDLIB for part in Path(os.path.relpath(f, root)).parts)]


def read_texts(files: Iterable[str], max_bytes: int | None = None) -> list[str]:
    out: list[str] = []
    total = 0
    for f in files:
        b = Path(f).read_bytes()
        try:
            s = b.decode("utf-8")
        except UnicodeDecodeError:
            continue
        out.append(s)
        total += len(b)
        if max_bytes is not None and total >= max_bytes:
            break
    return out


def train_gpt4o_bpe(texts: list[str], vocab_size: int) -> tuple[list[str], list[str]]:
    """Byte-level BPE over the GPT-4o split: (tokens without specials, merges in priority order)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(GPT4O_HF_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [None] * len(model["vocab"])
    for t, i in model["vocab"].items():
        tokens[i] = t
    merges = [m if isinstance(m, str) else f"{m[0]} {m[1]}" for m in model["merges"]]
    return tokens, merges


def gpt4o_tokenizer_metadata(texts: list[str], vocab_size: int) -> dict:
    from gguf import GGUFValueType as V

    from ..gguf.writer import Typed

    tokens, merges = train_gpt4o_bpe(texts, vocab_size)
    types = [1] * len(tokens)  # NORMAL
    tokens.append(UNUSED)
    types.append(5)  # UNUSED
    tokens.append(USER_DEFINED)
    types.append(4)  # USER_DEFINED
    for s in LLAMA4_SPECIALS + OVERLAPPING + RESERVED:
        tokens.append(s)
        types.append(3)  # CONTROL
    tid = tokens.index
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "llama4",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": Typed(types, V.ARRAY, V.INT32),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": Typed(tid("<|begin_of_text|>"), V.UINT32),
        "tokenizer.ggml.eos_token_id": Typed(tid("<|end_of_text|>"), V.UINT32),
        "tokenizer.ggml.eot_token_id": Typed(tid("<|eot|>"), V.UINT32),
        "tokenizer.ggml.padding_token_id": Typed(tid("<|finetune_right_pad|>"), V.UINT32),
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.chat_template": LLAMA4_TEMPLATE,
    }


def train_spm_pieces(texts: list[str], vocab_size: int) -> list[str]:
    """SentencePiece-style pieces (spaces as U+2581, one prefix space per text) by BPE merge order."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    pieces = [None] * len(model["vocab"])
    for t, i in model["vocab"].items():
        pieces[i] = t
    return pieces


def spm_tokenizer_metadata(texts: list[str], vocab_size: int) -> dict:
    from gguf import GGUFValueType as V

    from ..gguf.writer import Typed

    tokens = ["<unk>", "<s>", "</s>"]
    types = [2, 3, 3]  # UNKNOWN, CONTROL, CONTROL
    scores = [0.0, 0.0, 0.0]
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        types.append(6)  # BYTE
        scores.append(0.0)
    seen = set(tokens)
    for rank, p in enumerate(train_spm_pieces(texts, vocab_size)):
        if p in seen:
            continue
        seen.add(p)
        tokens.append(p)
        types.append(1)
        scores.append(-float(rank))
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": Typed(types, V.ARRAY, V.INT32),
        "tokenizer.ggml.scores": Typed(scores, V.ARRAY, V.FLOAT32),
        "tokenizer.ggml.bos_token_id": Typed(1, V.UINT32),
        "tokenizer.ggml.eos_token_id": Typed(2, V.UINT32),
        "tokenizer.ggml.unknown_token_id": Typed(0, V.UINT32),
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
    }


def write_vocab_gguf(path: str | os.PathLike, tokenizer_md: dict) -> Path:
    """A vocab-only Muse Glimmer GGUF: the tiny synthetic fixture's architecture keys with the
    tokenizer keys replaced by `tokenizer_md`, and no tensors."""
    from ..gguf.writer import write_gguf
    from ..model import synth

    md = {k: v for k, v in synth.model_metadata(synth.SynthSpec()).items() if not k.startswith("tokenizer.")}
    md.update(tokenizer_md)
    return write_gguf(path, "muse-glimmer", md, [], lambda s: None)
