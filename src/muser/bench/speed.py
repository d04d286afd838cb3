"""Speed cells shared by `muser bench decode|prefill|verify` (DESIGN.md
"Measurement protocol").

Definitions follow llama-bench (tools/llama-bench/llama-bench.cpp of the pinned llama.cpp), so a
ratio compares like with like:

* depth d: the KV holds d tokens before the measured ones. The depth is filled once per side
  (random ids, not timed) and every repetition starts from that state again (Muser: a session
  checkpoint rolled back; llama.cpp: llama_memory_clear + llama_state_seq_set_data, as
  llama-bench's cstate does).
* decode (tg N @ d): N single-token forwards, each with its logits, timed together; tok/s = N / s.
  Beside it, `muser generate`'s own loop over the same N positions (generate tok/s: the
  decode_row call, the sampler chain at llama.cpp's defaults over the candidates read back, the
  emitter) and its ratio to the engine's figure (DESIGN.md target: >= 95%).
* prefill (pp N @ d): one prompt of N ids in batches of n_batch 2048 / n_ubatch 512 (llama-bench
  defaults; Muser's prefill chunk is 512 rows, book 10.10); tok/s = N / s.
* TTFT (beside decode, at the first depth): a new request's time to its first token, the way
  `muser generate` serves one after load: a fresh session, a 16-token prompt (seeded ids of its
  own) prefilled with its last row's logits, and the first token sampled by llama.cpp's
  default chain (seed 0); DESIGN.md target on CUDA: <= 50 ms on the full geometry.
* verify (N rows @ d): one forward of N <= 16 rows with every row's logits (the speculative
  verify shape, book 10.1) against one single-row decode at the same depth; the figure is the
  time ratio verify / decode (DESIGN.md target: <= 1.3 on CUDA).

Ids are drawn from one seeded generator, identical for both sides. Cells run A B A B: each
repetition times Muser, then llama.cpp, so drift hits both alike. Achieved GB/s for decode is
(weight bytes one decoded token streams, ModelFile.weight_bytes_per_token, + the K/V bytes the
attention reads at that position, MuseConfig.kv_bytes) x tok/s; on CUDA the run also measures
the device copy bandwidth (a 1 GiB torch copy, read + write) and reports the fraction.

Gate: before any timing the engine's exactness gate runs on the same model, device and KV type
(Gate 2, muser.gates.gate2: the exact lane teacher-forced against the oracle's f32
arithmetic over a prompt crossing the window and --gate-tokens greedy tokens). A fast-lane run
is gated as the fast (integer) lane against the oracle's ggml-cpu arithmetic, same judge and
floors, and reports its drift from the f32 oracle beside it; a w4a4 run is gated by the exact
lane on the same loaded weights. A run
whose gate fails still writes its receipt, marked "not a result", and exits non-zero.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import hashlib
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

from ..cores import default_threads
from ..errors import ComparatorError, ContextOverflow, LaneError, MuserError
from .receipt import Cell

KINDS = ("decode", "prefill", "verify")
MAX_VERIFY = 16  # engine.session.MAX_VERIFY, the speculative verify width (book 10.1)
DEFAULT_TOKENS = {"decode": 128, "prefill": 512, "verify": MAX_VERIFY}  # tg128, pp512, 16 rows
AGAINST = ("llama.cpp",)
LLAMA_N_BATCH = 2048  # llama-bench cmd_params_defaults n_batch
LLAMA_N_UBATCH = 512  # llama-bench cmd_params_defaults n_ubatch
GGML_TYPE = {"f32": 0, "f16": 1}  # ggml.h enum ggml_type
KV_ELEM_BYTES = {"f32": 4, "f16": 2}
VERIFY_TARGET = 1.3  # DESIGN.md target: a 16-row verify forward <= 1.3x the one-row decode time (CUDA)
COPY_BYTES = 1 << 30  # device copy bandwidth probe: a 1 GiB buffer
DEVICE_SCRIPT = "device-llama-bench.sh"
LLAMA_TARBALL = "llama.cpp-src.tgz"


def _tuning_identity() -> dict | None:
    """The CUDA tiling tables this process runs (speed only, never values): each one's file, its
    entries and the SHA-256 of its bytes (the exact lane's matvec table; `i8` the integer lane's
    routes), so a receipt names the tables it was measured under."""
    try:
        from ..engine.kernels import qmatvec_v3, qtile_i8
    except ImportError:
        return None
    out: dict = {}
    for key, mod in (("v3", qmatvec_v3), ("i8", qtile_i8)):
        path = Path(mod.TUNING_FILE)
        if path.is_file():
            out[key] = {"file": f"src/muser/engine/kernels/{path.name}", "entries": len(mod.TUNED),
                        "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    if "v3" in out:  # the exact lane's table at the top level, as receipts have always named it
        out.update(out.pop("v3"))
    return out or None


# --- flags ------------------------------------------------------------------------------------

def register_kind(sub: argparse._SubParsersAction, kind: str, help: str, doc: str) -> None:
    p = sub.add_parser(kind, help=help, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    tok_help = {"decode": "tokens generated per repetition (default 128, like tg128)",
                "prefill": "prompt length (default 512, like pp512)",
                "verify": "rows of the verify forward, 1..16 (default 16)"}[kind]
    p.add_argument("--model", default=None, help="GGUF (default: the embedded default model)")
    p.add_argument("--device", default="cpu", help="cpu | cuda (default cpu)")
    p.add_argument("--lane", default="exact",
                   help="exact: f32 activations, exact weight decode (Gate 2 vs oracle f32); fast: ggml-cpu's "
                        "integer arithmetic on every call (activations to Q8_K/Q8_0, integer block sums; Gate 2 "
                        "vs oracle ggml-cpu); w4a4; split (cuda): the exact lane's contract through the split-activation "
                        "integer GEMM, row-invariant at every row count (default exact)")
    p.add_argument("--kv", default="f16", help="KV element type on both sides: f16 | f32 (default f16, "
                                               "llama-bench's default)")
    p.add_argument("--depths", default="0", help="comma-separated KV depths before the measured tokens "
                                                 "(default 0), e.g. 0,8192,32768")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS[kind], help=tok_help)
    p.add_argument("--reps", type=int, default=5, help="counted repetitions per cell (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up repetitions per cell (default 1)")
    p.add_argument("--against", default=None, help="comparator run side by side: llama.cpp")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for both sides (default: the cores this process may use)")
    p.add_argument("--gate-tokens", type=int, default=32, help="greedy tokens the exactness gate compares "
                                                                "(default 32)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random ids (default 0)")
    p.add_argument("--gate-receipt", default=None, metavar="RECEIPT",
                   help="gate by a full-width reduced-depth Gate 2 receipt (tools/device_gate_wide.py) of this "
                        "tree, device, KV type, widths and dtype mix instead of running the oracle on this model "
                        "(the full geometry's f32 oracle does not fit in memory); the receipt's gate then reads "
                        "n/a, gated_by that receipt")
    p.add_argument("--llama-bench-json", default=None,
                   help="CUDA: llama-bench JSON output produced earlier in the same device session "
                        "(read instead of running llama-bench)")
    p.add_argument("--llama-tarball", default=None,
                   help=f"CUDA: the pinned llama.cpp source tarball ({LLAMA_TARBALL}, made by pack-llama-src.sh)")
    p.add_argument("--llama-bench-script", default=None,
                   help=f"CUDA: the script that builds and runs llama-bench on that tarball ({DEVICE_SCRIPT})")
    p.add_argument("--out-dir", default=None, help="receipt directory (default: the per-user cache, muser.api.cache_dir()/receipts; give bench/receipts for the project's evidence)")
    if kind in ("decode", "prefill"):  # tok/s against depth (muser.bench.plot.plot_speed)
        from .plot import add_plot_flag

        add_plot_flag(p)
    p.set_defaults(func=lambda a, _k=kind: run(a, _k))


def parse_depths(text: str) -> list[int]:
    out: list[int] = []
    for part in str(text).split(","):
        part = part.strip()
        try:
            d = int(part)
        except ValueError:
            raise MuserError(f"--depths {text!r}: {part!r} is not an integer") from None
        if d < 0:
            raise MuserError(f"--depths {text!r}: depth {d} is negative")
        if d not in out:
            out.append(d)
    return out


def check_flags(args: argparse.Namespace, kind: str) -> dict:
    """Every refusal that needs no model: typed, one line, before any work."""
    from ..engine.lanes import DEVICES, Lane, parse_kv

    Lane.parse(args.lane)
    parse_kv(args.kv)
    if args.device not in DEVICES:
        raise LaneError(f"unknown device {args.device!r} (expected 'cpu' or 'cuda')")
    if args.against is not None and args.against not in AGAINST:
        raise ComparatorError(f"--against {args.against!r}: the comparator is one of {', '.join(AGAINST)}")
    if args.reps < 1:
        raise MuserError(f"--reps must be >= 1, got {args.reps}")
    if args.warmup < 0:
        raise MuserError(f"--warmup must be >= 0, got {args.warmup}")
    if args.tokens < 1:
        raise MuserError(f"--tokens must be >= 1, got {args.tokens}")
    if kind == "verify" and args.tokens > MAX_VERIFY:
        raise LaneError(f"--tokens {args.tokens}: the verify shape serves 1..{MAX_VERIFY} rows")
    if args.gate_tokens < 1:
        raise MuserError(f"--gate-tokens must be >= 1, got {args.gate_tokens}")
    if args.gate_receipt is not None and not Path(args.gate_receipt).is_file():
        raise MuserError(f"--gate-receipt {args.gate_receipt!r} is not a file")
    threads = default_threads() if args.threads is None else args.threads
    if threads < 1:
        raise MuserError(f"--threads must be >= 1, got {threads}")
    if args.llama_bench_json is not None:
        if args.device != "cuda" or args.against != "llama.cpp":
            raise ComparatorError("--llama-bench-json is read only with --device cuda --against llama.cpp")
        if not Path(args.llama_bench_json).is_file():
            raise ComparatorError(f"--llama-bench-json {args.llama_bench_json!r} is not a file")
    return {"depths": parse_depths(args.depths), "threads": threads}


def check_context(cfg, kind: str, depths: list[int], tokens: int) -> None:
    """A depth at or past the model's context, or one that leaves no room for the measured
    tokens, is refused before anything is loaded."""
    n_ctx = cfg.context_length
    for d in depths:
        if d >= n_ctx:
            raise ContextOverflow(f"--depths: depth {d} is >= the model's context_length {n_ctx}")
        if d + tokens > n_ctx:
            raise ContextOverflow(f"depth {d} + {tokens} {kind} tokens = {d + tokens} runs past the model's "
                                  f"context_length {n_ctx}")


# --- byte model -------------------------------------------------------------------------------


def kv_bytes_read(cfg, depth: int, n: int, kv: str) -> int:
    """K/V bytes the attention reads over n decoded tokens starting at position `depth`: the
    token at position p attends over p + 1 rows (its own included) in every layer, clipped to
    the window on sliding layers (MuseConfig.kv_bytes, book 9.7)."""
    e = KV_ELEM_BYTES[kv]
    return sum(cfg.kv_bytes(p + 1, e) for p in range(depth, depth + n))


# --- timing -----------------------------------------------------------------------------------


def interleave(cells: dict[str, Callable[[], float]], reps: int, warmup: int) -> dict[str, Cell]:
    """Like receipt.run_interleaved, but each callable resets its own state untimed and returns
    the seconds of its timed part (the depth restore is not part of a sample)."""
    out = {k: Cell(k) for k in cells}
    for _ in range(warmup):
        for k, fn in cells.items():
            out[k].warmup.append(float(fn()))
    for _ in range(reps):
        for k, fn in cells.items():
            out[k].samples.append(float(fn()))
    return out


def rate_stats(per_rep: list[float]) -> dict:
    """Mean and coefficient of variation of per-repetition rates (llama-bench avg_ts / stddev_ts)."""
    mean = statistics.fmean(per_rep)
    cv = statistics.stdev(per_rep) / mean if len(per_rep) > 1 and mean else 0.0
    return {"samples": per_rep, "mean": mean, "cv": cv}


def copy_bandwidth(device, reps: int = 10) -> dict:
    """Device copy bandwidth: a 1 GiB buffer copied `reps` times, GB/s counting read + write."""
    import torch

    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    torch.cuda.synchronize(device)
    samples = []
    for _ in range(reps):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        dst.copy_(src)
        t1.record()
        t1.synchronize()
        samples.append(2 * COPY_BYTES / (t0.elapsed_time(t1) * 1e-3) / 1e9)
    del src, dst
    torch.cuda.empty_cache()
    return {"buffer_bytes": COPY_BYTES, "gbps_samples": samples, "gbps_mean": statistics.fmean(samples),
            "gbps_max": max(samples), "rule": "torch copy of a 1 GiB uint8 buffer, (read + write) bytes / s"}


# --- Muser side -------------------------------------------------------------------------------


class MuserCells:
    """One session at one depth; each cell rolls back to the depth checkpoint, then times."""

    def __init__(self, model, depth_ids: np.ndarray, work_ids: np.ndarray, block: int):
        n_ctx = len(depth_ids) + block
        self.model = model
        self.s = model.session(max_context=n_ctx)
        if len(depth_ids):
            self.s.prefill(depth_ids)  # [d] ids, not timed
        self.cp = self.s.checkpoint(block=block)
        self.ids = work_ids

    def _reset(self) -> None:
        self.s.rollback(self.cp)

    def decode(self) -> float:
        self._reset()
        s, ids = self.s, self.ids
        t0 = time.perf_counter()
        for t in ids:
            s.decode(int(t))  # float32 [vocab] on the host: the forward has finished
        return time.perf_counter() - t0

    def prefill(self) -> float:
        self._reset()
        t0 = time.perf_counter()
        self.s.prefill(self.ids)
        return time.perf_counter() - t0

    def verify(self) -> float:
        self._reset()
        t0 = time.perf_counter()
        self.s.verify(self.ids)  # [N, vocab]
        return time.perf_counter() - t0

    def decode1(self) -> float:
        self._reset()
        t0 = time.perf_counter()
        self.s.decode(int(self.ids[0]))
        return time.perf_counter() - t0

    def ttft(self, prompt_ids: np.ndarray) -> float:
        """A new request's time to first token: a fresh session (one a request, as `muser generate`
        and the server open them: its prompt step is not a recorded graph yet), `prompt_ids`
        prefilled with the last row's logits, and the first token sampled by llama.cpp's default
        chain (seed 0) on the host."""
        from ..generation import generate
        from ..sample import SamplingParams

        ids = [int(t) for t in prompt_ids]
        s = self.model.session(max_context=len(ids) + 1)
        t0 = time.perf_counter()
        g = generate(s, self.model.tokenizer, ids, SamplingParams(seed=0), max_tokens=1, t_start=t0)
        next(g)  # the first token: sampled from candidates read back to the host
        dt = time.perf_counter() - t0
        del g, s
        return dt

    def generate(self) -> float:
        """N tokens the way `muser generate` makes them after its first: the generation loop's
        decode (decode_row: the row stays on the device on CUDA), llama.cpp's default sampler
        chain (seed 0) over the candidates read back, the emitter's detokenizing; end-of-
        generation tokens are banned so every repetition makes N tokens."""
        from ..generation import emitter, row_calls
        from ..sample import SamplingParams

        self._reset()
        tok = self.model.tokenizer
        ban = {int(t): float("-inf") for t in tok.eog_ids}
        em = emitter(tok, [int(self.ids[0])], SamplingParams(seed=0, logit_bias=ban), max_tokens=len(self.ids) + 1)
        _, decode = row_calls(self.s)
        t = int(self.ids[0])
        t0 = time.perf_counter()
        for _ in range(len(self.ids)):
            t = em.step(decode(t)).token
        return time.perf_counter() - t0


# --- llama.cpp on the CPU (llama-cpp-python's low-level API) -----------------------------------


class LlamaCpuCells:
    """The pinned llama.cpp through llama_decode with an explicit batch, llama-bench's context
    settings (n_batch 2048, n_ubatch 512, flash attention auto, swa_full off) and n_threads."""

    def __init__(self, path, n_ctx: int, kv: str, threads: int):
        from .llamacpp import _llama_cpp

        lc = self.lc = _llama_cpp()
        from llama_cpp._logger import set_verbose

        set_verbose(False)  # errors only, like Llama(verbose=False)
        lc.llama_backend_init()
        mp = lc.llama_model_default_params()
        mp.n_gpu_layers = 0
        self.model = lc.llama_model_load_from_file(str(path).encode(), mp)
        if not self.model:
            raise ComparatorError(f"llama.cpp could not load {str(path)!r}")
        cp = lc.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = LLAMA_N_BATCH
        cp.n_ubatch = LLAMA_N_UBATCH
        cp.n_seq_max = 1
        cp.n_threads = cp.n_threads_batch = threads
        cp.type_k = cp.type_v = GGML_TYPE[kv]
        cp.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_AUTO
        cp.swa_full = False
        cp.no_perf = True
        self.ctx = lc.llama_init_from_model(self.model, cp)
        if not self.ctx:
            lc.llama_model_free(self.model)
            raise ComparatorError(f"llama.cpp could not create a context of {n_ctx} for {str(path)!r}")
        lc.llama_set_n_threads(self.ctx, threads, threads)
        self.n_vocab = int(lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model)))
        self.settings = {"comparator": "llama-cpp-python==0.3.36 (llama_decode, low-level API)",
                         "n_ctx": n_ctx, "n_batch": LLAMA_N_BATCH, "n_ubatch": LLAMA_N_UBATCH,
                         "n_threads": threads, "type_k": GGML_TYPE[kv], "type_v": GGML_TYPE[kv],
                         "flash_attn_type": "auto", "swa_full": False, "n_gpu_layers": 0}
        cap = LLAMA_N_BATCH
        self.batch = lc.llama_batch_init(cap, 0, 1)
        b = self.batch
        self._tok = np.ctypeslib.as_array(b.token, shape=(cap,))
        self._pos = np.ctypeslib.as_array(b.pos, shape=(cap,))
        self._nseq = np.ctypeslib.as_array(b.n_seq_id, shape=(cap,))
        self._logits = np.ctypeslib.as_array(b.logits, shape=(cap,))
        self._nseq[:] = 1
        for i in range(cap):
            b.seq_id[i][0] = 0
        self.state: ctypes.Array | None = None
        self.depth = 0

    def _decode(self, ids: np.ndarray, pos0: int, all_logits: bool) -> None:
        """One llama_decode of len(ids) <= n_batch tokens at positions pos0.. (seq 0)."""
        n = len(ids)
        self._tok[:n] = ids
        self._pos[:n] = np.arange(pos0, pos0 + n)
        self._logits[:n] = 1 if all_logits else 0
        self._logits[n - 1] = 1
        self.batch.n_tokens = n
        rc = self.lc.llama_decode(self.ctx, self.batch)
        if rc != 0:
            raise ComparatorError(f"llama_decode returned {rc} at position {pos0} ({n} tokens)")
        self.lc.llama_synchronize(self.ctx)

    def _prompt(self, ids: np.ndarray, pos0: int) -> None:
        """llama-bench test_prompt: batches of n_batch, last token's logits."""
        for c0 in range(0, len(ids), LLAMA_N_BATCH):
            self._decode(ids[c0:c0 + LLAMA_N_BATCH], pos0 + c0, False)

    def set_depth(self, depth_ids: np.ndarray) -> None:
        """Fill the depth once and keep the sequence state (llama-bench's cstate)."""
        lc = self.lc
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), False)
        self.depth = len(depth_ids)
        self.state = None
        if self.depth:
            self._prompt(depth_ids, 0)
            size = lc.llama_state_seq_get_size(self.ctx, 0)
            buf = (ctypes.c_uint8 * size)()
            got = lc.llama_state_seq_get_data(self.ctx, buf, size, 0)
            if got != size:
                raise ComparatorError(f"llama_state_seq_get_data wrote {got} of {size} bytes")
            self.state = buf

    def _reset(self) -> None:
        lc = self.lc
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), False)
        if self.state is not None:
            if lc.llama_state_seq_set_data(self.ctx, self.state, len(self.state), 0) == 0:
                raise ComparatorError(f"llama_state_seq_set_data refused the depth-{self.depth} state")

    def decode(self, ids: np.ndarray) -> float:
        self._reset()
        t0 = time.perf_counter()
        for i, t in enumerate(ids):
            self._decode(ids[i:i + 1], self.depth + i, True)  # llama-bench test_gen
        return time.perf_counter() - t0

    def prefill(self, ids: np.ndarray) -> float:
        self._reset()
        t0 = time.perf_counter()
        self._prompt(ids, self.depth)
        return time.perf_counter() - t0

    def verify(self, ids: np.ndarray) -> float:
        self._reset()
        t0 = time.perf_counter()
        self._decode(ids, self.depth, True)  # one batch, every row's logits
        return time.perf_counter() - t0

    def decode1(self, ids: np.ndarray) -> float:
        self._reset()
        t0 = time.perf_counter()
        self._decode(ids[:1], self.depth, True)
        return time.perf_counter() - t0

    def close(self) -> None:
        lc = self.lc
        if getattr(self, "batch", None) is not None:
            lc.llama_batch_free(self.batch)
            self.batch = None
        if getattr(self, "ctx", None):
            lc.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            lc.llama_model_free(self.model)
            self.model = None


