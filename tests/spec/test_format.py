"""The DFlash sidecar contract: written with the real writer, read strictly, refused by name."""

from __future__ import annotations

import numpy as np
import pytest

from muser.errors import ContractError, LaneError, MetadataError, MissingKey
from muser.gguf.reader import read_gguf
from muser.gguf.writer import write_tensors
from muser.model.loader import open_model
from muser.model.synth import SynthSpec
from muser.spec.drafter import check_pair
from muser.spec.format import ARCH, open_drafter
from muser.spec.policy import FALLBACK_B


def _rewrite(tmp_path, src, drop_keys=(), set_keys=None, drop_tensors=(), add_tensors=None):
    """A copy of drafter `src` with metadata keys / tensors removed or replaced."""
    f = read_gguf(src)
    from muser.spec.format import _typed

    md = {k: _typed(v) for k, v in f.fields.items() if k not in ("general.architecture", "general.alignment")
          and k not in drop_keys}
    md.update(set_keys or {})
    tensors = {t.name: (np.array(f.array(t.name)), t.type.ggml_type, t.shape) for t in f if t.name not in drop_tensors}
    tensors.update(add_tensors or {})
    out = tmp_path / "edited.gguf"
    write_tensors(out, ARCH, md, tensors)
    f.close()
    return out


def test_round_trip_and_fit(spec_target, make_drafter):
    path = make_drafter(spec_target)
    f, cfg = open_drafter(path)
    f.close()
    assert cfg.target_layers == (1, 3) and cfg.block_size == 16 and cfg.window == 2048 and cfg.sink == 64
    assert cfg.mask_token == 3 and not cfg.own_head and not cfg.own_embedding
    mf = open_model(spec_target)
    try:
        g, cfg2, sha = check_pair(path, mf)
        g.close()
        assert cfg2 == cfg and len(sha) == 64
    finally:
        mf.close()


@pytest.mark.parametrize("key, err", [
    ("dflash.attention.sliding_window", "trained context window is unknown"),
    ("dflash.target_layers", "which target layers"),
    ("dflash.block_size", "dflash.block_size"),
    ("tokenizer.ggml.mask_token_id", "mask token"),
    ("dflash.attention.sliding_window_pattern", "sliding_window_pattern"),
])
def test_missing_keys_refused(tmp_path, spec_target, make_drafter, key, err):
    bad = _rewrite(tmp_path, make_drafter(spec_target), drop_keys=(key,))
    with pytest.raises(MissingKey, match=err):
        open_drafter(bad)


def test_refused_variants_and_tensors(tmp_path, spec_target, make_drafter):
    from gguf import GGUFValueType

    from muser.gguf.types import GgmlType
    from muser.gguf.writer import Typed

    src = make_drafter(spec_target)
    with pytest.raises(ContractError, match="DFlash2"):
        open_drafter(_rewrite(tmp_path, src, set_keys={"dflash.selector_rank": Typed(4, GGUFValueType.UINT32)}))
    with pytest.raises(ContractError, match="unexpected tensor 'extra.weight'"):
        open_drafter(_rewrite(tmp_path, src, add_tensors={"extra.weight": (np.zeros(4, np.float32), GgmlType.F32, (4,))}))
    with pytest.raises(ContractError, match="shared-K/V"):
        open_drafter(_rewrite(tmp_path, src, drop_tensors=("blk.0.attn_v.weight",)))
    with pytest.raises(ContractError, match="attention sinks"):
        open_drafter(_rewrite(tmp_path, src, add_tensors={
            "blk.0.attn_sinks.weight": (np.zeros(2, np.float32), GgmlType.F32, (2,))}))
    with pytest.raises(ContractError, match="has shape"):
        open_drafter(_rewrite(tmp_path, src, add_tensors={
            "fc.weight": (np.zeros((64, 64), np.float32), GgmlType.F32, (64, 64))}))
    with pytest.raises(MetadataError, match="block_size 32"):
        open_drafter(_rewrite(tmp_path, src, set_keys={"dflash.block_size": Typed(32, GGUFValueType.UINT32)}))


