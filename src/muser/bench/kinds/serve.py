"""`muser bench serve`: a load report of `muser serve` at 1, 4 and 16 concurrent clients, side by
side with the pinned llama-server on the same GGUF when one is given (--llama-server PATH).

Each server runs as its own process on a free port of 127.0.0.1, both on --threads CPU threads
(`muser serve --threads N`, llama-server `-t N`). Every client is one HTTP client object (made
before the level's clock starts) that streams /v1/completions requests one after another, each on
a new connection (greedy, EOS/EOT banned by logit_bias so every request produces exactly
--max-tokens tokens, stream_options.include_usage on). Per request: TTFT = send to the first
token chunk; inter-token latency = the gaps between token chunks.
Per level: p50/p99 of both, and throughput = completion tokens / wall time of the level.
Levels are interleaved per server (muser 1, llama 1, muser 4, ...), after one warm-up request.

Gate: every request's text under load equals the same prompt's text served alone (the level-1
run), per server (greedy under batching is what the request gets alone). --plot draws the PNG
from the receipt (muser.bench.plot.plot_serve).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import httpx

PROMPTS = ["def parse_args(argv):\n", "class Node:\n    def __init__(self", "import os\nimport sys\n\n\ndef main(",
           "for key, value in sorted(", "    return self._cache[", "try:\n    import json\nexcept ImportError:",
           "def __repr__(self):\n        return", "with open(path, 'rb') as f:\n"]
MUSER_LINE = re.compile(r"listening on (http://127\.0\.0\.1:\d+)/v1 \(model (\S+),")


class ServerProcess:
    """A server subprocess on a free port; `base` is http://127.0.0.1:PORT once it is up."""

    def __init__(self, argv: list[str], ready: re.Pattern | None = None, port: int | None = None,
                 env: dict | None = None, timeout_s: float = 300.0):
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env=env)
        self.log: list[str] = []
        self.base = f"http://127.0.0.1:{port}" if port is not None else None
        self.model = None
        found = threading.Event()

        def pump():
            for line in self.proc.stderr:
                self.log.append(line)
                m = ready.search(line) if ready is not None else None
                if m:
                    self.base, self.model = m.group(1), m.group(2)
                    found.set()

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{argv[0]} did not start:\n" + "".join(self.log[-30:]))
            if ready is not None and found.wait(0.2):
                break
            if ready is None and self._healthy():
                break
            time.sleep(0.2)

    def _healthy(self) -> bool:
        import httpx

        try:
            return httpx.get(self.base + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def muser_server(args: list[str]) -> ServerProcess:
    """`muser serve --port 0 ARGS` from this source tree; up once its startup line is printed."""
    src = str(Path(__file__).resolve().parents[3])
    env = dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return ServerProcess([sys.executable, "-m", "muser", "serve", "--port", "0", *args], MUSER_LINE, env=env)


def llama_server(binary: str, model: str, slots: int, ctx: int, threads: int, device: str) -> ServerProcess:
    """The pinned llama-server on the device Muser serves from: every layer offloaded with
    --device cuda (-ngl 99, as llama-bench runs on the GPU), none on the CPU."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
            "-c", str(ctx * slots), "-t", str(threads), "--no-webui", "-ngl", "99" if device == "cuda" else "0"]
    p = ServerProcess(argv, None, port=port)
    p.model = Path(model).name
    return p


def client() -> "httpx.Client":
    """One client's HTTP client, reused for its requests: building one loads the TLS trust store,
    tens of ms on a loaded host, which is the client's cost, not the server's. No keep-alive:
    llama-server's HTTP library closes a connection after a streamed response without saying so,
    so every request opens its own connection to either server."""
    import httpx

    return httpx.Client(timeout=600, limits=httpx.Limits(max_keepalive_connections=0))


def one_request(http: "httpx.Client", base: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "logit_bias": {"1": -100, "2": -100}, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    stamps, text, usage = [], [], None
    with http.stream("POST", base + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{base}: HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                usage = ev["usage"]
            for ch in ev.get("choices") or ():
                if ch.get("finish_reason") is None or ch.get("text"):
                    stamps.append(time.perf_counter())
                    text.append(ch.get("text") or "")
    if not stamps:
        raise RuntimeError(f"{base}: a request returned no tokens")
    return {"ttft_s": stamps[0] - t0, "itl_s": [b - a for a, b in zip(stamps, stamps[1:])],
            "text": "".join(text), "completion_tokens": (usage or {}).get("completion_tokens"),
            "total_s": stamps[-1] - t0}


def run_level(base: str, model: str, clients: int, rounds: int, max_tokens: int) -> dict:
    """`clients` threads share max(clients x rounds, len(PROMPTS)) requests (every prompt at every
    level, so each has its alone-text to be compared with)."""
    total = max(clients * rounds, len(PROMPTS))
    results: list[list[dict]] = [[] for _ in range(clients)]
    errors: list[BaseException] = []
    https = [client() for _ in range(clients)]

    def run_client(i: int) -> None:
        try:
            for j in range(i, total, clients):
                p = j % len(PROMPTS)
                results[i].append(dict(one_request(https[i], base, model, PROMPTS[p], max_tokens), prompt=p))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=run_client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    for h in https:
        h.close()
    if errors:
        raise errors[0]
    reqs = [r for rs in results for r in rs]
    ttft = [r["ttft_s"] for r in reqs]
    itl = [x for r in reqs for x in r["itl_s"]]
    tokens = sum(r["completion_tokens"] or (len(r["itl_s"]) + 1) for r in reqs)
    return {"clients": clients, "requests": len(reqs), "wall_s": wall, "completion_tokens": tokens,
            "throughput_tok_s": tokens / wall, "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
            "itl_p50_s": _pct(itl, 50), "itl_p99_s": _pct(itl, 99), "ttft_samples_s": ttft, "itl_samples_s": itl,
            "texts": [[r["prompt"], r["text"]] for r in reqs]}


def _pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * p / 100.0
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def register(sub: argparse._SubParsersAction) -> None:
    from ..plot import add_plot_flag

    p = sub.add_parser("serve", help="server load report: TTFT / inter-token latency p50/p99 and throughput",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="GGUF path (default: the embedded model)")
    p.add_argument("--clients", default="1,4,16", help="concurrency levels (default 1,4,16)")
    p.add_argument("--rounds", type=int, default=1, help="requests per client per level, at least every "
                   "prompt once (default 1)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per request (default 16)")
    p.add_argument("--slots", type=int, default=4, help="server slots (default 4)")
    p.add_argument("--ctx", type=int, default=1024, help="context per slot (default 1024)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--lane", default="exact")
    p.add_argument("--llama-server", metavar="PATH", help="the pinned llama-server binary, run side by side")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="CPU threads of each server: muser serve --threads, llama-server -t (default: the cores)")
    p.add_argument("--out-dir", help="receipt folder (default bench/receipts)")
    add_plot_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import httpx

    from ...api import default_model_path
    from ...errors import LaneError
    from ..plot import check_plot_flag, plot_for_run
    from ..receipt import device_description, write_receipt

    check_plot_flag(args)
    try:
        levels = [int(x) for x in args.clients.split(",") if x.strip()]
    except ValueError:
        raise LaneError(f"--clients {args.clients!r} must be comma-separated integers") from None
    if not levels or min(levels) < 1 or args.rounds < 1 or args.max_tokens < 1 or args.threads < 1:
        raise LaneError("--clients, --rounds, --max-tokens and --threads must be >= 1")
    if args.llama_server and not os.access(args.llama_server, os.X_OK):
        raise LaneError(f"--llama-server {args.llama_server!r} is not an executable file")
    model = args.model or str(default_model_path())
    servers = {"muser": muser_server(["--slots", str(args.slots), "--ctx", str(args.ctx), "--device", args.device,
                                      "--lane", args.lane, "--threads", str(args.threads),
                                      *(["--model", args.model] if args.model else [])])}
    try:
        if args.llama_server:
            servers["llama-server"] = llama_server(args.llama_server, model, args.slots, args.ctx, args.threads,
                                                   args.device)
        meta = httpx.get(servers["muser"].base + "/v1/models", timeout=10).json()["data"][0]
        for name, s in servers.items():  # warm-up: load paths, first allocations
            with client() as http:
                one_request(http, s.base, s.model, PROMPTS[0], args.max_tokens)
        results: dict[str, list[dict]] = {k: [] for k in servers}
        for c in levels:
            for name, s in servers.items():  # interleaved per level
                results[name].append(run_level(s.base, s.model, c, args.rounds, args.max_tokens))
    finally:
        for s in servers.values():
            s.stop()
    gate = _gate(results)
    out = write_receipt("serve", model={"path": model, "served_as": meta["id"], "sha256": meta["meta"]["sha256"]},
                        device=device_description(args.device), lane=args.lane, gate=gate, results=results,
                        out_dir=args.out_dir,
                        extra={"slots": args.slots, "ctx_per_slot": args.ctx, "max_tokens": args.max_tokens,
                               "threads": args.threads, "client": "one HTTP client per client, a new connection per request",
                               "rounds": args.rounds, "prompts": PROMPTS,
                               "comparator": "llama-server" if args.llama_server else
                               "none (no --llama-server binary given)"})
    print(f"{'server':>13} {'clients':>7} {'TTFT p50':>9} {'p99':>9} {'ITL p50':>9} {'p99':>9} {'tok/s':>8}")
    for name, rs in results.items():
        for r in rs:
            print(f"{name:>13} {r['clients']:>7} {r['ttft_p50_s'] * 1e3:8.1f}ms {r['ttft_p99_s'] * 1e3:8.1f}ms "
                  f"{r['itl_p50_s'] * 1e3:8.1f}ms {r['itl_p99_s'] * 1e3:8.1f}ms {r['throughput_tok_s']:8.2f}")
    print(f"gate (load == alone): {gate['status']}")
    print(f"receipt: {out}")
    plot_for_run(args, out)
    return 0 if gate["status"] != "fail" else 1


def _gate(results: dict[str, list[dict]]) -> dict:
    detail = {}
    for name, rs in results.items():
        if rs[0]["clients"] != 1:
            detail[name] = "n/a (no 1-client level to compare with)"
            continue
        alone = {p: t for p, t in rs[0]["texts"]}
        bad = [(r["clients"], p) for r in rs for p, t in r["texts"] if alone[p] != t]
        detail[name] = "pass" if not bad else f"fail: (clients, prompt) {bad[:8]}"
    kinds = {v.split(":")[0].split(" ")[0] for v in detail.values()}
    status = "fail" if "fail" in kinds else ("pass" if kinds == {"pass"} else "n/a")
    return {"status": status, "rule": "every greedy request under load has the text of the same prompt alone",
            "per_server": detail}


__all__ = ["ServerProcess", "client", "muser_server", "llama_server", "one_request", "run_level"]