# --- llama.cpp on CUDA (llama-bench through the device script) ---------------------------------


def given_file(value: str | None, flag: str, what: str) -> Path:
    """A comparator input named on the command line (never looked up in the checkout)."""
    if not value:
        raise ComparatorError(f"the CUDA llama.cpp comparator needs {flag} ({what})")
    if not Path(value).is_file():
        raise ComparatorError(f"{flag} {value!r} is not a file")
    return Path(value)


def bench_tests(kind: str, n: int) -> list[tuple[int, int]]:
    """The llama-bench tests (n_prompt, n_gen) standing for a kind: tg N, pp N, or pp N + tg 1
    for verify (llama-bench has no all-rows-logits shape; its pp N computes the last row's)."""
    return {"decode": [(0, n)], "prefill": [(n, 0)], "verify": [(n, 0), (0, 1)]}[kind]


def pick_bench_samples(records: list[dict], n_prompt: int, n_gen: int, depth: int, model_path) -> list[float]:
    """Seconds per repetition of one llama-bench test from its JSON output (samples_ns)."""
    name = Path(model_path).name
    hits = [r for r in records if int(r.get("n_prompt", -1)) == n_prompt and int(r.get("n_gen", -1)) == n_gen
            and int(r.get("n_depth", 0)) == depth]
    if not hits:
        raise ComparatorError(f"llama-bench output has no test with n_prompt {n_prompt}, n_gen {n_gen}, "
                              f"n_depth {depth}")
    for r in hits:
        got = Path(str(r.get("model_filename", ""))).name
        if got != name:
            raise ComparatorError(f"llama-bench output measured {got!r}, this run measures {name!r}")
    return [ns / 1e9 for r in hits for ns in r["samples_ns"]]


