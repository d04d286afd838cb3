"""`muser bench ppl`: perplexity of a micro Muse Glimmer GGUF on its corpus's held-out split,
computed by Muser (the CPU oracle) and by the pinned llama.cpp on the same file, in one run.

Text. `--text held-out` (or `val`) is the split of the micro model's corpus (muser.corpus:
CPython 3.11 standard library, fixed file rule, split by SHA-256 of the path). The files are read
from the corpus root and must hash to the split SHA-256 the GGUF records in
`muser.micro.provenance`; each file becomes [BOS] + Muser's tokenization of it + [EOS], files in
corpus order, and the resulting uint16 stream must hash to the stream SHA-256 of the provenance
(the very tokens the training run measured). The pinned llama.cpp tokenizes every file too, and
the run is refused if any file's ids differ.

Framing (identical for both sides). The stream is cut into non-overlapping windows of L tokens
(L = the model's context_length unless --window; stride L; the tail is dropped). With a budget of
N tokens, n = N // L windows are used, evenly spaced: window i starts at floor(i * W / n) * L
(W = number of whole windows in the stream). Each window runs from a fresh context at position 0
as one prefill with all-position logits; the first token of a window is context only, tokens
1..L-1 are scored: NLL = -log softmax(logits[t-1])[id[t]]. PPL = exp(mean NLL over all scored
tokens). This is the training run's held-out framing (tools/train_micro.py eval_windows).

Sides. Muser: muser.oracle.load(model, arithmetic, kv) -> session(max_context=L).prefill(ids,
all_logits=True). llama.cpp: bench.llamacpp.LlamaCppRunner (n_ctx = n_batch = L, type_k = type_v
= the same KV type, non-flash attention, one prefill per window).

Gate: |PPL_muser / PPL_llama.cpp - 1| <= 0.1%, and position by position (muser.gates.judge):
max |d log-softmax| <= max(1e-4, 2 x noise max), median <= max(1e-5, 2 x noise median), top-1
agreement >= 1 - 2 x the noise's top-1 disagreement, where the noise is the oracle rerun with
every norm output and rounding point's input moved 1 f32 ulp up, on the same windows (a
temperature-like slip barely moves a calibrated model's perplexity, but moves every position).
The receipt also carries, per side, mean NLL, next-token accuracy and per-window NLL. With --reference (the F16 master), the reference
runs through both sides with the same settings and each side reports its top-1 agreement with
the reference, mean KL(reference || model) and the reference's PPL. --no-comparator (for files
the pinned llama.cpp cannot load: Muser's native NVFP4) runs Muser alone; the gate is then n/a.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ...gates import judge
from ...oracle import NoiseFloor
from ...oracle.numerics import log_softmax

GATE_REL = 1e-3  # |PPL_muser / PPL_llama.cpp - 1| <= 0.1% (the micro model's perplexity gate)
DEFAULT_MAX_TOKENS = 8192  # 8 windows of 1024: about 3 minutes for the oracle on 2 cores
TEXTS = {"held-out": "heldout", "val": "val"}
PROVENANCE_KEY = "muser.micro.provenance"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ppl", help="held-out perplexity by Muser and by the pinned llama.cpp (gate: 0.1%%)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a micro Muse Glimmer GGUF (carries muser.micro.provenance)")
    p.add_argument("--text", required=True, choices=sorted(TEXTS), help="corpus split to evaluate")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help=f"token budget: N // window evenly spaced windows (default {DEFAULT_MAX_TOKENS})")
    p.add_argument("--window", type=int, default=None, help="window length L (default: context_length)")
    p.add_argument("--arithmetic", choices=("f32", "ggml-cpu"), default="ggml-cpu",
                   help="oracle arithmetic (default ggml-cpu: llama.cpp's CPU rounding points)")
    p.add_argument("--kv", choices=("f16", "f32"), default=None,
                   help="KV type on both sides (default: f16 with ggml-cpu, f32 with f32)")
    p.add_argument("--reference", default=None,
                   help="reference GGUF (the F16 master): top-1 agreement and KL per side")
    p.add_argument("--no-comparator", action="store_true",
                   help="Muser only, for files the pinned llama.cpp cannot load (gate n/a)")
    p.add_argument("--corpus-root", default=None,
                   help="CPython standard-library folder (default: the root the provenance records)")
    p.add_argument("--out-dir", default=None, help="receipt directory (default: the per-user cache, muser.api.cache_dir()/receipts; give bench/receipts for the project's evidence)")
    p.set_defaults(func=run)


# --- the text ---------------------------------------------------------------------------------


def provenance(f) -> dict:
    from ...errors import MetadataError

    if PROVENANCE_KEY not in f:
        raise MetadataError(f"the model has no {PROVENANCE_KEY!r} key: --text names a split of the micro "
                            "model's corpus, which only a micro model records")
    try:
        prov = json.loads(f.get_str(PROVENANCE_KEY))
        prov["corpus"], prov["streams"]  # noqa: B018 - both must be present
    except (ValueError, KeyError, TypeError) as e:
        raise MetadataError(f"{PROVENANCE_KEY!r} is not the provenance JSON export_micro writes ({e})") from None
    return prov


@dataclass
class Text:
    split: str
    ids: np.ndarray  # uint16 [n]: the split's stream
    files: list[str]
    per_file: list[np.ndarray]  # each file's ids (without BOS/EOS)
    split_sha256: str
    stream_sha256: str
    root: str


def load_text(f, tokenizer, text: str, root: str | None = None) -> Text:
    """The split's token stream, checked against the split and stream hashes of the provenance."""
    from ...errors import IdentityMismatch, TokenizerError

    split = TEXTS[text]
    prov = provenance(f)
    from ... import corpus

    root = root or prov.get("corpus_root") or str(corpus.DEFAULT_ROOT)
    docs = corpus.split_docs(corpus.load_docs(Path(root)), split)  # CorpusError (a MuserError) names the root
    sha = corpus.split_sha256(docs)
    want = prov["corpus"].get(split, {}).get("sha256")
    if sha != want:
        raise IdentityMismatch(f"{text} split under {root!r} hashes to {sha}, the model's provenance records "
                               f"{want}: not the text this model was measured on")
    bos, eos = tokenizer.bos_id, tokenizer.eos_id
    if bos is None or eos is None:
        raise TokenizerError(f"the tokenizer has BOS {bos} / EOS {eos}; the corpus framing needs both")
    per_file = [np.asarray(tokenizer.encode(d.text, add_special=False, parse_special=False), dtype=np.int64)
                for d in docs]
    parts = [np.concatenate([[bos], ids, [eos]]) for ids in per_file]
    stream = np.concatenate(parts).astype("<u2")
    ssha = hashlib.sha256(stream.tobytes()).hexdigest()
    swant = prov["streams"].get(split, {}).get("sha256")
    if ssha != swant:
        raise IdentityMismatch(f"{text} token stream hashes to {ssha}, the provenance records {swant}: the "
                               "tokenizer does not reproduce the training-time tokenization")
    return Text(split, stream, [d.relpath for d in docs], per_file, sha, ssha, root)


