"""PNG plots drawn from receipts (`muser bench plot RECEIPT... --out PNG`, and `--plot [PNG]` on
the bench kinds that have one).

A plot is drawn from receipt files only, never from a run's memory, so what a PNG shows is what a
receipt holds. One function per kind family:

* serve: TTFT and inter-token latency p50/p99 and throughput against concurrent clients, one
  line per server in the receipt (muser, and llama-server when the comparator ran);
* handoff: TTFT of remote vs local prefill (and the producer's own prefill), per prompt length,
  and the fraction of the K/V transfer hidden under the producer's prefill;
* kvpack: TTFT cold vs warm against prompt tokens, log scale;
* decode / prefill (speed): tok/s against KV depth, Muser and llama.cpp side by side.

Several receipts of one family go into one figure (e.g. handoff at several prompt lengths, or a
decode and a prefill receipt). matplotlib is imported only when a plot is drawn (the `bench`
extra), with the Agg backend: the runtime install does not need it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path
from typing import Any, Callable

from ..errors import PlotError

MATPLOTLIB_PIN = "matplotlib==3.11.2"  # pyproject.toml's bench extra
FAMILIES = {"serve": "serve", "handoff": "handoff", "kvpack": "kvpack", "decode": "speed", "prefill": "speed"}
DPI = 100  # with the figure sizes below a PNG stays well under 200 KB
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# --- receipts -----------------------------------------------------------------------------------


def load_receipt(path: str | os.PathLike) -> dict:
    """A receipt body with its file name kept under "_file"; a file that is not a receipt of a
    plotted kind is refused by name."""
    p = Path(path)
    if not p.is_file():
        raise PlotError(f"receipt {str(p)!r} is not a file")
    try:
        body = json.loads(p.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise PlotError(f"receipt {str(p)!r} is not JSON: {e}") from None
    if not isinstance(body, dict) or not isinstance(body.get("results"), dict):
        raise PlotError(f"receipt {str(p)!r} has no results object")
    kind = body.get("kind")
    if kind not in FAMILIES:
        raise PlotError(f"receipt {str(p)!r} is of kind {kind!r}: plots exist for {', '.join(FAMILIES)}")
    return body | {"_file": p.name}


def _need(body: dict, *keys: str) -> Any:
    """body[k0][k1]... or a PlotError naming the receipt and the missing path."""
    o: Any = body
    for i, k in enumerate(keys):
        if not isinstance(o, dict) or k not in o:
            raise PlotError(f"receipt {body['_file']!r} ({body['kind']}) lacks {'.'.join(keys[:i + 1])}")
        o = o[k]
    return o


def _number(body: dict, *keys: str) -> float:
    v = _need(body, *keys)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise PlotError(f"receipt {body['_file']!r}: {'.'.join(keys)} is {v!r}, not a number")
    return float(v)


def _where(body: dict) -> str:
    dev = body.get("device") or {}
    name = dev.get("gpu") or dev.get("cpu") or dev.get("kind") or "?"
    model = body.get("model") or {}
    path = model.get("path") if isinstance(model, dict) else None
    return f"{Path(path).name if path else '?'} on {name}"


def _tag(body: dict, many: bool) -> str:
    return f" [{body['time_utc'][:16]}]" if many else ""


# --- the plots ----------------------------------------------------------------------------------


def plot_serve(plt, bodies: list[dict]):
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    many = len(bodies) > 1
    for b in bodies:
        servers = _need(b, "results")
        if not servers:
            raise PlotError(f"receipt {b['_file']!r} (serve) holds no server's results")
        for name, levels in servers.items():
            if not isinstance(levels, list) or not levels:
                raise PlotError(f"receipt {b['_file']!r}: results.{name} is not a list of levels")
            for key in ("clients", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "throughput_tok_s"):
                bad = [r.get(key) if isinstance(r, dict) else r for r in levels
                       if not isinstance(r, dict) or isinstance(r.get(key), bool)
                       or not isinstance(r.get(key), (int, float))]
                if bad:
                    raise PlotError(f"receipt {b['_file']!r}: results.{name}[].{key} holds {bad[0]!r}, not a number")
            pts = sorted(levels, key=lambda r: r["clients"])
            cs = [r["clients"] for r in pts]
            label = name + _tag(b, many)
            for ax, key in ((axes[0], "ttft"), (axes[1], "itl")):
                line, = ax.plot(cs, [r[f"{key}_p50_s"] * 1e3 for r in pts], "o-", label=f"{label} p50")
                ax.plot(cs, [r[f"{key}_p99_s"] * 1e3 for r in pts], "x--", color=line.get_color(),
                        label=f"{label} p99")
            axes[2].plot(cs, [r["throughput_tok_s"] for r in pts], "o-", label=label)
    for ax, title in zip(axes, ("TTFT (ms)", "inter-token latency (ms)", "throughput (completion tok/s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    b = bodies[-1]
    fig.suptitle(f"muser serve load: {_where(b)}, {b.get('slots', '?')} slots, "
                 f"{b.get('max_tokens', '?')} tokens per request", fontsize=10)
    return fig


def plot_handoff(plt, bodies: list[dict]):
    import numpy as np

    rows = sorted(bodies, key=lambda b: _number(b, "results", "prompt_tokens"))
    fig, (a0, a1) = plt.subplots(1, 2, figsize=(11, 4))
    x = np.arange(len(rows))
    labels = [f"{int(_number(b, 'results', 'prompt_tokens'))} tokens\nKV {b.get('kv', '?')}"
              + (f"\n{b['time_utc'][:16]}" if len(rows) > 1 else "") for b in rows]
    tops = [0.0] * len(rows)
    for i, (name, key) in enumerate((("local prefill", "ttft_local_s"), ("remote prefill (handoff)", "ttft_remote_s"),
                                     ("producer's own prefill", "producer_prefill_s"))):
        ys = [_number(b, "results", key) * 1e3 for b in rows]
        err = [_spread(_handoff_samples(b, key)) * 1e3 for b in rows]
        a0.bar(x + (i - 1) * 0.27, ys, 0.27, yerr=err, capsize=3, label=name)
        tops = [max(t, y + e) for t, y, e in zip(tops, ys, err)]  # the group's highest bar + error
    for xi, b, top in zip(x, rows, tops):
        r = _number(b, "results", "remote_over_producer_prefill")
        t = _number(b, "results", "target_remote_over_producer")
        a0.annotate(f"remote/producer x{r:.3f}\n(target <= {t:g})", (xi, top), xytext=(0, 4),
                    textcoords="offset points", ha="center", fontsize=7)
    a0.set_ylim(0, a0.get_ylim()[1] * 1.4)  # room for the ratios and the legend above the bars
    a0.set_xticks(x, labels, fontsize=7)
    a0.set_ylabel("time to first token's logits (ms)")
    a0.set_title("TTFT: remote vs local prefill")
    a0.legend(fontsize=7, ncol=3, loc="upper center")
    hidden = [_number(b, "results", "hidden_fraction") for b in rows]
    a1.bar(x, hidden, 0.5, color="tab:green")
    for xi, h, b in zip(x, hidden, rows):
        a1.annotate(f"{h:.1%}\nexposed {_number(b, 'results', 'exposed_after_compute_s') * 1e3:.0f} ms",
                    (xi, h), xytext=(0, 3), textcoords="offset points", ha="center", fontsize=7)
    a1.set_ylim(0, 1.15)
    a1.set_xticks(x, labels, fontsize=7)
    a1.set_ylabel("fraction of K/V bytes that arrived\nbefore the producer finished")
    a1.set_title("transfer hidden under prefill")
    for ax in (a0, a1):
        ax.grid(axis="y", alpha=0.3)
    b = rows[-1]
    fig.suptitle(f"handoff: {_where(b)}, {b.get('transport', '')}", fontsize=9)
    return fig


def plot_kvpack(plt, bodies: list[dict]):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    many = len(bodies) > 1
    for b in bodies:
        lengths = _need(b, "results", "lengths")
        if not isinstance(lengths, dict) or not lengths:
            raise PlotError(f"receipt {b['_file']!r}: results.lengths holds no prompt length")
        ns = sorted(lengths, key=int)
        xs = [int(n) for n in ns]
        kv = b["results"].get("kv", "?")
        bench_mode = b["results"].get("mode") or {"name": "replay", "suffix_tokens": 0}  # older receipts: replay
        q = bench_mode.get("suffix_tokens") or 0
        warm_label = f" ({bench_mode.get('name')}: kvpack restore + suffix{f', question {q} tokens' if q else ''})"
        for mode, style in (("cold", "o-"), ("warm", "s-")):
            ys = [_number(b, "results", "lengths", n, f"ttft_{mode}_mean_s") * 1e3 for n in ns]
            line, = ax.plot(xs, ys, style, label=f"{mode}{warm_label if mode == 'warm' else ''}"
                            f" KV {kv}" + _tag(b, many))
            cells = b.get("cells") or {}
            for x, n in zip(xs, ns):  # every counted repetition, faint, beside its mean
                samples = (cells.get(f"{mode}/{n}") or {}).get("samples_s") or []
                ax.plot([x] * len(samples), [s * 1e3 for s in samples], ".", color=line.get_color(), alpha=0.35)
        for x, n in zip(xs, ns):
            ax.annotate(f"x{_number(b, 'results', 'lengths', n, 'speedup'):.1f}",
                        (x, _number(b, "results", "lengths", n, "ttft_warm_mean_s") * 1e3), xytext=(4, -10),
                        textcoords="offset points", fontsize=7)
    ax.set_yscale("log")
    questions = any((b["results"].get("mode") or {}).get("suffix_tokens") for b in bodies)
    ax.set_xlabel("document tokens (the timed prompt adds the question)" if questions else "prompt tokens")
    ax.set_ylabel("TTFT (ms, log scale)")
    ax.set_title(f"kvpack: TTFT cold vs warm, {_where(bodies[-1])}", fontsize=9)
    ax.grid(which="both", alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def plot_speed(plt, bodies: list[dict]):
    kinds = sorted({b["kind"] for b in bodies})
    fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        mine = [b for b in bodies if b["kind"] == kind]
        many, depths = len(mine) > 1, set()
        for b in mine:
            per = _need(b, "results", "per_depth")
            if not isinstance(per, dict) or not per:
                raise PlotError(f"receipt {b['_file']!r}: results.per_depth holds no depth")
            ds = sorted(per, key=int)
            for side, style in (("muser", "o-"), ("llama.cpp", "s--")):
                have = [d for d in ds if side in per[d]]
                if not have:
                    continue
                xs = [int(d) for d in have]
                depths.update(xs)
                ys = [_number(b, "results", "per_depth", d, side, "tok_s", "mean") for d in have]
                err = [_spread(per[d][side]["tok_s"].get("samples")) for d in have]
                ax.errorbar(xs, ys, yerr=err, fmt=style, capsize=3, label=side + _tag(b, many))
        ax.set_xticks(sorted(depths))
        if len(depths) == 1:  # one depth: a centred point, not a ±0.05 axis
            d = depths.pop()
            ax.set_xlim(d - max(d, 1) * 0.5, d + max(d, 1) * 0.5)
        b = mine[-1]
        settings = b.get("settings") or {}
        ax.set_xlabel("KV depth (tokens before the measured ones)")
        ax.set_ylabel("tok/s")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{kind} ({_number(b, 'results', 'tokens'):.0f} tokens per rep), "
                     f"{settings.get('device', '?')} {settings.get('lane', '')} KV {settings.get('kv', '?')}",
                     fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"speed: {_where(bodies[-1])}", fontsize=10)
    return fig


def _handoff_samples(b: dict, key: str) -> list | None:
    """The counted repetitions behind a handoff mean: the cells for local and remote TTFT, the
    producer's end records (one per remote repetition) for its own prefill."""
    if key == "producer_prefill_s":
        return [r.get(key) for r in b["results"].get("remote_reps") or ()]
    return ((b.get("cells") or {}).get("local" if key == "ttft_local_s" else "remote") or {}).get("samples_s")


