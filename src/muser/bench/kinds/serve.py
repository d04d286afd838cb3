"""`muser bench serve`: a load report of `muser serve` at 1, 4 and 16 concurrent clients, side by
side with the pinned llama-server on the same GGUF with `--against llama-server --llama-server PATH`.

Each server runs as its own process on a free port of 127.0.0.1, with the same slots, the same
context per slot (llama-server: -np SLOTS -c SLOTS x CTX, one KV buffer per slot, the per-slot
context it reports checked) and the same CPU threads (--threads: `muser serve --threads N`,
llama-server `-t N -tb N`; with --device cuda llama-server offloads every layer, -ngl 99). Every
client is one HTTP client object (made before the level's clock starts) that streams
/v1/completions requests one after another, each on a new connection (temperature 0, the model's end-of-generation tokens
banned by logit_bias so every request produces exactly --max-tokens tokens,
stream_options.include_usage on; llama-server is also sent cache_prompt=false, so neither server
reuses an earlier request's prompt KV). Per request: TTFT = send to the first token chunk;
inter-token latency = the gaps between token chunks. Per level: p50/p99 of both, and throughput =
completion tokens / wall time of the level. Levels are interleaved per server (muser 1, llama 1,
muser 4, ...), after one warm-up request. llama-server's own per-request timings (the `timings`
object of its last chunk: prompt_ms, predicted_per_second, ...) are kept beside them.

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
    """A server subprocess on a free port; `base` is http://127.0.0.1:PORT once it is ready: its
    `ready` line printed (muser serve prints it once loaded and warmed), or without one, and then
    in any case, /health answering 200 (both servers answer 503 while loading)."""

    def __init__(self, argv: list[str], ready: re.Pattern | None = None, port: int | None = None,
                 env: dict | None = None, timeout_s: float = 300.0):
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env=env)
        self.log: list[str] = []
        self.base = f"http://127.0.0.1:{port}" if port is not None else None
        self.model = None
        self.info: dict = {}  # what the comparator reported about itself (llama-server: its slots)
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
            if (ready is None or found.wait(0.2)) and self._healthy():
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


N_CTX_SLOT = re.compile(r"initializing, n_slots = (\d+), n_ctx_slot = (\d+), kv_unified = '(\w+)'")


def llama_server_argv(binary: str, model: str, port: int, slots: int, ctx: int, threads: int,
                      device: str = "cpu") -> list[str]:
    """llama-server with SLOTS slots of CTX tokens each (one KV buffer per slot: --no-kv-unified), on
    the device Muser serves from: every layer offloaded with --device cuda (-ngl 99, as llama-bench
    runs on the GPU), none on the CPU."""
    return [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
            "-c", str(ctx * slots), "--no-kv-unified", "-t", str(threads), "-tb", str(threads), "--no-webui",
            "-ngl", "99" if device == "cuda" else "0"]


def check_llama_slots(log: list[str], slots: int, ctx: int) -> dict:
    """The slot layout llama-server reports at start-up is the one asked for."""
    from ...errors import ComparatorError

    found = [m for m in map(N_CTX_SLOT.search, log) if m]
    if not found:
        raise ComparatorError("llama-server printed no 'initializing, n_slots = ..' line")
    got = {"n_slots": int(found[-1][1]), "n_ctx_slot": int(found[-1][2]), "kv_unified": found[-1][3] == "true"}
    if got != {"n_slots": slots, "n_ctx_slot": ctx, "kv_unified": False}:
        raise ComparatorError(f"llama-server runs {got}, not {slots} slots of {ctx} tokens each")
    return got


def llama_server(binary: str, model: str, slots: int, ctx: int, threads: int, device: str) -> ServerProcess:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = ServerProcess(llama_server_argv(binary, model, port, slots, ctx, threads, device), None, port=port)
    p.model = Path(model).name
    try:
        deadline = time.monotonic() + 10  # the log pump may trail /health by a moment
        while not any(N_CTX_SLOT.search(ln) for ln in p.log) and time.monotonic() < deadline:
            time.sleep(0.1)
        p.info = {"argv": p.proc.args, "slots": check_llama_slots(p.log, slots, ctx)}
    except BaseException:
        p.stop()
        raise
    return p


def request_body(model: str, prompt: str, max_tokens: int, banned: list[int], llama: bool) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "logit_bias": {str(t): -100 for t in banned}, "stream_options": {"include_usage": True}}
    if llama:
        body["cache_prompt"] = False  # server-context.cpp: else a repeated prompt reuses the slot's KV
    return body


def read_stream(t0: float, lines) -> dict:
    """One streamed /v1/completions response, from (arrival time, SSE line) pairs: TTFT, the
    inter-token gaps, the text, the usage's completion tokens and llama-server's `timings`."""
    stamps, text, usage, timings = [], [], None, None
    for t, line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ev = json.loads(line[6:])
        if ev.get("usage"):
            usage = ev["usage"]
        if ev.get("timings"):
            timings = ev["timings"]
        for ch in ev.get("choices") or ():
            if ch.get("finish_reason") is None or ch.get("text"):
                stamps.append(t)
                text.append(ch.get("text") or "")
    if not stamps:
        raise RuntimeError("a request returned no tokens")
    return {"ttft_s": stamps[0] - t0, "itl_s": [b - a for a, b in zip(stamps, stamps[1:])],
            "text": "".join(text), "completion_tokens": (usage or {}).get("completion_tokens"),
            "total_s": stamps[-1] - t0, "server_timings": timings}


def client() -> "httpx.Client":
    """One client's HTTP client, reused for its requests: building one loads the TLS trust store,
    tens of ms on a loaded host, which is the client's cost, not the server's. No keep-alive:
    llama-server's HTTP library closes a connection after a streamed response without saying so,
    so every request opens its own connection to either server."""
    import httpx

    return httpx.Client(timeout=600, limits=httpx.Limits(max_keepalive_connections=0))


def one_request(http: "httpx.Client", base: str, model: str, prompt: str, max_tokens: int, banned: list[int],
                llama: bool) -> dict:
    body = request_body(model, prompt, max_tokens, banned, llama)
    t0 = time.perf_counter()
    with http.stream("POST", base + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{base}: HTTP {r.status_code}: {r.read()[:300]!r}")
        return read_stream(t0, ((time.perf_counter(), line) for line in r.iter_lines()))


def run_level(base: str, model: str, clients: int, rounds: int, max_tokens: int, banned: list[int],
              llama: bool) -> dict:
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
                results[i].append(dict(one_request(https[i], base, model, PROMPTS[p], max_tokens, banned, llama),
                                       prompt=p))
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
    return level_stats(clients, wall, [r for rs in results for r in rs], max_tokens)


def level_stats(clients: int, wall: float, reqs: list[dict], max_tokens: int) -> dict:
    """One level's figures from its requests (read_stream results with their prompt index)."""
    short = [r["completion_tokens"] for r in reqs if r["completion_tokens"] != max_tokens]
    if short:
        raise RuntimeError(f"requests reported completion_tokens {short[:4]}, not the {max_tokens} every request "
                           "must produce (no usage, or an end-of-generation token was not banned)")
    ttft = [r["ttft_s"] for r in reqs]
    itl = [x for r in reqs for x in r["itl_s"]]
    tokens = sum(r["completion_tokens"] for r in reqs)
    return {"clients": clients, "requests": len(reqs), "wall_s": wall, "completion_tokens": tokens,
            "throughput_tok_s": tokens / wall, "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
            "itl_p50_s": _pct(itl, 50), "itl_p99_s": _pct(itl, 99), "ttft_samples_s": ttft, "itl_samples_s": itl,
            "texts": [[r["prompt"], r["text"]] for r in reqs],
            "server_timings": [r["server_timings"] for r in reqs if r["server_timings"] is not None]}


