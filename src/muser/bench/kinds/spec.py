"""`muser bench spec`: DFlash speculative decoding on one target + drafter pair: acceptance and
speed against Muser's own plain decode, gated by exactness (Gate 3: identical tokens).

Prompts. Natural text: [BOS] + the first --prompt-tokens tokens of the first --prompts files of the
micro model's held-out split (tools/corpus.py rule, the split hash checked against the model's
provenance). Synthetic text: [BOS] + a period-8 token pattern repeated (book 8.4: a fixture that a
drafter conditioned on the wrong window can still pass, reported beside natural text, never instead).

Cells, interleaved A B A B per prompt: plain decode and speculative decode of --max-tokens tokens,
greedy and sampled (T=0.7, top-k 40, top-p 0.95, min-p 0.05, fixed seed). The gate passes when every
speculative run emits exactly the plain run's tokens. Acceptance = accepted / proposed; mean accepted
length = accepted per round; speedup = plain wall time / speculative wall time for the same tokens.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("spec", help="DFlash acceptance and speedup vs plain decode, gated by identical tokens",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="target GGUF (default: the embedded model)")
    p.add_argument("--draft", help="drafter GGUF (default: the shipped drafter of the shipped model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--lane", default="exact")
    p.add_argument("--kv", default="f16")
    p.add_argument("--verify-len", type=int, default=7, choices=(3, 7, 15))
    p.add_argument("--prompts", type=int, default=5, help="held-out files used as natural prompts")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=1, help="timed repetitions of each cell")
    p.add_argument("--corpus-root", default=None)
    p.set_defaults(func=run)


def natural_prompts(model, n: int, n_tokens: int, root: str | None) -> list[tuple[str, list[int]]]:
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
    tok = model.tokenizer
    out = []
    for d in docs:
        ids = tok.encode(d.text[: 16 * n_tokens], add_special=False)
        if len(ids) >= n_tokens:
            out.append((d.relpath, [tok.bos_id] + ids[:n_tokens]))
        if len(out) == n:
            break
    return out


def synthetic_prompt(model, n_tokens: int) -> tuple[str, list[int]]:
    tok = model.tokenizer
    period = tok.encode("x = [1, 2, 3]\n", add_special=False)[:8]
    reps = n_tokens // len(period) + 1
    return f"synthetic period-{len(period)}", [tok.bos_id] + (period * reps)[:n_tokens]


def run(args: argparse.Namespace) -> int:
    import muser

    from ...api import default_model_path, shipped_drafter
    from ...errors import MuserError
    from ...sample import SamplingParams
    from ..receipt import device_description, write_receipt

    path = args.model or str(default_model_path())
    draft = args.draft or shipped_drafter(path)
    if draft is None:
        raise MuserError(f"no --draft given and {path!r} has no shipped drafter")
    model = muser.load(args.model, device=args.device, lane=args.lane, kv=args.kv)
    try:
        drafter = model.drafter(draft)
        prompts = [("natural", name, ids) for name, ids in natural_prompts(model, args.prompts, args.prompt_tokens,
                                                                            args.corpus_root)]
        prompts.append(("synthetic",) + synthetic_prompt(model, args.prompt_tokens))
        modes = {"greedy": SamplingParams(temperature=0.0),
                 "t0.7": SamplingParams(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05, seed=20261201)}
        rows, all_same = [], True
        for cls, name, ids in prompts:
            for mode, sp in modes.items():
                t_plain: list[float] = []
                t_spec: list[float] = []
                stats: dict = {}
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
                    same = same and got == plain and (not ref or ref == plain)
                    ref = plain
                all_same = all_same and same
                rows.append({"class": cls, "prompt": name, "mode": mode, "prompt_tokens": len(ids),
                             "tokens": len(ref), "identical": same, "plain_s": t_plain, "spec_s": t_spec,
                             "speedup": (sum(t_plain) / sum(t_spec)) if sum(t_spec) else None, **stats})
                print(f"{cls:9} {mode:6} {name[:32]:32} accept {stats['acceptance_rate'] or 0:.3f} "
                      f"len {stats['mean_accepted_length'] or 0:.2f} speedup {rows[-1]['speedup']:.2f} "
                      f"{'identical' if same else 'DIFFERENT'}", flush=True)
        summary = {}
        for cls in ("natural", "synthetic"):
            for mode in modes:
                sel = [r for r in rows if r["class"] == cls and r["mode"] == mode]
                p = sum(r["proposals"] for r in sel)
                a = sum(r["accepted"] for r in sel)
                n = sum(r["rounds"] for r in sel)
                summary[f"{cls}/{mode}"] = {
                    "proposals": p, "accepted": a, "rounds": n, "acceptance_rate": a / p if p else None,
                    "mean_accepted_length": a / n if n else None,
                    "speedup": sum(sum(r["plain_s"]) for r in sel) / sum(sum(r["spec_s"]) for r in sel)}
        ident = model.identity
        results = {"target_sha256": ident.artifact_sha256, "drafter_sha256": drafter.sha256,
                   "qualified": all_same, "verify_len": args.verify_len, "max_tokens": args.max_tokens,
                   "draft_sink_size": drafter.cfg.sink, "draft_sliding_window": drafter.cfg.window,
                   "summary": summary, "rows": rows,
                   "comparator": "llama.cpp draft-dflash not run in this receipt: the pinned llama.cpp's "
                                 "speculative binaries were not built on this machine"}
        path_r = write_receipt("spec", model=ident.to_json(), device=device_description(args.device), lane=args.lane,
                               gate={"status": "pass" if all_same else "fail",
                                     "rule": "speculative tokens identical to plain decode for every prompt/mode",
                                     "cases": len(rows), "identical_cases": sum(r["identical"] for r in rows),
                                     "tokens_compared": sum(r["tokens"] for r in rows)},
                               results=results)
        for k, v in summary.items():
            print(f"{k:18} acceptance {v['acceptance_rate'] or 0:.3f}  mean accepted {v['mean_accepted_length'] or 0:.2f}"
                  f"  speedup {v['speedup']:.2f}x")
        print(f"gate {'pass' if all_same else 'FAIL'}; receipt {path_r}")
        return 0 if all_same else 1
    finally:
        model.close()
