"""`muser bench spec`: DFlash speculative decoding on one target + drafter pair: acceptance and
speed against Muser's own plain decode, gated by exactness (Gate 3: identical tokens), and with
`--against llama.cpp --llama-spec BIN` the pinned llama.cpp's draft-dflash on the same pair, the
same prompts and the same draft length, side by side in the same receipt.

Prompts. Natural text: [BOS] + the first --prompt-tokens tokens of the first --prompts files of the
micro model's held-out split (muser.corpus rule, the split hash checked against the model's
provenance). Natural mid-file text ("natural-mid", what a user of a code model mostly
continues): for the same files, [BOS] + the --prompt-tokens tokens that end at the first line
boundary at or after the file's token midpoint (the whole file tokenized; a line boundary is the end
of a token whose bytes end in a newline); where that window does not tokenize back to its ids, the
next line boundary that does; a file with fewer than --prompt-tokens tokens before its cut, or no
boundary that round-trips, is skipped, and the receipt lists the cuts and the skips
(results.natural_mid). Synthetic text: [BOS] + a period-8 token pattern repeated (book 8.4: a fixture that a
drafter conditioned on the wrong window can still pass, reported beside natural text, never instead).
Every prompt is also a text that tokenizes back to exactly its ids (BOS added, specials parsed: how
llama-speculative-simple tokenizes -p); the pinned llama.cpp tokenizer (llama-cpp-python, vocab only)
must agree before any run.

Cells, interleaved per prompt and mode after one untimed warm-up: Muser plain decode, Muser
speculative decode (its acceptance gate as shipped), Muser speculative decode with the gate held open
(AcceptanceGate(close_below=0): every round drafts) and (with --against) llama-speculative-simple,
of --max-tokens tokens, greedy and sampled (T=0.7, top-k 40, top-p 0.95, min-p 0.05, fixed seed),
--threads CPU threads on every side. The gate passes when every Muser speculative run emits exactly
the plain run's tokens. Acceptance = accepted / proposed; mean accepted length = accepted proposals
per verify round (the bonus token not counted); tok/s = generated tokens / (prompt + generation wall
time), model load excluded; speedup = plain wall time / speculative wall time for the same tokens.

llama.cpp's figures are parsed from its own output (muser.bench.llamabin). The comparison
"Muser >= llama.cpp" per class takes acceptance like for like (Muser's gate held open: llama.cpp's
driver has no gate and drafts every round) and tok/s product against product (Muser gated). Known
differences, all in the receipt: llama.cpp drafts --verify-len tokens from the block
[last, mask x verify-len] (common/speculative.cpp) where Muser reads the first --verify-len of the
trained block [last, mask x (block - 1)]; llama.cpp's first round drafts from the prompt's last
token (its prefill stops one token short), Muser's first token comes from the prefill; llama.cpp
stops once it has generated more than -n tokens, so a run may be up to one round longer (its tokens
are counted as it reports them); and where the two targets' logits split a near-tie the greedy
continuations differ (`same_continuation` per run).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

MODES = {"greedy": {"temperature": 0.0},
         "t0.7": {"temperature": 0.7, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "seed": 20261201}}
CLASSES = ("natural", "natural-mid", "synthetic")
AGAINST = ("llama.cpp",)


def register(sub: argparse._SubParsersAction) -> None:
    from ...cores import default_threads

    p = sub.add_parser("spec", help="DFlash acceptance and speedup vs plain decode, gated by identical tokens; "
                                    "--against llama.cpp: its draft-dflash side by side",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="target GGUF (default: the embedded model)")
    p.add_argument("--draft", help="drafter GGUF (default: the shipped drafter of the shipped model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--lane", default="exact")
    p.add_argument("--kv", default="f16")
    p.add_argument("--verify-len", type=int, default=7, choices=(3, 7, 15))
    p.add_argument("--prompts", type=int, default=5,
                   help="held-out files used as natural prompts (their starts; natural-mid: cuts inside them)")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=1, help="timed repetitions of each cell")
    p.add_argument("--corpus-root", default=None)
    p.add_argument("--threads", type=int, default=default_threads(),
                   help="CPU threads of every side (default: the cores this process may use)")
    p.add_argument("--against", choices=AGAINST, help="comparator run side by side: llama.cpp (draft-dflash)")
    p.add_argument("--llama-spec", metavar="PATH", help="the pinned llama-speculative-simple binary (--against)")
    p.add_argument("--out-dir", default=None, help="receipt directory (default: the per-user cache, "
                   "muser.api.cache_dir()/receipts; give bench/receipts for the project's evidence)")
    p.set_defaults(func=run)


MID_RULE = ("[BOS] + the --prompt-tokens tokens ending at the first line boundary (a token whose bytes end in "
            "a newline) at or after the token midpoint of the whole file tokenized, else the next boundary whose "
            "window round-trips; skipped when fewer tokens precede the cut or no boundary round-trips")


def heldout_docs(model, root: str | None) -> list:
    """The micro model's held-out split (muser.corpus rule), its hash checked against the model's provenance."""
    from ...errors import IdentityMismatch, MuserError
    from ... import corpus
    from .ppl import provenance

    prov = provenance(model.engine.model_file.gguf)
    root = root or prov.get("corpus_root") or str(corpus.DEFAULT_ROOT)
    try:
        docs = corpus.split_docs(corpus.load_docs(Path(root)), "heldout")
    except corpus.CorpusError as e:
        raise MuserError(f"corpus: {e}") from None
    sha = corpus.split_sha256(docs)
    if sha != prov["corpus"]["heldout"]["sha256"]:
        raise IdentityMismatch(f"the held-out split under {root!r} hashes to {sha}, not the model's provenance")
    return docs


def natural_prompts(model, n: int, n_tokens: int, root: str | None) -> list[tuple[str, list[int]]]:
    return start_prompts(model.tokenizer, heldout_docs(model, root), n, n_tokens)


def start_prompts(tok, docs: list, n: int | None, n_tokens: int) -> list[tuple[str, list[int]]]:
    """The natural class over `docs` (muser.corpus.Doc, in order): (relpath, [BOS] + the first n_tokens
    tokens) of the first n documents holding that many (every such document when n is None)."""
    out = []
    for d in docs:
        ids = tok.encode(d.text[: 16 * n_tokens], add_special=False)
        if len(ids) >= n_tokens:
            out.append((d.relpath, [tok.bos_id] + ids[:n_tokens]))
        if len(out) == n:
            break
    return out


def ends_line(tok, token: int) -> bool:
    """MID_RULE's line boundary: the end of a token whose bytes end in a newline."""
    return tok.decode_bytes([token]).endswith(b"\n")