def load_bench_json(path) -> list[dict]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ComparatorError(f"--llama-bench-json {str(path)!r} is not llama-bench JSON output ({e})") from None
    if not isinstance(data, list) or not all(isinstance(r, dict) and "samples_ns" in r for r in data):
        raise ComparatorError(f"--llama-bench-json {str(path)!r} is not a list of llama-bench tests")
    return data


class LlamaBenchCuda:
    """One llama-bench run per repetition (-r 1), interleaved with Muser's repetitions."""

    def __init__(self, model_path, kv: str, tarball: str | None, script: str | None):
        self.script = given_file(script, "--llama-bench-script", DEVICE_SCRIPT)
        self.tarball = given_file(tarball, "--llama-tarball", LLAMA_TARBALL)
        self.model_path = Path(model_path)
        self.kv = kv
        self.runs: list[dict] = []
        if shutil.which("bash") is None:
            raise ComparatorError("bash is needed to run the device llama-bench script")

    def run(self, n_prompt: int, n_gen: int, depth: int) -> list[dict]:
        cmd = ["bash", str(self.script), str(self.tarball), str(self.model_path), "-p", str(n_prompt),
               "-n", str(n_gen), "-d", str(depth), "-r", "1", "-ctk", self.kv, "-ctv", self.kv]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["?"]
            raise ComparatorError(f"llama-bench failed (exit {p.returncode}): {tail[0]}")
        try:
            recs = json.loads(p.stdout[p.stdout.index("["):])
        except ValueError as e:
            raise ComparatorError(f"llama-bench printed no JSON ({e})") from None
        self.runs.append({"cmd": cmd[1:], "records": recs})
        return recs

    def cell(self, kind: str, n: int, depth: int) -> dict[str, Callable[[], float]]:
        """Cell callables; verify's two tests come from one llama-bench call (pp N, tg 1)."""
        tests = bench_tests(kind, n)
        n_prompt = max(t[0] for t in tests)
        n_gen = max(t[1] for t in tests)
        box: dict = {}

        def first() -> float:
            box["recs"] = self.run(n_prompt, n_gen, depth)
            np_, ng = tests[0]
            return pick_bench_samples(box["recs"], np_, ng, depth, self.model_path)[0]

        if len(tests) == 1:
            return {"main": first}

        def second() -> float:
            np_, ng = tests[1]
            return pick_bench_samples(box.pop("recs"), np_, ng, depth, self.model_path)[0]

        return {"verify": first, "decode1": second}


