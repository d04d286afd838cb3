#!/usr/bin/env python3
"""The micro model's corpus and tokenizer: the CPython 3.11 standard library plus the Python sources of
the pinned packages (tools/corpus_packages.json).

    tools/corpus.py pin NAMES.txt        resolve names to the newest sdist (version, file, SHA-256)
    tools/corpus.py fetch                download the pinned sdists into ~/.cache/muser/corpus/sdists, verified
    tools/corpus.py extract              apply the package rule; framed per-package files in the cache
    tools/corpus.py tokenizer            train the BPE on a sample of the train split
    tools/corpus.py carry                write .device/corpus (what the GPU run receives)
    tools/corpus.py manifest             count tokens of the full corpus; write models/corpus-manifest.json
    tools/corpus_carry.py tokenize CARRY OUT    (GPU machine) the carry -> uint16 token streams
    tools/corpus.py build [--root DIR] [--out .device/micro]   the stdlib-only corpus of the first micro model
    tools/corpus.py hashes [--root DIR]                         print the stdlib split hashes

The corpus rule, the split and its hash framing are muser.corpus (one definition).

Token streams: each file becomes [BOS] + ids(text) + [EOS]; the split's stream is the files in order,
stored little-endian uint16 (`<split>.u16`).

Tokenizer: byte-level BPE trained with `tokenizers` on the train split only; 8,192 tokens = 6 specials
(ids 0..5: BOS, EOS, EOT, MASK, START_HEADER, END_HEADER) + 256 byte symbols + merges. Pre-tokenizer:
Split(llama.cpp's LLAMA_VOCAB_PRE_TYPE_GPT4O regex, "isolated") then ByteLevel(use_regex=False); the GGUF
names it `tokenizer.ggml.pre = "llama4"`, which the pinned llama.cpp maps to that same regex
(src/llama-vocab.cpp), so both split identically.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tools"))
DEFAULT_OUT = REPO / ".device" / "micro"

# The corpus rule itself lives in the package (bench ppl reads the held-out split through it).
from muser.corpus import (  # noqa: E402,F401 - re-exported for tools/export_micro.py
    BOS,
    DEFAULT_ROOT,
    EOS,
    EOT,
    EXCLUDED_DIR_PREFIXES,
    EXCLUDED_DIRS,
    EXCLUDED_FILE_PREFIXES,
    EXCLUDED_FILES,
    HELDOUT_BELOW,
    MASK,
    SPECIALS,
    SPLITS,
    VAL_BELOW,
    CorpusError,
    Doc,
    list_sources,
    load_docs,
    split_docs,
    split_of,
    split_sha256,
)

VOCAB_SIZE = 8192
MIN_FREQUENCY = 2

TOKENIZER_PRE = "llama4"

# llama.cpp's pre-tokenizer regex for LLAMA_VOCAB_PRE_TYPE_GPT4O ("llama4"), verbatim from
# src/llama-vocab.cpp (regex_exprs[0] of that case): the rewrite of the tokenizer.json original
# without \p{Lu}/\p{Ll} classes ([^a-z] / [^A-Z] under a letter lookahead). Oniguruma (tokenizers)
# reads the same syntax, so mirroring this string makes both splitters agree.
GPT4O_REGEX = (
    "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+"
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
    "|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*"
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
    "|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)


def corpus_summary(docs: list[Doc], non_utf8: list[str], root: Path) -> dict:
    out = {
        "root": str(root),
        "rule": {
            "files": "*.py regular files, symlinks not followed",
            "excluded_dirs": list(EXCLUDED_DIRS) + [p + "*" for p in EXCLUDED_DIR_PREFIXES],
            "excluded_files": list(EXCLUDED_FILES) + [p + "*.py" for p in EXCLUDED_FILE_PREFIXES],
            "excluded_non_utf8": non_utf8,
            "order": "relative POSIX path, sorted by code point",
            "split": f"sha256(relpath)[0] < {HELDOUT_BELOW}: heldout; < {VAL_BELOW}: val; else train",
            "hash_framing": "sha256 of concat(relpath + '\\n' + str(len(bytes)) + '\\n' + bytes)",
        },
        "splits": {},
    }
    n_all = len(docs)
    for s in SPLITS:
        ds = split_docs(docs, s)
        out["splits"][s] = {
            "files": len(ds),
            "file_fraction": round(len(ds) / n_all, 5),
            "bytes": sum(len(d.data) for d in ds),
            "sha256": split_sha256(ds),
        }
    return out


# ---------------------------------------------------------------------------------------------
# tokenizer


def new_tokenizer():
    """An empty byte-level BPE with the llama4 (GPT-4o) pre-tokenizer of the pinned llama.cpp."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(GPT4O_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE):
    from tokenizers import pre_tokenizers, trainers

    tok = new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=MIN_FREQUENCY,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise CorpusError(f"BPE training produced {tok.get_vocab_size()} tokens, asked for {vocab_size}")
    for i, s in enumerate(SPECIALS):
        if tok.token_to_id(s) != i:
            raise CorpusError(f"special {s!r} has id {tok.token_to_id(s)}, expected {i}")
    return tok


