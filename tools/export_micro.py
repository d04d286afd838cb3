#!/usr/bin/env python3
"""Export the trained micro Muse Glimmer to GGUF: F16 master (norms F32) and Q8_0, with identity pins.

    tools/export_micro.py --weights RUN_OUT [--corpus .device/micro] [--out models]
                          [--dtypes F16,Q8_0] [--quantizer muser|gguf]

RUN_OUT holds what tools/train_micro.py wrote (micro-weights.json + micro-weights-N.npz). The weights
are already in llama.cpp's convention (norm weights as llama.cpp multiplies them, i.e. the converter's
`+1` already applied; Q/K rows in the interleaved RoPE layout; attn_q_norm = qk_scale_factor broadcast,
attn_k_norm = ones), so the export is a straight copy under the real key and tensor names
(src/models/muse-glimmer.cpp, conversion/muse_glimmer.py). Every quantized file is derived from the F16
master values (the llama-quantize flow: F16 GGUF -> f32 -> quantize). Files are validated with
muser.model.loader.open_model after writing, and a pin is written beside each.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tools"))

import corpus  # noqa: E402
from gguf import GGUFValueType as V  # noqa: E402

from muser.gguf.identity import write_pin  # noqa: E402
from muser.gguf.types import GgmlType as G  # noqa: E402
from muser.gguf.writer import TensorSpec, Typed, write_gguf  # noqa: E402
from muser.model.config import ARCH, COLLAR  # noqa: E402
from muser.model.contract import TensorClass, expected_tensors  # noqa: E402
from muser.model.loader import open_model  # noqa: E402
from muser.model.synth import CHAT_TEMPLATE  # noqa: E402

NAME = "muse-glimmer-micro"
FILE_TYPE = {"F32": 0, "F16": 1, "Q8_0": 7}  # llama_ftype: ALL_F32, MOSTLY_F16, MOSTLY_Q8_0


class ExportError(Exception):
    pass


@dataclass(frozen=True)
class _Geo:  # the fields contract.expected_tensors reads
    hidden: int
    attn_dim: int
    kv_dim: int
    ffn: int
    vocab: int
    head_dim: int
    n_layers: int


def geo_of(g: dict) -> _Geo:
    return _Geo(g["hidden"], g["n_heads"] * g["head_dim"], g["n_kv_heads"] * g["head_dim"], g["ffn"],
                g["vocab"], g["head_dim"], g["n_layers"])


# ---------------------------------------------------------------------------------------------
# inputs


def load_weights(run_dir: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """(manifest, name -> f32 array in numpy order), every shard checked against its SHA-256."""
    run_dir = Path(run_dir)
    man_path = run_dir / "micro-weights.json"
    if not man_path.is_file():
        raise ExportError(f"{str(man_path)!r} not found (the training run's output)")
    man = json.loads(man_path.read_text())
    if man.get("format") != "muse-glimmer-micro/1":
        raise ExportError(f"{str(man_path)!r}: unknown format {man.get('format')!r}")
    arrays: dict[str, np.ndarray] = {}
    for fn, digest in man["shards"].items():
        p = run_dir / fn
        got = hashlib.sha256(p.read_bytes()).hexdigest()
        if got != digest:
            raise ExportError(f"shard {str(p)!r}: sha256 {got} != manifest {digest}")
        with np.load(p, allow_pickle=False) as z:
            for k in z.files:
                arrays[k] = np.ascontiguousarray(z[k], dtype=np.float32)
    for name, info in man["tensors"].items():
        if name not in arrays:
            raise ExportError(f"tensor {name!r} missing from shard {info['shard']!r}")
        if list(arrays[name].shape) != info["shape"]:
            raise ExportError(f"tensor {name!r} has shape {list(arrays[name].shape)}, manifest {info['shape']}")
        if not np.all(np.isfinite(arrays[name])):
            raise ExportError(f"tensor {name!r} holds non-finite values")
    return man, arrays


def load_tokenizer(corpus_dir: Path, want_sha: str) -> tuple[list[str], list[str], dict]:
    from tokenizers import Tokenizer

    corpus_dir = Path(corpus_dir)
    cman = json.loads((corpus_dir / "corpus.json").read_text())
    tok = Tokenizer.from_file(str(corpus_dir / "tokenizer.json"))
    tokens, merges = corpus.vocab_and_merges(tok)
    have = hashlib.sha256(json.dumps([tokens, merges]).encode()).hexdigest()
    if have != want_sha or cman["tokenizer"]["vocab_sha256"] != want_sha:
        raise ExportError(f"tokenizer in {str(corpus_dir)!r} has vocab sha256 {have}, the weights were trained "
                          f"with {want_sha} (rebuild with tools/corpus.py build)")
    return tokens, merges, cman


# ---------------------------------------------------------------------------------------------
# metadata


def metadata(g: dict, tokens: list[str], merges: list[str], dtype: str, provenance: dict) -> dict:
    k = lambda s: f"{ARCH}.{s}"  # noqa: E731
    n = g["n_layers"]
    specials = set(corpus.SPECIALS)
    return {
        "general.name": NAME,
        "general.file_type": Typed(FILE_TYPE[dtype], V.UINT32),
        k("context_length"): Typed(g["seq_len"], V.UINT32),
        k("embedding_length"): Typed(g["hidden"], V.UINT32),
        k("block_count"): Typed(n, V.UINT32),
        k("feed_forward_length"): Typed(g["ffn"], V.UINT32),
        k("attention.head_count"): Typed(g["n_heads"], V.UINT32),
        k("attention.head_count_kv"): Typed(g["n_kv_heads"], V.UINT32),
        k("attention.key_length"): Typed(g["head_dim"], V.UINT32),
        k("attention.value_length"): Typed(g["head_dim"], V.UINT32),
        k("attention.layer_norm_rms_epsilon"): Typed(g["rms_eps"], V.FLOAT32),
        k("attention.sliding_window"): Typed(g["window"], V.UINT32),
        k("attention.sliding_window_pattern"): Typed([il % COLLAR != COLLAR - 1 for il in range(n)], V.ARRAY, V.BOOL),
        k("rope.freq_base"): Typed(g["rope_base"], V.FLOAT32),
        k("rope.freq_base_swa"): Typed(g["rope_base_swa"], V.FLOAT32),
        k("logit_scale"): Typed(g["logit_scale"], V.FLOAT32),
        k("final_logit_softcapping"): Typed(g["softcap"], V.FLOAT32),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": corpus.TOKENIZER_PRE,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": Typed([3 if t in specials else 1 for t in tokens], V.ARRAY, V.INT32),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": Typed(tokens.index(corpus.BOS), V.UINT32),
        "tokenizer.ggml.eos_token_id": Typed(tokens.index(corpus.EOS), V.UINT32),
        "tokenizer.ggml.eot_token_id": Typed(tokens.index(corpus.EOT), V.UINT32),
        "tokenizer.ggml.mask_token_id": Typed(tokens.index(corpus.MASK), V.UINT32),
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.chat_template": CHAT_TEMPLATE,
        "muser.micro.provenance": json.dumps(provenance, sort_keys=True),
    }


# ---------------------------------------------------------------------------------------------
# tensors


def quantizer(kind: str):
    """values f32 [rows, n] -> Q8_0 bytes; 'muser' = muser.quant.quantize, 'gguf' = gguf.quants.quantize."""
    if kind == "muser":
        try:
            from muser.quant import quantize
        except ImportError as e:
            raise ExportError(f"muser.quant.quantize is not available ({e}); pass --quantizer gguf") from None
        return lambda vals, t: np.asarray(quantize(vals, t))
    if kind == "gguf":
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import quantize as gq

        return lambda vals, t: gq(vals, GGMLQuantizationType(int(t)))
    raise ExportError(f"unknown quantizer {kind!r} (muser | gguf)")


def f16_master(w: np.ndarray, name: str) -> np.ndarray:
    h = w.astype("<f2")  # round to nearest even, like ggml_fp32_to_fp16
    if not np.all(np.isfinite(h)):
        raise ExportError(f"tensor {name!r} overflows F16 (max |w| = {float(np.abs(w).max())})")
    return h


def tensor_plan(g: dict, dtype: str) -> list[tuple[TensorSpec, TensorClass]]:
    out = []
    for r in expected_tensors(geo_of(g)):
        if r.cls in (TensorClass.NORM, TensorClass.QK_NORM):
            t = G.F32  # the converter keeps 1-D tensors F32; llama-quantize never quantizes them
        else:
            t = G[dtype]
        out.append((TensorSpec(r.name, r.shape, t), r.cls))
    return out


def export(run_dir: Path, corpus_dir: Path, out_dir: Path, dtypes=("F16", "Q8_0"), quant: str = "muser",
           name: str = NAME, log=print) -> dict[str, Path]:
    man, arrays = load_weights(run_dir)
    g = man["geometry"]
    tokens, merges, cman = load_tokenizer(corpus_dir, man["tokenizer_vocab_sha256"])
    if len(tokens) != g["vocab"]:
        raise ExportError(f"tokenizer has {len(tokens)} tokens, the weights {g['vocab']}")
    for s, digest in man["streams"].items():
        if cman["streams"][s]["sha256"] != digest:
            raise ExportError(f"{s} stream sha256 {cman['streams'][s]['sha256']} != training run's {digest}")
    plan = tensor_plan(g, "F32")
    want = {s.name for s, _ in plan}
    if set(arrays) != want:
        raise ExportError(f"weights have tensors {sorted(set(arrays) ^ want)[:4]} not matching the contract")
    for s, _ in plan:
        if tuple(arrays[s.name].shape) != tuple(reversed(s.shape)):
            raise ExportError(f"tensor {s.name!r} shape {arrays[s.name].shape} != contract {tuple(reversed(s.shape))}")
    provenance = {
        "corpus": {k: {"files": v["files"], "bytes": v["bytes"], "sha256": v["sha256"]}
                   for k, v in cman["splits"].items()},
        "corpus_root": cman["root"],
        "eval_framing": "non-overlapping windows of context_length tokens over the split stream "
                        "([BOS] ids [EOS] per file, corpus order); NLL of tokens 1..L-1 of each window",
        "streams": {k: {"tokens": v["tokens"], "sha256": v["sha256"]} for k, v in cman["streams"].items()},
        "tokenizer_vocab_sha256": man["tokenizer_vocab_sha256"],
        "training": {"step": man["step"], "val_loss": man["val_loss"], "selected": man["selected"]},
        "q_scale": g["q_scale"],
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    q = None
    master = {s.name: (f16_master(arrays[s.name], s.name).astype(np.float32) if cls not in
                       (TensorClass.NORM, TensorClass.QK_NORM) else arrays[s.name]) for s, cls in plan}
    written: dict[str, Path] = {}
    for dtype in dtypes:
        dtype = dtype.upper()
        if dtype not in FILE_TYPE:
            raise ExportError(f"unsupported dtype {dtype!r} (F32 | F16 | Q8_0)")
        specs = [s for s, _ in tensor_plan(g, dtype)]
        if dtype == "Q8_0" and q is None:
            q = quantizer(quant)

        def produce(s: TensorSpec, dtype=dtype) -> np.ndarray:
            if s.ggml_type == G.F32:
                return np.ascontiguousarray(arrays[s.name] if dtype == "F32" else master[s.name], dtype="<f4")
            if s.ggml_type == G.F16:
                return f16_master(arrays[s.name], s.name)
            return q(master[s.name], s.ggml_type)  # from the F16 master values

        path = out_dir / f"{name}-{dtype.lower()}.gguf"
        write_gguf(path, ARCH, metadata(g, tokens, merges, dtype, provenance), specs, produce)
        m = open_model(path)
        try:
            write_pin(m.identity, out_dir / f"{name}-{dtype.lower()}.pin.json")
            log(f"wrote {path} ({path.stat().st_size:,} bytes, {m.n_params:,} params, "
                f"sha256 {m.identity.artifact_sha256[:16]}...)")
        finally:
            m.close()
        written[dtype] = path
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", type=Path, required=True, help="the training run's output folder")
    ap.add_argument("--corpus", type=Path, default=corpus.DEFAULT_OUT)
    ap.add_argument("--out", type=Path, default=REPO / "models")
    ap.add_argument("--dtypes", default="F16,Q8_0")
    ap.add_argument("--quantizer", default="muser", choices=["muser", "gguf"])
    ap.add_argument("--name", default=NAME)
    a = ap.parse_args(argv)
    try:
        export(a.weights, a.corpus, a.out, tuple(a.dtypes.split(",")), a.quantizer, a.name)
    except ExportError as e:
        print(f"export: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
