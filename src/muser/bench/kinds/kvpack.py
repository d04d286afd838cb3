"""`muser bench kvpack`: time to first token cold vs warm (kvpack restore + suffix prefill).

For each prompt length P: a store is primed with one run, then "cold/P" (fresh session, full
prefill, first greedy token) and "warm/P" (fresh session over the store: restore the longest
stored prefix, prefill the rest, first greedy token) are timed interleaved, A B A B. The gate:
the warm first-token logits are bitwise the cold ones and the greedy text of both runs is
identical (--gate-tokens tokens). Also recorded: bytes on disk per stored token against the
model's KV formula (MuseConfig.kv_bytes), and restore bandwidth (read + verify + install of the
hit, and read + verify alone) against the read bandwidth of a plain file in the same directory
(page cache as it is).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

TEXT = "def handle(self, request, *args, **kwargs):\n    if request.method == 'GET':\n" \
       "        return self.get(request, *args, **kwargs)\n    raise ValueError(request)\n\n"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("kvpack", help="TTFT cold vs warm kvpack restore, bytes per token, restore bandwidth",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF (default: the embedded default model)")
    p.add_argument("--device", default="cpu", help="cpu | cuda (default cpu)")
    p.add_argument("--lane", default="exact", help="exact | fast (default exact)")
    p.add_argument("--kv", default="f16", help="KV type: f16 | f32 (default f16)")
    p.add_argument("--lengths", default="600,1000", help="prompt lengths in tokens (default 600,1000)")
    p.add_argument("--reps", type=int, default=5, help="counted repetitions per cell (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up repetitions per cell (default 1)")
    p.add_argument("--gate-tokens", type=int, default=16, help="greedy tokens compared by the gate (default 16)")
    p.add_argument("--dir", default=None, help="kvpack directory (default: a fresh temporary one, removed)")
    p.add_argument("--out-dir", default=None, help="receipt directory (default bench/receipts)")
    p.set_defaults(func=run)


def _prompt(tok, n: int) -> list[int]:
    ids = tok.encode(TEXT, add_special=True)
    body = tok.encode(TEXT, add_special=False)
    while len(ids) < n:
        ids += body
    return ids[:n]


def _read_bandwidth(d: Path, nbytes: int) -> dict:
    """Bytes/s of reading a plain file of `nbytes` in `d` (written, fsynced, read 3 times)."""
    path = d / "read-probe.bin"
    with open(path, "wb") as f:
        f.write(os.urandom(1 << 20) * max(1, nbytes >> 20))
        f.flush()
        os.fsync(f.fileno())
    size = path.stat().st_size
    samples = []
    buf = bytearray(size)
    for _ in range(3):
        t0 = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            f.readinto(buf)
        samples.append(size / (time.perf_counter() - t0))
    path.unlink()
    return {"bytes": size, "bytes_per_s": samples, "mean_bytes_per_s": float(np.mean(samples)),
            "note": "page cache as found (no cache drop); same filesystem as the store"}


def run(args: argparse.Namespace) -> int:
    import muser

    from ...errors import ContextOverflow, LaneError
    from ...kv.serial import assemble
    from ..receipt import device_description, run_interleaved, write_receipt
    from ..speed import model_json

    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    if not lengths or min(lengths) < 2 or args.reps < 1 or args.warmup < 0 or args.gate_tokens < 1:
        raise LaneError(f"--lengths {args.lengths!r} (each >= 2), --reps >= 1, --warmup >= 0, --gate-tokens >= 1")
    m = muser.load(args.model, device=args.device, lane=args.lane, kv=args.kv)
    tmp = None
    try:
        cfg = m.config
        too_long = [n for n in lengths if n + args.gate_tokens > cfg.context_length]
        if too_long:
            raise ContextOverflow(f"prompt lengths {too_long} + {args.gate_tokens} gate tokens exceed the "
                                  f"model's context_length {cfg.context_length}")
        d = Path(args.dir) if args.dir else Path(tmp := tempfile.mkdtemp(prefix="muser-kvpack-bench-"))
        tok = m.tokenizer
        fns, results, gates = {}, {}, {}
        for n in lengths:
            ids = _prompt(tok, n)
            n_ctx = n + args.gate_tokens
            prime = m.session(max_context=n_ctx, kvpack=d)
            prime.prefill(ids)
            prime.wait()
            store = prime.store
            expect = (n - 1) // store.binding.layout.chunk_tokens * store.binding.layout.chunk_tokens

            def cold(ids=ids, n_ctx=n_ctx):
                return int(np.argmax(m.session(max_context=n_ctx).prefill(ids)))

            def warm(ids=ids, n_ctx=n_ctx, expect=expect, store=store):
                s = m.session(max_context=n_ctx, kvpack=store)
                t = int(np.argmax(s.prefill(ids)))
                if s.last["restored"] != expect:
                    raise LaneError(f"warm run restored {s.last['restored']} tokens, expected {expect}")
                s.wait()
                return t

            fns[f"cold/{n}"], fns[f"warm/{n}"] = cold, warm
            # gate: bitwise first logits, identical greedy text
            sc, sw = m.session(max_context=n_ctx), m.session(max_context=n_ctx, kvpack=store)
            lc, lw = sc.prefill(ids), sw.prefill(ids)
            bitwise = bool(np.array_equal(lc, lw))
            delta = float(np.abs(lc - lw).max())
            tc, tw = [], []
            for _ in range(args.gate_tokens):
                tc.append(int(np.argmax(lc)))
                tw.append(int(np.argmax(lw)))
                if len(tc) < args.gate_tokens:
                    lc, lw = sc.decode(tc[-1]), sw.decode(tw[-1])
            sw.wait()
            text_c, text_w = tok.decode(tc), tok.decode(tw)
            gates[n] = {"restored": sw.last["restored"], "bitwise_first_logits": bitwise,
                        "max_abs_delta_first_logits": delta,
                        "greedy_ids_identical": tc == tw, "text_identical": text_c == text_w, "text": text_c}
            # restore bandwidth: read + verify + assemble + install of the hit, 5 times
            samples, read_verify = [], []
            for _ in range(5):
                s = m.session(max_context=n_ctx)
                t0 = time.perf_counter()
                hit = store.lookup(ids)  # read + verify every entry of the prefix
                t1 = time.perf_counter()
                s.restore(assemble(hit.tiles, store.binding.layout, tokens=ids[:hit.n_tokens]))  # install
                samples.append(time.perf_counter() - t0)
                read_verify.append(t1 - t0)
            file_bytes = sum(os.path.getsize(next(d.rglob(nm))) for nm in hit.names)
            payload = sum(2 * len(t.layers) * t.rows * store.binding.layout.row_bytes for t in hit.tiles)
            formula = cfg.kv_bytes(hit.n_tokens, 2 if args.kv == "f16" else 4)
            results[n] = {
                "prompt_tokens": n, "stored_prefix_tokens": hit.n_tokens,
                "bytes_on_disk": file_bytes, "bytes_on_disk_per_token": file_bytes / hit.n_tokens,
                "kv_payload_bytes": payload, "formula_kv_bytes": formula,
                "payload_equals_formula": payload == formula,
                "overhead_bytes": file_bytes - payload,
                "restore_s": samples, "restore_bytes_per_s": [file_bytes / x for x in samples],
                "read_verify_s": read_verify, "read_verify_bytes_per_s": [file_bytes / x for x in read_verify],
            }
        cells = run_interleaved(fns, reps=args.reps, warmup=args.warmup)
        disk = _read_bandwidth(d, max(r["bytes_on_disk"] for r in results.values()) * 4)
        for n in lengths:
            c, w = cells[f"cold/{n}"], cells[f"warm/{n}"]
            results[n].update({"ttft_cold_mean_s": c.mean, "ttft_cold_cv": c.cv, "ttft_warm_mean_s": w.mean,
                               "ttft_warm_cv": w.cv, "speedup": c.mean / w.mean,
                               "restore_vs_disk_read": float(np.mean(results[n]["restore_bytes_per_s"]))
                               / disk["mean_bytes_per_s"],
                               "read_verify_vs_disk_read": float(np.mean(results[n]["read_verify_bytes_per_s"]))
                               / disk["mean_bytes_per_s"]})
        ok = all(g["bitwise_first_logits"] and g["greedy_ids_identical"] and g["text_identical"]
                 for g in gates.values()) and all(r["payload_equals_formula"] for r in results.values())
        gate = {"status": "pass" if ok else "fail", "rule": "warm first-token logits bitwise equal to cold; "
                "identical greedy text; stored KV payload equals MuseConfig.kv_bytes", "per_length": gates}
        plot = _plot(results, lengths, args.out_dir)
        path = write_receipt("kvpack", model=model_json(m), device=device_description(args.device), lane=args.lane,
                             gate=gate, results={"kv": args.kv, "lengths": results, "disk_read": disk,
                                                 "plot": plot}, cells=cells, out_dir=args.out_dir)
        for n in lengths:
            r = results[n]
            print(f"P={n}: TTFT cold {r['ttft_cold_mean_s'] * 1e3:.1f} ms, warm {r['ttft_warm_mean_s'] * 1e3:.1f} ms "
                  f"({r['speedup']:.2f}x, {r['stored_prefix_tokens']} restored); "
                  f"{r['bytes_on_disk_per_token']:.0f} B/token on disk, payload == formula: "
                  f"{r['payload_equals_formula']}; restore {np.mean(r['restore_bytes_per_s']) / 1e9:.3f} GB/s "
                  f"(read + verify {np.mean(r['read_verify_bytes_per_s']) / 1e9:.3f} GB/s) vs plain read "
                  f"{disk['mean_bytes_per_s'] / 1e9:.2f} GB/s")
        print(f"gate: {gate['status']}; receipt {path}")
        return 0 if ok else 1
    finally:
        m.close()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def _plot(results: dict, lengths: list[int], out_dir: str | None) -> str | None:
    """A PNG beside the receipts when matplotlib is installed; else None (recorded as such)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    from ..receipt import default_receipts_dir

    fig, ax = plt.subplots(figsize=(5, 3))
    x = np.arange(len(lengths))
    ax.bar(x - 0.2, [results[n]["ttft_cold_mean_s"] * 1e3 for n in lengths], 0.4, label="cold")
    ax.bar(x + 0.2, [results[n]["ttft_warm_mean_s"] * 1e3 for n in lengths], 0.4, label="warm (kvpack)")
    ax.set_xticks(x, [str(n) for n in lengths])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT (ms)")
    ax.legend()
    out = Path(out_dir or os.environ.get("MUSER_RECEIPTS") or default_receipts_dir()) / f"kvpack-ttft-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return str(out)
