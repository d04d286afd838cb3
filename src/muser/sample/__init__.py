"""Sampling: llama.cpp's default sampler chain with its MT19937 stream, reproduced exactly."""

from __future__ import annotations

from .chain import Sampler, log_softmax_at
from .params import SamplingParams, greedy

__all__ = ["SamplingParams", "Sampler", "greedy", "log_softmax_at"]