def test_geometry_must_fit_target(tmp_path, spec_target, make_drafter, make_gguf):
    mf = open_model(spec_target)
    try:
        with pytest.raises(ContractError, match="target layer 4 is outside"):
            check_pair(make_drafter(spec_target, target_layers=[1, 4]), mf)
        other = make_gguf(SynthSpec(hidden=128, n_heads=4, n_kv_heads=2, head_dim=32, ffn=128, sliding_window=16,
                                    context_length=512))
        with pytest.raises(ContractError, match="embedding_length 128 != the target's hidden 64"):
            check_pair(make_drafter(other), mf)
    finally:
        mf.close()


def test_fallback_b_native_nvfp4(tmp_path, make_gguf, make_drafter):
    import json

    from muser.quant.convert import convert

    src = make_gguf(SynthSpec(hidden=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn=256, sliding_window=16,
                              context_length=512, dtype="F16"))
    nv = tmp_path / "native-nvfp4.gguf"
    convert(src, nv, "nvfp4")
    d = make_drafter(nv, head_dim=64)
    mf = open_model(nv)
    try:
        assert "NVFP4_E2M1" in mf.identity.dtype_mix
        with pytest.raises(LaneError) as e:
            check_pair(d, mf, receipts=tmp_path)
        assert str(e.value) == FALLBACK_B
        g, _, sha = check_pair(d, open_model(src))  # the same drafter on the non-native target loads
        g.close()
        rec = {"kind": "spec", "gate": {"status": "pass"},
               "results": {"qualified": True, "target_sha256": mf.identity.artifact_sha256, "drafter_sha256": sha}}
        (tmp_path / "20990101T000000Z-spec.json").write_text(json.dumps(rec))
        g, _, _ = check_pair(d, mf, receipts=tmp_path)  # a qualified receipt names the pair
        g.close()
        rec["results"]["qualified"] = False
        (tmp_path / "20990101T000000Z-spec.json").write_text(json.dumps(rec))
        with pytest.raises(LaneError):
            check_pair(d, mf, receipts=tmp_path)
    finally:
        mf.close()


def test_shipped_drafter_loads_in_pinned_llama_cpp():
    """The shipped sidecar loads in the pinned llama.cpp's `dflash` loader, and a draft context
    sharing the shipped target's head (ctx_other) is created."""
    from pathlib import Path

    llama_cpp = pytest.importorskip("llama_cpp")
    models = Path(__file__).resolve().parents[2] / "models"
    tgt = llama_cpp.Llama(model_path=str(models / "muse-glimmer-micro-q8_0.gguf"), n_ctx=256, verbose=False)
    mp = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(str(models / "muse-glimmer-micro-dflash.gguf").encode(), mp)
    assert model, "llama.cpp refused the drafter file"
    try:
        assert llama_cpp.llama_model_n_embd(model) == 384  # the target's hidden
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx = 256
        cp.ctx_other = tgt._ctx.ctx
        ctx = llama_cpp.llama_init_from_model(model, cp)
        assert ctx, "llama.cpp could not create the draft context beside the target"
        llama_cpp.llama_free(ctx)
    finally:
        llama_cpp.llama_model_free(model)
        tgt.close()


@pytest.mark.parametrize("key", ["dflash.attention.layer_norm_rms_epsilon", "dflash.rope.freq_base"])
def test_float_keys_missing_or_not_positive_refused(tmp_path, spec_target, make_drafter, key):
    from gguf import GGUFValueType

    from muser.gguf.writer import Typed

    src = make_drafter(spec_target)
    with pytest.raises(MissingKey, match=key):
        open_drafter(_rewrite(tmp_path, src, drop_keys=(key,)))
    for bad in (float("nan"), 0.0, -1.0):
        with pytest.raises(MetadataError, match=f"{key}.*finite positive float, got {bad!r}"):
            open_drafter(_rewrite(tmp_path, src, set_keys={key: Typed(bad, GGUFValueType.FLOAT32)}))
