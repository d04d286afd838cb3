"""Measurement protocol and receipts (DESIGN.md "Measurement protocol").

Every cell: warm-up, then N counted repetitions (5 by default), mean and coefficient of
variation; several cells are interleaved A B A B so drift hits them alike. Every result is an
append-only JSON receipt under bench/receipts/ with command, git SHA, model identity, device,
lane, gate status and all raw samples.

Only write_receipt makes receipts: it stamps the writer, refuses a "pass" without measured
evidence of its own (or one copied from another receipt, or one whose run skipped part of its
gate: that run is "partial"), and seals the content with a SHA-256 digest; verify_receipt tells
whether a file on disk is one it could have written, unedited.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import ReceiptError

REPO_ROOT = Path(__file__).resolve().parents[3]
REPO_RECEIPTS = REPO_ROOT / "bench" / "receipts"  # the repository's receipts (kept, scanned by the tests)


def default_receipts_dir() -> Path:
    """Where a receipt goes when no out_dir is given: the per-user cache, not the repository."""
    from ..api import cache_dir

    return cache_dir() / "receipts"


@dataclass
class Cell:
    name: str
    samples: list[float] = field(default_factory=list)  # seconds per repetition
    warmup: list[float] = field(default_factory=list)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples)

    @property
    def cv(self) -> float:
        if len(self.samples) < 2 or self.mean == 0:
            return 0.0
        return statistics.stdev(self.samples) / self.mean

    def to_json(self) -> dict:
        return {"name": self.name, "samples_s": self.samples, "warmup_s": self.warmup,
                "mean_s": self.mean, "cv": self.cv}


def run_interleaved(fns: dict[str, Callable[[], Any]], reps: int = 5, warmup: int = 1,
                    clock: Callable[[], float] = time.perf_counter) -> dict[str, Cell]:
    """Warm each cell, then time reps rounds of A B A B ... Returns seconds per call."""
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    cells = {k: Cell(k) for k in fns}
    for _ in range(warmup):
        for k, fn in fns.items():
            t0 = clock()
            fn()
            cells[k].warmup.append(clock() - t0)
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = clock()
            fn()
            cells[k].samples.append(clock() - t0)
    return cells


def git_sha() -> str:
    sent = os.environ.get("MUSER_GIT_SHA")
    if sent:  # the SHA a copied tree was sent at (the GPU machine's .git may be an older copy)
        if not _SHA.fullmatch(sent) or sent == "unknown":  # refused before any work: verify_receipt would reject it
            raise ReceiptError(f"MUSER_GIT_SHA {sent!r} is not a full 40-hex git SHA (git rev-parse HEAD)")
        return sent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (sha or "unknown") + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("MUSER_GIT_SHA", "unknown")


def device_description(device: str = "cpu") -> dict:
    d: dict[str, Any] = {"kind": device, "machine": platform.machine(), "python": sys.version.split()[0],
                         "cpu_count": os.cpu_count()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                d["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    if device.startswith("cuda"):
        try:
            import torch

            d["gpu"] = torch.cuda.get_device_name(0)
            d["torch"] = torch.__version__
        except Exception as e:  # the receipt records what it could not learn
            d["gpu_error"] = repr(e)
    return d


WRITER = "muser.bench.receipt/2"  # stamped into every receipt this module writes
STATUSES = ("pass", "fail", "partial", "n/a")
ENVELOPE = ("kind", "time_utc", "command", "git_sha", "model", "device", "lane", "gate", "results", "cells")
# gate keys that describe or point elsewhere; a "pass" needs at least one measured key beside them
GATE_PROSE = frozenset({"status", "name", "rule", "what", "note", "reason", "gated_by", "skipped"})
_SHA = re.compile(r"[0-9a-f]{40}(-dirty)?|unknown")
_SHELL_VAR = re.compile(r"\$\{?[A-Za-z_]")


def check_gate(gate: dict) -> None:
    """The writer's rules for a gate field (fail closed, before anything is written):
    status is pass / fail / partial / n/a; "pass" carries measured evidence of its own (a
    verdict copied from another receipt is "n/a" with `gated_by` naming it); a run that
    skipped part of its gate (`skipped` non-empty) reads "partial", never "pass"."""
    if not isinstance(gate, dict):
        raise ReceiptError(f"gate must be a dict, got {type(gate).__name__}")
    st = gate.get("status")
    if st not in STATUSES:
        raise ReceiptError(f"gate status must be one of {', '.join(STATUSES)}, got {st!r}")
    if "receipt" in gate:
        raise ReceiptError(f"gate names another receipt ({gate['receipt']!r}): a verdict is not copied; "
                           "use status 'n/a' with gated_by")
    if st == "pass":
        if not set(gate) - GATE_PROSE:
            raise ReceiptError(f"gate 'pass' carries no measured evidence of its own (keys {sorted(gate)})")
        if gate.get("gated_by"):
            raise ReceiptError(f"gate 'pass' is gated_by {gate['gated_by']!r}: only its own run can pass")
        if gate.get("skipped"):
            raise ReceiptError(f"gate skipped {gate['skipped']!r}: the run reads 'partial', not 'pass'")


def digest(body: dict) -> str:
    """SHA-256 over the canonical JSON of a receipt without its digest field."""
    core = {k: v for k, v in body.items() if k != "digest"}
    text = json.dumps(core, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=_jsonable)
    return hashlib.sha256(text.encode()).hexdigest()


def write_receipt(kind: str, *, model: dict | None, device: dict, lane: str | None,
                  gate: dict, results: dict, cells: dict[str, Cell] | None = None,
                  command: list[str] | None = None, out_dir: str | os.PathLike | None = None,
                  extra: dict | None = None) -> Path:
    """Write one append-only receipt (never overwrites); returns its path. The gate field
    follows check_gate; the receipt carries the writer's stamp and a digest over its content,
    so a later edit is detectable (verify_receipt)."""
    if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", kind or ""):
        raise ReceiptError(f"receipt kind {kind!r} must be lower-case letters, digits and dashes")
    check_gate(gate)
    cmd = list(command) if command is not None else list(sys.argv)
    if not all(isinstance(c, str) for c in cmd):
        raise ReceiptError(f"command must be a list of strings, got {cmd!r}")
    bad = [c for c in cmd if _SHELL_VAR.search(c)]
    if bad:
        raise ReceiptError(f"command holds an unexpanded shell variable {bad[0]!r}: record the argv that ran")
    clash = sorted(set(extra or {}) & (set(ENVELOPE) | {"writer", "digest"}))
    if clash:
        raise ReceiptError(f"extra fields {clash} would overwrite the receipt envelope")
    now = _dt.datetime.now(_dt.timezone.utc)
    body = {
        "kind": kind,
        "time_utc": now.isoformat(timespec="seconds"),
        "command": cmd,
        "git_sha": git_sha(),
        "model": model,
        "device": device,
        "lane": lane,
        "gate": gate,
        "results": results,
        "cells": {k: c.to_json() for k, c in (cells or {}).items()},
    }
    body.update(extra or {})
    body["writer"] = WRITER
    body = json.loads(json.dumps(body, default=_jsonable))  # the digest covers what is stored
    body["digest"] = digest(body)
    out = Path(out_dir or os.environ.get("MUSER_RECEIPTS") or default_receipts_dir())
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{now.strftime('%Y%m%dT%H%M%SZ')}-{kind}"
    text = json.dumps(body, indent=2) + "\n"
    n = 1
    while True:
        path = out / (f"{stem}.json" if n == 1 else f"{stem}-{n}.json")
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        try:
            os.link(tmp, path)  # atomic, and refuses to replace an existing receipt
        except FileExistsError:
            n += 1
            continue
        finally:
            tmp.unlink()
        return path


def verify_receipt(path: str | os.PathLike, legacy: dict[str, str] | None = None) -> list[str]:
    """What keeps `path` from being a receipt this writer produced (empty list: none).
    `legacy` maps file names to the SHA-256 of their bytes: genuine receipts written before the
    digest, frozen as they are (checked for everything but the stamp and digest)."""
    p = Path(path)
    raw = p.read_bytes()
    try:
        body = json.loads(raw)
    except ValueError as e:
        return [f"not JSON: {e}"]
    if not isinstance(body, dict):
        return ["not a JSON object"]
    why: list[str] = []
    missing = [k for k in ENVELOPE if k not in body]
    if missing:
        return [f"no envelope: missing {missing}"]
    frozen = (legacy or {}).get(p.name)
    if frozen is not None:
        if hashlib.sha256(raw).hexdigest() != frozen:
            why.append("legacy receipt changed since it was frozen")
    elif body.get("writer") != WRITER:
        why.append(f"writer stamp {body.get('writer')!r}, not {WRITER!r}")
    elif body.get("digest") != digest(body):
        why.append("digest does not match the content (edited after writing)")
    cmd = body["command"]
    if not (isinstance(cmd, list) and cmd and all(isinstance(c, str) for c in cmd)):
        why.append(f"command {cmd!r} is not an argv list")
    elif any(_SHELL_VAR.search(c) for c in cmd):
        why.append(f"command holds an unexpanded shell variable: {cmd!r}")
    if not _SHA.fullmatch(str(body["git_sha"])):
        why.append(f"git_sha {body['git_sha']!r} is not what git rev-parse gives")
    try:
        t = _dt.datetime.fromisoformat(str(body["time_utc"]))
        stem = f"{t.strftime('%Y%m%dT%H%M%SZ')}-{body['kind']}"
        stamp_ok = str(body["time_utc"]).endswith("+00:00") and \
            re.fullmatch(re.escape(stem) + r"(-[2-9]|-[1-9]\d+)?\.json", p.name) is not None
    except (ValueError, TypeError):
        stamp_ok = False
    if not stamp_ok:
        why.append(f"file name {p.name!r} does not match time_utc {body['time_utc']!r} and kind {body['kind']!r}")
    gate = body["gate"]
    if frozen is not None and isinstance(gate, dict) and gate.get("status") == "pass" \
            and not set(gate) - GATE_PROSE and body["results"]:
        gate = {k: v for k, v in gate.items() if k != "status"} | {"status": "pass", "results": "measured"}
        # a legacy gate names its rule and keeps its figures in results (this run's own)
    try:
        check_gate(gate)
    except ReceiptError as e:
        why.append(str(e))
    return why


def _jsonable(o: Any) -> Any:
    try:
        import numpy as np

        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:
        pass
    if isinstance(o, (set, frozenset)):
        return sorted(o)
    if isinstance(o, Path):
        return str(o)
    return str(o)
