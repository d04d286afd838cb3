#!/usr/bin/env python3
"""Export the trained micro Muse Glimmer to GGUF: F16 master (norms F32) and Q8_0, with identity pins.

    tools/export_micro.py --weights RUN_OUT [--tokenizer .device/corpus/tokenizer.json] [--out DIR]
                          [--dtypes F16,Q8_0] [--quantizer muser|gguf]
    tools/export_micro.py --continuations [--model GGUF ...] [--out models] [--new-tokens 64]
    tools/export_micro.py --stdlib-list OUT.json     the stdlib held-out listing the device run carries
    tools/export_micro.py --bpb GGUF                 a GGUF's bits per byte on the stdlib held-out files

RUN_OUT holds what the training run wrote (micro-run.json + micro-weights-N.npz, tools/train_micro.py).
The weights are already in llama.cpp's convention (norm weights as llama.cpp multiplies them, i.e. the
converter's `+1` already applied; Q/K rows in the interleaved RoPE layout; attn_q_norm = qk_scale_factor
broadcast, attn_k_norm = ones) and 2-D tensors are already the F16 master's values, so the export is a
straight copy under the real key and tensor names (src/models/muse-glimmer.cpp,
conversion/muse_glimmer.py). Every quantized file is derived from the F16 master values (the
llama-quantize flow: F16 GGUF -> f32 -> quantize). The provenance records the training corpus's
streams and the stdlib val / held-out splits and streams under this vocabulary (what `muser bench ppl
--text` re-derives). Files are validated with muser.model.loader.open_model after writing, and a pin
is written beside each.

--continuations writes <out>/muse-glimmer-micro-continuations.json (models/README.md quotes it): greedy
continuations of held-out prompts (PROMPTS: the first lines of held-out files, framed as the training
stream frames a file: [BOS] + ids), each decoded by the pinned llama.cpp and by muser.oracle (arithmetic
ggml-cpu, f16 KV: llama.cpp's CPU rounding points), with whether the two agree token for token, and one
sampled continuation per prompt from Muser's API.
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
from train_micro import RUN_FORMAT  # noqa: E402

NAME = "muse-glimmer-micro"
# The README's greedy continuations: (held-out file, number of leading lines used as the prompt).
PROMPTS = (("secrets.py", 34), ("sched.py", 53), ("test/test_print.py", 17), ("chunk.py", 55),
           ("traceback.py", 21))
SAMPLED_SEEDS = (1, 2, 3, 4, 5)  # one sampled continuation per prompt, at muser.SamplingParams' defaults
CONTINUATIONS = f"{NAME}-continuations.json"
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
    """(the run record, name -> f32 array in numpy order), every shard checked against its SHA-256."""
    run_dir = Path(run_dir)
    run_path = run_dir / "micro-run.json"
    if not run_path.is_file():
        raise ExportError(f"{str(run_path)!r} not found (the training run's output)")
    run = json.loads(run_path.read_text())
    if run.get("format") != RUN_FORMAT:
        raise ExportError(f"{str(run_path)!r}: unknown format {run.get('format')!r} (want {RUN_FORMAT!r})")
    if "weights" not in run:
        raise ExportError(f"{str(run_path)!r} records no saved weights (status {run.get('status')!r})")
    man = run["weights"]
    arrays: dict[str, np.ndarray] = {}
    for fn, digest in man["shards"].items():
        p = run_dir / fn
        got = hashlib.sha256(p.read_bytes()).hexdigest()
        if got != digest:
            raise ExportError(f"shard {str(p)!r}: sha256 {got} != manifest {digest}")
        with np.load(p, allow_pickle=False) as z:
            for k in z.files:
                arrays[k] = np.ascontiguousarray(z[k], dtype=np.float32)  # F16 -> F32 is exact
    for name, info in man["tensors"].items():
        if name not in arrays:
            raise ExportError(f"tensor {name!r} missing from shard {info['shard']!r}")
        if list(arrays[name].shape) != info["shape"]:
            raise ExportError(f"tensor {name!r} has shape {list(arrays[name].shape)}, manifest {info['shape']}")
        if not np.all(np.isfinite(arrays[name])):
            raise ExportError(f"tensor {name!r} holds non-finite values")
    return run, arrays


def load_tokenizer(path: Path, trained: dict):
    """(tokenizer, tokens, merges) from a tokenizer.json, checked against the identity the training
    run recorded (the file's SHA-256 and/or the vocabulary's)."""
    from tokenizers import Tokenizer

    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ExportError(f"tokenizer {str(path)!r} not found")
    tok = Tokenizer.from_file(str(path))
    tokens, merges = corpus.vocab_and_merges(tok)
    have = {"sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "vocab_sha256": hashlib.sha256(json.dumps([tokens, merges]).encode()).hexdigest()}
    checked = [k for k in have if k in trained]
    if not checked:
        raise ExportError(f"the training run records no tokenizer identity ({sorted(trained)})")
    for k in checked:
        if have[k] != trained[k]:
            raise ExportError(f"tokenizer {str(path)!r} has {k} {have[k]}, the weights were trained with {trained[k]}")
    return tok, tokens, merges


def stdlib_streams(tok, root: Path) -> tuple[dict, dict]:
    """The stdlib val and held-out splits (muser.corpus rule) and their streams under `tok`: what
    `muser bench ppl --text` re-derives and checks."""
    docs = corpus.load_docs(root)
    splits, streams = {}, {}
    for s in ("val", "heldout"):
        sd = corpus.split_docs(docs, s)
        ids = corpus.encode_docs(tok, sd)
        splits[s] = {"files": len(sd), "bytes": sum(len(d.data) for d in sd), "sha256": corpus.split_sha256(sd)}
        streams[s] = {"tokens": int(ids.size), "sha256": hashlib.sha256(ids.tobytes()).hexdigest()}
    return splits, streams


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


def export(run_dir: Path, tokenizer: Path, out_dir: Path, dtypes=("F16", "Q8_0"), quant: str = "muser",
           name: str = NAME, root: Path = corpus.DEFAULT_ROOT, log=print) -> dict[str, Path]:
    run, arrays = load_weights(run_dir)
    g = run["geometry"]
    tok, tokens, merges = load_tokenizer(tokenizer, run["corpus"]["tokenizer"])
    if len(tokens) != g["vocab"]:
        raise ExportError(f"tokenizer has {len(tokens)} tokens, the weights {g['vocab']}")
    plan = tensor_plan(g, "F32")
    want = {s.name for s, _ in plan}
    if set(arrays) != want:
        raise ExportError(f"weights have tensors {sorted(set(arrays) ^ want)[:4]} not matching the contract")
    for s, _ in plan:
        if tuple(arrays[s.name].shape) != tuple(reversed(s.shape)):
            raise ExportError(f"tensor {s.name!r} shape {arrays[s.name].shape} != contract {tuple(reversed(s.shape))}")
    splits, streams = stdlib_streams(tok, Path(root))
    best = run["main"]["best"]
    provenance = {
        "corpus": splits,  # the stdlib evaluation splits: muser bench ppl --text reads them
        "corpus_root": str(root),
        "eval_framing": "non-overlapping windows of context_length tokens over the split stream "
                        "([BOS] ids [EOS] per file, corpus order); NLL of tokens 1..L-1 of each window",
        "streams": streams,
        "training_corpus": {"streams": {k: {"tokens": v["tokens"], "sha256": v["sha256"]}
                                        for k, v in run["corpus"]["streams"].items()},
                            "tokenizer": run["corpus"]["tokenizer"]},
        "training": {"step": best["step"], "val_loss": best.get("val_loss"), "heldout_loss": best.get("heldout_loss"),
                     "selected": run["selected"]["rule"], "steps": run["main"]["steps"],
                     "tokens": run["main"]["tokens"]},
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
        path.chmod(0o644)  # the writer's temp file is private; a shipped model is world-readable
        m = open_model(path)
        try:
            write_pin(m.identity, out_dir / f"{name}-{dtype.lower()}.pin.json")
            log(f"wrote {path} ({path.stat().st_size:,} bytes, {m.n_params:,} params, "
                f"sha256 {m.identity.artifact_sha256[:16]}...)")
        finally:
            m.close()
        written[dtype] = path
    return written


# ---------------------------------------------------------------------------------------------
# greedy continuations


def prompt_text(relpath: str, n_lines: int, root: Path = corpus.DEFAULT_ROOT) -> str:
    """The first n_lines lines of a held-out corpus file (refused if the file is not held out)."""
    if corpus.split_of(relpath) != "heldout":
        raise ExportError(f"{relpath!r} is in the {corpus.split_of(relpath)} split, not held-out")
    text = (Path(root) / relpath).read_bytes().decode("utf-8")
    lines = text.splitlines(keepends=True)
    if len(lines) <= n_lines:
        raise ExportError(f"{relpath!r} has {len(lines)} lines; a prompt of {n_lines} leaves nothing to continue")
    return "".join(lines[:n_lines])


def greedy_llamacpp(path: Path, prompt: list[int], n_new: int, stop: set[int]) -> tuple[list[int], list]:
    """Greedy decode in the pinned llama.cpp: one prefill, then one token per eval; argmax of the
    last row (f16 KV, non-flash attention, as bench/llamacpp.py's runner sets it)."""
    import llama_cpp

    ll = llama_cpp.Llama(str(path), n_ctx=len(prompt) + n_new, n_batch=512, n_ubatch=512, logits_all=True,
                         type_k=1, type_v=1, flash_attn=False, n_threads=1, n_threads_batch=1, seed=0,
                         verbose=False)
    try:
        out: list[int] = []
        rows = []  # the logits each token was chosen from
        ll.eval(prompt)
        while len(out) < n_new:
            rows.append(np.array(ll.scores[ll.n_tokens - 1], dtype=np.float32))
            t = int(np.argmax(rows[-1]))
            out.append(t)
            if t in stop or len(out) == n_new:
                break
            ll.eval([t])
        return out, rows
    finally:
        ll.close()


def greedy_oracle(path: Path, prompt: list[int], n_new: int, stop: set[int]) -> tuple[list[int], list]:
    """Greedy decode with muser.oracle (ggml-cpu arithmetic, f16 KV): prefill, then decode."""
    from muser import oracle

    m = oracle.load(path, arithmetic="ggml-cpu", kv="f16")
    try:
        s = m.session(max_context=len(prompt) + n_new)
        logits = s.prefill(prompt)
        out: list[int] = []
        rows = []
        while len(out) < n_new:
            rows.append(logits)
            t = int(np.argmax(logits))
            out.append(t)
            if t in stop or len(out) == n_new:
                break
            logits = s.decode(t)
        return out, rows
    finally:
        m.close()


def continuation_run(model: Path, n_new: int, root: Path, prompts, log) -> dict:
    """The three greedy continuations of one GGUF, llama.cpp and oracle side by side."""
    from muser.text import Tokenizer

    m = open_model(model)
    try:
        tok = Tokenizer.from_gguf(m.gguf)
        cfg, ident = m.config, m.identity
    finally:
        m.close()
    stop = set(cfg.eog_ids)
    rows = []
    for relpath, n_lines in prompts:
        text = prompt_text(relpath, n_lines, root)
        ids = [cfg.bos_id] + tok.encode(text, add_special=False)  # the training stream's file framing
        a, la = greedy_llamacpp(model, ids, n_new, stop)
        b, lb = greedy_oracle(model, ids, n_new, stop)
        first_diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if first_diff is None and len(a) != len(b):
            first_diff = min(len(a), len(b))
        margin = None
        if first_diff is not None and first_diff < min(len(a), len(b)):
            i, x, y = first_diff, a[first_diff], b[first_diff]  # same prefix, so the same position
            margin = {"llamacpp_logit_gap": float(la[i][x] - la[i][y]),  # its pick over the oracle's
                      "oracle_logit_gap": float(lb[i][y] - lb[i][x])}
        rows.append({"file": relpath, "prompt_lines": n_lines, "prompt_tokens": len(ids),
                     "prompt_tail": "".join(text.splitlines(keepends=True)[-3:]),
                     "llamacpp_ids": a, "oracle_ids": b, "identical": first_diff is None,
                     "first_difference": first_diff, "logit_gap_at_difference": margin,
                     "llamacpp_text": tok.decode(a, render_special=False),
                     "oracle_text": tok.decode(b, render_special=False)})
        log(f"{Path(model).name} {relpath}: {len(ids)} prompt tokens, {len(a)} new; "
            f"{'identical' if first_diff is None else f'differ from token {first_diff} (gaps {margin})'}")
    return {"model": {"file": Path(model).name, "artifact_sha256": ident.artifact_sha256}, "continuations": rows}


def sampled_run(model: Path, n_new: int, root: Path, prompts, log) -> dict:
    """One sampled continuation per prompt from Muser's API (SamplingParams defaults: temperature 0.8,
    llama.cpp's sampler chain and MT19937 stream), seed SAMPLED_SEEDS[i]."""
    import muser

    m = muser.load(model, pin=Path(model).with_suffix(".pin.json"))
    try:
        tok, bos = m.tokenizer, m.config.bos_id
        rows = []
        for (relpath, n_lines), seed in zip(prompts, SAMPLED_SEEDS):
            text = prompt_text(relpath, n_lines, root)
            ids = [bos] + tok.encode(text, add_special=False)
            params = muser.SamplingParams(max_tokens=n_new, seed=seed)
            out = [e.token for e in m.stream(ids, sampling=params)]
            rows.append({"file": relpath, "prompt_lines": n_lines, "prompt_tokens": len(ids), "seed": seed,
                         "sampling": {"temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p,
                                      "min_p": params.min_p},
                         "ids": out, "text": tok.decode(out, render_special=False)})
            log(f"{Path(model).name} {relpath}: sampled {len(out)} tokens (seed {seed})")
        return {"model": {"file": Path(model).name, "artifact_sha256": m.identity.artifact_sha256}, "sampled": rows}
    finally:
        m.close()


def continuations(models: list[Path], out_dir: Path, n_new: int = 64, root: Path = corpus.DEFAULT_ROOT,
                  prompts=PROMPTS, log=print, name: str = CONTINUATIONS) -> Path:
    """Write <out_dir>/<name>: the greedy continuations of every model in `models` (llama.cpp and the
    oracle side by side) and one sampled continuation per prompt from the first (Muser's API)."""
    body = {"decoding": f"greedy (argmax), at most {n_new} new tokens, stop at an EOG token",
            "prompt_framing": "[BOS] + tokens of the first prompt_lines lines of a held-out file",
            "llamacpp": "llama-cpp-python==0.3.36, f16 KV, flash_attn off, prefill then one token per eval",
            "oracle": "muser.oracle arithmetic ggml-cpu, f16 KV, prefill then decode",
            "sampling": "muser.load(model).stream(ids, sampling=SamplingParams(max_tokens, seed)): the API's "
                        "defaults (CPU exact lane, f16 KV), stop at an EOG token",
            "runs": [continuation_run(Path(m), n_new, root, prompts, log) for m in models],
            "sampled_runs": [sampled_run(Path(models[0]), n_new, root, prompts, log)]}
    out = Path(out_dir) / name
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(body, indent=1, ensure_ascii=False) + "\n")
    tmp.replace(out)
    return out