# --- gate -------------------------------------------------------------------------------------


def exact_view(engine):
    """The exact lane over an engine's already-loaded weights (for gating a w4a4-lane run)."""
    from ..engine.forward import Forward
    from ..engine.lanes import Lane

    ex = copy.copy(engine)
    ex.lane = Lane.EXACT
    ex.forward = Forward(engine.cfg, engine.weights, Lane.EXACT, engine.device)
    ex.forward.ensure_positions(engine.cfg.context_length)
    return ex


def run_gate(model, path, lane: str, kv: str, n_gen: int) -> dict:
    """Gate 2 (muser.gates.gate2) on this model, device and KV type; see the module doc."""
    from .. import oracle as oracle_mod
    from ..gates import default_prompt, gate2

    cfg = model.config
    prompt = default_prompt(cfg)
    room = cfg.context_length - n_gen - 1
    if room < 1:
        raise ContextOverflow(f"--gate-tokens {n_gen} leaves no room for a prompt in context {cfg.context_length}")
    prompt = prompt[:room]
    from ..gates import GATE_ARITHMETIC

    gated = lane if lane in GATE_ARITHMETIC else "exact"  # w4a4: its exact-lane view is gated
    arith = GATE_ARITHMETIC[gated]
    t0 = time.perf_counter()
    o = oracle_mod.load(path, arithmetic=arith, kv=kv)
    try:
        engine = model.engine if lane == gated else exact_view(model.engine)
        r = gate2(path, engine, o, kv, n_gen=n_gen, prompt=prompt, noise="if_needed")
    finally:
        o.close()
    gate = {"status": r["status"], "name": f"Gate 2 (engine {gated} lane vs oracle {arith}, same KV type)",
            "rule": ("f32 K/V: max |d log-softmax| <= max(1e-4, 2 x noise floor), median <= max(1e-5, 2 x noise "
                     "median), identical greedy tokens" if kv == "f32" else
                     "f16 K/V: max <= 2 x noise floor, median <= 2 x noise median, top-1 >= 1 - 2 x noise disagreement"),
            "lane_gated": gated, "seconds": round(time.perf_counter() - t0, 2)}
    gate.update({k: r[k] for k in ("kv", "prompt_tokens", "greedy_tokens", "max_dlsm", "median_dlsm",
                                   "noise_floor", "noise_floor_parts", "bound", "median_bound", "top1_agreement",
                                   "top1_bound", "checks", "tokens_identical", "token_agreement",
                                   "first_token_mismatch", "dtype_mix")})
    if lane == "fast":
        # beside the gate: the integer lane's drift from the f32 oracle (what it gives up vs exact)
        ids = np.asarray(prompt, dtype=np.int64)
        from ..oracle.numerics import log_softmax

        o32 = oracle_mod.load(path, arithmetic="f32", kv=kv)
        try:
            a = o32.logits(prompt, "prefill")
        finally:
            o32.close()
        b = model.session(max_context=len(ids)).prefill(ids, all_logits=True)
        d = np.abs(log_softmax(a) - log_softmax(b)).max(-1)  # [rows]
        gate["fast_lane_drift"] = {"what": "fast lane vs oracle f32, prefill of the gate prompt, every row",
                                   "max_dlsm": float(d.max()), "median_dlsm": float(np.median(d)),
                                   "argmax_agreement": float(np.mean(a.argmax(-1) == b.argmax(-1)))}
    return gate


