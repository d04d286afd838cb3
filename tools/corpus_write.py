"""The full corpus in order (the stdlib, then the packages), the tokenizer's training sample, and the
carry writer (used by tools/corpus.py; the carry format is tools/corpus_carry.py)."""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import shutil
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tools"))

from corpus_carry import encode  # noqa: E402
from corpus_packages import read_package  # noqa: E402

from muser.corpus import (  # noqa: E402
    DEFAULT_ROOT,
    SPLITS,
    CorpusError,
    frame,
    load_docs,
    package_split_of,
)

STDLIB_PREFIX = "cpython-3.11/"  # a '.' never survives canonical_name, so no package shares the prefix
CARRY_BUDGET = 50 << 20  # the whole carry folder (the GPU call's tree is capped at 64 MiB)
SHARD_RAW = 48 << 20  # framed bytes per train shard: inside xz -9's 64 MiB dictionary
XZ_PRESET = 9 | lzma.PRESET_EXTREME


def corpus_docs(entries: list[dict], docs_dir: Path, stdlib_root: Path = DEFAULT_ROOT
                ) -> Iterator[tuple[str, bytes, str]]:
    """(relpath, bytes, split) of the whole corpus in order: the stdlib (prefixed), then the packages."""
    for d in load_docs(stdlib_root):
        yield STDLIB_PREFIX + d.relpath, d.data, d.split
    for e in entries:
        for rel, data in read_package(docs_dir, e["name"]):
            yield rel, data, package_split_of(e["name"], rel)


def unit(tag: bytes, relpath: str) -> float:
    """A deterministic number in [0, 1) per (purpose, document): subsets are `unit < fraction`."""
    return int.from_bytes(hashlib.sha256(tag + b":" + relpath.encode("utf-8")).digest()[:8], "big") / 2.0**64


def package_of(relpath: str) -> str:
    return "cpython-3.11" if relpath.startswith(STDLIB_PREFIX) else relpath.split("/", 1)[0]


def subset(docs: list[tuple[str, bytes, str]], tag: bytes, fraction: float, cap: int) -> list[tuple[str, bytes, str]]:
    """Documents with unit(tag, relpath) < min(fraction, cap / bytes of its package in its split): a
    uniform sample in which no package (ansible's collections are 185 MB) passes about `cap` bytes."""
    size: dict[tuple[str, str], int] = {}
    for rel, data, split in docs:
        k = (package_of(rel), split)
        size[k] = size.get(k, 0) + len(data)
    return [(r, d, s) for r, d, s in docs if unit(tag, r) < min(fraction, cap / size[(package_of(r), s)])]


def _compress(blob: bytes) -> bytes:
    return lzma.compress(blob, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=XZ_PRESET)


def _shard_info(name: str, docs: list[tuple[str, bytes]], xz: bytes, blob: bytes, tok) -> dict:
    return {"file": name, "docs": len(docs), "bytes": sum(len(d) for _, d in docs),
            "framed_bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest(),
            "xz_bytes": len(xz), "xz_sha256": hashlib.sha256(xz).hexdigest(),
            "tokens": int(encode(tok, docs).size) if tok is not None else None}


def carry_shards(docs: list[tuple[str, bytes, str]], fractions: dict[str, float], cap: int
                 ) -> list[tuple[str, str, list[tuple[str, bytes]]]]:
    """(split, shard file, documents) of the carry: per split, subset(docs, b"carry", fraction, cap), plus
    every stdlib held-out file; train cut into SHARD_RAW-byte shards in corpus order."""
    picked: dict[str, list[tuple[str, bytes]]] = {}
    for split in SPLITS:
        ds = [x for x in docs if x[2] == split]
        keep = {r for r, _, _ in subset(ds, b"carry", fractions[split], cap)}
        if split == "heldout":
            keep |= {r for r, _, _ in ds if r.startswith(STDLIB_PREFIX)}
        picked[split] = [(r, d) for r, d, _ in ds if r in keep]
    jobs: list[tuple[str, str, list[tuple[str, bytes]]]] = []
    shard: list[tuple[str, bytes]] = []
    size = 0
    for rel, data in picked["train"]:
        shard.append((rel, data))
        size += len(data)
        if size >= SHARD_RAW:
            jobs.append(("train", f"train-{len(jobs):02d}.xz", shard))
            shard, size = [], 0
    if shard:
        jobs.append(("train", f"train-{len(jobs):02d}.xz", shard))
    return jobs + [("val", "val.xz", picked["val"]), ("heldout", "heldout.xz", picked["heldout"])]