def mid_cut(tok, text: str, n_tokens: int) -> dict:
    """Where MID_RULE cuts `text`: {"file_tokens", "midpoint", "end"} (the window is ids[end - n_tokens:end]),
    or {"file_tokens", "midpoint", "skipped": reason}."""
    ids = tok.encode(text, add_special=False)
    mid = len(ids) // 2
    cut: dict = {"file_tokens": len(ids), "midpoint": mid}
    ends = [e for e in range(max(mid, 1), len(ids) + 1) if ends_line(tok, ids[e - 1])]
    if not ends:
        return dict(cut, skipped="no line boundary at or after the midpoint")
    if ends[0] < n_tokens:
        return dict(cut, skipped=f"{ends[0]} tokens before the cut, fewer than --prompt-tokens {n_tokens}")
    for e in ends:
        window = [tok.bos_id] + ids[e - n_tokens:e]
        # llama.cpp is given the text, so the window must tokenize back to exactly its ids
        if tok.encode(tok.decode(window[1:]), add_special=True, parse_special=True) == window:
            return dict(cut, end=e, line_boundaries_tried=ends.index(e) + 1)
    return dict(cut, skipped=f"none of the {len(ends)} line boundaries after the midpoint round-trips")


def natural_mid_prompts(model, names: list[str], n_tokens: int,
                        root: str | None) -> tuple[list[tuple[str, list[int]]], list[dict]]:
    """MID_RULE's prompts of the held-out files `names` (in that order), and every file's cut or skip."""
    return mid_prompts(model.tokenizer, heldout_docs(model, root), names, n_tokens)


