"""`muser bench tokenizer`: token-for-token parity with the pinned llama.cpp tokenizer over the
CPython standard library sources, plus encode speed of both on one core.

Vocabularies (each a vocab-only GGUF that llama.cpp opens with vocab_only=True):
* gpt2   — the synthetic fixture's byte-level BPE (pre "gpt-2");
* llama4 — a byte-level BPE trained here on every 7th stdlib file with the GPT-4o split,
           pre "llama4" (the type the pinned llama.cpp gives Muse Glimmer's vocabulary);
* default — the embedded default model's tokenizer (muser.api.default_model_path: the shipped
           micro model, pre "llama4");
* any --model GGUF.
Corpus: every .py file of the CPython standard library (muser.text.synth.stdlib_files: third-
party site-packages excluded) in sorted order (valid UTF-8 through `encode(str)`, the rest
through `encode_bytes`), then the stress texts with add_special / parse_special on and off and
the malformed-byte cases. A mismatch is a case whose token list differs at all.

Speed: both tokenizers on the same fixed slice of the corpus (--speed-mb), pinned to one CPU,
warm-up then 5 interleaved repetitions; MB/s = bytes / mean seconds. Muser is timed twice: with
its word cache emptied before every repetition ("cold", the headline figure) and with the cache
as the previous repetition left it ("warm"). The full-corpus pass times are reported too.

Gate: pass when every vocabulary has 0 mismatches and Muser encodes >= 1 MB/s on every one.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

SPEED_TARGET_MB_S = 1.0
VOCABS = ("gpt2", "llama4", "default")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tokenizer", help="tokenizer parity vs the pinned llama.cpp over the stdlib + speed")
    p.add_argument("--vocab", action="append", choices=VOCABS, default=None,
                   help=f"built-in vocabularies to test (repeatable; default: {', '.join(VOCABS)})")
    p.add_argument("--model", action="append", default=[], help="also test this GGUF's tokenizer")
    p.add_argument("--limit-files", type=int, default=None, help="only the first N stdlib files")
    p.add_argument("--speed-mb", type=float, default=2.0, help="MB of the corpus in each speed repetition")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--cpu", type=int, default=None, help="CPU to pin to (default: the first allowed)")
    p.add_argument("--out-dir", default=None, help="receipt directory (default: the per-user cache, muser.api.cache_dir()/receipts; give bench/receipts for the project's evidence)")
    p.set_defaults(func=run)


def build_vocabs(names: list[str], workdir: Path) -> dict[str, Path]:
    from ...model import synth as msynth
    from ...text import synth as tsynth

    out: dict[str, Path] = {}
    if "gpt2" in names:
        md = msynth.tokenizer_metadata(msynth.SynthSpec())
        out["gpt2"] = tsynth.write_vocab_gguf(workdir / "vocab-gpt2.gguf", md)
    if "llama4" in names:
        texts = tsynth.read_texts(tsynth.stdlib_files()[::7], max_bytes=8_000_000)
        md = tsynth.gpt4o_tokenizer_metadata(texts, 8192)
        out["llama4"] = tsynth.write_vocab_gguf(workdir / "vocab-llama4.gguf", md)
    if "default" in names:
        from ...api import default_model_path

        out["default"] = default_model_path()
    return out


def _corpus(limit: int | None) -> list[tuple[str, bytes]]:
    from ...text.synth import stdlib_files

    files = stdlib_files()
    if limit is not None:
        files = files[:limit]
    return [(f, Path(f).read_bytes()) for f in files]


def _first_diff(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def parity_one(path: Path, corpus: list[tuple[str, bytes]], log) -> dict:
    import llama_cpp

    from ...gguf.reader import read_gguf
    from ...text import Tokenizer
    from ...text.stress import stress_bytes, stress_texts

    f = read_gguf(path)
    tok = Tokenizer.from_gguf(f)
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    res = {"gguf": str(path), "pre": tok.vocab.pre, "model": tok.vocab.model, "vocab_size": tok.vocab_size,
           "tokenizer_sha256": tok.sha256}
    n_tokens = n_cases = n_bad = 0
    bad: list[dict] = []
    t_ours = t_ref = 0.0
    n_bytes = 0
    for i, (name, data) in enumerate(corpus):
        t = time.perf_counter()
        ref = llm.tokenize(data, add_bos=False, special=False)
        t_ref += time.perf_counter() - t
        t = time.perf_counter()
        try:
            ours = tok.encode(data.decode("utf-8"))
        except UnicodeDecodeError:
            ours = tok.encode_bytes(data)
        t_ours += time.perf_counter() - t
        n_bytes += len(data)
        n_cases += 1
        n_tokens += len(ref)
        if ours != ref:
            n_bad += 1
            k = _first_diff(ref, ours)
            if len(bad) < 20:
                bad.append({"case": name, "at": k, "llama.cpp": ref[k : k + 8], "muser": ours[k : k + 8]})
        if (i + 1) % 1000 == 0:
            log(f"  {path.name}: {i + 1}/{len(corpus)} files, {n_bad} mismatches")
    res["stdlib"] = {"files": len(corpus), "bytes": n_bytes, "tokens_compared": n_tokens, "mismatches": n_bad,
                     "muser_full_pass_mb_s": n_bytes / 1e6 / t_ours if t_ours else None,
                     "llama_cpp_full_pass_mb_s": n_bytes / 1e6 / t_ref if t_ref else None}
    ids = sorted(tok.vocab.special_ids, key=lambda i: -len(tok.vocab.tokens[i]))
    specials = [tok.vocab.tokens[i] for i in ids]
    s_tokens = s_cases = s_bad = 0
    for text in stress_texts(specials):
        for add in (False, True):
            for sp in (False, True):
                ref = llm.tokenize(text.encode("utf-8"), add_bos=add, special=sp)
                ours = tok.encode(text, add_special=add, parse_special=sp)
                s_cases += 1
                s_tokens += len(ref)
                if ours != ref:
                    s_bad += 1
                    if len(bad) < 40:
                        bad.append({"case": f"stress {text[:40]!r} add={add} special={sp}",
                                    "at": _first_diff(ref, ours)})
    for data in stress_bytes():
        for sp in (False, True):
            ref = llm.tokenize(data, add_bos=False, special=sp)
            ours = tok.encode_bytes(data, parse_special=sp)
            s_cases += 1
            s_tokens += len(ref)
            if ours != ref:
                s_bad += 1
                if len(bad) < 40:
                    bad.append({"case": f"bytes {data[:24]!r} special={sp}", "at": _first_diff(ref, ours)})
    res["stress"] = {"cases": s_cases, "tokens_compared": s_tokens, "mismatches": s_bad}
    res["tokens_compared"] = n_tokens + s_tokens
    res["mismatches"] = n_bad + s_bad
    res["mismatch_examples"] = bad
    res["_tok"], res["_llm"] = tok, llm
    return res


def speed_one(res: dict, corpus: list[tuple[str, bytes]], mb: float, reps: int):
    from ..receipt import run_interleaved

    tok, llm = res["_tok"], res["_llm"]
    # a fixed slice from the middle of the sorted corpus, valid UTF-8 only
    start = len(corpus) // 3
    texts: list[tuple[str, bytes]] = []
    total = 0
    for _, data in corpus[start:] + corpus[:start]:
        try:
            s = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        texts.append((s, data))
        total += len(data)
        if total >= mb * 1e6:
            break
    def cold():
        if tok.vocab.kind == "bpe":
            tok._bpe._cache.clear()  # every word goes through the merges again
        return [tok.encode(s) for s, _ in texts]

    cells = run_interleaved({
        "muser": cold,
        "muser_warm": lambda: [tok.encode(s) for s, _ in texts],
        "llama.cpp": lambda: [llm.tokenize(b, add_bos=False, special=False) for _, b in texts],
    }, reps=reps, warmup=1)
    return total, cells


def run(args: argparse.Namespace) -> int:
    import sys

    from ...text.synth import STDLIB
    from ..receipt import device_description, write_receipt

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    allowed = sorted(os.sched_getaffinity(0))
    cpu = args.cpu if args.cpu is not None else allowed[0]
    os.sched_setaffinity(0, {cpu})  # "one core": every measurement below runs on this CPU

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    names = args.vocab or list(VOCABS)
    corpus = _corpus(args.limit_files)
    log(f"corpus: {len(corpus)} files, {sum(len(d) for _, d in corpus) / 1e6:.1f} MB")
    results: dict[str, dict] = {}
    all_cells = {}
    with tempfile.TemporaryDirectory(prefix="muser-tokbench-") as tmp:
        paths = build_vocabs(names, Path(tmp))
        for m in args.model:
            paths[Path(m).name] = Path(m)
        for name, path in paths.items():
            log(f"{name}: parity over the corpus ...")
            res = parity_one(path, corpus, log)
            log(f"{name}: {res['tokens_compared']:,} tokens compared, {res['mismatches']} mismatches")
            nbytes, cells = speed_one(res, corpus, args.speed_mb, args.reps)
            res["speed"] = {
                "bytes_per_rep": nbytes, "cpu": cpu,
                "muser_mb_s": nbytes / 1e6 / cells["muser"].mean, "muser_cv": cells["muser"].cv,
                "muser_warm_cache_mb_s": nbytes / 1e6 / cells["muser_warm"].mean,
                "muser_warm_cache_cv": cells["muser_warm"].cv,
                "llama_cpp_mb_s": nbytes / 1e6 / cells["llama.cpp"].mean, "llama_cpp_cv": cells["llama.cpp"].cv,
            }
            sp = res["speed"]
            log(f"{name}: muser {sp['muser_mb_s']:.2f} MB/s (warm cache {sp['muser_warm_cache_mb_s']:.2f}), "
                f"llama.cpp {sp['llama_cpp_mb_s']:.2f} MB/s")
            for k, c in cells.items():
                c.name = f"{name}:{k}"
                all_cells[c.name] = c
            res.pop("_tok"), res.pop("_llm")
            results[name] = res
    mism = sum(r["mismatches"] for r in results.values())
    slow = [n for n, r in results.items() if r["speed"]["muser_mb_s"] < SPEED_TARGET_MB_S]
    gate = {"status": "pass" if mism == 0 and not slow else "fail", "mismatches": mism,
            "tokens_compared": sum(r["tokens_compared"] for r in results.values()),
            "speed_target_mb_s": SPEED_TARGET_MB_S, "below_speed_target": slow,
            "corpus_files": len(corpus), "full_corpus": args.limit_files is None, "corpus_root": STDLIB}
    model = {n: {"tokenizer_sha256": r["tokenizer_sha256"], "pre": r["pre"], "vocab_size": r["vocab_size"]}
             for n, r in results.items()}
    path = write_receipt("tokenizer", model=model, device=device_description("cpu"), lane=None, gate=gate,
                         results=results, cells=all_cells, out_dir=args.out_dir)
    print(f"tokenizer parity: {gate['tokens_compared']:,} tokens compared, {mism} mismatches; "
          f"gate {gate['status']}; receipt {path}")
    return 0 if gate["status"] == "pass" else 1
