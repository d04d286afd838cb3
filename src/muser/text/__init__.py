"""Text: the GGUF tokenizer (llama.cpp-exact), the streaming detokenizer, the chat template."""

from __future__ import annotations

from .tokenizer import Tokenizer

__all__ = ["Tokenizer", "Detokenizer", "ChatTemplate"]


def __getattr__(name: str):
    if name == "Detokenizer":
        from .detok import Detokenizer

        return Detokenizer
    if name == "ChatTemplate":
        from .template import ChatTemplate

        return ChatTemplate
    raise AttributeError(f"module 'muser.text' has no attribute {name!r}")