def tokenizer_from_vocab(tokens: list[str], merges: list[str]):
    """Rebuild the HF tokenizer from a GGUF's tokens (by id) and merges ("a b", by priority)."""
    from tokenizers import AddedToken, models

    tok = new_tokenizer()
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ")) for m in merges]
    tok.model = models.BPE(vocab=vocab, merges=pairs)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS if s in vocab])
    return tok


def vocab_and_merges(tok) -> tuple[list[str], list[str]]:
    model = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    tokens: list[str] = [""] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    merges = [m if isinstance(m, str) else f"{m[0]} {m[1]}" for m in model["merges"]]
    return tokens, merges


def encode_docs(tok, docs: list[Doc]) -> np.ndarray:
    """[BOS] + ids + [EOS] per file, concatenated, as uint16."""
    bos, eos = SPECIALS.index(BOS), SPECIALS.index(EOS)
    encs = tok.encode_batch([d.text for d in docs], add_special_tokens=False)
    parts = []
    for e in encs:
        parts.append(np.asarray([bos] + e.ids + [eos], dtype=np.uint32))
    ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)
    if ids.size and int(ids.max()) >= 65536:
        raise CorpusError(f"token id {int(ids.max())} does not fit uint16")
    return ids.astype("<u2")


# ---------------------------------------------------------------------------------------------
# build


