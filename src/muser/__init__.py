"""Muser: an inference engine for Muse Glimmer.

    import muser
    m = muser.load(path, device="cpu", lane="exact", kv="f16")     # fails closed
    for piece in m.generate("def fib(n):\\n", sampling=muser.SamplingParams(max_tokens=32, seed=1)):
        print(piece, end="")
    s = m.session(max_context=256)            # prefill / decode / checkpoint / rollback
    muser.oracle.load(path, arithmetic="f32")  # the numpy reference, same Session surface

Public names
    load(path=None, device, lane, kv, pin) -> Model   open, validate and upload a GGUF
    Model            .config .identity .tokenizer .chat() .encode_chat() .session()
                     .generate() .stream() .stream_chat() .close()
    SamplingParams   llama.cpp's sampler knobs (temperature 0.8 by default), max_tokens, stop
    oracle           the numpy CPU reference (muser.oracle.load)
    prompt           the one set of prompt defaults (BOS, special text, chat BOS, sampling)
    default_model_path(), cache_dir()   the embedded model; Muser's per-user cache folder
    MuserError       the base of every typed error (muser.errors)
    __version__

Heavy modules (torch) load on first use, so `import muser` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

from .errors import MuserError

__version__ = "0.1.0"

_LAZY = {
    "load": ("muser.api", "load"),
    "Model": ("muser.api", "Model"),
    "default_model_path": ("muser.api", "default_model_path"),
    "cache_dir": ("muser.api", "cache_dir"),
    "SamplingParams": ("muser.sample", "SamplingParams"),
    "oracle": ("muser.oracle", None),
    "prompt": ("muser.prompt", None),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        mod, attr = _LAZY[name]
        m = importlib.import_module(mod)
        return m if attr is None else getattr(m, attr)
    raise AttributeError(f"module 'muser' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["MuserError", "load", "Model", "SamplingParams", "oracle", "prompt", "default_model_path",
           "cache_dir", "__version__"]
