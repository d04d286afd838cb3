"""Fallback B (book 7.6, 8.8): a native NVFP4 target is not qualified for speculative decoding.

The refusal happens at load, before any weights move, unless a qualified speculative receipt
(`muser bench spec`, gate "pass", results.qualified true) names exactly this target and drafter.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import LaneError

NATIVE_NVFP4 = "NVFP4_E2M1"  # Muser's native payload dtype (muser.gguf.types)
FALLBACK_B = ("native NVFP4 fast-lane speculative decode is unqualified; omit --draft and use plain NVFP4 "
              "decode, or route speculative serving to the kquant lane")


def qualified_pair(target_sha: str, drafter_sha: str, receipts: Path | None) -> Path | None:
    """The first qualified spec receipt naming (target, drafter), if any."""
    if receipts is None or not Path(receipts).is_dir():
        return None
    for p in sorted(Path(receipts).glob("*-spec.json")):
        try:
            r = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        res = r.get("results") or {}
        if (r.get("kind") == "spec" and (r.get("gate") or {}).get("status") == "pass" and res.get("qualified") is True
                and res.get("target_sha256") == target_sha and res.get("drafter_sha256") == drafter_sha):
            return p
    return None


def check_fallback_b(dtype_mix: dict, target_sha: str, drafter_sha: str, receipts: Path | None) -> None:
    if NATIVE_NVFP4 in dtype_mix and qualified_pair(target_sha, drafter_sha, receipts) is None:
        raise LaneError(FALLBACK_B)


__all__ = ["FALLBACK_B", "check_fallback_b", "qualified_pair"]
