"""The strict reader on well-formed files: every value type, zero-copy tensor views, the type table."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFValueType as V
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from muser.errors import MissingKey, WrongKeyType
from muser.gguf.reader import ValueType, read_gguf
from muser.gguf.types import TYPES, GgmlType, type_info
from muser.gguf.writer import Typed, write_tensors


def test_type_table_matches_ggml_geometry():
    for t in GGMLQuantizationType:
        ti = type_info(int(t))
        assert (ti.block_elems, ti.block_bytes) == GGML_QUANT_SIZES[t], t.name
    assert type_info(1000).ggml_type is GgmlType.NVFP4_E2M1
    assert (type_info(1000).block_elems, type_info(1000).block_bytes) == (2, 1)
    assert type_info(1001).ggml_type is GgmlType.F8_E4M3FN
    assert type_info(40).block_bytes == 36 and type_info(40).block_elems == 64
    assert type_info(12).bits_per_element == 4.5 and type_info(14).bits_per_element == 6.5625
    assert len(TYPES) == len(GGMLQuantizationType) + 2


def test_round_trip_every_value_type(tmp_path):
    md = {
        "t.u8": Typed(200, V.UINT8), "t.i8": Typed(-5, V.INT8), "t.u16": Typed(60000, V.UINT16),
        "t.i16": Typed(-3000, V.INT16), "t.u32": Typed(4_000_000_000, V.UINT32), "t.i32": Typed(-7, V.INT32),
        "t.f32": Typed(0.25, V.FLOAT32), "t.bool": Typed(True, V.BOOL), "t.str": "héllo ✓",
        "t.u64": Typed(1 << 40, V.UINT64), "t.i64": Typed(-(1 << 40), V.INT64), "t.f64": Typed(1e-300, V.FLOAT64),
        "t.arr_i32": Typed([1, -2, 3], V.ARRAY, V.INT32), "t.arr_str": ["a", "", "ß"],
        "t.arr_bool": Typed([True, False, True], V.ARRAY, V.BOOL), "t.arr_f32": Typed([0.5, 1.5], V.ARRAY, V.FLOAT32),
    }
    a = np.arange(64, dtype=np.float32).reshape(2, 32)
    h = np.arange(32, dtype=np.float16)
    q = np.random.default_rng(0).integers(0, 256, size=(3, 34), dtype=np.uint8)
    p = write_tensors(tmp_path / "rt.gguf", "muse-glimmer", md, {
        "a": (a, GgmlType.F32, (32, 2)), "h": (h, GgmlType.F16, (32,)), "q": (q, GgmlType.Q8_0, (32, 3)),
    })
    with read_gguf(p) as f:
        assert f.version == 3 and f.alignment == 32
        assert f.get_int("t.u8") == 200 and f.get_int("t.i8") == -5 and f.get_int("t.u16") == 60000
        assert f.get_int("t.i16") == -3000 and f.get_int("t.u32") == 4_000_000_000 and f.get_int("t.i32") == -7
        assert f.get_float("t.f32") == 0.25 and f.get_bool("t.bool") is True and f.get_str("t.str") == "héllo ✓"
        assert f.get_int("t.u64") == 1 << 40 and f.get_int("t.i64") == -(1 << 40) and f.get_float("t.f64") == 1e-300
        assert list(f.get_array("t.arr_i32", ValueType.INT32)) == [1, -2, 3]
        assert f.get_array("t.arr_str", ValueType.STRING) == ["a", "", "ß"]
        assert list(f.get_array("t.arr_bool")) == [True, False, True]
        assert f.field("t.arr_f32").type_name == "ARRAY[FLOAT32]"
        with pytest.raises(WrongKeyType, match="t.str"):
            f.get_int("t.str")
        with pytest.raises(WrongKeyType, match="t.arr_i32"):
            f.get_array("t.arr_i32", ValueType.STRING)
        with pytest.raises(MissingKey, match="t.none"):
            f.get_int("t.none")
        assert f.architecture == "muse-glimmer"
        # tensors: ggml shape order, numpy views, zero copy and read-only
        ta = f.tensors["a"]
        assert ta.shape == (32, 2) and ta.np_shape == (2, 32) and ta.n_rows == 2 and ta.row_bytes == 128
        av = f.array("a")
        np.testing.assert_array_equal(av, a)
        assert not av.flags.writeable and not av.flags.owndata
        np.testing.assert_array_equal(f.array("h"), h)
        qv = f.raw("q")
        assert qv.shape == (3, 34)
        np.testing.assert_array_equal(qv, q)
        assert all(t.offset % 32 == 0 for t in f)


def test_custom_alignment(tmp_path):
    a = np.ones((4, 32), dtype=np.float32)
    p = write_tensors(tmp_path / "al.gguf", "muse-glimmer", {}, {"a": (a, GgmlType.F32, (32, 4)),
                                                                   "b": (a, GgmlType.F32, (32, 4))}, alignment=64)
    with read_gguf(p) as f:
        assert f.alignment == 64 and f.get_int("general.alignment") == 64
        assert all((t.offset - f.data_offset) % 64 == 0 for t in f)