def _sha_file(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def build(root: Path = DEFAULT_ROOT, out: Path = DEFAULT_OUT, vocab_size: int = VOCAB_SIZE,
          max_files: int | None = None, log=print) -> dict:
    """Build everything the device run needs into `out`; returns the manifest (also corpus.json).
    `max_files` keeps only the first N files of each split (small test corpora)."""
    root, out = Path(root), Path(out)
    t0 = time.time()
    rels, non_utf8 = list_sources(root)
    docs = load_docs(root)
    if max_files is not None:
        docs = [d for s in SPLITS for d in split_docs(docs, s)[:max_files]]
        docs.sort(key=lambda d: d.relpath)
    summary = corpus_summary(docs, non_utf8, root)
    summary["subset_max_files"] = max_files
    held = summary["splits"]["heldout"]["file_fraction"]
    if max_files is None and held < 0.05:
        raise CorpusError(f"held-out split holds {held:.2%} of files, need >= 5%")
    log(f"corpus: {len(docs)} files ({len(non_utf8)} non-UTF-8 excluded) in {time.time() - t0:.1f}s")
    for s in SPLITS:
        d = summary["splits"][s]
        log(f"  {s:8s} {d['files']:5d} files {d['bytes']:>10,d} bytes  sha256 {d['sha256']}")

    t1 = time.time()
    train_texts = [d.text for d in split_docs(docs, "train")]
    tok = train_tokenizer(train_texts, vocab_size)
    log(f"tokenizer: {tok.get_vocab_size()} tokens trained in {time.time() - t1:.1f}s")

    out.mkdir(parents=True, exist_ok=True)
    tok_path = out / "tokenizer.json"
    tok.save(str(tok_path))
    tokens, merges = vocab_and_merges(tok)
    summary["tokenizer"] = {
        "vocab_size": len(tokens),
        "n_merges": len(merges),
        "specials": list(SPECIALS),
        "pre": TOKENIZER_PRE,
        "regex": GPT4O_REGEX,
        "min_frequency": MIN_FREQUENCY,
        "vocab_sha256": hashlib.sha256(json.dumps([tokens, merges]).encode()).hexdigest(),
    }
    summary["streams"] = {}
    for s in SPLITS:
        ids = encode_docs(tok, split_docs(docs, s))
        p = out / f"{s}.u16"
        tmp = p.with_suffix(".tmp")
        ids.tofile(tmp)
        os.replace(tmp, p)
        summary["streams"][s] = {"file": p.name, "tokens": int(ids.size), "sha256": _sha_file(p),
                                 "bytes_per_token": round(summary["splits"][s]["bytes"] / max(1, ids.size), 4)}
        log(f"  stream {s:8s} {ids.size:>10,d} tokens ({summary['streams'][s]['bytes_per_token']} bytes/token)")
    summary["framing"] = "per file: [BOS] + ids(text, no specials parsed) + [EOS]; files in corpus order; <u2"
    man = out / "corpus.json"
    man.write_text(json.dumps(summary, indent=1) + "\n")
    log(f"wrote {out} in {time.time() - t0:.1f}s")
    return summary


# ---------------------------------------------------------------------------------------------
# the package corpus: extract, tokenizer, carry, manifest

CACHE = Path.home() / ".cache" / "muser" / "corpus"
EXTRACTED = CACHE / "extract.json"
TOKENIZER = CACHE / "tokenizer.json"
CARRY = REPO / ".device" / "corpus"
MANIFEST = REPO / "tools" / "corpus_manifest.json"
TOKENIZER_SAMPLE_BYTES = 32 << 20  # BPE training sample of the train split (minutes on two cores)
TOKENIZER_SAMPLE_CAP = 1 << 20  # at most ~1 MiB of any one package in the sample
CARRY_CAP = 6 << 20  # at most ~6 MiB of any one package in a carried split
CARRY_VAL_BYTES = 5 << 20  # ~1.5M tokens
CARRY_HELDOUT_BYTES = 7 << 20  # ~2M tokens of held-out packages (plus all stdlib held-out files)
CARRY_CODE = ("tools/corpus_carry.py", "src/muser/__init__.py", "src/muser/errors.py", "src/muser/corpus.py")


def _load_all(log=print):
    from corpus_write import corpus_docs

    entries = json.loads(EXTRACTED.read_text())["packages"]
    t = time.time()
    docs = list(corpus_docs(entries, CACHE / "docs"))
    log(f"corpus: {len(docs)} documents, {sum(len(d) for _, d, _ in docs) / 2**20:.0f} MiB read in "
        f"{time.time() - t:.0f}s")
    return entries, docs


def _split_totals(docs) -> dict:
    from muser.corpus import frame

    out = {}
    for s in SPLITS:
        h = hashlib.sha256()
        n = b = 0
        for rel, data, sp in docs:
            if sp == s:
                h.update(frame(rel, data))
                n += 1
                b += len(data)
        out[s] = {"files": n, "bytes": b, "sha256": h.hexdigest()}
    return out


def _fraction_for(docs, split: str, tag: bytes, target: int, cap: int) -> float:
    """The smallest fraction (to 1e-4) whose capped subset of `split` holds >= target bytes."""
    from corpus_write import subset

    ds = [x for x in docs if x[2] == split]
    lo, hi = 0.0, 1.0
    for _ in range(14):
        mid = (lo + hi) / 2
        if sum(len(d) for _, d, _ in subset(ds, tag, mid, cap)) >= target:
            hi = mid
        else:
            lo = mid
    return round(hi, 4)


def cmd_tokenizer(docs, log=print) -> None:
    from corpus_write import subset

    frac = _fraction_for(docs, "train", b"tokenizer", TOKENIZER_SAMPLE_BYTES, TOKENIZER_SAMPLE_CAP)
    sample = subset([x for x in docs if x[2] == "train"], b"tokenizer", frac, TOKENIZER_SAMPLE_CAP)
    t = time.time()
    tok = train_tokenizer([d.decode("utf-8") for _, d, _ in sample])
    CACHE.mkdir(parents=True, exist_ok=True)
    tok.save(str(TOKENIZER))
    log(f"tokenizer: {tok.get_vocab_size()} tokens from {len(sample)} documents "
        f"({sum(len(d) for _, d, _ in sample) / 2**20:.1f} MiB, fraction {frac}) in {time.time() - t:.0f}s")


def tokenizer_info(path: Path = TOKENIZER) -> dict:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    tokens, merges = vocab_and_merges(tok)
    return {"file": "tokenizer.json", "sha256": _sha_file(path), "vocab_size": len(tokens), "n_merges": len(merges),
            "specials": list(SPECIALS), "pre": TOKENIZER_PRE, "regex": GPT4O_REGEX, "min_frequency": MIN_FREQUENCY,
            "vocab_sha256": hashlib.sha256(json.dumps([tokens, merges]).encode()).hexdigest()}


def cmd_carry(docs, train_fraction: float, out: Path = CARRY, threads: int = 2, count_tokens: bool = True,
              max_train_shards: int | None = None, log=print) -> dict:
    from corpus_write import write_carry

    fr = {"train": train_fraction,
          "val": _fraction_for(docs, "val", b"carry", CARRY_VAL_BYTES, CARRY_CAP),
          "heldout": _fraction_for([x for x in docs if not x[0].startswith("cpython-3.11/")], "heldout", b"carry",
                                   CARRY_HELDOUT_BYTES, CARRY_CAP)}
    full = _split_totals(docs)
    man = write_carry(out, TOKENIZER, docs, fr, CARRY_CAP, full, tokenizer_info(),
                      [REPO / c for c in CARRY_CODE], threads=threads, count_tokens=count_tokens,
                      max_train_shards=max_train_shards, log=log)
    log(f"carry: {man['carry_bytes'] / 2**20:.2f} MiB, tokens train {man['carried']['train']['tokens']}, "
        f"val {man['carried']['val']['tokens']}, heldout {man['carried']['heldout']['tokens']}")
    return man


def count_tokens(docs, log=print, batch: int = 1024) -> list[int]:
    """Stream tokens per document ([BOS] + ids + [EOS], as the token streams hold them)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TOKENIZER))
    out: list[int] = []
    t = time.time()
    for i in range(0, len(docs), batch):
        encs = tok.encode_batch([d.decode("utf-8") for _, d, _ in docs[i:i + batch]], add_special_tokens=False)
        out += [len(e.ids) + 2 for e in encs]
        if (i // batch) % 20 == 0:
            log(f"  tokens: {i + batch}/{len(docs)} documents, {sum(out):,d} tokens, {time.time() - t:.0f}s")
    return out


COUNT_SAMPLE = 1 / 16  # the full corpus's token totals are estimated from this deterministic share


def cmd_manifest(entries, docs, carry_dir: Path = CARRY, log=print) -> dict:
    """The corpus manifest: the rule, every package, the split totals and hashes; tokens by the tokenizer:
    exact for the stdlib and for every carried document (per shard), estimated for the full corpus from
    the documents with unit(b"count", relpath) < COUNT_SAMPLE (split bytes x the sample's tokens/byte)."""
    from corpus_write import STDLIB_PREFIX, carry_shards, unit

    if not (carry_dir / "corpus.json").is_file():
        raise CorpusError(f"{carry_dir / 'corpus.json'} is missing: write the carry first")
    carry = json.loads((carry_dir / "corpus.json").read_text())
    if carry["tokenizer"]["sha256"] != _sha_file(TOKENIZER):
        raise CorpusError("the carry's tokenizer differs from the cached tokenizer")
    fr = {s: carry["carried"][s]["fraction"] for s in SPLITS}
    written = {i["file"]: i for s in SPLITS for i in carry["carried"][s]["shards"]}
    selection = carry_shards(docs, fr, carry["cap"])
    shards = [(sp, name, ds) for sp, name, ds in selection if name in written]
    train_shards = {"written": sum(1 for sp, _, _ in shards if sp == "train"),
                    "of": sum(1 for sp, _, _ in selection if sp == "train")}
    for _, name, ds in shards:
        if written[name]["docs"] != len(ds):
            raise CorpusError(f"{name}: the carry holds {written[name]['docs']} documents, its selection {len(ds)}")
    carried = {r for _, _, ds in shards for r, _ in ds}
    sampled = {r for r, _, _ in docs if unit(b"count", r) < COUNT_SAMPLE}
    need = [x for x in docs if x[0] in carried or x[0] in sampled or x[0].startswith(STDLIB_PREFIX)]
    log(f"counting tokens of {len(need)} documents ({sum(len(d) for _, d, _ in need) / 2**20:.0f} MiB)")
    per_doc = {x[0]: n for x, n in zip(need, count_tokens(need, log))}
    for _, name, ds in shards:
        written[name]["tokens"] = sum(per_doc[r] for r, _ in ds)
    for s in SPLITS:
        carry["carried"][s]["tokens"] = sum(i["tokens"] for i in carry["carried"][s]["shards"])
    totals = _split_totals(docs)
    for s in SPLITS:
        smp = [(r, d) for r, d, sp in docs if sp == s and r in sampled]
        st, sb = sum(per_doc[r] for r, _ in smp), sum(len(d) for _, d in smp)
        totals[s]["tokens_estimate"] = round(totals[s]["bytes"] * st / sb)
        totals[s]["token_sample"] = {"files": len(smp), "bytes": sb, "tokens": st}
    rels, non_utf8 = list_sources(DEFAULT_ROOT)
    std = corpus_summary(load_docs(DEFAULT_ROOT), non_utf8, DEFAULT_ROOT)
    for s in SPLITS:
        std["splits"][s]["tokens"] = sum(n for r, n in per_doc.items()
                                         if r.startswith(STDLIB_PREFIX) and split_of(r[len(STDLIB_PREFIX):]) == s)
    man = {
        "rule": "muser.corpus (stdlib rule, then the package rule; dedupe by content SHA-256 in corpus order)",
        "order": f"stdlib files as {STDLIB_PREFIX}<relpath> by path, then packages by canonical name, files by path",
        "hash_framing": "sha256 of concat(relpath + '\\n' + str(len(bytes)) + '\\n' + bytes) over a split in order",
        "tokens": "per document [BOS] + ids + [EOS] with the tokenizer below; tokens_estimate = split bytes x "
                  f"tokens/byte of the documents with unit(b'count', relpath) < {COUNT_SAMPLE}",
        "pinned_list": {"file": "tools/corpus_packages.json", "sha256": _sha_file(REPO / "tools" / "corpus_packages.json")},
        "splits": totals,
        "stdlib": {"root": std["root"], "splits": std["splits"], "excluded_non_utf8": non_utf8},
        "heldout_packages": [e["name"] for e in entries if e["heldout"]],
        "tokenizer": tokenizer_info(),
        "carry": {"selection": carry["selection"], "cap": carry["cap"], "train_shards": train_shards,
                  "carry_bytes": sum(p.stat().st_size for p in carry_dir.rglob("*") if p.is_file()),
                  "splits": {s: {k: v for k, v in carry["carried"][s].items() if k != "shards"} for s in SPLITS},
                  "shards": {s: [{k: i[k] for k in ("file", "docs", "bytes", "tokens", "xz_bytes", "xz_sha256")}
                                 for i in carry["carried"][s]["shards"]] for s in SPLITS}},
        "packages": entries,
    }
    MANIFEST.write_text(json.dumps(man, indent=1) + "\n")
    log(f"manifest: {MANIFEST} ({MANIFEST.stat().st_size / 1024:.0f} KiB); carried tokens " +
        ", ".join(f"{s} {carry['carried'][s]['tokens']:,d}" for s in SPLITS) + "; full corpus (estimated) " +
        ", ".join(f"{s} {totals[s]['tokens_estimate']:,d}" for s in SPLITS))
    return man


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="corpus + tokenizer + token streams into OUT")
    b.add_argument("--root", type=Path, default=DEFAULT_ROOT)
    b.add_argument("--out", type=Path, default=DEFAULT_OUT)
    b.add_argument("--vocab", type=int, default=VOCAB_SIZE)
    h = sub.add_parser("hashes", help="print the corpus summary (split hashes) as JSON")
    h.add_argument("--root", type=Path, default=DEFAULT_ROOT)
    pn = sub.add_parser("pin", help="resolve package names to their newest sdist (tools/corpus_packages.json)")
    pn.add_argument("names", type=Path, help="a text file of package names (whitespace separated)")
    sub.add_parser("fetch", help="download the pinned sdists into the cache, SHA-256 verified")
    sub.add_parser("extract", help="apply the package rule to the fetched sdists (framed files in the cache)")
    sub.add_parser("tokenizer", help="train the BPE on a sample of the train split")
    mf = sub.add_parser("manifest", help="count tokens; write tools/corpus_manifest.json")
    mf.add_argument("--carry", type=Path, default=CARRY, help="the carry folder written by `carry`")
    c = sub.add_parser("carry", help="write the carry folder for the GPU run")
    c.add_argument("--train-fraction", type=float, required=True)
    c.add_argument("--out", type=Path, default=CARRY)
    c.add_argument("--threads", type=int, default=2)
    c.add_argument("--no-token-count", action="store_true", help="leave the token counts to tokenize_carry")
    c.add_argument("--max-train-shards", type=int, default=None, help="write only the first N train shards")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "build":
            build(a.root, a.out, a.vocab)
        elif a.cmd == "pin":
            import corpus_fetch

            pinned = corpus_fetch.pin(a.names.read_text().split())
            corpus_fetch.PINNED.write_text(json.dumps(pinned, indent=1) + "\n")
            print(f"pinned {len(pinned['packages'])} packages, skipped {len(pinned['skipped'])}")
        elif a.cmd == "fetch":
            import corpus_fetch

            pinned = corpus_fetch.fetch(json.loads(corpus_fetch.PINNED.read_text()))
            corpus_fetch.PINNED.write_text(json.dumps(pinned, indent=1) + "\n")
        elif a.cmd == "extract":
            import corpus_fetch
            import corpus_packages

            res = corpus_packages.extract(json.loads(corpus_fetch.PINNED.read_text()), corpus_fetch.DEFAULT_CACHE,
                                          CACHE / "docs")
            EXTRACTED.write_text(json.dumps(res, indent=1) + "\n")
        elif a.cmd == "tokenizer":
            cmd_tokenizer(_load_all()[1])
        elif a.cmd == "manifest":
            cmd_manifest(*_load_all(), a.carry)
        elif a.cmd == "carry":
            cmd_carry(_load_all()[1], a.train_fraction, a.out, a.threads, not a.no_token_count, a.max_train_shards)
        else:
            rels, non_utf8 = list_sources(a.root)
            print(json.dumps(corpus_summary(load_docs(a.root), non_utf8, a.root), indent=1))
    except CorpusError as e:
        print(f"corpus: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