def mid_prompts(tok, docs: list, names: list[str], n_tokens: int) -> tuple[list[tuple[str, list[int]]], list[dict]]:
    """The natural-mid class: MID_RULE's prompts of the documents `names` of `docs` (in that order), and
    every file's cut or skip."""
    by_name = {d.relpath: d for d in docs}
    prompts, cuts = [], []
    for name in names:
        cut = mid_cut(tok, by_name[name].text, n_tokens)
        cuts.append({"file": name, **cut})
        if "end" in cut:
            ids = tok.encode(by_name[name].text, add_special=False)
            prompts.append((f"{name}@{cut['end']}", [tok.bos_id] + ids[cut["end"] - n_tokens:cut["end"]]))
    return prompts, cuts


def synthetic_prompt(model, n_tokens: int) -> tuple[str, list[int]]:
    return synthetic_ids(model.tokenizer, n_tokens)


def synthetic_ids(tok, n_tokens: int) -> tuple[str, list[int]]:
    """The synthetic class: [BOS] + a period-8 token pattern repeated to n_tokens."""
    period = tok.encode("x = [1, 2, 3]\n", add_special=False)[:8]
    reps = n_tokens // len(period) + 1
    return f"synthetic period-{len(period)}", [tok.bos_id] + (period * reps)[:n_tokens]


def prompt_text(tok, name: str, ids: list[int]) -> str:
    """The text whose tokenization (BOS added, specials parsed) is exactly `ids`."""
    from ...errors import TokenizerError

    text = tok.decode(ids[1:])
    if ids[0] != tok.bos_id or tok.encode(text, add_special=True, parse_special=True) != ids:
        raise TokenizerError(f"prompt {name!r} does not round-trip through its text: llama.cpp could not be "
                             "given the same ids")
    return text


def check_llama_tokens(model_path: str, prompts: list[tuple[str, str, str, list[int]]]) -> int:
    """The pinned llama.cpp tokenizer gives every prompt text exactly Muser's ids; returns the ids compared."""
    from ...errors import TokenizerError
    from ..llamacpp import _llama_cpp

    llm = _llama_cpp().Llama(model_path=model_path, vocab_only=True, verbose=False)
    try:
        n = 0
        for _, name, text, ids in prompts:
            ref = llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
            if ref != ids:
                k = next(i for i, (a, b) in enumerate(zip(ref + [-1], ids + [-1])) if a != b)
                raise TokenizerError(f"prompt {name!r}: llama.cpp tokenizes it to {ref[k:k + 6]} at {k}, "
                                     f"Muser to {ids[k:k + 6]}")
            n += len(ids)
        return n
    finally:
        llm.close()


def class_figures(rows: list[dict], side: str) -> dict:
    """Pooled figures of one side over rows: counts summed, rates from the sums."""
    sel = [r[side] for r in rows]
    p = sum(s["proposals"] for s in sel)
    a = sum(s["accepted"] for s in sel)
    n = sum(s["rounds"] for s in sel)
    toks = sum(s["tokens"] for s in sel)
    secs = sum(s["wall_s"] for s in sel)
    return {"proposals": p, "accepted": a, "rounds": n, "tokens": toks, "wall_s": secs,
            "acceptance_rate": a / p if p else None, "mean_accepted_length": a / n if n else None,
            "tok_s": toks / secs if secs else None}


