#!/usr/bin/env python3
"""The corpus carry: what the GPU machine receives, and how it becomes token streams there.

    python3 tools/corpus_carry.py tokenize CARRY OUT     # on the GPU machine: CARRY -> OUT/*.u16 + corpus.json

A carry folder holds
    tokenizer.json                     the byte-level BPE (tools/corpus.py tokenizer)
    train-NN.xz, val.xz, heldout.xz    xz streams of framed documents (muser.corpus.frame: relpath "\\n"
                                       decimal length "\\n" bytes, back to back), each a deterministic subset
                                       of its split in corpus order
    corpus.json                        what was carried vs the full corpus; per shard file name, SHA-256 of
                                       the .xz and of the framed bytes, documents, bytes, tokens
`tokenize_carry` checks every hash, encodes each document as [BOS] + ids + [EOS] (the framing of
tools/corpus.py's streams) and writes train.u16 / val.u16 / heldout.u16 (little-endian uint16, shards
concatenated in order) and a corpus.json in the format tools/train_micro.py reads.
Needs only numpy, tokenizers and this checkout's src/muser/corpus.py.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from muser.corpus import BOS, EOS, SPECIALS, SPLITS, CorpusError, unframe  # noqa: E402


def read_shard(carry: Path, info: dict) -> list[tuple[str, bytes]]:
    """The documents of one carried shard, its .xz and framed-bytes SHA-256 checked."""
    raw = (carry / info["file"]).read_bytes()
    if hashlib.sha256(raw).hexdigest() != info["xz_sha256"]:
        raise CorpusError(f"{info['file']}: sha256 differs from corpus.json")
    blob = lzma.decompress(raw)
    if hashlib.sha256(blob).hexdigest() != info["sha256"]:
        raise CorpusError(f"{info['file']}: framed bytes' sha256 differs from corpus.json")
    docs = unframe(blob)
    if len(docs) != info["docs"]:
        raise CorpusError(f"{info['file']}: {len(docs)} documents, corpus.json says {info['docs']}")
    return docs


def encode(tok, docs: list[tuple[str, bytes]], batch: int = 2048) -> np.ndarray:
    """[BOS] + ids(text, no special parsing) + [EOS] per document, as little-endian uint16."""
    bos, eos = SPECIALS.index(BOS), SPECIALS.index(EOS)
    parts = []
    for i in range(0, len(docs), batch):
        encs = tok.encode_batch([d.decode("utf-8") for _, d in docs[i:i + batch]], add_special_tokens=False)
        for e in encs:
            parts.append(np.asarray([bos, *e.ids, eos], dtype=np.uint32))
    ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)
    if ids.size and int(ids.max()) >= 65536:
        raise CorpusError(f"token id {int(ids.max())} does not fit uint16")
    return ids.astype("<u2")


def tokenize_carry(carry_dir: str | Path, out_dir: str | Path, log=print) -> dict:
    """Turn a carry folder into train.u16 / val.u16 / heldout.u16 + corpus.json in `out_dir`."""
    from tokenizers import Tokenizer

    carry, out = Path(carry_dir), Path(out_dir)
    man = json.loads((carry / "corpus.json").read_text())
    tok_path = carry / "tokenizer.json"
    if hashlib.sha256(tok_path.read_bytes()).hexdigest() != man["tokenizer"]["sha256"]:
        raise CorpusError(f"{tok_path}: sha256 differs from corpus.json")
    tok = Tokenizer.from_file(str(tok_path))
    if tok.get_vocab_size() != man["tokenizer"]["vocab_size"]:
        raise CorpusError(f"{tok_path}: {tok.get_vocab_size()} tokens, corpus.json says "
                          f"{man['tokenizer']['vocab_size']}")
    out.mkdir(parents=True, exist_ok=True)
    streams = {}
    for split in SPLITS:
        p = out / f"{split}.u16"
        tmp = p.with_name(p.name + ".tmp")
        h = hashlib.sha256()
        n = 0
        with open(tmp, "wb") as f:
            for info in man["carried"][split]["shards"]:
                ids = encode(tok, read_shard(carry, info))
                if info["tokens"] is not None and ids.size != info["tokens"]:
                    raise CorpusError(f"{info['file']}: {ids.size} tokens, corpus.json says {info['tokens']}")
                b = ids.tobytes()
                f.write(b)
                h.update(b)
                n += ids.size
        os.replace(tmp, p)
        streams[split] = {"file": p.name, "tokens": n, "sha256": h.hexdigest()}
        log(f"  {split:8s} {n:>12,d} tokens -> {p}")
    carried = {s: {**man["carried"][s], "tokens": streams[s]["tokens"]} for s in SPLITS}
    res = {"splits": carried, "full": man["full"], "tokenizer": man["tokenizer"], "streams": streams,
           "framing": "per document: [BOS] + ids(text, no specials parsed) + [EOS]; documents in carry order; <u2"}
    (out / "corpus.json").write_text(json.dumps(res, indent=1) + "\n")
    return res


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tokenize", help="carry folder -> uint16 token streams + corpus.json")
    t.add_argument("carry", type=Path)
    t.add_argument("out", type=Path)
    a = ap.parse_args(argv)
    try:
        tokenize_carry(a.carry, a.out)
    except CorpusError as e:
        print(f"corpus: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
