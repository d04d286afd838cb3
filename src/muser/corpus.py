"""The micro model's corpus rule: which CPython 3.11 standard-library files, in which order,
in which split (train / val / held-out), and the split hash. `muser bench ppl` reads the
held-out split through it; tools/corpus.py builds the tokenizer and token streams on it.

Corpus rule (reproducible on any machine of our kind; the pyenv 3.11.7 install):
- every regular `*.py` file under ROOT = <python 3.11.7>/lib/python3.11, symlinks not followed;
- excluded directories: site-packages (third-party), __pycache__, lib-dynload, config-3.11-* (build
  files); excluded files: `_sysconfigdata_*.py` (paths of the machine that built Python) and
  `pydoc_data/topics.py` (generated from the HTML docs, not source);
- test/, idlelib/, lib2to3/, tkinter/, turtledemo/, distutils/ ARE included: they are ordinary Python
  source and double the corpus (a 12.6M-parameter model trained for minutes is data-bound);
- a file that is not strict UTF-8 is excluded (4 deliberately mis-encoded test inputs in 3.11.7);
- order: relative POSIX paths sorted by code point;
- split by the first byte b of SHA-256(relative path, UTF-8): b < 16 -> held-out (1/16 = 6.25% of
  files expected), 16 <= b < 24 -> val (checkpoint selection during training), else train.

Package corpus rule (the pinned source distributions of tools/corpus_packages.json, added after the
stdlib):
- every regular `*.py` member of the sdist (tar or zip), links skipped, the archive's top directory
  stripped; named `<canonical package name>/<path>`; tests/ and docs/ directories are kept;
- a file is dropped when it is empty, larger than MAX_FILE_BYTES (generated tables), holds a NUL byte,
  is not strict UTF-8, or contains a special token's text;
- deduplication by SHA-256 of the content over the whole corpus in order (the stdlib first, then the
  packages by canonical name, files by path): a later copy of seen content is dropped;
- split: a package is held out whole when SHA-256("package:" + name)[0] < PACKAGE_HELDOUT_BELOW
  (8/256 = 3.1% of packages expected); a file of any other package is val when
  SHA-256(relpath)[0] < PACKAGE_VAL_BELOW, else train. The stdlib keeps its own rule above, so its
  held-out files stay held out and old and new perplexities compare.

Split hash framing: SHA-256 over the files of the split in order, each framed as
    relpath (UTF-8) + b"\\n" + str(len(content_bytes)) (ASCII decimal) + b"\\n" + content_bytes
(length-prefixed, so the framing is unambiguous).
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import MuserError

DEFAULT_ROOT = Path("/root/.pyenv/versions/3.11.7/lib/python3.11")

EXCLUDED_DIRS = ("site-packages", "__pycache__", "lib-dynload")
EXCLUDED_DIR_PREFIXES = ("config-3.11-",)
EXCLUDED_FILES = ("pydoc_data/topics.py",)
EXCLUDED_FILE_PREFIXES = ("_sysconfigdata_",)

HELDOUT_BELOW = 16  # first SHA-256 byte < 16 -> held-out
VAL_BELOW = 24  # 16 <= byte < 24 -> val
SPLITS = ("train", "val", "heldout")

PACKAGE_HELDOUT_BELOW = 8  # SHA-256("package:" + name)[0] < 8 -> the whole package is held out
PACKAGE_VAL_BELOW = 4  # a kept package's file: SHA-256(relpath)[0] < 4 -> val (1.6%)
MAX_FILE_BYTES = 1 << 20

# Special tokens, ids 0..5 in this order (the same set and order as muser.model.synth); a
# corpus file containing one of these texts is refused.
BOS, EOS, EOT, MASK, START_HEADER, END_HEADER = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|eot|>", "<|mask|>", "<|start_header|>", "<|end_header|>",
)
SPECIALS = (BOS, EOS, EOT, MASK, START_HEADER, END_HEADER)


class CorpusError(MuserError):
    """The corpus cannot be built as specified (missing root, bad file, hash mismatch)."""


@dataclass(frozen=True)
class Doc:
    relpath: str
    data: bytes  # the file's bytes (valid UTF-8)
    split: str

    @property
    def text(self) -> str:
        return self.data.decode("utf-8")


def canonical_name(name: str) -> str:
    """A package name as the index compares them (PEP 503: runs of -_. become -, lower case)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def split_of(relpath: str) -> str:
    b = hashlib.sha256(relpath.encode("utf-8")).digest()[0]
    if b < HELDOUT_BELOW:
        return "heldout"
    if b < VAL_BELOW:
        return "val"
    return "train"


def _excluded_dir(rel_dir: str, name: str) -> bool:
    return name in EXCLUDED_DIRS or (rel_dir == "" and name.startswith(EXCLUDED_DIR_PREFIXES))


def _excluded_file(relpath: str) -> bool:
    return relpath in EXCLUDED_FILES or os.path.basename(relpath).startswith(EXCLUDED_FILE_PREFIXES)