def write_carry(out: Path, tok_path: Path, docs: list[tuple[str, bytes, str]], fractions: dict[str, float],
                cap: int, full: dict, tokenizer_info: dict, code_files: list[Path], threads: int = 2,
                count_tokens: bool = True, max_train_shards: int | None = None, log=print) -> dict:
    """Write the carry into `out` (replaced whole): per split, subset(docs, b"carry", fraction, cap), plus
    every stdlib held-out file. Refuses to leave a folder over CARRY_BUDGET. A shard left in `out`.tmp by
    an interrupted run is reused when it decompresses to exactly the shard's framed bytes.
    `count_tokens=False` leaves the shards' token counts to tokenize_carry (tokens: null);
    `max_train_shards` keeps only the first N train shards (corpus.json records it)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path)) if count_tokens else None
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    for old in ("tokenizer.json", "corpus.json", "code"):
        if (tmp / old).is_dir():
            shutil.rmtree(tmp / old)
        elif (tmp / old).exists():
            (tmp / old).unlink()
    shutil.copy(tok_path, tmp / "tokenizer.json")
    for f in code_files:  # the code tokenize_carry needs, for a GPU checkout that predates it
        dst = tmp / "code" / f.relative_to(REPO)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(f, dst)
    jobs = carry_shards(docs, fractions, cap)
    n_train_shards = sum(1 for sp, _, _ in jobs if sp == "train")
    if max_train_shards is not None:
        jobs = [j for j in jobs if j[0] != "train" or int(j[1][6:8]) < max_train_shards]

    names = {name for _, name, _ in jobs}
    for p in tmp.glob("*.xz"):
        if p.name not in names:
            p.unlink()

    def run(job):
        split, name, ds = job
        blob = b"".join(frame(r, d) for r, d in ds)
        xz = None
        if (tmp / name).is_file():
            old = (tmp / name).read_bytes()
            try:
                if lzma.decompress(old) == blob:
                    xz = old
            except lzma.LZMAError:
                pass
        if xz is None:
            xz = _compress(blob)
            (tmp / name).write_bytes(xz)
        info = _shard_info(name, ds, xz, blob, tok)
        log(f"  {name:12s} {info['docs']:7d} docs {info['bytes'] / 2**20:8.1f} MiB -> {len(xz) / 2**20:6.2f} MiB xz, "
            f"{info['tokens']} tokens")
        return split, info

    with ThreadPoolExecutor(threads) as ex:
        results = list(ex.map(run, jobs))
    carried = {}
    for s in SPLITS:
        shards = [i for sp, i in results if sp == s]
        carried[s] = {"fraction": fractions[s], "files": sum(i["docs"] for i in shards),
                      "bytes": sum(i["bytes"] for i in shards), "tokens": sum(i["tokens"] for i in shards) if count_tokens else None,
                      "xz_bytes": sum(i["xz_bytes"] for i in shards), "shards": shards}
    man = {"framing": "xz of documents back to back: relpath '\\n' decimal length '\\n' bytes (muser.corpus.frame)",
           "selection": "unit(b'carry', relpath) < min(fraction[split], cap / bytes of the package in the split), "
                        "plus every stdlib held-out file; corpus order", "cap": cap,
           "train_shards": {"written": min(n_train_shards, max_train_shards or n_train_shards),
                            "of": n_train_shards},
           "carried": carried, "full": full, "tokenizer": tokenizer_info}
    (tmp / "corpus.json").write_text(json.dumps(man, indent=1) + "\n")
    total = sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file())
    man["carry_bytes"] = total
    if total > CARRY_BUDGET:
        raise CorpusError(f"carry would be {total} bytes > {CARRY_BUDGET} (lower the train fraction)")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return man
