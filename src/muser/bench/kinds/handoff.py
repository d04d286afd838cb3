"""`muser bench handoff`: remote prefill (a `muser prefill-node` process on 127.0.0.1) against
local prefill on the decode node, same model, lane, KV type and chunking.

Cells, interleaved A B A B (warm-up, then --reps counted repetitions), each on a fresh session:
- local: session.prefill(prompt) -> last-row logits;
- remote: RemotePrefill.prefill(session, prompt): request, the producer's chunked prefill with
  NoPE tiles streamed per chunk, the SWA tail and logits, detached install, commit -> logits.
The TTFT of a cell is the time to the first token's logits on the decode node (sampling the
argmax of those logits is the same for both and not timed).

Per remote repetition the receipt keeps the producer's own prefill time (from its sealed end
record), the target ratio remote TTFT / producer prefill (<= 1.1), the fraction of K/V bytes
that arrived before the producer finished computing (the transfer hidden under prefill), the
time exposed after it finished, and the bytes read from the link next to book 15.7's formula
(serial tile framing and seals are the difference).

Gate 3 before timing: one remote and one local prefill must leave bitwise identical planes and
logits, and --gate-tokens greedy decode steps from each must give identical tokens and bitwise
identical logits. A failing gate still writes the receipt, marked "not a result", and exits 1.
The two-GPU arm (producer on GPU 0, decode node on GPU 1) needs a machine with two GPUs; this
command measures loopback on one host only and says so in the receipt.
"""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from ..plot import add_plot_flag

    p = sub.add_parser("handoff", help="remote vs local prefill TTFT over loopback mutual TLS (receipt)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF (default: the shipped micro model, F16)")
    p.add_argument("--tokens", type=int, default=1000, help="prompt tokens (default 1000)")
    p.add_argument("--kv", choices=("f16", "f32"), default="f16")
    p.add_argument("--lane", choices=("exact", "fast"), default="exact",
                   help="exact: f32 activations against the exact weight decode (Gate 2 vs oracle f32); fast: ggml-cpu's "
                        "integer arithmetic on every call (activations to Q8_K/Q8_0, integer block sums, row-invariant; Gate 2 vs oracle ggml-cpu); default exact")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--gate-tokens", type=int, default=16, help="greedy steps compared by Gate 3 (default 16)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads on both sides (default 1: two processes share the host)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=None, help="receipt directory (default bench/receipts)")
    add_plot_flag(p)
    p.set_defaults(func=run)


def _gate3(m, rp, ids, steps: int) -> dict:
    import numpy as np

    remote, local = m.session(max_context=len(ids) + steps), m.session(max_context=len(ids) + steps)
    lr, ll = rp.prefill(remote, ids), local.prefill(ids)
    why = None if rp.last.path == "remote" else f"remote prefill fell back: {rp.last.reason}"
    for pa, pb in zip(remote.cache.planes, local.cache.planes):
        if why is None and (pa.state() != pb.state() or not bool((pa.keys == pb.keys).all())
                            or not bool((pa.values == pb.values).all())):
            why = f"layer {pa.layer}: installed plane differs from the local prefill's"
    tokens = []
    for i in range(steps + 1):
        if why is None and not np.array_equal(lr, ll):
            why = f"logits differ at step {i} (max |d| {float(np.max(np.abs(lr - ll))):.3e})"
        ta, tb = int(np.argmax(lr)), int(np.argmax(ll))
        if why is None and ta != tb:
            why = f"greedy token differs at step {i}: {ta} vs {tb}"
        if why is not None or i == steps:
            break
        tokens.append(ta)
        lr, ll = remote.decode(ta), local.decode(tb)
    return {"status": "fail" if why else "pass", "gate": "3 (remote handoff vs local prefill)",
            "reason": why, "greedy_tokens": tokens, "kv": m.kv, "lane": m.lane}


