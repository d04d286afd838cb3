"""`muser prefill-node --listen HOST:PORT --certs DIR`: serve remote prefill (the producer of
Handoff V2, docs/handoff.md). Binds only to HOST; admits decode nodes whose certificate comes
from DIR's CA and whose name and fingerprint are in DIR/peers.json (or --allow)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prefill-node", help="serve remote prefill over mutual TLS (Handoff V2 producer)",
                       description=__doc__)
    p.add_argument("--listen", required=True, metavar="HOST:PORT",
                   help="interface and port to bind (port 0 picks a free one; printed on start)")
    p.add_argument("--certs", required=True, metavar="DIR", help="certs dir (muser certs init / issue)")
    p.add_argument("--name", default="prefill", help="this node's certificate name in DIR (default prefill)")
    p.add_argument("--allow", action="append", metavar="NAME",
                   help="peer name allowed to connect (repeatable; default: every name in peers.json)")
    p.add_argument("--model", default=None, metavar="F", help="GGUF to serve (default: the embedded model)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--lane", default=None, choices=("exact", "fast"),
                   help="exact: f32 activations against the exact weight decode (Gate 2 vs oracle f32); fast: ggml-cpu's "
                        "integer arithmetic on every call (activations to Q8_K/Q8_0, integer block sums, row-invariant; "
                        "Gate 2 vs oracle ggml-cpu); default: the device's, as `muser serve` takes it (fast on cuda, "
                        "exact on cpu); a request from a decode node of another lane is refused")
    p.add_argument("--kv", default="f16", choices=("f16", "f32"))
    p.add_argument("--stall-timeout", type=float, default=30.0, metavar="S",
                   help="seconds a link may stay silent before it is dropped (default 30)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="CPU threads for torch (default: torch's own choice)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import logging

    import muser

    from ..errors import MuserError
    from ..handoff import Certs, PrefillNode
    from ..handoff.producer import parse_addr

    parse_addr(args.listen)  # cheap refusals before the model loads
    if args.threads is not None:
        if args.threads < 1:
            raise MuserError(f"--threads must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    certs = Certs.load(args.certs, args.name)
    model = muser.load(args.model, device=args.device, lane=args.lane, kv=args.kv)
    node = PrefillNode(model, certs, args.listen, allow=args.allow, stall_s=args.stall_timeout)
    host, port = node.address
    print(f"prefill-node listening on {host}:{port}", flush=True)
    try:
        node.serve_forever()
    finally:
        node.close()
    return 0
