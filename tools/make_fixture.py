#!/usr/bin/env python3
"""Write a synthetic Muse Glimmer GGUF.

    tools/make_fixture.py OUT [--dtype F32|F16|BF16|Q8_0|Q4_0|Q4_K|Q5_K|Q6_K|q4_k_xl] [--layers N]
                              [--hidden H] [--heads N] [--kv-heads N] [--head-dim D] [--ffn F]
                              [--window W] [--vocab V] [--source master|blocks] [--seed S]
    tools/make_fixture.py OUT --full      # the 16.75 GB full geometry, Figure 6.6 mix, streamed
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from muser.model.synth import FULL_GEOMETRY, SynthSpec, write_fixture  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--full", action="store_true", help="full geometry (52 layers, 6656 hidden, 202,048 vocab)")
    ap.add_argument("--dtype")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--kv-heads", type=int)
    ap.add_argument("--head-dim", type=int)
    ap.add_argument("--ffn", type=int)
    ap.add_argument("--window", type=int)
    ap.add_argument("--vocab", type=int, help="pad the vocabulary to this many tokens")
    ap.add_argument("--source", choices=["master", "blocks"])
    ap.add_argument("--seed", type=int)
    a = ap.parse_args()
    spec = FULL_GEOMETRY if a.full else SynthSpec()
    kw = {k: v for k, v in {
        "dtype": a.dtype, "n_layers": a.layers, "hidden": a.hidden, "n_heads": a.heads,
        "n_kv_heads": a.kv_heads, "head_dim": a.head_dim, "ffn": a.ffn, "sliding_window": a.window,
        "vocab_pad_to": a.vocab, "source": a.source, "seed": a.seed,
    }.items() if v is not None}
    spec = replace(spec, **kw)
    t0 = time.time()
    done = [0]

    def progress(s):
        done[0] += s.nbytes
        print(f"\r{done[0] / 1e9:8.2f} GB written  {s.name:<40}", end="", file=sys.stderr, flush=True)

    path = write_fixture(a.out, spec, progress=progress)
    print(f"\nwrote {path} ({path.stat().st_size:,} B) in {time.time() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