def run(args: argparse.Namespace) -> int:
    import statistics
    import tempfile
    import time

    import numpy as np
    import torch

    import muser

    from ...api import shipped_model
    from ...bench.receipt import device_description, run_interleaved, write_receipt
    from ...errors import LaneError
    from ...handoff import RemotePrefill, certs, tiles
    from ...handoff import manifest as mf
    from ...handoff.spawn import NodeProcess
    from ..plot import check_plot_flag, plot_for_run

    check_plot_flag(args)
    if args.threads < 1:
        raise LaneError(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    path = args.model
    if path is None:
        shipped = shipped_model()
        path = str(shipped.with_name(shipped.name.replace("-q8_0.", "-f16."))) if shipped else None
    if path is None:
        raise LaneError("no --model given and no shipped micro model in models/")
    m = muser.load(path, kv=args.kv, lane=args.lane)
    if not 1 <= args.tokens <= m.config.context_length - args.gate_tokens:
        raise LaneError(f"--tokens {args.tokens} must be in [1, {m.config.context_length - args.gate_tokens}]")
    ids = [int(t) for t in np.random.default_rng(args.seed).integers(0, m.config.vocab, args.tokens)]
    with tempfile.TemporaryDirectory(prefix="muser-handoff-bench-") as tmp:
        certs.init(tmp)
        certs.issue(tmp, "prefill")
        certs.issue(tmp, "decode")
        with NodeProcess(path, tmp, kv=args.kv, lane=args.lane, stall_s=300.0, threads=args.threads) as node:
            rp = RemotePrefill(node.addr, tmp, ledger=f"{tmp}/ledger.json", stall_s=300.0)
            gate = _gate3(m, rp, ids, args.gate_tokens)
            outcomes = []

            def remote_cell():
                rp.prefill(m.session(max_context=args.tokens), ids)
                if rp.last.path != "remote":
                    raise LaneError(f"remote prefill fell back during timing: {rp.last.reason}")
                outcomes.append((rp.last, time.time()))

            cells = run_interleaved({"local": lambda: m.session(max_context=args.tokens).prefill(ids),
                                     "remote": remote_cell}, reps=args.reps, warmup=args.warmup)
    counted = outcomes[args.warmup:]
    layout = tiles.layout_of(m.session(max_context=args.tokens))
    formula = mf.kv_rows_formula(layout, 0, args.tokens)
    reps = []
    for o, done in counted:
        early = sum(b for (_, kind, b, t) in o.arrivals if kind in ("nope", "swa") and t <= o.compute_done_unix)
        kv_frames = sum(b for (_, kind, b, _) in o.arrivals if kind in ("nope", "swa"))
        reps.append({"ttft_s": o.ttft_s, "producer_prefill_s": o.producer_prefill_s,
                     "ratio_to_producer_prefill": o.ttft_s / o.producer_prefill_s,
                     "hidden_fraction": early / kv_frames,
                     "exposed_after_compute_s": max(0.0, done - o.compute_done_unix),
                     "kv_bytes": o.kv_bytes, "tile_bytes": o.tile_bytes, "wire_bytes": o.wire_bytes,
                     "arrivals": o.arrivals, "compute_done_unix": o.compute_done_unix})
    def mean(k):
        return statistics.fmean(r[k] for r in reps)
    results = {
        "prompt_tokens": args.tokens, "chunk": layout.chunk_tokens,
        "ttft_local_s": cells["local"].mean, "ttft_remote_s": cells["remote"].mean,
        "remote_over_local": cells["remote"].mean / cells["local"].mean,
        "producer_prefill_s": mean("producer_prefill_s"),
        "remote_over_producer_prefill": mean("ratio_to_producer_prefill"), "target_remote_over_producer": 1.1,
        "hidden_fraction": mean("hidden_fraction"), "exposed_after_compute_s": mean("exposed_after_compute_s"),
        "kv_bytes": reps[0]["kv_bytes"], "kv_bytes_formula": formula,
        "kv_bytes_match_formula": all(r["kv_bytes"] == formula for r in reps),
        "tile_bytes": reps[0]["tile_bytes"], "wire_bytes": reps[0]["wire_bytes"],
        "wire_overhead_bytes": reps[0]["wire_bytes"] - formula, "remote_reps": reps,
    }
    out = write_receipt(
        "handoff", model={"path": path, "identity": m.identity.to_json()}, device=device_description("cpu"),
        lane=args.lane, gate=gate, results=results, cells=cells, out_dir=args.out_dir,
        extra={"kv": args.kv, "threads_each_side": args.threads, "transport": "TLS 1.3 mutual auth over 127.0.0.1 (one host, two processes)",
               "not_measured": "two-GPU arm (producer GPU 0, decode node GPU 1): needs a two-GPU machine"},
    )
    tag = "" if gate["status"] == "pass" else "  (NOT A RESULT: Gate 3 failed)"
    print(f"Gate 3: {gate['status']}{'' if not gate['reason'] else ' - ' + gate['reason']}")
    print(f"TTFT local {results['ttft_local_s'] * 1e3:.1f} ms, remote {results['ttft_remote_s'] * 1e3:.1f} ms "
          f"(x{results['remote_over_local']:.3f}); producer prefill {results['producer_prefill_s'] * 1e3:.1f} ms, "
          f"remote/producer x{results['remote_over_producer_prefill']:.3f} (target <= 1.1){tag}")
    print(f"hidden under prefill {results['hidden_fraction']:.1%}, exposed {results['exposed_after_compute_s'] * 1e3:.1f} ms; "
          f"K/V bytes {results['kv_bytes']} (formula {formula}), on the link {results['wire_bytes']}")
    print(f"receipt: {out}")
    plot_for_run(args, out)
    return 0 if gate["status"] == "pass" else 1
