"""The CPU cores this process may run on: the default worker count of every `--threads` flag."""

from __future__ import annotations

import os


def default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
