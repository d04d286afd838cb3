"""Hugging Face -> GGUF conversion for Muse Glimmer (`muser convert`)."""

from .hf import TARGETS, convert_hf

__all__ = ["TARGETS", "convert_hf"]
