"""The kvpack store: verified entries behind a small backend interface; a local directory is the
embedded backend (docs/kvpack.md says how an object store would back the same interface).

    store = Store.open(path, binding, budget_bytes=8 << 30)
    hit = store.lookup(ids)          # the longest verified stored prefix (< len(ids)), or None
    hit = store.restore(session, ids)  # the same, installed into the session as its tiles verify
    store.put(name, blob, verify)    # durable and verified before visible; never raises OSError

Directory layout: `KVPACK` (marker), `lock` (fcntl lock for eviction and gc), `objects/aa/NAME`
(NAME = address + ".nope" | ".swa"), `tmp/` (files being written, named with the writer's pid).
A write is temp file -> fsync -> read back and verify -> rename -> fsync(dir): a name only ever
holds a complete, verified entry, so readers need no lock and never see a torn file; concurrent
writers of one name each rename a complete copy. Reads touch the file's mtime (LRU recency);
eviction under the exclusive lock removes the least recently used entries until the budget holds.
"""

from __future__ import annotations

import builtins
import errno
import fcntl
import json
import logging
import os
import secrets
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..errors import IdentityMismatch, KvStateError, MuserError
from ..kv.serial import Tile, cover, install_tile
from .entry import Binding, decode_entry, read_manifest

LOAD_THREADS = 8  # entries of one lookup read and verified at once

log = logging.getLogger("muser.kvpack")
MARKER = {"format": "muser-kvpack-dir", "version": 1}


@dataclass(frozen=True)
class ObjectInfo:
    name: str
    size: int
    last_used: float  # seconds since the epoch (mtime)


class StoreBackend(Protocol):
    """Named immutable blobs. `put` is atomic and durable when it returns; `get` returns a complete
    blob or None; `touch` records use (LRU); `evict(budget)` keeps the total under budget;
    `prefetch(names)` is a hint that these names are about to be read (it may do nothing)."""

    def get(self, name: str) -> memoryview | None: ...
    def prefetch(self, names: Sequence[str]) -> None: ...
    def put(self, name: str, data: bytes, verify: Callable[[bytearray], None] | None = None) -> None: ...
    def exists(self, name: str) -> bool: ...
    def delete(self, name: str) -> None: ...
    def touch(self, name: str) -> None: ...
    def list(self) -> Iterator[ObjectInfo]: ...
    def evict(self, budget_bytes: int) -> builtins.list[str]: ...


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _valid_name(name: str) -> str:
    stem, _, kind = name.partition(".")
    if len(stem) != 64 or any(c not in "0123456789abcdef" for c in stem) or kind not in ("nope", "swa"):
        raise KvStateError(f"kvpack object name {name!r} is not <sha256 hex>.nope|.swa")
    return name


