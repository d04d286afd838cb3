"""The malformed-GGUF corpus: every case is refused with a typed error naming the offending value,
fast and in little memory, from the Python API and from the CLI (one line, exit 2, no traceback)."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from muser.errors import (
    ContractError, GGUFError, GGUFLimitError, GGUFTruncated, MetadataError, MissingKey, WrongKeyType,
)
from muser.gguf.types import GgmlType as G
from muser.gguf.writer import TensorSpec, Typed, write_gguf
from muser.model.loader import open_model
from muser.model.synth import SynthSpec, model_metadata, tensor_bytes, tensor_specs

from . import rawgguf as R

SMALL = SynthSpec(hidden=256, n_heads=4, n_kv_heads=2, head_dim=32, ffn=256, vocab_target=300)


def _one_tensor_file(name="w", dims=(32, 2), dtype=0, offset=0, data_len=None, extra_kv=(), extra_infos=()):
    nbytes = 32 * 2 * 4 if data_len is None else data_len
    return R.gguf([R.kv("general.architecture", R.STR, "muse-glimmer"), *extra_kv],
                  [R.tinfo(name, list(dims), dtype, offset), *extra_infos], b"\x01" * nbytes)


@dataclass
class Case:
    name: str
    build: Callable[[Path], None]  # writes the file
    error: type
    needle: str  # must appear in the message (the offending value)


def raw(b: bytes) -> Callable[[Path], None]:
    return lambda p: p.write_bytes(b)


def synth(md_update=None, md_drop=(), mutate_specs=None, mutate_bytes=None, spec=SMALL):
    def build(p: Path) -> None:
        md = model_metadata(spec)
        md.update(md_update or {})
        for k in md_drop:
            md.pop(k)
        specs = tensor_specs(spec)
        if mutate_specs:
            specs = mutate_specs(specs)

        def produce(s: TensorSpec) -> np.ndarray:
            if mutate_bytes and s.name in mutate_bytes:
                return mutate_bytes[s.name](s)
            return tensor_bytes(spec, s)

        write_gguf(p, "muse-glimmer", md, specs, produce)
    return build


def _replace_spec(name, new):
    return lambda specs: [new if s.name == name else s for s in specs]


def _f32(values):
    return lambda s: np.asarray(values, dtype="<f4")


def _k(x):
    return f"muse-glimmer.{x}"


HEAD = 32
CASES = [
    # -- structure: header ------------------------------------------------------------------
    Case("empty", raw(b""), GGUFTruncated, "0 bytes"),
    Case("bad-magic", raw(b"GGML" + b"\0" * 40), GGUFError, "magic"),
    Case("version-1", raw(R.header(0, 0, version=1)), GGUFError, "version 1"),
    Case("big-endian", raw(b"GGUF" + struct.pack(">I", 3) + b"\0" * 16), GGUFError, "big-endian"),
    Case("truncated-header", raw(R.header(0, 0)[:20]), GGUFTruncated, "truncated"),
    Case("huge-kv-count", raw(R.header(0, 1 << 40)), GGUFLimitError, str(1 << 40)),
    Case("huge-tensor-count", raw(R.header(1 << 40, 0)), GGUFLimitError, str(1 << 40)),
    # -- structure: metadata -----------------------------------------------------------------
    Case("truncated-key", raw(R.header(0, 1) + struct.pack("<Q", 20) + b"general"), GGUFLimitError, "20"),
    Case("huge-string-length", raw(R.header(0, 1) + struct.pack("<Q", 1 << 62) + b"x" * 16), GGUFLimitError, str(1 << 62)),
    Case("unknown-value-type", raw(R.header(0, 1) + R.s("a.b") + struct.pack("<I", 99) + b"\0" * 8), GGUFError, "99"),
    Case("nested-array", raw(R.header(0, 1) + R.s("a.arr") + struct.pack("<II", R.ARR, R.ARR) + struct.pack("<Q", 1) + b"\0" * 16), GGUFError, "a.arr"),
    # The 49-byte file: an array count of 2^40 that would make a naive reader allocate gigabytes.
    Case("array-count-2^40", raw(R.header(0, 1) + R.s("a") + struct.pack("<II", R.ARR, R.U8) + struct.pack("<Q", 1 << 40)), GGUFLimitError, str(1 << 40)),
    Case("string-array-huge-element", raw(R.header(0, 1) + R.s("toks") + struct.pack("<II", R.ARR, R.STR) + struct.pack("<Q", 2) + R.s("ok") + struct.pack("<Q", 1 << 50)), GGUFLimitError, str(1 << 50)),
    Case("duplicate-key", raw(R.gguf([R.kv("a.b", R.U32, 1), R.kv("a.b", R.U32, 2)], [])), GGUFError, "a.b"),
    Case("bad-bool", raw(R.gguf([R.kv("a.flag", R.BOOL, 2)], [])), GGUFError, "a.flag"),
    Case("invalid-utf8-key", raw(R.gguf([R.kv(b"bad\xff", R.U32, 1)], [])), GGUFError, "UTF-8"),
    Case("truncated-value", raw(R.header(0, 1) + R.s("a.u64") + struct.pack("<I", R.U64) + b"\0\0"), GGUFTruncated, "a.u64"),
    # -- structure: tensor infos ---------------------------------------------------------------
    Case("truncated-tensor-info", raw(R.header(2, 0) + R.tinfo("w", [32, 2], 0, 0) + R.s("x" * 40) + struct.pack("<I", 2) + struct.pack("<Q", 4) + b"\0" * 4), GGUFTruncated, "x" * 40),
    Case("n_dims-5", raw(_one_tensor_file(dims=(1, 1, 1, 1, 1))), GGUFError, "n_dims 5"),
    Case("element-count-overflow", raw(_one_tensor_file(dims=(1 << 32, 1 << 32))), GGUFLimitError, "overflows"),
    Case("zero-dim", raw(_one_tensor_file(dims=(32, 0))), GGUFError, "zero-sized"),
    Case("unknown-dtype", raw(_one_tensor_file(dtype=77)), GGUFError, "77"),
    Case("row-not-block-multiple", raw(_one_tensor_file(dims=(100, 2), dtype=int(G.Q4_K))), GGUFError, "100"),
    Case("alignment-not-pow2", raw(_one_tensor_file(extra_kv=[R.kv("general.alignment", R.U32, 48)])), GGUFError, "48"),
    Case("alignment-wrong-type", raw(_one_tensor_file(extra_kv=[R.kv("general.alignment", R.STR, "32")])), WrongKeyType, "general.alignment"),
    Case("misaligned-offset", raw(_one_tensor_file(offset=8)), GGUFError, "offset 8"),
    Case("tensor-past-eof", raw(_one_tensor_file(data_len=100)), GGUFTruncated, "'w'"),
    Case("overlapping-tensors", raw(_one_tensor_file(data_len=1024, extra_infos=[R.tinfo("v", [32, 2], 0, 224)])), GGUFError, "overlap"),
    Case("duplicate-tensor", raw(_one_tensor_file(data_len=1024, extra_infos=[R.tinfo("w", [32, 2], 0, 256)])), GGUFError, "'w'"),
    Case("data-section-past-eof", raw(_one_tensor_file(data_len=0)[:-8]), GGUFTruncated, "truncated"),
    # -- metadata contract -------------------------------------------------------------------
    Case("wrong-architecture", synth(md_update={"general.architecture": "llama"}), MetadataError, "'llama'"),
    Case("missing-embedding-length", synth(md_drop=[_k("embedding_length")]), MissingKey, "embedding_length"),
    Case("wrong-typed-block-count", synth(md_update={_k("block_count"): "4"}), WrongKeyType, "block_count"),
    Case("wrong-typed-eps", synth(md_update={_k("attention.layer_norm_rms_epsilon"): Typed(1, R.U32)}), WrongKeyType, "layer_norm_rms_epsilon"),
    Case("missing-swa-pattern", synth(md_drop=[_k("attention.sliding_window_pattern")]), MissingKey, "sliding_window_pattern"),
    Case("pattern-not-collar", synth(md_update={_k("attention.sliding_window_pattern"): Typed([True, True, False, False], R.ARR, R.BOOL)}), MetadataError, "SSFF"),
    Case("negative-softcap", synth(md_update={_k("final_logit_softcapping"): -20.0}), MetadataError, "-20"),
    Case("eos-out-of-vocab", synth(md_update={"tokenizer.ggml.eos_token_id": Typed(99999, R.U32)}), MetadataError, "99999"),
    Case("value-length-differs", synth(md_update={_k("attention.value_length"): Typed(64, R.U32)}), MetadataError, "64"),
    # -- tensor contract -----------------------------------------------------------------------
    Case("wrong-shape", synth(mutate_specs=_replace_spec("blk.1.attn_q.weight", TensorSpec("blk.1.attn_q.weight", (256, 256), G.F32))),
         ContractError, "[256, 256]"),
    Case("missing-tensor", synth(mutate_specs=lambda ss: [s for s in ss if s.name != "blk.2.ffn_up.weight"]), ContractError, "blk.2.ffn_up.weight"),
    Case("unknown-tensor", synth(mutate_specs=lambda ss: ss + [TensorSpec("blk.0.attn_qkv.weight", (256, 32), G.F32)],
                                 mutate_bytes={"blk.0.attn_qkv.weight": lambda s: np.zeros(256 * 32, "<f4")}), ContractError, "attn_qkv"),
    Case("dtype-not-admitted", synth(mutate_specs=_replace_spec("blk.0.ffn_up.weight", TensorSpec("blk.0.ffn_up.weight", (256, 256), G.Q4_1)),
                                     mutate_bytes={"blk.0.ffn_up.weight": lambda s: np.zeros(s.nbytes, np.uint8)}), ContractError, "Q4_1"),
    Case("quantized-norm", synth(mutate_specs=_replace_spec("blk.0.attn_norm.weight", TensorSpec("blk.0.attn_norm.weight", (256,), G.F16)),
                                 mutate_bytes={"blk.0.attn_norm.weight": lambda s: np.ones(256, "<f2")}), ContractError, "F16"),
    Case("learned-q-norm", synth(mutate_bytes={"blk.1.attn_q_norm.weight": _f32(np.linspace(3.0, 4.0, HEAD))}), ContractError, "blk.1.attn_q_norm"),
    Case("k-norm-not-ones", synth(mutate_bytes={"blk.2.attn_k_norm.weight": _f32([1.0] * (HEAD - 1) + [1.5])}), ContractError, "1.5"),
    Case("q-norm-differs-across-layers", synth(mutate_bytes={"blk.3.attn_q_norm.weight": _f32([2.0] * HEAD)}), ContractError, "2.0"),
    Case("nan-norm", synth(mutate_bytes={"output_norm.weight": _f32([1.0] * 255 + [float("nan")])}), ContractError, "output_norm"),
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("malformed")
    out = {}
    for c in CASES:
        p = d / f"{c.name}.gguf"
        c.build(p)
        out[c.name] = p
    return out


def test_corpus_is_large_enough():
    assert len(CASES) >= 20
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_api_refuses(case: Case, corpus):
    path = corpus[case.name]
    tracemalloc.start()
    t0 = time.perf_counter()
    with pytest.raises(case.error) as ei:
        open_model(path).close()
    dt = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert case.needle in str(ei.value), f"message {str(ei.value)!r} does not name {case.needle!r}"
    assert dt < 0.1, f"{case.name}: {dt * 1000:.1f} ms"
    assert peak < 50 << 20, f"{case.name}: peak {peak / 2**20:.1f} MiB"


def test_cli_refuses_every_case(corpus, tmp_path):
    """One child process per case, measured from a fresh parent so max RSS is per-run."""
    names = [c.name for c in CASES]
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import json, resource, subprocess, sys, time\n"
        "out = {}\n"
        "for name, path in json.loads(sys.argv[1]).items():\n"
        "    t = time.perf_counter()\n"
        "    r = subprocess.run([sys.executable, '-m', 'muser', 'inspect', path], capture_output=True, text=True)\n"
        "    out[name] = [r.returncode, r.stdout, r.stderr, time.perf_counter() - t]\n"
        "out['__maxrss_kb'] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss\n"
        "print(json.dumps(out))\n"
    )
    arg = json.dumps({n: str(corpus[n]) for n in names})
    r = subprocess.run([sys.executable, str(probe), arg], capture_output=True, text=True, check=True)
    res = json.loads(r.stdout)
    for c in CASES:
        rc, stdout, stderr, _ = res[c.name]
        assert rc == 2, (c.name, rc, stderr)
        assert stdout == ""
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("muser: error: "), (c.name, stderr)
        assert "Traceback" not in stderr
        assert c.needle in lines[0], (c.name, lines[0])
    # The whole interpreter (numpy included) stays under 50 MB for every case.
    assert res["__maxrss_kb"] < 50 * 1024, res["__maxrss_kb"]


def test_gguf_package_reader_is_not_what_we_use(corpus):
    """The 2^40-count file is refused by us in bounded memory (a naive reader would try to allocate)."""
    p = corpus["array-count-2^40"]
    assert p.stat().st_size == 49