WIDE_GATE_KIND = "engine-gate2-wide"  # tools/device_gate_wide.py: kind engine-gate2-wide-<device>
WIDTH_KEYS = ("hidden", "ffn", "n_heads", "n_kv_heads", "head_dim", "vocab")


def model_widths(cfg) -> dict:
    return {"hidden": cfg.hidden, "ffn": cfg.ffn, "n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads,
            "head_dim": cfg.head_dim, "vocab": cfg.vocab}


def gate_from_receipt(path, model, device: str, kv: str, lane: str = "exact") -> dict:
    """The gate of a run gated by a full-width reduced-depth Gate 2 receipt. Refused (typed, before
    any timing) unless the receipt is one the writer produced, of this tree (git SHA), device kind,
    lane and KV type, with this model's widths and dtype mix; its verdict is not copied: this run's
    gate reads n/a, gated_by the receipt, and the figures are a result only if that receipt passed."""
    from .receipt import git_sha, verify_receipt

    p = Path(path)
    why = verify_receipt(p)
    if why:
        raise MuserError(f"--gate-receipt {str(p)!r} is not a receipt of the writer: {why[0]}")
    body = json.loads(p.read_text())
    want_kind = f"{WIDE_GATE_KIND}-{device}"
    if body["kind"] != want_kind:
        raise MuserError(f"--gate-receipt {p.name!r} is a {body['kind']!r} receipt, not {want_kind!r}")
    sha = git_sha()
    if body["git_sha"] != sha:
        raise MuserError(f"--gate-receipt {p.name!r} gated tree {body['git_sha']}, this run is {sha}")
    if body.get("lane") != lane:
        raise MuserError(f"--gate-receipt {p.name!r} gated lane {body.get('lane')!r}, this run is lane {lane!r}")
    fx = body.get("model") or {}
    widths = model_widths(model.config)
    got = {k: fx.get(k) for k in WIDTH_KEYS}
    if got != widths:
        raise MuserError(f"--gate-receipt {p.name!r} gated widths {got}, this model has {widths}")
    mix = sorted(set(model.engine.model_file.contract.dtypes.values()))
    if sorted(fx.get("dtypes") or ()) != mix:
        raise MuserError(f"--gate-receipt {p.name!r} gated dtypes {fx.get('dtypes')}, this model has {mix}")
    rows = [r for r in body["gate"].get("rows") or () if r.get("kv") == kv]
    if not rows:
        raise MuserError(f"--gate-receipt {p.name!r} has no Gate 2 row for KV type {kv!r}")
    row = rows[0]
    against = "oracle ggml-cpu" if lane == "fast" else "oracle f32"
    return {"status": "n/a", "name": f"Gate 2 at full width, reduced depth (engine {lane} lane vs {against})",
            "gated_by": p.name, "gated_by_digest": body["digest"], "gated_by_status": row.get("status"),
            "gated_by_row": row, "gated_by_fixture": fx, "lane_gated": lane}


