"""Muser: an inference engine for Muse Glimmer.

    import muser
    m = muser.load(path, device="cpu", lane="exact", kv="f16")
    muser.oracle.load(path, arithmetic="f32")       # the numpy reference, same Session surface

Heavy modules (torch) load on first use, so `import muser` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

from .errors import MuserError

__version__ = "0.1.0"

_LAZY = {
    "load": ("muser.api", "load"),
    "SamplingParams": ("muser.sample", "SamplingParams"),
    "oracle": ("muser.oracle", None),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        mod, attr = _LAZY[name]
        m = importlib.import_module(mod)
        return m if attr is None else getattr(m, attr)
    raise AttributeError(f"module 'muser' has no attribute {name!r}")


__all__ = ["MuserError", "load", "SamplingParams", "oracle", "__version__"]