class DirectoryBackend:
    """A local directory shared by any number of processes (see module doc)."""

    def __init__(self, root: str | os.PathLike, create: bool = True):
        self.root = Path(root)
        self.objects = self.root / "objects"
        self.tmp = self.root / "tmp"
        marker = self.root / "KVPACK"
        if not marker.is_file():
            if not create:
                raise KvStateError(f"{str(self.root)!r} is not a kvpack directory (no KVPACK marker)")
            self.objects.mkdir(parents=True, exist_ok=True)
            self.tmp.mkdir(exist_ok=True)
            with self.locked():
                if not marker.is_file():
                    t = self.tmp / f"KVPACK.{os.getpid()}.tmp"
                    t.write_text(json.dumps(MARKER) + "\n")
                    os.replace(t, marker)
                    _fsync_dir(self.root)
        try:
            got = json.loads(marker.read_text())
        except ValueError:
            got = None
        if got != MARKER:
            raise KvStateError(f"{str(marker)!r} holds {got!r}, expected {MARKER!r}")

    @contextmanager
    def locked(self) -> Iterator[None]:
        fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock (also when the process dies)

    def _path(self, name: str) -> Path:
        return self.objects / _valid_name(name)[:2] / name

    def get(self, name: str) -> memoryview | None:
        """The file's bytes, read into an uninitialised buffer: bytearray(size) zero-fills it
        first, a pass over the memory as slow as the SHA-256 that follows (numpy also asks for huge
        pages for large arrays, fewer page faults)."""
        try:
            with open(self._path(name), "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                view = memoryview(np.empty(size, dtype=np.uint8)).cast("B")  # writable, [size]
                got = 0
                while got < size:
                    n = f.readinto(view[got:])
                    if not n:
                        break
                    got += n
                return view if got == size else view[:got]
        except FileNotFoundError:
            return None

    def prefetch(self, names: Sequence[str]) -> None:
        """Start the page cache's reads of these entries (POSIX_FADV_WILLNEED queues readahead of
        each whole file and returns), so the disk streams while the readers verify what they have."""
        for name in names:
            try:
                fd = os.open(self._path(name), os.O_RDONLY)
            except OSError:  # gone meanwhile: its reader reports the miss
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            except OSError:  # a file system without readahead hints: the reads still work
                pass
            finally:
                os.close(fd)

    def exists(self, name: str) -> bool:
        return self._path(name).is_file()

    def put(self, name: str, data: bytes, verify: Callable[[bytearray], None] | None = None) -> None:
        final = self._path(name)
        final.parent.mkdir(exist_ok=True)
        tmp = self.tmp / f"{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                view = memoryview(data)
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
                os.fsync(fd)
            finally:
                os.close(fd)
            if verify is not None:  # what reached the disk, not what we meant to write
                with open(tmp, "rb") as f:
                    verify(bytearray(f.read()))
            os.rename(tmp, final)
            _fsync_dir(final.parent)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise

    def delete(self, name: str) -> None:
        try:
            os.unlink(self._path(name))
        except FileNotFoundError:
            pass

    def touch(self, name: str) -> None:
        try:
            os.utime(self._path(name))
        except FileNotFoundError:
            pass

    def list(self) -> Iterator[ObjectInfo]:
        if not self.objects.is_dir():
            return
        for sub in sorted(self.objects.iterdir()):
            if not sub.is_dir():
                continue
            for p in sorted(sub.iterdir()):
                try:
                    st = p.stat()
                except FileNotFoundError:
                    continue
                yield ObjectInfo(p.name, st.st_size, st.st_mtime)

    def evict(self, budget_bytes: int) -> builtins.list[str]:
        """Remove least recently used objects until the total is <= budget_bytes."""
        with self.locked():
            objs = sorted(self.list(), key=lambda o: (o.last_used, o.name))
            total = sum(o.size for o in objs)
            gone = []
            for o in objs:
                if total <= budget_bytes:
                    break
                self.delete(o.name)
                total -= o.size
                gone.append(o.name)
            return gone

    def stale_temps(self) -> builtins.list[Path]:
        """Temp files whose writer process is gone (a killed writer leaves one; never visible)."""
        out = []
        for p in sorted(self.tmp.glob("*.tmp")) if self.tmp.is_dir() else []:
            parts = p.name.split(".")
            try:
                pid = int(parts[-3]) if len(parts) >= 4 else int(parts[1])
                os.kill(pid, 0)
            except (ValueError, IndexError):
                out.append(p)
            except ProcessLookupError:
                out.append(p)
            except PermissionError:
                pass
        return out


@dataclass(frozen=True)
class Hit:
    n_tokens: int
    tiles: tuple[Tile, ...]
    names: tuple[str, ...]


class Store:
    """Verified kvpack entries for one binding over a backend."""

    def __init__(self, backend: StoreBackend, binding: Binding, budget_bytes: int | None = None):
        if budget_bytes is not None and budget_bytes < 0:
            raise KvStateError(f"kvpack budget must be >= 0 bytes, got {budget_bytes}")
        self.backend = backend
        self.binding = binding
        self.budget_bytes = budget_bytes
        self.misses: list[str] = []  # reasons, newest last (also logged)

    @classmethod
    def open(cls, root: str | os.PathLike, binding: Binding, budget_bytes: int | None = None) -> Store:
        return cls(DirectoryBackend(root), binding, budget_bytes)

    @staticmethod
    def name(address: str, kind: str) -> str:
        return f"{address}.{kind}"

    def _miss(self, reason: str) -> None:
        self.misses.append(reason)
        log.warning("kvpack miss: %s", reason)

    def load(self, address: str, kind: str, chunk_ids: Sequence[int] | None = None) -> Tile | None:
        """A verified tile, or None (absent; corrupt, truncated and foreign entries are logged
        misses, and corrupt ones are removed so the next writer replaces them)."""
        name = self.name(address, kind)
        data = self.backend.get(name)
        if data is None:
            return None
        try:
            return decode_entry(data, self.binding, address, kind, chunk_ids).tile
        except MuserError as e:
            self._miss(f"{name}: {e}")
            if not isinstance(e, IdentityMismatch):  # a foreign entry is refused, not destroyed
                self.backend.delete(name)
            return None

    def _candidates(self, ids: Sequence[int]) -> Iterator[tuple[int, list[str], list[tuple]]]:
        """Stored prefixes of `ids` that leave at least one token to prefill, longest first, whose
        entries all exist: (tokens, names, load() jobs), NOPE chunks 0..c in order, then the SWA
        tail at the end of chunk c."""
        ch = self.binding.layout.chunk_tokens
        addrs = self.binding.addresses(list(ids)[: len(ids) - 1])  # ends <= len(ids) - 1
        layout = self.binding.layout
        for c in range(len(addrs) - 1, -1, -1):
            names = [self.name(addrs[j], "nope") for j in range(c + 1)] if layout.full_layers else []
            if layout.sliding_layers:
                names.append(self.name(addrs[c], "swa"))
            if not all(self.backend.exists(n) for n in names):
                continue
            jobs = []
            for j, n in enumerate(names):
                addr, kind = n.split(".")
                k = j if kind == "nope" else c
                jobs.append((addr, kind, ids[k * ch:(k + 1) * ch] if kind == "nope" else None))
            yield (c + 1) * ch, names, jobs

    def lookup(self, ids: Sequence[int]) -> Hit | None:
        """The longest stored prefix of `ids` that leaves at least one token to prefill: NOPE
        tiles of chunks 0..c and the SWA tail at the end of chunk c, all verified."""
        for n_tokens, names, jobs in self._candidates(ids):
            tiles = self._load_all(jobs)
            if any(t is None for t in tiles):
                continue
            for n in names:
                self.backend.touch(n)
            return Hit(n_tokens, tuple(t for t in tiles if t is not None), tuple(names))
        return None

    @staticmethod
    def _swa_first(jobs: Sequence[tuple]) -> list[int]:
        """Indices of `jobs` in the order to read them: the SWA tail first (the one entry whose
        size does not shrink with the chunk: window rows of every sliding layer, 12x a NOPE
        chunk on the full model; read last it would be a serial tail), then the NOPE chunks."""
        return sorted(range(len(jobs)), key=lambda i: jobs[i][1] != "swa")

    def _load_all(self, jobs: Sequence[tuple]) -> list[Tile | None]:
        """load() of every (address, kind, chunk ids), results in job order; several entries are
        read and verified at once (file reads and SHA-256 release the GIL): a 32k-token prefix
        is ~0.5 GB. The backend prefetches them meanwhile."""
        if len(jobs) < 2:
            return [self.load(*j) for j in jobs]
        order = self._swa_first(jobs)
        with ThreadPoolExecutor(min(LOAD_THREADS, len(jobs)) + 1, thread_name_prefix="kvpack-load") as ex:
            ex.submit(self.backend.prefetch, [self.name(*jobs[i][:2]) for i in order])
            futures = {i: ex.submit(self.load, *jobs[i]) for i in order}
            return [futures[i].result() for i in range(len(jobs))]

    def restore(self, target: Any, ids: Sequence[int]) -> Hit | None:
        """lookup(ids), installed into `target` (a session or a KvCache: begin_install / commit).
        The entries are read and verified on LOAD_THREADS threads, the SWA tail first (_swa_first),
        while the backend prefetches them all. This thread installs each tile into detached planes as soon
        as it verified, in whatever order they finish (tiles hold disjoint rows), so the copies
        overlap the reads and the SHA-256s. Nothing is committed unless every entry of the prefix
        verified (otherwise the next shorter prefix is tried, as lookup does); the live planes
        change only at the commit."""
        layout = self.binding.layout
        for n_tokens, names, jobs in self._candidates(ids):
            order = self._swa_first(jobs)
            inst = target.begin_install(n_tokens)
            tiles: list[Tile | None] = [None] * len(jobs)
            complete = True
            with ThreadPoolExecutor(min(LOAD_THREADS, len(jobs)) + 1, thread_name_prefix="kvpack-load") as ex:
                ex.submit(self.backend.prefetch, [names[i] for i in order])
                futures: dict[Future, int] = {ex.submit(self.load, *jobs[i]): i for i in order}
                for f in as_completed(futures):
                    t = f.result()
                    if t is None:  # a logged miss: abandon this install (never committed)
                        complete = False
                        for rest in futures:
                            rest.cancel()
                        break
                    install_tile(inst, t)  # only a verified tile reaches the planes
                    tiles[futures[f]] = t
            if not complete:
                continue
            got = [t for t in tiles if t is not None]
            cover(got, layout, n_tokens)  # NOPE chunks [0, n) without gap, the SWA tail at n
            target.commit(inst)
            for n in names:
                self.backend.touch(n)
            return Hit(n_tokens, tuple(got), tuple(names))
        return None

    def put(self, name: str, blob: bytes, address: str, kind: str) -> bool:
        """Write one entry (verified from disk before it becomes visible). A failed write (full
        disk, I/O error) is logged and leaves the store as it was; returns whether it landed."""
        try:
            self.backend.put(name, blob, verify=lambda b: decode_entry(b, self.binding, address, kind))
        except (OSError, MuserError) as e:
            what = "disk full" if isinstance(e, OSError) and e.errno == errno.ENOSPC else type(e).__name__
            log.warning("kvpack write of %s failed (%s): %s; the store is unchanged", name, what, e)
            return False
        if self.budget_bytes is not None:
            self.backend.evict(self.budget_bytes)
        return True

    def total_bytes(self) -> int:
        return sum(o.size for o in self.backend.list())


@dataclass(frozen=True)
class Audit:
    name: str
    size: int
    ok: bool
    reason: str  # "" when ok
    manifest: dict | None
    last_used: float = 0.0  # mtime, seconds since the epoch


def audit(backend: StoreBackend) -> list[Audit]:
    """Verify every entry against its own manifest (any binding): structure, manifest digest,
    address and kind against the name, tile digest and layout. `muser kvpack verify` prints it."""
    out = []
    for o in backend.list():
        data = backend.get(o.name)
        if data is None:
            continue  # evicted meanwhile
        manifest = None
        try:
            manifest, _ = read_manifest(data)
            binding = Binding.from_json(manifest.get("binding"))
            address, _, kind = o.name.partition(".")
            decode_entry(data, binding, address, kind)
            out.append(Audit(o.name, o.size, True, "", manifest, o.last_used))
        except (MuserError, KeyError, TypeError) as e:
            out.append(Audit(o.name, o.size, False, f"{type(e).__name__}: {e}", manifest, o.last_used))
    return out
