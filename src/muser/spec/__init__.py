"""DFlash speculative decoding: the drafter sidecar (format), its torch forward (net, drafter), the
acceptance gate and the speculative session (book ch. 8, 10.6).

    from muser.spec import Drafter, SpecSession
    d = Drafter.load("models/muse-glimmer-micro-dflash.gguf", model.engine)
    s = SpecSession(model.session(capture=d.cfg.target_layers), d, verify_len=7)

`muser.spec.net` imports torch only (the trainer shares it); the rest loads on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "Drafter": "muser.spec.drafter", "DraftContext": "muser.spec.drafter", "SpecSession": "muser.spec.session",
    "AcceptanceGate": "muser.spec.gate", "DrafterConfig": "muser.spec.format", "open_drafter": "muser.spec.format",
    "write_drafter": "muser.spec.format",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'muser.spec' has no attribute {name!r}")
