"""The pinned llama.cpp's own binaries as comparators: llama-speculative-simple (DFlash drafting,
`--spec-type draft-dflash`) and llama-server. A binary is always a path named on the command line.

llama-speculative-simple (examples/speculative-simple/speculative-simple.cpp) prints the prompt and
the generated pieces on stdout and its figures on stderr (common/log.cpp: level NONE -> stdout):
  encoded / decoded N tokens in S seconds, speed: R t/s   (prompt less its last token / generation)
  n_draft, n_predict, n_drafted, n_accept, accept         (the example's own counters)
and, at verbosity >= 4, common_speculative_print_stats's line per drafter:
  statistics draft-dflash: #calls(b,g,a) = B G A, #gen drafts = .., #acc drafts = .., #gen tokens = P,
  #acc tokens = X, #mean acc len = 1 + X / A
A = accept calls = verify rounds, P = proposed tokens, X = accepted proposals. The example's
n_drafted counts a round's draft again after a checkpoint restore (a context without partial
sequence removal re-verifies only the accepted part), so the impl line is the round-exact count:
acceptance = X / P, mean accepted length = X / A (proposals per round accepted, the bonus token
excluded: the figure muser.spec.SpecSession.stats reports).
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..errors import ComparatorError

_F = r"([0-9]+(?:\.[0-9]+)?|nan|-?inf)"
_PHASE = re.compile(r"(encoded|decoded)\s+(\d+) tokens in\s+" + _F + r" seconds, speed:\s+" + _F + r" t/s")
_COUNTER = re.compile(r"^(?:.*\s)?(n_draft|n_predict|n_drafted|n_accept)\s+=\s+(-?\d+)\s*$")
_IMPL = re.compile(r"adding speculative implementation '([^']+)'")
_LIMITS = re.compile(r"- n_max=(\d+), n_min=(\d+), p_min=" + _F)
_BLOCK = re.compile(r"- block_size=(\d+), mask_token_id=(-?\d+), n_extract=(\d+)")
_STATS = re.compile(r"statistics\s+(\S+): #calls\(b,g,a\) =\s+(\d+)\s+(\d+)\s+(\d+), #gen drafts =\s+(\d+), "
                    r"#acc drafts =\s+(\d+), #gen tokens =\s+(\d+), #acc tokens =\s+(\d+)"
                    r"(?:, #mean acc len =\s+" + _F + r")?")
_CKPT = "speculative decoding will use checkpoints"
_CLAMP = "exceeds the trained block size"


def executable(path: str | os.PathLike | None, flag: str) -> Path:
    """A comparator binary named by `flag`: an existing executable file (never searched for)."""
    if not path:
        raise ComparatorError(f"{flag} PATH is required: the pinned llama.cpp binary to run")
    p = Path(path)
    if not p.is_file() or not os.access(p, os.X_OK):
        raise ComparatorError(f"{flag} {str(path)!r} is not an executable file")
    return p.resolve()


def binary_identity(path: Path) -> dict:
    """SHA-256 of the binary and what its --version prints (llama.cpp's build number and commit)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    try:
        out = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise ComparatorError(f"{path} --version failed: {e}") from e
    version = [ln.strip() for ln in (out.stdout + out.stderr).splitlines() if ln.strip().startswith("version:")]
    if out.returncode != 0 or not version:
        raise ComparatorError(f"{path} --version printed no 'version:' line (exit {out.returncode}): "
                              f"{(out.stdout + out.stderr)[-400:]!r}")
    return {"path": str(path), "sha256": h.hexdigest(), "version": version[0]}


@dataclass(frozen=True)
class SpecSampling:
    """The target's sampler for one run: greedy (temperature 0) or llama.cpp's chain at T > 0."""

    temperature: float
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int = 0

    def argv(self) -> list[str]:
        if self.temperature == 0:
            return ["--temp", "0", "--seed", str(self.seed)]
        return ["--temp", repr(self.temperature), "--top-k", str(self.top_k), "--top-p", repr(self.top_p),
                "--min-p", repr(self.min_p), "--seed", str(self.seed)]


def speculative_argv(binary: Path, target: str, draft: str, prompt: str, n_predict: int, n_draft: int,
                     ctx: int, threads: int, sampling: SpecSampling, kv: str = "f16") -> list[str]:
    """llama-speculative-simple on the CPU with the DFlash drafter; every setting spelled out.
    --no-escape: the prompt is Python source whose backslashes are text (arg.cpp processes
    escapes in -p by default); -fa off: the non-flash attention path, the one the logits
    comparator (bench.llamacpp) and Muser's exact lane mirror; -ctk/-ctv: the target's KV type, as
    Muser's --kv; -lv 4: the drafter statistics line."""
    return [str(binary), "-m", target, "-md", draft, "--spec-type", "draft-dflash",
            "--spec-draft-n-max", str(n_draft), "--spec-draft-n-min", "0", "--spec-draft-p-min", "0",
            "-p", prompt, "--no-escape", "-n", str(n_predict), "-c", str(ctx),
            "-t", str(threads), "-tb", str(threads), "-ctk", kv, "-ctv", kv, "-fa", "off", "-lv", "4",
            *sampling.argv()]


def parse_speculative(stdout: str, stderr: str, prompt: str) -> dict:
    """The figures of one llama-speculative-simple run (raises ComparatorError when one is missing)."""
    out: dict = {"checkpoints": _CKPT in stderr, "n_max_clamped": _CLAMP in stderr}
    impls = _IMPL.findall(stderr)
    if impls != ["draft-dflash"]:
        raise ComparatorError(f"llama.cpp ran speculative implementations {impls}, not ['draft-dflash']: "
                              f"{_tail(stderr)}")
    m = _BLOCK.search(stderr)
    lim = _LIMITS.search(stderr)
    if m is None or lim is None:
        raise ComparatorError(f"llama.cpp printed no DFlash block/limits line: {_tail(stderr)}")
    out["drafter"] = {"block_size": int(m[1]), "mask_token_id": int(m[2]), "n_extract": int(m[3]),
                      "n_max": int(lim[1]), "n_min": int(lim[2]), "p_min": float(lim[3])}
    phases = {k: (int(n), float(s), float(r)) for k, n, s, r in _PHASE.findall(stderr)}
    if set(phases) != {"encoded", "decoded"}:
        raise ComparatorError(f"llama.cpp printed no encode/decode timing lines: {_tail(stderr)}")
    out["prompt_eval_tokens"], out["prompt_eval_s"], _ = phases["encoded"]
    out["tokens"], out["decode_s"], out["decode_tok_s"] = phases["decoded"]
    counters = {}
    for line in stderr.splitlines():
        c = _COUNTER.match(line.strip())
        if c:
            counters[c[1]] = int(c[2])
    missing = {"n_draft", "n_predict", "n_drafted", "n_accept"} - set(counters)
    if missing:
        raise ComparatorError(f"llama.cpp printed no {sorted(missing)}: {_tail(stderr)}")
    out.update(counters)
    stats = [s for s in _STATS.findall(stderr) if s[0] == "draft-dflash"]
    if len(stats) != 1:
        raise ComparatorError(f"llama.cpp printed {len(stats)} draft-dflash statistics lines (needs -lv 4): "
                              f"{_tail(stderr)}")
    _, cb, cg, ca, gd, ad, gt, at, _mean = stats[0]
    rounds, proposals, accepted = int(ca), int(gt), int(at)
    out.update(calls_begin=int(cb), calls_draft=int(cg), rounds=rounds, gen_drafts=int(gd), acc_drafts=int(ad),
               proposals=proposals, accepted=accepted,
               acceptance_rate=accepted / proposals if proposals else None,
               mean_accepted_length=accepted / rounds if rounds else None,
               llama_mean_acc_len=float(_mean) if _mean else None)
    if out["tokens"] != out["n_predict"]:
        raise ComparatorError(f"llama.cpp decoded {out['tokens']} tokens but counted n_predict {out['n_predict']}")
    out["text"] = generated_text(stdout, prompt)
    return out


def generated_text(stdout: str, prompt: str) -> str:
    """The continuation printed after the echoed prompt: "\\n\\n" + BOS piece + prompt, then the
    generated pieces, then "\\n\\n" twice (after the loop and at exit)."""
    i = stdout.find(prompt)
    if i < 0:
        raise ComparatorError("llama.cpp's stdout does not echo the prompt it was given")
    text = stdout[i + len(prompt):]
    if not text.endswith("\n" * 4):
        raise ComparatorError("llama.cpp's stdout does not end as llama-speculative-simple ends it (\\n\\n twice)")
    return text[:-4]


def run_speculative(argv: Sequence[str], prompt: str, timeout_s: float = 600.0) -> dict:
    """Run one llama-speculative-simple command and parse it; a refused drafter or any failure is a
    ComparatorError quoting what llama.cpp said."""
    t0 = time.perf_counter()
    try:
        p = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, errors="replace")
    except subprocess.TimeoutExpired as e:
        raise ComparatorError(f"{argv[0]} ran past {timeout_s:.0f} s") from e
    except OSError as e:
        raise ComparatorError(f"{argv[0]} could not start: {e}") from e
    if p.returncode != 0:
        raise ComparatorError(f"{Path(argv[0]).name} exited {p.returncode}: {_errors(p.stderr)}")
    res = parse_speculative(p.stdout, p.stderr, prompt)
    res["process_s"] = time.perf_counter() - t0
    return res


def _errors(stderr: str) -> str:
    """What llama.cpp said when it failed: its error lines, else the end of its log."""
    lines = [ln.strip() for ln in stderr.splitlines()
             if re.search(r"error|failed|unknown|invalid|abort|assert", ln, re.IGNORECASE)]
    return " | ".join(lines[-12:]) if lines else _tail(stderr)


def _tail(text: str, n: int = 12) -> str:
    return " | ".join(ln.strip() for ln in text.strip().splitlines()[-n:])


__all__ = ["SpecSampling", "binary_identity", "executable", "generated_text", "parse_speculative",
           "run_speculative", "speculative_argv"]
