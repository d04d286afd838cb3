"""MuseConfig from GGUF metadata (Table 9.1), derived quantities, the collar, the KV formula."""

from __future__ import annotations

import math

import numpy as np
import pytest
from gguf import GGUFValueType as V

from muser.errors import MetadataError, MissingKey
from muser.gguf.reader import read_gguf
from muser.gguf.writer import Typed, write_gguf
from muser.model.config import POST_NORM_EPS, LayerKind, MuseConfig
from muser.model.contract import check_contract, expected_tensors, parameter_count
from muser.model.synth import FULL_GEOMETRY, SynthSpec, model_metadata


def _metadata_only(tmp_path, spec, **update):
    md = model_metadata(spec)
    md.update(update)
    return write_gguf(tmp_path / "md.gguf", "muse-glimmer", md, [], lambda s: None)


def test_tiny_fixture_config(tiny_gguf):
    with read_gguf(tiny_gguf) as f:
        c = MuseConfig.from_gguf(f)
        r = check_contract(f, c)
    assert (c.n_layers, c.hidden, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn) == (4, 512, 8, 2, 32, 512)
    assert c.attn_dim == 256 and c.kv_dim == 64 and c.heads_per_kv == 4
    assert c.attn_scale == float(np.float32(1) / np.sqrt(np.float32(32)))
    assert c.layer_kinds == (LayerKind.SLIDING_ROPE,) * 3 + (LayerKind.FULL_NOPE,)
    assert [k.uses_rope for k in c.layer_kinds] == [True, True, True, False]
    assert c.sliding_window == 32 and c.rope_base_swa == 10000.0
    assert c.logit_scale == pytest.approx(1 / math.sqrt(26), rel=1e-6) and c.softcap == 20.0
    assert c.rms_eps == pytest.approx(1e-5) and c.post_norm_eps == float(np.float32(1e-8)) == float(POST_NORM_EPS)
    assert (c.bos_id, c.eos_id, c.eot_id) == (0, 1, 2) and c.eog_ids == {1, 2}
    assert r.q_scale == pytest.approx(3.87)


def test_full_geometry_book_numbers(tmp_path):
    """Book 9.12 and 9.7: 27,854,794,240 parameters; 1,826,619,392 B of f16 KV per 131,072 slot."""
    p = _metadata_only(tmp_path, FULL_GEOMETRY)
    with read_gguf(p) as f:
        c = MuseConfig.from_gguf(f)
    assert (c.n_layers, c.hidden, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn, c.vocab) == \
        (52, 6656, 32, 2, 128, 19968, 202048)
    assert c.n_swa == 39 and c.n_full == 13
    assert [i for i, k in enumerate(c.layer_kinds) if k is LayerKind.FULL_NOPE] == list(range(3, 52, 4))
    assert c.attn_dim == 4096 and c.kv_dim == 256 and c.heads_per_kv == 16
    assert parameter_count(c) == 27_854_794_240
    assert c.kv_bytes(131_072) == 1_826_619_392
    assert c.kv_bytes(1) == 52 * 1024  # 1,024 B per cached row per layer (book 9.5)
    assert c.kv_bytes(2048) == 52 * 2048 * 1024
    assert len(expected_tensors(c)) == 3 + 52 * 14


def test_pattern_as_period(tmp_path):
    # llama.cpp also accepts a u32 period: layer il is sliding iff il % n < n - 1.
    p = _metadata_only(tmp_path, SynthSpec(n_layers=8), **{
        "muse-glimmer.attention.sliding_window_pattern": Typed(4, V.UINT32)})
    with read_gguf(p) as f:
        assert MuseConfig.from_gguf(f).swa_pattern == (True, True, True, False) * 2


def test_pattern_wrong_length_refused(tmp_path):
    p = _metadata_only(tmp_path, SynthSpec(), **{
        "muse-glimmer.attention.sliding_window_pattern": Typed([True, True, True, False] * 2, V.ARRAY, V.BOOL)})
    with read_gguf(p) as f, pytest.raises(MetadataError, match="8 entries"):
        MuseConfig.from_gguf(f)


def test_partial_rotary_refused(tmp_path):
    p = _metadata_only(tmp_path, SynthSpec(), **{"muse-glimmer.rope.dimension_count": Typed(16, V.UINT32)})
    with read_gguf(p) as f, pytest.raises(MetadataError, match="16"):
        MuseConfig.from_gguf(f)


@pytest.mark.parametrize("key", [
    "context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
    "attention.head_count_kv", "attention.key_length", "attention.value_length",
    "attention.layer_norm_rms_epsilon", "attention.sliding_window", "attention.sliding_window_pattern",
    "rope.freq_base", "rope.freq_base_swa", "logit_scale", "final_logit_softcapping",
])
def test_every_key_is_required(tmp_path, key):
    md = model_metadata(SynthSpec())
    md.pop(f"muse-glimmer.{key}")
    p = write_gguf(tmp_path / "m.gguf", "muse-glimmer", md, [], lambda s: None)
    with read_gguf(p) as f, pytest.raises(MissingKey, match=key.replace(".", r"\.")):
        MuseConfig.from_gguf(f)


@pytest.mark.parametrize("key", ["tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"])
def test_special_ids_required(tmp_path, key):
    md = model_metadata(SynthSpec())
    md.pop(key)
    p = write_gguf(tmp_path / "m.gguf", "muse-glimmer", md, [], lambda s: None)
    with read_gguf(p) as f, pytest.raises(MissingKey, match=key):
        MuseConfig.from_gguf(f)


def test_eom_joins_eog(tmp_path):
    p = _metadata_only(tmp_path, SynthSpec(), **{"tokenizer.ggml.eom_token_id": Typed(5, V.UINT32)})
    with read_gguf(p) as f:
        assert MuseConfig.from_gguf(f).eog_ids == {1, 2, 5}
