"""`muser bench plot RECEIPT... --out PNG`: one PNG drawn from receipts of one family (serve;
handoff; kvpack; decode and prefill). What each plot shows: muser.bench.plot."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plot", help="draw a PNG plot from serve / handoff / kvpack / decode / prefill receipts",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("receipts", nargs="+", metavar="RECEIPT", help="receipt JSON files of one family")
    p.add_argument("--out", required=True, metavar="PNG", help="the PNG to write (its folder must exist)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..plot import plot_receipts

    out = plot_receipts(args.receipts, args.out)
    print(f"plot: {out} ({out.stat().st_size} bytes)")
    return 0