# --- the run ----------------------------------------------------------------------------------


def model_json(m) -> dict:
    mf = m.engine.model_file
    return {"path": str(m.path), "identity": m.identity.to_json(),
            "dtypes": sorted(set(mf.contract.dtypes.values())),
            "weight_bytes_per_token": mf.weight_bytes_per_token(),
            "context_length": m.config.context_length}


def canonical_command(args: argparse.Namespace, kind: str, model_path, depths, threads) -> list[str]:
    cmd = ["muser", "bench", kind, "--model", str(model_path), "--device", args.device, "--lane", args.lane,
           "--kv", args.kv, "--depths", ",".join(map(str, depths)), "--tokens", str(args.tokens),
           "--reps", str(args.reps), "--warmup", str(args.warmup), "--threads", str(threads),
           "--gate-tokens", str(args.gate_tokens), "--seed", str(args.seed)]
    if args.against:
        cmd += ["--against", args.against]
    if args.llama_bench_json:
        cmd += ["--llama-bench-json", str(args.llama_bench_json)]
    if args.gate_receipt:
        cmd += ["--gate-receipt", str(args.gate_receipt)]
    return cmd


def _ids(rng: np.random.Generator, vocab: int, n: int) -> np.ndarray:
    return rng.integers(0, vocab, size=n, dtype=np.int64)  # [n], llama-bench: std::rand() % n_vocab


