"""The package corpus on disk: extract the pinned sdists by the muser.corpus rule into framed
per-package files, and read them back in corpus order (used by tools/corpus.py)."""

from __future__ import annotations

import hashlib
import os
import sys
import tarfile
import zipfile
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from muser.corpus import (  # noqa: E402
    DEFAULT_ROOT,
    CorpusError,
    drop_reason,
    frame,
    load_docs,
    package_heldout,
    package_split_of,
    sdist_members,
    unframe,
)

DEFAULT_DOCS = Path.home() / ".cache" / "muser" / "corpus" / "docs"


def _license_file_line(text: str) -> str | None:
    for line in text.splitlines():
        line = line.strip().strip("#*=- ").strip()
        if line:
            return line[:120]
    return None


def sdist_license(path: Path) -> str | None:
    """License of an sdist: PKG-INFO's License-Expression, else License (first line), else its
    License :: classifiers, else the first line of a top-level LICENSE*/COPYING* file; None when the
    sdist states none (such a package is left out of the corpus)."""
    path = Path(path)
    files: dict[str, str] = {}
    if path.name.endswith(".zip"):
        with zipfile.ZipFile(path) as z:
            for n in z.namelist():
                base = n.split("/", 1)[-1]
                if n.count("/") == 1 and (base == "PKG-INFO" or base.upper().startswith(("LICENSE", "COPYING"))):
                    files[base] = z.read(n).decode("utf-8", "replace")
    else:
        with tarfile.open(path) as t:
            for m in t:
                base = m.name.split("/", 1)[-1]
                if m.isreg() and m.name.count("/") == 1 and (
                        base == "PKG-INFO" or base.upper().startswith(("LICENSE", "COPYING"))):
                    f = t.extractfile(m)
                    if f is not None:
                        files[base] = f.read().decode("utf-8", "replace")
    head = files.get("PKG-INFO", "").split("\n\n", 1)[0]
    fields: dict[str, list[str]] = {}
    for line in head.splitlines():
        if line[:1] in (" ", "\t") or ":" not in line:
            continue
        k, v = line.split(":", 1)
        fields.setdefault(k.strip().lower(), []).append(v.strip())
    for key in ("license-expression", "license"):
        v = (fields.get(key) or [""])[0]
        if v and v.upper() not in ("UNKNOWN", "NONE"):
            return v.splitlines()[0][:120]
    cls = [c.split("::")[-1].strip() for c in fields.get("classifier", []) if c.startswith("License ::")]
    if cls:
        return "; ".join(cls)
    for base in sorted(files):
        if base != "PKG-INFO":
            line = _license_file_line(files[base])
            if line:
                return f"{base}: {line}"
    return None


def extract(pinned: dict, cache: Path, docs_dir: Path, stdlib_root: Path = DEFAULT_ROOT, log=print) -> dict:
    """Apply the package rule to every pinned sdist (in canonical-name order), dedupe against the stdlib
    and earlier packages, write `<docs_dir>/<name>.frames`; returns the per-package entries."""
    docs_dir.mkdir(parents=True, exist_ok=True)
    seen: set[bytes] = {hashlib.sha256(d.data).digest() for d in load_docs(stdlib_root)}
    entries = []
    for p in sorted(pinned["packages"], key=lambda p: p["name"]):
        sd = cache / p["sdist"]
        if hashlib.sha256(sd.read_bytes()).hexdigest() != p["sha256"]:
            raise CorpusError(f"{sd}: sha256 differs from the pinned {p['sha256']}")
        lic = sdist_license(sd)
        if lic is None or lic != p.get("license", lic):
            raise CorpusError(f"{sd}: license {lic!r} differs from the pinned {p.get('license')!r}")
        dropped: Counter[str] = Counter()
        kept = []
        for inner, data in sdist_members(sd):
            why = drop_reason(data)
            if why is None:
                h = hashlib.sha256(data).digest()
                if h in seen:
                    why = "duplicate"
                else:
                    seen.add(h)
            if why is None:
                kept.append((f"{p['name']}/{inner}", data))
            else:
                dropped[why] += 1
        tmp = docs_dir / f"{p['name']}.frames.tmp"
        with open(tmp, "wb") as f:
            for rel, data in kept:
                f.write(frame(rel, data))
        os.replace(tmp, docs_dir / f"{p['name']}.frames")
        by_split: Counter[str] = Counter()
        by_split_bytes: Counter[str] = Counter()
        for rel, data in kept:
            s = package_split_of(p["name"], rel)
            by_split[s] += 1
            by_split_bytes[s] += len(data)
        e = {"name": p["name"], "version": p["version"], "sdist": p["sdist"], "sha256": p["sha256"],
             "license": lic, "heldout": package_heldout(p["name"]),
             "files": len(kept), "bytes": sum(len(d) for _, d in kept),
             "split_files": dict(sorted(by_split.items())), "split_bytes": dict(sorted(by_split_bytes.items())),
             "dropped": dict(sorted(dropped.items()))}
        entries.append(e)
        log(f"  {p['name']:40s} {e['files']:6d} files {e['bytes']:>12,d} bytes {'HELDOUT' if e['heldout'] else ''}")
    return {"packages": entries}


def read_package(docs_dir: Path, name: str) -> list[tuple[str, bytes]]:
    return unframe((docs_dir / f"{name}.frames").read_bytes())