def _pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * p / 100.0
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def register(sub: argparse._SubParsersAction) -> None:
    from ..plot import add_plot_flag
    from ...cores import default_threads

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
    p.add_argument("--against", choices=("llama-server",), help="comparator run side by side: llama-server")
    p.add_argument("--llama-server", metavar="PATH", help="the pinned llama-server binary (--against)")
    p.add_argument("--threads", type=int, default=default_threads(),
                   help="CPU threads of both servers (default: the cores this process may use)")
    p.add_argument("--out-dir", help="receipt directory (default: the per-user cache, muser.api.cache_dir()/receipts; "
                                     "give bench/receipts for the project's evidence)")
    add_plot_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import httpx

    from ...api import default_model_path
    from ...errors import ComparatorError, LaneError
    from ...gguf.reader import read_gguf
    from ...text import Tokenizer
    from ..llamabin import binary_identity, executable
    from ..plot import check_plot_flag, plot_for_run
    from ..receipt import device_description, write_receipt

    check_plot_flag(args)
    try:
        levels = [int(x) for x in args.clients.split(",") if x.strip()]
    except ValueError:
        raise LaneError(f"--clients {args.clients!r} must be comma-separated integers") from None
    if not levels or min(levels) < 1 or args.rounds < 1 or args.max_tokens < 1:
        raise LaneError("--clients, --rounds and --max-tokens must be >= 1")
    if args.slots < 1 or args.ctx < 1 or args.threads < 1:
        raise LaneError("--slots, --ctx and --threads must be >= 1")
    binary = None
    if args.against:
        binary = executable(args.llama_server, "--llama-server")
        identity = binary_identity(binary)
    elif args.llama_server:
        raise ComparatorError(f"--llama-server {args.llama_server} is only run with --against llama-server")
    model = args.model or str(default_model_path())
    f = read_gguf(model)
    try:
        banned = sorted(Tokenizer.from_gguf(f).eog_ids)  # every request runs its full --max-tokens
    finally:
        f.close()
    servers = {"muser": muser_server(["--slots", str(args.slots), "--ctx", str(args.ctx), "--device", args.device,
                                      "--lane", args.lane, "--threads", str(args.threads),
                                      *(["--model", args.model] if args.model else [])])}
    try:
        if binary is not None:
            servers["llama-server"] = llama_server(str(binary), model, args.slots, args.ctx, args.threads,
                                                   args.device)
        meta = httpx.get(servers["muser"].base + "/v1/models", timeout=10).json()["data"][0]
        for name, s in servers.items():  # warm-up: load paths, first allocations
            with client() as http:
                one_request(http, s.base, s.model, PROMPTS[0], args.max_tokens, banned, name != "muser")
        results: dict[str, list[dict]] = {k: [] for k in servers}
        for c in levels:
            for name, s in servers.items():  # interleaved per level
                results[name].append(run_level(s.base, s.model, c, args.rounds, args.max_tokens, banned,
                                               name != "muser"))
    finally:
        for s in servers.values():
            s.stop()
    gate = _gate(results)
    out = write_receipt("serve", model={"path": model, "served_as": meta["id"], "sha256": meta["meta"]["sha256"]},
                        device=device_description(args.device), lane=args.lane, gate=gate, results=results,
                        out_dir=args.out_dir,
                        extra={"slots": args.slots, "ctx_per_slot": args.ctx, "max_tokens": args.max_tokens,
                               "rounds": args.rounds, "threads": args.threads, "banned_tokens": banned,
                               "client": "one HTTP client per client, a new connection per request",
                               "prompts": PROMPTS,
                               "comparator": {"name": "llama-server", **identity,
                                              **servers["llama-server"].info} if binary is not None else
                               {"name": "none (no --against)"},
                               "side_by_side": side_by_side(results)})
    print(f"{'server':>13} {'clients':>7} {'TTFT p50':>9} {'p99':>9} {'ITL p50':>9} {'p99':>9} {'tok/s':>8}")
    for name, rs in results.items():
        for r in rs:
            print(f"{name:>13} {r['clients']:>7} {r['ttft_p50_s'] * 1e3:8.1f}ms {r['ttft_p99_s'] * 1e3:8.1f}ms "
                  f"{r['itl_p50_s'] * 1e3:8.1f}ms {r['itl_p99_s'] * 1e3:8.1f}ms {r['throughput_tok_s']:8.2f}")
    print(f"gate (load == alone): {gate['status']}")
    print(f"receipt: {out}")
    plot_for_run(args, out)
    return 0 if gate["status"] != "fail" else 1


def side_by_side(results: dict[str, list[dict]]) -> list[dict]:
    """Per concurrency level, each server's TTFT/ITL p50/p99 (s) and throughput (tok/s)."""
    keys = ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "throughput_tok_s")
    levels = [r["clients"] for r in next(iter(results.values()))]
    return [{"clients": c, **{name: {k: r[k] for k in keys} for name, rs in results.items()
                               for r in rs if r["clients"] == c}} for c in levels]


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


__all__ = ["ServerProcess", "check_llama_slots", "client", "level_stats", "llama_server", "llama_server_argv",
           "muser_server",
           "one_request", "read_stream", "request_body", "run_level", "side_by_side"]