# ---------------------------------------------------------------------------------------------
# the stdlib held-out files: their list for the device run, and a GGUF's bits per byte on them


def stdlib_listing(out: Path, root: Path = corpus.DEFAULT_ROOT) -> Path:
    """<out>: the stdlib held-out files (muser.corpus rule) as relpath + SHA-256 + bytes, in corpus order."""
    docs = corpus.split_docs(corpus.load_docs(root), "heldout")
    body = {"rule": "muser.corpus stdlib held-out split", "root": str(root),
            "split_sha256": corpus.split_sha256(docs),
            "files": [{"relpath": d.relpath, "sha256": hashlib.sha256(d.data).hexdigest(), "bytes": len(d.data)}
                      for d in docs]}
    Path(out).write_text(json.dumps(body, indent=1) + "\n")
    return Path(out)


def gguf_bits_per_byte(model: Path, root: Path = corpus.DEFAULT_ROOT) -> dict:
    """A micro GGUF's bits per byte on the stdlib held-out files: its weights (dequantized to f32) in
    tools/micro_net.py's f32 forward, scored by train_micro.bits_per_byte (the device run's framing)."""
    import torch

    import micro_net
    import train_micro
    from muser.gguf.reader import read_gguf

    f = read_gguf(model)
    try:
        k = lambda s: f.get(f"{ARCH}.{s}")  # noqa: E731
        tokens = list(f.get("tokenizer.ggml.tokens"))
        g = micro_net.Geometry(vocab=len(tokens), hidden=k("embedding_length"), n_layers=k("block_count"),
                               n_heads=k("attention.head_count"), n_kv_heads=k("attention.head_count_kv"),
                               head_dim=k("attention.key_length"), ffn=k("feed_forward_length"),
                               window=k("attention.sliding_window"), seq_len=k("context_length"))
        state = {t.name: torch.from_numpy(np.array(f.array(t.name), dtype=np.float32)) for t in f}
        tok = corpus.tokenizer_from_vocab(tokens, list(f.get("tokenizer.ggml.merges")))
        bos, eos = int(f.get("tokenizer.ggml.bos_token_id")), int(f.get("tokenizer.ggml.eos_token_id"))
    finally:
        f.close()
    m = micro_net.MicroGlimmer(g)
    micro_net.load_gguf_state(m, state)
    docs = [(d.relpath, d.data) for d in corpus.split_docs(corpus.load_docs(root), "heldout")]
    res = train_micro.bits_per_byte(m, docs, tok, bos, eos, g.seq_len, "cpu")
    return dict(res, model=Path(model).name, artifact_sha256=hashlib.sha256(Path(model).read_bytes()).hexdigest())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--weights", type=Path, help="the training run's output folder")
    what.add_argument("--continuations", action="store_true", help="write the README's greedy continuations")
    what.add_argument("--stdlib-list", type=Path, help="write the stdlib held-out listing the device run reads")
    what.add_argument("--bpb", type=Path, help="print a GGUF's bits per byte on the stdlib held-out files (JSON)")
    ap.add_argument("--model", type=Path, action="append", default=None,
                    help="--continuations: a GGUF to decode (repeatable; default: the shipped F16 and Q8_0)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--tokenizer", type=Path, default=REPO / ".device" / "corpus" / "tokenizer.json",
                    help="--weights: the tokenizer.json the run trained with (a folder: its tokenizer.json)")
    ap.add_argument("--out", type=Path, default=REPO / "models")
    ap.add_argument("--dtypes", default="F16,Q8_0")
    ap.add_argument("--quantizer", default="muser", choices=["muser", "gguf"])
    ap.add_argument("--name", default=NAME)
    a = ap.parse_args(argv)
    try:
        if a.stdlib_list:
            print(stdlib_listing(a.stdlib_list))
        elif a.bpb:
            print(json.dumps(gguf_bits_per_byte(a.bpb), indent=1))
        elif a.continuations:
            models = a.model or [REPO / "models" / f"{NAME}-q8_0.gguf"]
            continuations(models, a.out, a.new_tokens)
        else:
            export(a.weights, a.tokenizer, a.out, tuple(a.dtypes.split(",")), a.quantizer, a.name)
    except ExportError as e:
        print(f"export: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
