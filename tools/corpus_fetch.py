"""Pin and fetch the source distributions of the package corpus (network; `tools/corpus.py pin|fetch`).

    pin    names -> tools/corpus_packages.json   newest version's sdist, file name, size, SHA-256, URL
    fetch  every pinned sdist into the cache, SHA-256 verified

The index's JSON API names each release's files and their SHA-256; the file is then fetched by URL and
hashed before it is kept, so a pinned list reproduces byte for byte. No sdist is built or executed
(a `pip download` of an sdist runs its build backend to read metadata; reading the tarball does not).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tools"))

from corpus_packages import sdist_license  # noqa: E402

from muser.corpus import CorpusError, canonical_name, package_heldout  # noqa: E402

INDEX = "https://pypi.org/pypi/"
DEFAULT_CACHE = Path.home() / ".cache" / "muser" / "corpus" / "sdists"
PINNED = REPO / "tools" / "corpus_packages.json"
MAX_SDIST_BYTES = 80 << 20  # larger sdists are vendored C++/Java trees (pyarrow, pyspark), not Python


def _get(url: str, timeout: float = 120.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def pin_one(name: str) -> dict:
    """The newest release's sdist of `name`: {name, version, sdist, size, sha256, url} or {name, skip}."""
    url = INDEX + urllib.parse.quote(name) + "/json"
    try:
        meta = json.loads(_get(url))
    except Exception as e:  # an unknown name is recorded as skipped, with the reason
        return {"name": canonical_name(name), "skip": f"index: {type(e).__name__}: {e}"}
    version = meta["info"]["version"]
    sdists = [u for u in meta["urls"] if u["packagetype"] == "sdist"]
    if not sdists:
        return {"name": canonical_name(name), "skip": f"{version}: no sdist"}
    u = sdists[0]
    if u["size"] > MAX_SDIST_BYTES:
        return {"name": canonical_name(name), "skip": f"{version}: sdist {u['size']} bytes > {MAX_SDIST_BYTES}"}
    return {"name": canonical_name(meta["info"]["name"]), "version": version, "sdist": u["filename"],
            "size": u["size"], "sha256": u["digests"]["sha256"], "url": urllib.parse.urljoin(url, u["url"])}


def pin(names: list[str], threads: int = 8) -> dict:
    seen: list[str] = []
    for n in names:
        if canonical_name(n) not in seen:
            seen.append(canonical_name(n))
    with ThreadPoolExecutor(threads) as ex:
        rows = list(ex.map(pin_one, seen))
    pkgs: dict[str, dict] = {}
    skipped = []
    for r in rows:
        if "skip" in r:
            skipped.append(r)
        elif r["name"] not in pkgs:
            pkgs[r["name"]] = r
    for r in pkgs.values():
        r["heldout"] = package_heldout(r["name"])
    return {"packages": [pkgs[k] for k in sorted(pkgs)], "skipped": sorted(skipped, key=lambda r: r["name"]),
            "heldout": sorted(k for k in pkgs if pkgs[k]["heldout"])}


def fetch_one(p: dict, cache: Path) -> Path:
    dest = cache / p["sdist"]
    if dest.is_file() and hashlib.sha256(dest.read_bytes()).hexdigest() == p["sha256"]:
        return dest
    data = _get(p["url"])
    got = hashlib.sha256(data).hexdigest()
    if got != p["sha256"]:
        raise CorpusError(f"{p['sdist']}: sha256 {got} != pinned {p['sha256']}")
    tmp = dest.with_name(dest.name + ".part")
    tmp.write_bytes(data)
    os.replace(tmp, dest)
    return dest


def fetch(pinned: dict, cache: Path = DEFAULT_CACHE, threads: int = 8, log=print) -> dict:
    """Download every pinned sdist (verified) and record its license (corpus_packages.sdist_license);
    a package whose sdist states no license moves to "skipped". Returns the updated pinned list."""
    cache.mkdir(parents=True, exist_ok=True)
    pkgs = pinned["packages"]
    with ThreadPoolExecutor(threads) as ex:
        paths = list(ex.map(lambda p: fetch_one(p, cache), pkgs))
    log(f"fetched {len(paths)} sdists ({sum(p.stat().st_size for p in paths) / 2**20:.0f} MiB) into {cache}")
    kept, skipped = [], list(pinned["skipped"])
    for p, path in zip(pkgs, paths):
        lic = sdist_license(path)
        if lic is None:
            skipped.append({"name": p["name"], "skip": f"{p['version']}: the sdist states no license"})
        else:
            kept.append({**p, "license": lic})
    return {"packages": kept, "skipped": sorted(skipped, key=lambda r: r["name"]),
            "heldout": [p["name"] for p in kept if p["heldout"]]}
