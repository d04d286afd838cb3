"""Measurement protocol and receipts (DESIGN.md "Measurement protocol").

Every cell: warm-up, then N counted repetitions (5 by default), mean and coefficient of
variation; several cells are interleaved A B A B so drift hits them alike. Every result is an
append-only JSON receipt under bench/receipts/ with command, git SHA, model identity, device,
lane, gate status and all raw samples.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

REPO_ROOT = Path(__file__).resolve().parents[3]


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


def write_receipt(kind: str, *, model: dict | None, device: dict, lane: str | None,
                  gate: dict, results: dict, cells: dict[str, Cell] | None = None,
                  command: list[str] | None = None, out_dir: str | os.PathLike | None = None,
                  extra: dict | None = None) -> Path:
    """Write one append-only receipt; returns its path. `gate` = {"status": "pass"|"fail"|"n/a", ...}."""
    if gate.get("status") not in ("pass", "fail", "n/a"):
        raise ValueError(f"gate status must be pass/fail/n/a, got {gate.get('status')!r}")
    now = _dt.datetime.now(_dt.timezone.utc)
    body = {
        "kind": kind,
        "time_utc": now.isoformat(timespec="seconds"),
        "command": command if command is not None else sys.argv,
        "git_sha": git_sha(),
        "model": model,
        "device": device,
        "lane": lane,
        "gate": gate,
        "results": results,
        "cells": {k: c.to_json() for k, c in (cells or {}).items()},
    }
    if extra:
        body.update(extra)
    out = Path(out_dir or os.environ.get("MUSER_RECEIPTS") or default_receipts_dir())
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{now.strftime('%Y%m%dT%H%M%SZ')}-{kind}"
    path = out / f"{stem}.json"
    n = 1
    while path.exists():
        n += 1
        path = out / f"{stem}-{n}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(body, indent=2, default=_jsonable) + "\n")
    os.replace(tmp, path)
    return path


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
