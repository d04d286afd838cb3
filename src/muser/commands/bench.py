"""`muser bench KIND ...`: benchmark commands that write receipts (per-user cache by default;
`--out-dir bench/receipts` adds them to the project's evidence)."""

from __future__ import annotations

import argparse
import importlib
import pkgutil


def register(sub: argparse._SubParsersAction) -> None:
    from ..bench import kinds

    p = sub.add_parser("bench", help="benchmarks and parity gates that write JSON receipts")
    bsub = p.add_subparsers(dest="bench_kind", required=True, metavar="KIND")
    for info in sorted(pkgutil.iter_modules(kinds.__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):
            importlib.import_module(f"{kinds.__name__}.{info.name}").register(bsub)