def compare(rows: list[dict], modes=tuple(MODES)) -> dict:
    """Per class/mode: the sides' pooled figures and whether Muser >= llama.cpp on each. Acceptance
    is like for like: Muser with its gate held open (every round drafts, as llama.cpp's driver,
    which has no gate); tok/s is product against product: Muser with its gate."""
    out = {}
    for cls in CLASSES:
        for mode in modes:
            sel = [r for r in rows if r["class"] == cls and r["mode"] == mode]
            if not sel:
                continue
            m, mo, ll = (class_figures(sel, side) for side in ("muser", "muser_gate_open", "llama.cpp"))
            ge = {k: (a[k] is not None and ll[k] is not None and a[k] >= ll[k])
                  for k, a in (("acceptance_rate", mo), ("mean_accepted_length", mo), ("tok_s", m))}
            out[f"{cls}/{mode}"] = {"muser": m, "muser_gate_open": mo, "llama.cpp": ll, "muser_ge_llama_cpp": ge}
    return out


def run(args: argparse.Namespace) -> int:
    import torch

    import muser

    from ...api import default_model_path, shipped_drafter
    from ...errors import ComparatorError, LaneError, MuserError
    from ...sample import SamplingParams
    from ...spec.gate import AcceptanceGate
    from ..llamabin import SpecSampling, binary_identity, executable, run_speculative, speculative_argv
    from ..receipt import device_description, write_receipt

    if args.threads < 1:
        raise LaneError(f"--threads must be >= 1, got {args.threads}")
    for name in ("prompts", "prompt_tokens", "max_tokens", "reps"):
        if getattr(args, name) < 1:
            raise LaneError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    binary = None
    if args.against:
        if args.kv not in ("f16", "f32"):
            raise ComparatorError(f"--kv {args.kv!r}: llama.cpp is given f16 or f32 K/V")
        if args.device != "cpu":
            raise ComparatorError(f"--against llama.cpp runs the CPU build of llama-speculative-simple, "
                                  f"not --device {args.device}")
        binary = executable(args.llama_spec, "--llama-spec")
    elif args.llama_spec:
        raise ComparatorError(f"--llama-spec {args.llama_spec} is only run with --against llama.cpp")
    path = args.model or str(default_model_path())
    draft = args.draft or shipped_drafter(path)
    if draft is None:
        raise MuserError(f"no --draft given and {path!r} has no shipped drafter")
    draft = str(draft)
    torch.set_num_threads(args.threads)
    model = muser.load(args.model, device=args.device, lane=args.lane, kv=args.kv)
    try:
        drafter = model.drafter(draft)
        tok = model.tokenizer
        natural = natural_prompts(model, args.prompts, args.prompt_tokens, args.corpus_root)
        mid, mid_cuts = natural_mid_prompts(model, [name for name, _ in natural], args.prompt_tokens,
                                            args.corpus_root)
        prompts = [("natural", name, ids) for name, ids in natural]
        prompts += [("natural-mid", name, ids) for name, ids in mid]
        prompts.append(("synthetic",) + synthetic_prompt(model, args.prompt_tokens))
        texts = [(cls, name, prompt_text(tok, name, ids), ids) for cls, name, ids in prompts]
        comparator: dict = {"name": "none (no --against)"}
        if binary is not None:
            n_ctx = max(len(ids) for *_, ids in texts) + args.max_tokens + 2 * (args.verify_len + 1)
            n_ctx = -(-n_ctx // 256) * 256
            if n_ctx > model.config.context_length:
                raise LaneError(f"prompt + --max-tokens need a {n_ctx}-token context, the model has "
                                f"{model.config.context_length}")
            comparator = {"name": "llama.cpp draft-dflash (llama-speculative-simple)", **binary_identity(binary),
                          "n_ctx": n_ctx, "draft_n_max": args.verify_len, "threads": args.threads,
                          "tokenizer_ids_compared": check_llama_tokens(path, texts)}
        warm = texts[0][3]
        for gate in (None, AcceptanceGate(close_below=0.0)):  # untimed: first allocations, kernel set-up
            [e.token for e in model.stream(warm, 8, sampling=SamplingParams(temperature=0.0))]
            [e.token for e in model.stream(warm, 8, sampling=SamplingParams(temperature=0.0), draft=draft,
                                           verify_len=args.verify_len, gate=gate)]
        rows, all_same = [], True
        for cls, name, text, ids in texts:
            for mode, knobs in MODES.items():
                sp = SamplingParams(**knobs)
                row = {"class": cls, "prompt": name, "mode": mode, "prompt_tokens": len(ids)}
                t_plain: list[float] = []
                t_spec: list[float] = []
                t_open: list[float] = []
                llama: list[dict] = []
                stats: dict = {}
                counts = {"proposals": 0, "accepted": 0, "rounds": 0, "tokens": 0}
                counts_open = dict(counts)
                same = True
                ref: list[int] = []
                for _ in range(args.reps):
                    t0 = time.perf_counter()
                    plain = [e.token for e in model.stream(ids, args.max_tokens, sampling=sp)]
                    t_plain.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    g = model.stream(ids, args.max_tokens, sampling=sp, draft=draft, verify_len=args.verify_len)
                    got = [e.token for e in g]
                    t_spec.append(time.perf_counter() - t0)
                    stats = g.spec.stats()
                    for k in ("proposals", "accepted", "rounds"):
                        counts[k] += stats[k]
                    counts["tokens"] += len(got)
                    t0 = time.perf_counter()
                    g = model.stream(ids, args.max_tokens, sampling=sp, draft=draft, verify_len=args.verify_len,
                                     gate=AcceptanceGate(close_below=0.0))
                    got_open = [e.token for e in g]
                    t_open.append(time.perf_counter() - t0)
                    for k, v in g.spec.stats().items():
                        if k in counts_open:
                            counts_open[k] += v
                    counts_open["tokens"] += len(got_open)
                    same = same and got == plain and got_open == plain and (not ref or ref == plain)
                    ref = plain
                    if binary is not None:
                        argv = speculative_argv(binary, path, draft, text, args.max_tokens, args.verify_len,
                                                comparator["n_ctx"], args.threads, SpecSampling(**knobs), args.kv)
                        llama.append(run_speculative(argv, text))
                all_same = all_same and same
                row.update(tokens=len(ref), identical=same, plain_s=t_plain, spec_s=t_spec,
                           speedup=(sum(t_plain) / sum(t_spec)) if sum(t_spec) else None, **stats)
                row["muser"] = dict(counts, wall_s=sum(t_spec))
                row["muser_gate_open"] = dict(counts_open, wall_s=sum(t_open))
                mo = row["muser_gate_open"]
                line = (f"{cls:11} {mode:6} {name[:28]:28} muser accept {stats['acceptance_rate'] or 0:.3f} "
                        f"len {stats['mean_accepted_length'] or 0:.2f} (gate open: "
                        f"{mo['accepted'] / mo['proposals'] if mo['proposals'] else 0:.3f} "
                        f"len {mo['accepted'] / mo['rounds'] if mo['rounds'] else 0:.2f}) "
                        f"speedup {row['speedup']:.2f} {'identical' if same else 'DIFFERENT'}")
                if llama:
                    _check_drafter(llama[0]["drafter"], drafter.cfg, args.verify_len)
                    comparator["drafter_as_read"] = llama[0]["drafter"]
                    text_m = tok.decode([t for t in ref if not tok.is_eog(t)])  # llama.cpp prints no EOG
                    row["llama.cpp"] = {
                        "proposals": sum(x["proposals"] for x in llama), "accepted": sum(x["accepted"] for x in llama),
                        "rounds": sum(x["rounds"] for x in llama), "tokens": sum(x["tokens"] for x in llama),
                        "wall_s": sum(x["prompt_eval_s"] + x["decode_s"] for x in llama),
                        "same_continuation": [_prefix_agrees(text_m, x["text"]) for x in llama],
                        "runs": [{k: v for k, v in x.items() if k != "drafter"} for x in llama]}
                    f = row["llama.cpp"]
                    line += (f" | llama.cpp accept {f['accepted'] / f['proposals'] if f['proposals'] else 0:.3f} "
                             f"len {f['accepted'] / f['rounds'] if f['rounds'] else 0:.2f}")
                rows.append(row)
                print(line, flush=True)
        summary = {}
        for cls in CLASSES:
            for mode in MODES:
                sel = [r for r in rows if r["class"] == cls and r["mode"] == mode]
                if not sel:  # every natural-mid file skipped by rule
                    continue
                summary[f"{cls}/{mode}"] = dict(class_figures(sel, "muser"), speedup=sum(
                    sum(r["plain_s"]) for r in sel) / sum(sum(r["spec_s"]) for r in sel),
                    gate_open=class_figures(sel, "muser_gate_open"))
        ident = model.identity
        results = {"target_sha256": ident.artifact_sha256, "drafter_sha256": drafter.sha256,
                   "drafter_path": draft, "qualified": all_same, "verify_len": args.verify_len,
                   "max_tokens": args.max_tokens, "prompt_tokens": args.prompt_tokens, "reps": args.reps,
                   "threads": args.threads, "draft_block_size": drafter.cfg.block_size,
                   "draft_sink_size": drafter.cfg.sink, "draft_sliding_window": drafter.cfg.window,
                   "modes": MODES, "natural_mid": {"rule": MID_RULE, "cuts": mid_cuts,
                                                   "skipped": [c["file"] for c in mid_cuts if "skipped" in c]},
                   "summary": summary, "rows": rows, "comparator": comparator}
        if binary is not None:
            results["comparison"] = compare(rows)
            results["muser_ge_llama_cpp_acceptance_every_class"] = all(
                v["muser_ge_llama_cpp"]["acceptance_rate"] and v["muser_ge_llama_cpp"]["mean_accepted_length"]
                for v in results["comparison"].values())
        path_r = write_receipt("spec", model=ident.to_json(), device=device_description(args.device), lane=args.lane,
                               gate={"status": "pass" if all_same else "fail",
                                     "rule": "speculative tokens (gated and gate held open) identical to plain "
                                             "decode for every prompt/mode",
                                     "cases": len(rows), "identical_cases": sum(r["identical"] for r in rows),
                                     "tokens_compared": sum(r["tokens"] for r in rows)},
                               results=results, out_dir=args.out_dir)
        _print_summary(summary, results.get("comparison"))
        print(f"gate {'pass' if all_same else 'FAIL'}; receipt {path_r}")
        return 0 if all_same else 1
    finally:
        model.close()


def _check_drafter(seen: dict, cfg, verify_len: int) -> None:
    """llama.cpp loaded our drafter as the DFlash it is: same block, mask token and captured layers."""
    from ...errors import ComparatorError

    want = {"block_size": cfg.block_size, "mask_token_id": cfg.mask_token, "n_extract": len(cfg.target_layers),
            "n_max": verify_len}
    got = {k: seen[k] for k in want}
    if got != want:
        raise ComparatorError(f"llama.cpp read the drafter as {got}, Muser as {want}")


def _prefix_agrees(a: str, b: str) -> bool:
    """One continuation is a prefix of the other (llama.cpp may run one round past -n)."""
    return a.startswith(b) or b.startswith(a)


def _print_summary(summary: dict, comparison: dict | None) -> None:
    for k, v in summary.items():
        line = (f"{k:18} muser acceptance {v['acceptance_rate'] or 0:.3f}  mean accepted "
                f"{v['mean_accepted_length'] or 0:.2f}  {v['tok_s'] or 0:.1f} tok/s  speedup {v['speedup']:.2f}x")
        if comparison and k in comparison:
            ll, ge = comparison[k]["llama.cpp"], comparison[k]["muser_ge_llama_cpp"]
            mo = comparison[k]["muser_gate_open"]
            line += (f" | gate open {mo['acceptance_rate'] or 0:.3f} / {mo['mean_accepted_length'] or 0:.2f}"
                     f" | llama.cpp acceptance {ll['acceptance_rate'] or 0:.3f}  mean accepted "
                     f"{ll['mean_accepted_length'] or 0:.2f}  {ll['tok_s'] or 0:.1f} tok/s | muser >= llama.cpp: "
                     + ", ".join(f"{m} {'yes' if ok else 'NO'}" for m, ok in ge.items()))
        print(line)