def _spread(samples) -> float:
    return statistics.stdev(samples) if isinstance(samples, list) and len(samples) > 1 else 0.0


PLOTTERS: dict[str, Callable] = {"serve": plot_serve, "handoff": plot_handoff, "kvpack": plot_kvpack,
                                 "speed": plot_speed}


# --- drawing and writing --------------------------------------------------------------------------


def pyplot():
    """matplotlib.pyplot on the Agg backend, or a PlotError saying how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise PlotError(f"plots need matplotlib: pip install 'muser[bench]' (pins {MATPLOTLIB_PIN})") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def check_out(out: str | os.PathLike) -> Path:
    p = Path(out)
    if p.suffix.lower() != ".png":
        raise PlotError(f"plot path {str(p)!r} must end in .png")
    if not p.parent.is_dir():
        raise PlotError(f"plot path {str(p)!r}: folder {str(p.parent)!r} does not exist")
    if p.is_dir():
        raise PlotError(f"plot path {str(p)!r} is a folder")
    return p


def plot_receipts(paths: list[str | os.PathLike], out: str | os.PathLike) -> Path:
    """One PNG at `out` from receipts of one family; every receipt is read and checked, and the
    figure drawn, before the file is written (temp file, then rename: never half a PNG)."""
    if not paths:
        raise PlotError("no receipt given")
    target = check_out(out)
    bodies = [load_receipt(p) for p in paths]
    families = sorted({FAMILIES[b["kind"]] for b in bodies})
    if len(families) > 1:
        raise PlotError(f"receipts of different families ({', '.join(families)}) do not share a plot: "
                        + ", ".join(f"{b['_file']} is {b['kind']}" for b in bodies))
    plt = pyplot()
    before = set(plt.get_fignums())
    try:
        fig = PLOTTERS[families[0]](plt, bodies)
    except BaseException:  # a receipt refused mid-figure: its half-drawn figure goes too
        for n in set(plt.get_fignums()) - before:
            plt.close(n)
        raise
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        fig.tight_layout()
        fig.savefig(tmp, dpi=DPI, format="png")
        os.replace(tmp, target)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return target


# --- the --plot flag of the bench kinds -----------------------------------------------------------


def add_plot_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plot", nargs="?", const="", default=None, metavar="PNG",
                   help="also draw the receipt's PNG plot (needs the bench extra); bare --plot writes it next "
                        "to the receipt (same name, .png)")


def check_plot_flag(args: argparse.Namespace) -> None:
    """Before any work: a --plot run has matplotlib and a writable .png target."""
    if args.plot is None:
        return
    pyplot()
    if args.plot:
        check_out(args.plot)


def plot_for_run(args: argparse.Namespace, receipt: Path) -> Path | None:
    """The run's plot, drawn from the receipt it just wrote (None without --plot)."""
    if args.plot is None:
        return None
    out = plot_receipts([receipt], args.plot or receipt.with_suffix(".png"))
    print(f"plot: {out}")
    return out


__all__ = ["load_receipt", "plot_receipts", "plot_serve", "plot_handoff", "plot_kvpack", "plot_speed",
           "add_plot_flag", "check_plot_flag", "plot_for_run", "PNG_MAGIC"]