def list_sources(root: Path = DEFAULT_ROOT) -> tuple[list[str], list[str]]:
    """(included relpaths sorted, excluded non-UTF-8 relpaths sorted)."""
    root = Path(root)
    if not (root / "os.py").is_file() or not (root / "test").is_dir():
        raise CorpusError(f"{str(root)!r} is not a CPython standard-library directory (no os.py / test/)")
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        rel_dir = os.path.relpath(dirpath, root)
        rel_dir = "" if rel_dir == "." else rel_dir.replace(os.sep, "/")
        dirnames[:] = [d for d in dirnames if not _excluded_dir(rel_dir, d)]
        for fn in filenames:
            if not fn.endswith(".py"):
                continue
            full = os.path.join(dirpath, fn)
            if os.path.islink(full) or not os.path.isfile(full):
                continue
            rel = f"{rel_dir}/{fn}" if rel_dir else fn
            if not _excluded_file(rel):
                found.append(rel)
    found.sort()
    included, non_utf8 = [], []
    for rel in found:
        try:
            (root / rel).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            non_utf8.append(rel)
            continue
        included.append(rel)
    return included, non_utf8


def load_docs(root: Path = DEFAULT_ROOT) -> list[Doc]:
    root = Path(root)
    rels, _ = list_sources(root)
    docs = [Doc(r, (root / r).read_bytes(), split_of(r)) for r in rels]
    for d in docs:
        for s in SPECIALS:
            if s.encode() in d.data:
                raise CorpusError(f"{d.relpath!r} contains the special token text {s!r}")
    return docs


def split_docs(docs: list[Doc], split: str) -> list[Doc]:
    if split not in SPLITS:
        raise CorpusError(f"unknown split {split!r} (expected one of {SPLITS})")
    return [d for d in docs if d.split == split]


def split_sha256(docs: list[Doc]) -> str:
    h = hashlib.sha256()
    for d in docs:
        h.update(frame(d.relpath, d.data))
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# package corpus


def package_heldout(name: str) -> bool:
    return hashlib.sha256(b"package:" + canonical_name(name).encode("utf-8")).digest()[0] < PACKAGE_HELDOUT_BELOW


def package_split_of(name: str, relpath: str) -> str:
    """The split of `relpath` (`<name>/<path>`) of package `name`."""
    if package_heldout(name):
        return "heldout"
    return "val" if hashlib.sha256(relpath.encode("utf-8")).digest()[0] < PACKAGE_VAL_BELOW else "train"


def drop_reason(data: bytes) -> str | None:
    """Why a package file is dropped by the rule, or None when it is kept."""
    if not data:
        return "empty"
    if len(data) > MAX_FILE_BYTES:
        return "large"
    if b"\0" in data:
        return "nul"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return "non_utf8"
    if any(sp.encode() in data for sp in SPECIALS):
        return "special"
    return None


def sdist_members(path: Path) -> list[tuple[str, bytes]]:
    """(path inside the package, bytes) of every regular `*.py` member of an sdist, top directory
    stripped, sorted by path; a path seen twice is refused (an ambiguous archive)."""
    import tarfile
    import zipfile

    path = Path(path)
    out: dict[str, bytes] = {}

    def add(name: str, data: bytes) -> None:
        parts = name.replace("\\", "/").split("/")
        inner = "/".join(p for p in parts[1:] if p not in ("", "."))
        if not inner.endswith(".py") or ".." in inner.split("/"):
            return
        if inner in out:
            raise CorpusError(f"{path.name}: member {inner!r} appears twice")
        out[inner] = data

    if path.name.endswith(".zip"):
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                if not info.is_dir() and info.filename.endswith(".py") and (info.external_attr >> 28) != 0xA:
                    add(info.filename, z.read(info))
    elif path.name.endswith((".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar")):
        with tarfile.open(path) as t:
            for m in t:
                if m.isreg() and m.name.endswith(".py"):
                    f = t.extractfile(m)
                    if f is not None:
                        add(m.name, f.read())
    else:
        raise CorpusError(f"{path.name}: not a tar or zip source distribution")
    return sorted(out.items())


# Framing of a document stream (the split hash framing, written out): relpath + "\n" + decimal
# length + "\n" + bytes, documents back to back.


def frame(relpath: str, data: bytes) -> bytes:
    if "\n" in relpath:
        raise CorpusError(f"relpath {relpath!r} holds a newline")
    return relpath.encode("utf-8") + b"\n" + str(len(data)).encode("ascii") + b"\n" + data


def unframe(blob: bytes) -> list[tuple[str, bytes]]:
    """The (relpath, bytes) documents of a framed stream; a truncated or malformed stream is refused."""
    out = []
    i, n = 0, len(blob)
    while i < n:
        j = blob.find(b"\n", i)
        k = blob.find(b"\n", j + 1) if j >= 0 else -1
        if j < 0 or k < 0 or not blob[j + 1:k].isdigit():
            raise CorpusError(f"framed stream: bad header at byte {i}")
        size = int(blob[j + 1:k])
        if k + 1 + size > n:
            raise CorpusError(f"framed stream: document at byte {i} runs past the end ({size} bytes)")
        out.append((blob[i:j].decode("utf-8"), blob[k + 1:k + 1 + size]))
        i = k + 1 + size
    return out
