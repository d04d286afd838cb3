"""`muser serve`: an OpenAI-compatible HTTP server (chat/completions, completions, models,
sessions, health, Prometheus metrics).

    muser serve                                   # the embedded micro model on the CPU, port 8080
    muser serve --model F.gguf --device cuda --slots 4 --api-key KEY
    muser serve --prefill-node 10.0.0.2:7070 --certs DIR   # prompts prefill on a `muser prefill-node`
    muser serve --kvpack DIR                 # prompts restore their longest stored prefix (docs/kvpack.md)
    OPENAI_BASE_URL=http://127.0.0.1:8080/v1 python -c "import openai; ..."

--threads N sets the forward's CPU threads (torch's and the C kernels', which follow torch's) as
`muser generate --threads N` does; unset, torch's default (the usable cores). One engine-loop
thread owns the model; N slots (each its own KV) share every step, and the
sequences that become ready within --batch-window-us of the first join the same step (the decode
batcher; /metrics: muser_engine_steps_total, muser_step_sequences). --port 0
takes a free port. The port is bound first and the model loads behind it: /health answers 503
{"status": "loading"} and every other endpoint 503 with Retry-After until the model is loaded
and warmed, then 200; the "listening on http://HOST:PORT/v1" line is printed then (a first
"loading behind" line names the port at once). With --prefill-node, a slot's prompt is prefilled
by that node over mutual TLS (Handoff V2, docs/handoff.md) with this server's certificate DIR/decode
from `muser certs issue DIR decode`; a refusal or a dead node prefills locally and logs why
(/metrics: muser_prefills_total{path="remote"|"local"}). With --kvpack, a prompt on an empty
slot restores its longest stored prefix from DIR and the new 512-token chunks are persisted in
the background (/metrics: muser_restored_tokens_total, muser_prefilled_tokens_total).
"""

from __future__ import annotations

import argparse

from .generate import add_model_args, check_model_args, load_model


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)  # --model --device --lane --kv --threads, as `muser generate` takes them
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 = a free port)")
    p.add_argument("--slots", type=int, default=4, help="sequences served at once (default 4)")
    p.add_argument("--ctx", type=int, help="context per slot in tokens (default: the model's, at most 4096)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: no key)")
    p.add_argument("--model-id", help="the model name clients send (default: the file name without .gguf)")
    p.add_argument("--queue", type=int, default=64, help="requests waiting for a slot before 503 (default 64)")
    p.add_argument("--max-sessions", type=int, default=16, help="named sessions kept (LRU, default 16)")
    p.add_argument("--max-body", type=int, default=4 << 20, help="request body limit in bytes (default 4 MiB)")
    p.add_argument("--max-prompt", type=int, help="prompt limit in tokens (default: the context less one)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds (default 600)")
    p.add_argument("--prefill-node", metavar="HOST:PORT", help="prefill prompts on this `muser prefill-node`")
    p.add_argument("--certs", metavar="DIR", help="certs dir for --prefill-node (muser certs init / issue; "
                                                  "this server's certificate is DIR/decode)")
    p.add_argument("--prefill-peer", metavar="NAME",
                   help="the prefill node's certificate name in DIR (default prefill; needs --prefill-node)")
    p.add_argument("--batch-window-us", type=int, default=250, metavar="US",  # muser.server.loop.BATCH_WINDOW_US
                   help="decode batcher window: sequences ready within US microseconds of the first share one "
                        "engine step while a slot is free (default 250; 0 = no wait)")
    p.add_argument("--kvpack", metavar="DIR", help="kvpack store: restore stored prompt prefixes, persist new "
                                                   "chunks (created if absent)")
    p.set_defaults(func=run)


def _remote(args: argparse.Namespace):
    """RemotePrefill for --prefill-node, its certs loaded: refusals before the model loads."""
    from ..errors import LaneError

    if args.prefill_node is None:
        for flag, v in (("--certs", args.certs), ("--prefill-peer", args.prefill_peer)):
            if v is not None:
                raise LaneError(f"{flag} {v} is only used with --prefill-node HOST:PORT")
        return None
    if args.certs is None:
        raise LaneError(f"--prefill-node {args.prefill_node} needs --certs DIR (mutual TLS with the node)")
    from ..handoff import RemotePrefill
    from ..handoff.certs import check_name

    peer = args.prefill_peer or "prefill"
    check_name(peer)
    remote = RemotePrefill(args.prefill_node, args.certs, name="decode", peer=peer)
    if peer not in remote.certs.peers:
        raise LaneError(f"--prefill-peer {peer} is not in {args.certs}/peers.json (muser certs issue {args.certs} {peer})")
    return remote


def run(args: argparse.Namespace) -> int:
    from ..errors import ContextOverflow, LaneError
    from ..server import Server

    for name in ("slots", "queue", "max_sessions", "max_body"):
        if getattr(args, name) < 1:
            raise LaneError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.batch_window_us < 0:
        raise LaneError(f"--batch-window-us must be >= 0, got {args.batch_window_us}")
    if not 0 <= args.port <= 65535:
        raise LaneError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_prompt is not None and args.max_prompt < 1:
        raise LaneError(f"--max-prompt must be >= 1, got {args.max_prompt}")
    if not args.timeout > 0:
        raise LaneError(f"--timeout must be > 0 seconds, got {args.timeout}")
    if args.ctx is not None and args.ctx < 2:
        raise ContextOverflow(f"--ctx {args.ctx} must be >= 2")
    if args.api_key is not None and not args.api_key:
        raise LaneError("--api-key must not be empty")
    remote = _remote(args)
    if remote is not None and args.kvpack is not None:
        raise LaneError(f"--kvpack {args.kvpack} with --prefill-node {args.prefill_node} is not served: a prompt "
                        "is either restored from the store or prefilled by the node")
    check_model_args(args)
    # the model loads behind the bound port (/health: 503 until ready); --threads is set before
    # the weights load, as for `muser generate`
    Server(lambda: load_model(args), slots=args.slots, context=args.ctx, host=args.host, port=args.port,
           model_id=args.model_id, remote=remote, kvpack=args.kvpack, batch_window_us=args.batch_window_us,
           queue_limit=args.queue, max_sessions=args.max_sessions, api_key=args.api_key,
           max_body_bytes=args.max_body, max_prompt_tokens=args.max_prompt, timeout_s=args.timeout).serve()
    return 0