def llamacpp_tokenization_check(path, text: Text, docs_bytes: list[bytes]) -> int:
    """Tokenize every file with the pinned llama.cpp (vocab only); refuse on the first difference."""
    from ...errors import ComparatorError, TokenizerError
    from ..llamacpp import PINNED_VERSION

    try:
        import llama_cpp
    except ImportError as e:
        raise ComparatorError(f"llama-cpp-python=={PINNED_VERSION} is not importable ({e})") from e
    if getattr(llama_cpp, "__version__", "?") != PINNED_VERSION:
        raise ComparatorError(f"llama-cpp-python {llama_cpp.__version__} is installed, pinned {PINNED_VERSION}")
    vocab = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    try:
        for name, data, ours in zip(text.files, docs_bytes, text.per_file):
            theirs = vocab.tokenize(data, add_bos=False, special=False)
            if list(ours) != theirs:
                i = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
                raise TokenizerError(f"{name!r}: Muser and llama.cpp tokenize differently from token {i} "
                                     f"({list(ours[i:i + 3])} vs {theirs[i:i + 3]})")
    finally:
        vocab.close()
    return len(text.files)


def window_starts(n_stream: int, window: int, max_tokens: int) -> tuple[list[int], int]:
    """Starts of n = max_tokens // window evenly spaced windows among the W whole windows; (starts, W)."""
    from ...errors import EmptyInput

    total = n_stream // window
    if total < 1:
        raise EmptyInput(f"the stream holds {n_stream} tokens, less than one window of {window}")
    n = max_tokens // window
    if n < 1:
        raise EmptyInput(f"--max-tokens {max_tokens} is less than one window of {window} tokens")
    n = min(n, total)
    return [(i * total // n) * window for i in range(n)], total


# --- scoring ----------------------------------------------------------------------------------


@dataclass
class Side:
    """Running totals of one engine over the windows."""

    name: str
    nll: list[float] = field(default_factory=list)  # per window: sum of NLL over its scored tokens
    tok_nll: list[np.ndarray] = field(default_factory=list)  # per window: NLL of each scored token
    n: list[int] = field(default_factory=list)  # per window: scored tokens
    hits: int = 0  # argmax == next token
    ref_agree: int = 0  # argmax == the reference's argmax (same side)
    kl: float = 0.0  # sum over positions of KL(reference || model)
    ref_nll: float = 0.0
    seconds: float = 0.0

    def add(self, lp: np.ndarray, targets: np.ndarray) -> np.ndarray:
        """lp [T-1, vocab] log-probs for targets [T-1]; returns argmax [T-1]."""
        nll = -lp[np.arange(len(targets)), targets]  # [T-1] float64
        self.tok_nll.append(nll)
        self.nll.append(float(nll.sum()))
        self.n.append(len(targets))
        top = lp.argmax(axis=-1)
        self.hits += int((top == targets).sum())
        return top

    def add_reference(self, lp: np.ndarray, top: np.ndarray, lp_ref: np.ndarray, targets: np.ndarray) -> None:
        self.ref_agree += int((top == lp_ref.argmax(axis=-1)).sum())
        self.kl += float((np.exp(lp_ref) * (lp_ref - lp)).sum())
        self.ref_nll += float(-lp_ref[np.arange(len(targets)), targets].sum())

    @property
    def tokens(self) -> int:
        return sum(self.n)

    @property
    def mean_nll(self) -> float:
        return sum(self.nll) / self.tokens

    @property
    def ppl(self) -> float:
        return math.exp(self.mean_nll)

    def summary(self, with_reference: bool) -> dict:
        out = {"ppl": self.ppl, "mean_nll": self.mean_nll, "scored_tokens": self.tokens,
               "next_token_accuracy": self.hits / self.tokens, "seconds": round(self.seconds, 2),
               "window_mean_nll": [s / n for s, n in zip(self.nll, self.n)]}
        if with_reference:
            out |= {"top1_agreement_with_reference": self.ref_agree / self.tokens,
                    "mean_kl_from_reference": self.kl / self.tokens,
                    "reference_ppl": math.exp(self.ref_nll / self.tokens)}
        return out


@dataclass
class Between:
    """Muser vs llama.cpp, position by position."""

    per_pos_max: list[np.ndarray] = field(default_factory=list)
    agree: int = 0
    n: int = 0

    def add(self, lp_a: np.ndarray, lp_b: np.ndarray) -> None:
        self.per_pos_max.append(np.abs(lp_a - lp_b).max(axis=-1))
        self.agree += int((lp_a.argmax(-1) == lp_b.argmax(-1)).sum())
        self.n += lp_a.shape[0]

    def summary(self) -> dict:
        d = np.concatenate(self.per_pos_max)
        return {"max_abs_dlogsoftmax": float(d.max()), "median_abs_dlogsoftmax": float(np.median(d)),
                "top1_agreement": self.agree / self.n, "positions": self.n}


# --- the run ----------------------------------------------------------------------------------


def _model_json(m) -> dict:
    f = m.file.gguf
    return {"path": str(m.path), "identity": m.identity.to_json(),
            "dtypes": sorted(set(m.file.contract.dtypes.values())),
            "weight_precision": f.get("muser.weight_precision")}


def _check_reference(m, ref) -> None:
    from ...errors import IdentityMismatch

    a, b = m.config, ref.config
    if m.identity.tokenizer_sha256 != ref.identity.tokenizer_sha256:
        raise IdentityMismatch(f"--reference has tokenizer {ref.identity.tokenizer_sha256[:16]}..., the model "
                               f"{m.identity.tokenizer_sha256[:16]}...: not the same vocabulary")
    for k in ("vocab", "context_length", "hidden", "n_layers"):
        if getattr(a, k) != getattr(b, k):
            raise IdentityMismatch(f"--reference {k} {getattr(b, k)} != the model's {getattr(a, k)}")


def run(args: argparse.Namespace) -> int:
    from ... import oracle as oracle_mod
    from ...errors import ContextOverflow
    from ...text import Tokenizer
    from ..llamacpp import LlamaCppRunner
    from ..receipt import device_description, write_receipt

    t_start = time.time()
    kv = args.kv or ("f16" if args.arithmetic == "ggml-cpu" else "f32")
    m = oracle_mod.load(args.model, arithmetic=args.arithmetic, kv=kv)  # fails closed on a bad file
    ref = None
    runners: list = []
    try:
        cfg = m.config
        L = args.window or cfg.context_length
        if not 2 <= L <= cfg.context_length:
            raise ContextOverflow(f"--window {L} must be in [2, {cfg.context_length}] (the model's context_length)")
        if args.reference:
            ref = oracle_mod.load(args.reference, arithmetic=args.arithmetic, kv=kv)
            _check_reference(m, ref)
            if ref.identity.artifact_sha256 == m.identity.artifact_sha256:
                ref.close()
                ref = "self"
        tok = Tokenizer.from_gguf(m.file.gguf)
        t0 = time.time()
        text = load_text(m.file.gguf, tok, args.text, args.corpus_root)
        starts, total = window_starts(len(text.ids), L, args.max_tokens)
        n_checked = 0
        if not args.no_comparator:
            root = Path(text.root)
            n_checked = llamacpp_tokenization_check(args.model, text,
                                                    [(root / rel).read_bytes() for rel in text.files])
            runners.append(LlamaCppRunner(args.model, kv=kv, n_ctx=L, n_batch=L))
            if ref not in (None, "self"):
                runners.append(LlamaCppRunner(args.reference, kv=kv, n_ctx=L, n_batch=L))
        t_text = time.time() - t0

        muser_side, llama_side, between = Side("muser"), Side("llama.cpp"), Between()
        noise_side, noise_between = Side("muser, 1 ulp up"), Between()
        for i, s in enumerate(starts):
            ids = text.ids[s:s + L].astype(np.int64)  # [L]
            tgt = ids[1:]  # [L-1]: token t is scored from the logits of position t-1

            def oracle_lp(model) -> np.ndarray:
                return log_softmax(model.session(max_context=L).prefill(ids, all_logits=True)[:-1])

            t0 = time.time()
            lp_m = oracle_lp(m)
            top_m = muser_side.add(lp_m, tgt)
            if ref is not None:
                muser_side.add_reference(lp_m, top_m, lp_m if ref == "self" else oracle_lp(ref), tgt)
            muser_side.seconds += time.time() - t0
            t0 = time.time()
            arith = m.forward.arith  # the jitter switch OracleModel.noise_floor uses
            arith.jitter = "up"
            try:
                lp_n = oracle_lp(m)
            finally:
                arith.jitter = None
            noise_side.add(lp_n, tgt)
            noise_between.add(lp_m, lp_n)
            del lp_n
            noise_side.seconds += time.time() - t0
            if runners:
                t0 = time.time()
                lp_l = log_softmax(runners[0].logits(ids)[:-1])
                top_l = llama_side.add(lp_l, tgt)
                if ref is not None:
                    lp_r = lp_l if ref == "self" else log_softmax(runners[1].logits(ids)[:-1])
                    llama_side.add_reference(lp_l, top_l, lp_r, tgt)
                llama_side.seconds += time.time() - t0
                between.add(lp_m, lp_l)
                del lp_l
            del lp_m
            print(f"window {i + 1}/{len(starts)} @ {s}: muser nll {muser_side.nll[-1] / muser_side.n[-1]:.5f}"
                  + (f"  llama.cpp {llama_side.nll[-1] / llama_side.n[-1]:.5f}" if runners else ""),
                  file=sys.stderr, flush=True)

        results: dict = {
            "text": {"name": args.text, "split": text.split, "files": len(text.files),
                     "split_sha256": text.split_sha256, "stream_sha256": text.stream_sha256,
                     "stream_tokens": int(len(text.ids)), "corpus_root": text.root,
                     "llamacpp_tokenization_identical_files": n_checked},
            "framing": {"window": L, "stride": L, "whole_windows": total, "windows": len(starts),
                        "window_starts": starts, "max_tokens": args.max_tokens,
                        "scored_per_window": L - 1,
                        "rule": "non-overlapping windows of L tokens, n = max_tokens // L of the W whole "
                                "windows evenly spaced (start_i = floor(i*W/n)*L); each window a fresh "
                                "context from position 0, one prefill; tokens 1..L-1 scored"},
            "settings": {"arithmetic": args.arithmetic, "kv": kv},
            "muser": muser_side.summary(ref is not None),
            "text_seconds": round(t_text, 2),
            "wall_seconds": None,
        }
        d = np.concatenate(noise_side.tok_nll) - np.concatenate(muser_side.tok_nll)
        ns = noise_between.summary()
        floor = NoiseFloor(ns["max_abs_dlogsoftmax"], [ns["max_abs_dlogsoftmax"]], "prefill", ns["positions"],
                           jitter=ns["max_abs_dlogsoftmax"], median=ns["median_abs_dlogsoftmax"],
                           top1=ns["top1_agreement"])
        results["noise_floor"] = {
            "what": "oracle rerun with every norm output and rounding point's input moved 1 f32 ulp up",
            "ppl": noise_side.ppl, "ppl_rel_shift": noise_side.ppl / muser_side.ppl - 1.0,
            "token_nll_diff_std": float(d.std()), "seconds": round(noise_side.seconds, 2)} | ns
        if runners:
            rel = muser_side.ppl / llama_side.ppl - 1.0
            d = np.concatenate(muser_side.tok_nll) - np.concatenate(llama_side.tok_nll)
            results["llamacpp"] = llama_side.summary(ref is not None)
            results["agreement"] = {"ppl_rel_diff": rel, "abs_ppl_rel_diff": abs(rel),
                                    "nll_diff": muser_side.mean_nll - llama_side.mean_nll,
                                    "token_nll_diff_std": float(d.std())} | between.summary()
            v = judge(np.concatenate(between.per_pos_max), between.agree / between.n, floor)
            ok = abs(rel) <= GATE_REL and v["ok"]
            gate = {"status": "pass" if ok else "fail", "name": "ppl agreement",
                    "rule": f"|PPL_muser / PPL_llama.cpp - 1| <= {GATE_REL:g}; per position: max <= max(1e-4, "
                            "2 x noise max), median <= max(1e-5, 2 x noise median), top-1 >= 1 - 2 x noise "
                            "disagreement", "value": abs(rel), "ppl_ok": abs(rel) <= GATE_REL,
                    "per_position": {k: v[k] for k in ("values", "bounds", "checks")},
                    "noise_ppl_rel_shift": results["noise_floor"]["ppl_rel_shift"]}
        else:
            gate = {"status": "n/a", "name": "ppl agreement",
                    "reason": "--no-comparator: the pinned llama.cpp does not run this file"}
        results["wall_seconds"] = round(time.time() - t_start, 2)
        extra = {"comparator": runners[0].settings() if runners else None}
        if ref is not None:
            extra["reference"] = _model_json(m) if ref == "self" else _model_json(ref)
        path = write_receipt("ppl", model=_model_json(m), device=device_description("cpu"),
                             lane=f"oracle {args.arithmetic} kv={kv}" + ("" if not runners else " vs llama.cpp"),
                             gate=gate, results=results, out_dir=args.out_dir, extra=extra)
    finally:
        for r in runners:
            r.close()
        m.close()
        if ref not in (None, "self"):
            ref.close()

    mu = results["muser"]
    line = f"muser ({args.arithmetic}, kv {kv}): ppl {mu['ppl']:.5f}  acc {mu['next_token_accuracy']:.4f}"
    if ref is not None:
        line += f"  top1 vs ref {mu['top1_agreement_with_reference']:.4f}  KL {mu['mean_kl_from_reference']:.5f}"
    print(line)
    nf = results["noise_floor"]
    print(f"noise floor: 1-ulp jitter moves Muser's ppl by {nf['ppl_rel_shift'] * 100:+.5f}% "
          f"(token NLL std {nf['token_nll_diff_std']:.4f}), per position max {nf['max_abs_dlogsoftmax']:.3e} "
          f"median {nf['median_abs_dlogsoftmax']:.3e} top1 {nf['top1_agreement']:.4f}")
    if runners:
        ll, ag = results["llamacpp"], results["agreement"]
        line = f"llama.cpp (kv {kv}):{' ' * max(0, len(args.arithmetic) - 2)} ppl {ll['ppl']:.5f}  acc {ll['next_token_accuracy']:.4f}"
        if ref is not None:
            line += f"  top1 vs ref {ll['top1_agreement_with_reference']:.4f}  KL {ll['mean_kl_from_reference']:.5f}"
        print(line)
        print(f"agreement: ppl {ag['ppl_rel_diff'] * 100:+.5f}%  token NLL std {ag['token_nll_diff_std']:.4f}  "
              f"max |d logsoftmax| {ag['max_abs_dlogsoftmax']:.3e}  median {ag['median_abs_dlogsoftmax']:.3e}  "
              f"top1 {ag['top1_agreement']:.4f}")
    print(f"{len(starts)} windows x {L} tokens ({results['framing']['windows'] * (L - 1)} scored); "
          f"gate {gate['status']}; receipt: {path}")
    return 0 if gate["status"] in ("pass", "n/a") else 1
