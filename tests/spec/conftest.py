"""Fixtures: tiny synthetic targets (muser.model.synth) and random DFlash drafters for them, written
as real sidecar GGUFs by muser.spec.format.write_drafter."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from muser.gguf.reader import read_gguf
from muser.model.synth import SynthSpec
from muser.spec.format import write_drafter

# a target small enough for many CPU generations: 4 layers, hidden 64, window 16 (the SWA ring wraps)
SPEC_TARGET = SynthSpec(hidden=64, n_heads=4, n_kv_heads=2, head_dim=32, ffn=128, sliding_window=16,
                        context_length=512, lm_gain=8.0)


def drafter_geo(target, **kw) -> dict:
    geo = {"hidden": target.get_int("muse-glimmer.embedding_length"), "n_layers": 1, "n_heads": 2,
           "n_kv_heads": 1, "head_dim": 32, "ffn": 64, "context_length": 512, "eps": 1e-6, "rope_base": 10000.0,
           "target_layers": [1, 3], "block_size": 16, "window": 2048}
    geo.update(kw)
    return geo


def random_drafter_tensors(geo: dict, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    H, hd = geo["hidden"], geo["head_dim"]

    def w(o, i):
        return (rng.standard_normal((o, i)) / np.sqrt(i)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t = {"fc.weight": w(H, len(geo["target_layers"]) * H), "enc.output_norm.weight": norm(H),
         "output_norm.weight": norm(H)}
    for il in range(geo["n_layers"]):
        p = f"blk.{il}."
        t.update({p + "attn_norm.weight": norm(H), p + "attn_q.weight": w(geo["n_heads"] * hd, H),
                  p + "attn_k.weight": w(geo["n_kv_heads"] * hd, H), p + "attn_v.weight": w(geo["n_kv_heads"] * hd, H),
                  p + "attn_output.weight": w(H, geo["n_heads"] * hd), p + "attn_q_norm.weight": norm(hd),
                  p + "attn_k_norm.weight": norm(hd), p + "ffn_norm.weight": norm(H),
                  p + "ffn_gate.weight": w(geo["ffn"], H), p + "ffn_up.weight": w(geo["ffn"], H),
                  p + "ffn_down.weight": w(H, geo["ffn"])})
    return t


@pytest.fixture(scope="session")
def spec_target(make_gguf):
    return make_gguf(SPEC_TARGET)


@pytest.fixture(scope="session")
def make_drafter(tmp_path_factory):
    """make_drafter(target_path, seed=0, tensors=None, **geo) -> Path of a drafter GGUF for that target."""
    out = tmp_path_factory.mktemp("drafters")
    cache: dict[str, object] = {}

    def make(target_path, seed: int = 0, tensors=None, **kw):
        key = hashlib.sha256(json.dumps([str(target_path), seed, sorted(kw.items()), tensors is None],
                                        default=str).encode()).hexdigest()[:16]
        if tensors is None and key in cache:
            return cache[key]
        f = read_gguf(target_path)
        try:
            geo = drafter_geo(f, **kw)
            path = write_drafter(out / f"drafter-{key}-{len(cache)}.gguf", geo,
                                 tensors if tensors is not None else random_drafter_tensors(geo, seed), f)
        finally:
            f.close()
        cache[key] = path
        return path

    return make