def run(args: argparse.Namespace, kind: str) -> int:
    from .. import api
    from ..engine.session import PREFILL_CHUNK
    from ..model.loader import open_model
    from .receipt import device_description, write_receipt

    flags = check_flags(args, kind)
    if kind in ("decode", "prefill"):
        from .plot import check_plot_flag

        check_plot_flag(args)
    depths, threads = flags["depths"], flags["threads"]
    n = args.tokens
    path = Path(args.model) if args.model else api.default_model_path()
    mf = open_model(path)  # metadata and contract only: the context check before any weight moves
    try:
        check_context(mf.config, kind, depths, n)
    finally:
        mf.close()
    cuda = args.device == "cuda"
    # The comparator's pieces are found (or refused) before any work too.
    bench_json = load_bench_json(args.llama_bench_json) if args.llama_bench_json else None
    if bench_json is not None:
        for d in depths:
            for np_, ng in bench_tests(kind, n):
                pick_bench_samples(bench_json, np_, ng, d, path)
    llama = None
    if args.against and cuda and bench_json is None:
        llama = LlamaBenchCuda(path, args.kv, args.llama_tarball, args.llama_bench_script)
    elif args.against and not cuda:
        from .llamacpp import _llama_cpp

        _llama_cpp()
    if not cuda:
        import torch

        torch.set_num_threads(threads)

    t_start = time.perf_counter()
    m = api.load(path if args.model else None, device=args.device, lane=args.lane, kv=args.kv)
    try:
        cfg = m.config
        if args.gate_receipt:
            gate = gate_from_receipt(args.gate_receipt, m, args.device, args.kv, args.lane)
            print(f"gate: by {gate['gated_by']} ({gate['gated_by_status']})", file=sys.stderr, flush=True)
        else:
            gate = run_gate(m, path, args.lane, args.kv, args.gate_tokens)
            print(f"gate: {gate['status']} (max |d log-softmax| {gate['max_dlsm']:.3e}, bound {gate['bound']:.3e}, "
                  f"{gate['greedy_tokens']} greedy tokens identical: {gate['tokens_identical']})",
                  file=sys.stderr, flush=True)
        copy_bw = copy_bandwidth(m.engine.device) if cuda else None
        if args.against and not cuda:
            llama = LlamaCpuCells(path, max(depths) + n, args.kv, threads)
            if llama.n_vocab != cfg.vocab:
                raise ComparatorError(f"llama.cpp sees vocab {llama.n_vocab}, Muser {cfg.vocab}")
        rng = np.random.default_rng(args.seed)
        cells: dict[str, Cell] = {}
        per_depth: dict[str, dict] = {}
        for d in depths:
            depth_ids, work_ids = _ids(rng, cfg.vocab, d), _ids(rng, cfg.vocab, n)
            mc = MuserCells(m, depth_ids, work_ids, block=n)
            fns: dict[str, Callable[[], float]] = {}
            if kind == "verify":
                fns[f"muser verify d{d}"] = mc.verify
                fns[f"muser decode1 d{d}"] = mc.decode1
            else:
                fns[f"muser d{d}"] = getattr(mc, kind)
            if kind == "decode":
                fns[f"muser generate d{d}"] = mc.generate
                if d == depths[0]:  # its own ids, so the other cells' draws stay as they were
                    tids = _ids(np.random.default_rng(args.seed + 1), cfg.vocab, TTFT_PROMPT)
                    fns[f"muser ttft{TTFT_PROMPT}"] = lambda t=tids, c=mc: c.ttft(t)
            if isinstance(llama, LlamaCpuCells):
                llama.set_depth(depth_ids)
                if kind == "verify":
                    fns[f"llama.cpp verify d{d}"] = lambda w=work_ids: llama.verify(w)
                    fns[f"llama.cpp decode1 d{d}"] = lambda w=work_ids: llama.decode1(w)
                else:
                    fns[f"llama.cpp d{d}"] = lambda f=getattr(llama, kind), w=work_ids: f(w)
            elif isinstance(llama, LlamaBenchCuda):
                for sub, fn in llama.cell(kind, n, d).items():
                    fns[f"llama.cpp d{d}" if sub == "main" else f"llama.cpp {sub} d{d}"] = fn
            got = interleave(fns, args.reps, args.warmup)
            if bench_json is not None:  # read, not run: not interleaved (recorded as such)
                tests = bench_tests(kind, n)
                names = [f"llama.cpp d{d}"] if kind != "verify" else [f"llama.cpp verify d{d}",
                                                                      f"llama.cpp decode1 d{d}"]
                for name, (np_, ng) in zip(names, tests):
                    got[name] = Cell(name, samples=pick_bench_samples(bench_json, np_, ng, d, path))
            cells.update(got)
            per_depth[str(d)] = summarize(kind, got, d, n, cfg, m.engine.model_file, args.kv, copy_bw, cuda)
            del mc
            print(line_for(kind, d, per_depth[str(d)]), file=sys.stderr, flush=True)

        ok = gate["status"] == "pass" or (gate.get("gated_by") is not None and gate.get("gated_by_status") == "pass")
        results = {"status": "result" if ok else "not a result",
                   "kind": kind, "tokens": n, "depths": depths, "reps": args.reps, "warmup": args.warmup,
                   "definition": DEFINITIONS[kind], "per_depth": per_depth,
                   "wall_seconds": round(time.perf_counter() - t_start, 2)}
        if not ok:
            results["reason"] = "the exactness gate failed: these speed figures are not a result"
        if copy_bw is not None:
            results["copy_bandwidth"] = copy_bw
        extra = {"settings": {"device": args.device, "lane": args.lane, "kv": args.kv, "threads": threads,
                              "seed": args.seed, "muser_prefill_chunk": PREFILL_CHUNK,
                              "cuda_graphs": cuda, "matvec_tuning": _tuning_identity()},
                 "comparator": None, "argv": sys.argv}
        if isinstance(llama, LlamaCpuCells):
            extra["comparator"] = llama.settings | {"interleaved": True}
        elif isinstance(llama, LlamaBenchCuda):
            extra["comparator"] = {"comparator": f"llama-bench via {llama.script.name}", "interleaved": True,
                                   "tarball": str(llama.tarball), "runs": llama.runs}
        elif bench_json is not None:
            raw = Path(args.llama_bench_json).read_bytes()
            extra["comparator"] = {"comparator": "llama-bench JSON read from a file", "interleaved": False,
                                   "file": str(args.llama_bench_json),
                                   "sha256": hashlib.sha256(raw).hexdigest(), "records": bench_json}
        dev = device_description(args.device) | {"threads": threads}
        receipt = write_receipt(kind, model=model_json(m), device=dev, lane=args.lane, gate=gate,
                                results=results, cells=cells,
                                command=canonical_command(args, kind, path, depths, threads),
                                out_dir=args.out_dir, extra=extra)
    finally:
        if isinstance(llama, LlamaCpuCells):
            llama.close()
        m.close()
    verdict = "" if ok else "  [NOT A RESULT: gate failed]"
    print(f"{kind}: gate {gate['status']}{verdict}; receipt: {receipt}")
    if kind in ("decode", "prefill"):
        from .plot import plot_for_run

        plot_for_run(args, receipt)
    return 0 if ok else 1


DEFINITIONS = {
    "decode": "tg N @ d: N single-token forwards with logits after d tokens of KV; tok/s = N / seconds",
    "prefill": "pp N @ d: one N-token prompt after d tokens of KV (batches of 512 rows); tok/s = N / seconds",
    "verify": "one forward of N rows with every row's logits vs one single-row decode, both after d tokens "
              "of KV; ratio = verify seconds / decode seconds",
}


TTFT_PROMPT = 16  # prompt tokens of the TTFT cell (DESIGN.md: TTFT for a 16-token prompt)
TTFT_TARGET_S = 0.050
TTFT_DEFINITION = ("a new request's time to first token: a fresh session, a 16-token prompt prefilled with its "
                   "last row's logits, the first token sampled by llama.cpp's default chain (seed 0) on the host; "
                   "seconds per repetition")

GENERATE_DEFINITION = ("N tokens sampled and fed back as `muser generate` does after its first (decode_row, "
                       "llama.cpp's default chain, seed 0, end-of-generation tokens banned, detokenized); "
                       "tok/s = N / seconds, beside the engine's decode (the DESIGN.md target: >= 95% of it)")


def summarize(kind: str, cells: dict[str, Cell], d: int, n: int, cfg, mf, kv: str, copy_bw, cuda: bool) -> dict:
    out: dict = {}
    sides = ("muser", "llama.cpp")
    if kind in ("decode", "prefill"):
        per_tok = None
        if kind == "decode":
            wb = mf.weight_bytes_per_token()
            kvb = kv_bytes_read(cfg, d, n, kv)
            per_tok = wb + kvb / n
            out["bytes_per_token"] = {"weights": wb, "kv_read_mean": kvb / n, "total": per_tok,
                                      "rule": "GGUF weight bytes one token streams (one embedding row) + "
                                              "K/V bytes attention reads at that position"}
        for side in sides:
            c = cells.get(f"{side} d{d}")
            if c is None:
                continue
            st = rate_stats([n / s for s in c.samples]) | {"seconds_mean": c.mean}
            if per_tok is not None:
                gb = [per_tok * r / 1e9 for r in st["samples"]]
                st["achieved_gbps"] = {"samples": gb, "mean": statistics.fmean(gb)}
                if copy_bw is not None and side == "muser":
                    st["fraction_of_copy_bandwidth"] = statistics.fmean(gb) / copy_bw["gbps_mean"]
            out[side] = {"tok_s": st}
        g = cells.get(f"muser generate d{d}")
        if g is not None and "muser" in out:
            out["muser_generate"] = {"tok_s": rate_stats([n / s for s in g.samples]) | {"seconds_mean": g.mean},
                                     "definition": GENERATE_DEFINITION}
            out["ratio_generate_over_decode"] = out["muser_generate"]["tok_s"]["mean"] / out["muser"]["tok_s"]["mean"]
        f = cells.get(f"muser ttft{TTFT_PROMPT}")
        if f is not None and kind == "decode":
            out["muser_ttft"] = {"prompt_tokens": TTFT_PROMPT, "seconds": rate_stats(f.samples),
                                 "definition": TTFT_DEFINITION,
                                 "target": {"rule": f"TTFT <= {TTFT_TARGET_S * 1e3:.0f} ms (CUDA, full geometry)",
                                            "applies": cuda, "met": f.mean <= TTFT_TARGET_S}}
        if "llama.cpp" in out:
            out["ratio_muser_over_llamacpp"] = out["muser"]["tok_s"]["mean"] / out["llama.cpp"]["tok_s"]["mean"]
    else:
        for side in sides:
            v, one = cells.get(f"{side} verify d{d}"), cells.get(f"{side} decode1 d{d}")
            if v is None or one is None:
                continue
            ratios = [a / b for a, b in zip(v.samples, one.samples)] if len(v.samples) == len(one.samples) else []
            out[side] = {"verify_s": {"mean": v.mean, "cv": v.cv}, "decode1_s": {"mean": one.mean, "cv": one.cv},
                         "ratio_verify_over_decode1": v.mean / one.mean, "ratio_per_rep": ratios,
                         "verify_rows_per_s": n / v.mean}
        if "muser" in out:
            out["muser"]["target"] = {"rule": f"verify <= {VERIFY_TARGET} x decode1 (CUDA)",
                                      "applies": cuda,
                                      "met": out["muser"]["ratio_verify_over_decode1"] <= VERIFY_TARGET}
        if "llama.cpp" in out:
            out["speed_ratio_verify"] = out["llama.cpp"]["verify_s"]["mean"] / out["muser"]["verify_s"]["mean"]
            out["speed_ratio_decode1"] = out["llama.cpp"]["decode1_s"]["mean"] / out["muser"]["decode1_s"]["mean"]
    return out


def line_for(kind: str, d: int, r: dict) -> str:
    if kind in ("decode", "prefill"):
        mu = r["muser"]["tok_s"]
        s = f"{kind} d{d}: muser {mu['mean']:.2f} tok/s (cv {mu['cv']:.3f})"
        if "achieved_gbps" in mu:
            s += f" {mu['achieved_gbps']['mean']:.2f} GB/s"
        if "muser_generate" in r:
            s += (f" | generate {r['muser_generate']['tok_s']['mean']:.2f} tok/s "
                  f"({r['ratio_generate_over_decode']:.3f} of decode)")
        if "muser_ttft" in r:
            s += f" | TTFT{r['muser_ttft']['prompt_tokens']} {r['muser_ttft']['seconds']['mean'] * 1e3:.1f} ms"
        if "llama.cpp" in r:
            ll = r["llama.cpp"]["tok_s"]
            s += f" | llama.cpp {ll['mean']:.2f} tok/s (cv {ll['cv']:.3f}) | ratio {r['ratio_muser_over_llamacpp']:.3f}"
        return s
    mu = r["muser"]
    s = (f"verify d{d}: muser verify {mu['verify_s']['mean'] * 1e3:.2f} ms / decode1 "
         f"{mu['decode1_s']['mean'] * 1e3:.2f} ms = {mu['ratio_verify_over_decode1']:.3f}")
    if "llama.cpp" in r:
        ll = r["llama.cpp"]
        s += (f" | llama.cpp {ll['verify_s']['mean'] * 1e3:.2f} / {ll['decode1_s']['mean'] * 1e3:.2f} ms = "
              f"{ll['ratio_verify_over_decode1']:.3f} | speed ratio verify {r['speed_ratio_verify']:.3f}")
    return s
