"""`muser generate`: stream a completion from a Muse Glimmer GGUF.

    muser generate --prompt "def fib(n):" --max-tokens 64
    echo "import json" | muser generate --prompt - --echo
    muser generate --chat "Explain the sliding window." --system "Be brief." --temperature 0
    muser generate --messages @conversation.json --json

The model comes from `muser.load(path, device, lane, kv)` (default: the embedded model). Text is
written to stdout as it is produced; time to first token (from the moment the model is loaded:
the prompt's tokenizing, the session and the prefill count) and decode tokens/s go to stderr. With
--json, one JSON object per generated token (id, text piece, logprob) is written per line, then
a summary object.

Defaults (muser.prompt, the same as the Python API's): sampling at temperature 0.8 with
top-k 40, top-p 0.95, min-p 0.05 (llama.cpp's defaults; --temperature 0 is greedy), at most 128
tokens. --prompt / --prompt-file text gets the BOS the GGUF asks for and its special-token text
is taken literally (--special parses it into control tokens); --chat / --messages are rendered
through the GGUF's chat template, whose roles are checked, with one BOS.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ..prompt import DEFAULT_MAX_TOKENS, DEFAULT_PROMPT, DEFAULT_TEMPERATURE

# The engine's choices (muser.engine.lanes DEVICES / Lane / KV_TYPES, held equal by a test), here
# so argparse refuses a bad one before torch is imported.
DEVICES = ("cpu", "cuda")
LANES = ("exact", "fast", "w4a4", "split")  # w4a4: W4A4 files only; split: cuda only
KV_TYPES = ("f16", "f32")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model/--device/--lane/--kv/--threads, shared by generate and chat."""
    p.add_argument("--model", help="GGUF path (default: the embedded model)")
    p.add_argument("--device", default="cpu", choices=DEVICES, help="default cpu")
    p.add_argument("--lane", default=None, choices=LANES,
                   help="exact: f32 activations against the exact weight values (Gate 2 vs oracle f32); fast: ggml-cpu's "
                        "integer arithmetic on every call (activations to Q8_K/Q8_0, integer block sums, row-invariant; "
                        "Gate 2 vs oracle ggml-cpu); w4a4: exact, FP4 activations in verify forwards (W4A4 files only); "
                        "split (cuda): the exact lane's contract with the K-quant projections through the "
                        "split-activation integer GEMM, row-invariant at every row count, slower today. "
                        "Default: fast on cuda, the faster gated lane there; exact on cpu. CUDA, full "
                        "geometry, one H100: decode a tie (exact 98.47, fast 98.19 tok/s), first token of a 16-token "
                        "prompt 55.0 against 17.8 ms, 16-row verify 5.74 against 1.87 decodes, pp512 1,629 tok/s "
                        "in the fast lane; CPU, micro model: no measured difference (the fast lane's decode 0.97x inside "
                        "the CV; bench/NOTES.md, "
                        "\"The default lane\")")
    p.add_argument("--kv", default="f16", choices=KV_TYPES, help="KV cache type (default f16)")
    p.add_argument("--threads", type=int, help="CPU threads for the forward (default: torch's, the usable cores)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help=f"tokens to generate at most (default {DEFAULT_MAX_TOKENS})")
    p.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE,
                   help=f"0 = greedy (default {DEFAULT_TEMPERATURE}, as in llama.cpp and the Python API)")
    p.add_argument("--top-k", type=int, default=40, help="0 = off (default 40)")
    p.add_argument("--top-p", type=float, default=0.95, help="1 = off (default 0.95)")
    p.add_argument("--min-p", type=float, default=0.05, help="0 = off (default 0.05)")
    p.add_argument("--typical-p", type=float, default=1.0, help="1 = off (default 1.0)")
    p.add_argument("--repeat-penalty", type=float, default=1.0, help="1 = off (default 1.0)")
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--penalty-last-n", type=int, default=64, help="penalty window in tokens (0 = off)")
    p.add_argument("--logit-bias", action="append", default=[], metavar="TOKEN=BIAS",
                   help="add BIAS to TOKEN's logit (repeatable; BIAS may be -inf)")
    p.add_argument("--seed", type=int, help="sampling seed (default: drawn and reported)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt or a chat",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help=f"raw prompt text, '-' reads stdin (default, with no other source: "
                                      f"{DEFAULT_PROMPT!r}, a Python file's start)")
    src.add_argument("--prompt-file", metavar="FILE", help="read the raw prompt from FILE ('-' = stdin)")
    src.add_argument("--chat", metavar="TEXT", help="one user message, rendered with the chat template")
    src.add_argument("--messages", metavar="JSON|@FILE",
                     help="a JSON list of {role, content} messages (or @path to a JSON file)")
    p.add_argument("--system", help="system message placed before --chat")
    add_sampling_args(p)
    p.add_argument("--max-context", type=int, help="session context (default: prompt + max tokens)")
    p.add_argument("--special", action="store_true", help="parse special-token text in the prompt into control tokens")
    p.add_argument("--render-special", action="store_true", help="show control tokens' text in the output")
    p.add_argument("--echo", action="store_true", help="write the prompt text before the completion")
    p.add_argument("--json", action="store_true", help="JSON lines: one per token, then a summary")
    p.add_argument("--kvpack", metavar="DIR", help="reuse stored KV prefixes from DIR and store new ones "
                   "(muser kvpack; created if absent; drafting is then off unless --draft, which it refuses)")
    dg = p.add_mutually_exclusive_group()
    dg.add_argument("--draft", metavar="PATH", help="DFlash drafter GGUF: speculative decoding, same tokens "
                    "(default: the shipped drafter when the model is the shipped micro model)")
    dg.add_argument("--no-draft", action="store_true", help="plain decoding, no drafter")
    p.add_argument("--verify-len", type=int, default=7, choices=(3, 7, 15),
                   help="proposals per speculative round (default 7)")
    p.set_defaults(func=run)


def _bias(items: list[str]) -> dict[int, float]:
    from ..errors import SamplingError

    out: dict[int, float] = {}
    for it in items:
        tok, sep, val = it.partition("=")
        try:
            if not sep:
                raise ValueError
            out[int(tok)] = float(val)
        except ValueError:
            raise SamplingError(f"--logit-bias {it!r} must be TOKEN=BIAS") from None
    return out


def _messages(args: argparse.Namespace) -> list[dict] | None:
    from ..errors import TemplateError

    if args.chat is not None:
        msgs = [{"role": "system", "content": args.system}] if args.system else []
        return msgs + [{"role": "user", "content": args.chat}]
    if args.messages is not None:
        raw = args.messages
        if raw.startswith("@"):
            raw = Path(raw[1:]).read_text(encoding="utf-8")
        try:
            msgs = json.loads(raw)
        except ValueError as e:
            raise TemplateError(f"--messages is not valid JSON: {e}") from None
        if not isinstance(msgs, list):
            raise TemplateError("--messages must be a JSON list of messages")
        return msgs
    if args.system:
        raise TemplateError("--system goes with --chat")
    return None


def read_prompt(args: argparse.Namespace) -> str | None:
    """--prompt TEXT | --prompt - | --prompt-file FILE|- ; None when neither is given."""
    from ..errors import EmptyInput

    if args.prompt_file is not None:
        src = args.prompt_file
        text = sys.stdin.read() if src == "-" else Path(src).read_text(encoding="utf-8")
    elif args.prompt == "-":
        src, text = "-", sys.stdin.read()
    else:
        return args.prompt
    if not text:
        raise EmptyInput(f"the prompt read from {'stdin' if src == '-' else src!r} is empty")
    return text


def sampling_params(args: argparse.Namespace):
    from ..sample import SamplingParams

    return SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        typical_p=args.typical_p, repeat_penalty=args.repeat_penalty,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        penalty_last_n=args.penalty_last_n, logit_bias=_bias(args.logit_bias), seed=args.seed,
        max_tokens=args.max_tokens, stop=tuple(args.stop),
    )


def check_model_args(args: argparse.Namespace) -> None:
    """--threads and --model refused before anything loads (`muser serve` checks them before it
    binds its port)."""
    from ..errors import LaneError

    if args.threads is not None and args.threads < 1:
        raise LaneError(f"--threads must be >= 1, got {args.threads}")
    if args.model is not None and not Path(args.model).is_file():
        raise FileNotFoundError(2, "no such GGUF file" if not Path(args.model).exists() else "not a file",
                                args.model)


def load_model(args: argparse.Namespace):
    """Threads set before the weights load; the model from muser.load (no --model: the embedded
    one, held to the pin shipped beside it)."""
    check_model_args(args)
    import muser

    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    return muser.load(args.model, device=args.device, lane=args.lane, kv=args.kv)


def run(args: argparse.Namespace) -> int:
    from .. import prompt as P
    from ..api import default_model_path
    from ..generation import generate

    params = sampling_params(args)
    messages = _messages(args)  # bad input is refused before the model is loaded
    text = read_prompt(args)
    path = args.model if args.model is not None else default_model_path()
    model = load_model(args)
    session = None
    try:
        from ..api import shipped_drafter

        if args.kvpack and args.draft:
            from ..errors import SamplingError

            raise SamplingError("--kvpack with --draft: restored prefixes are not served to the speculative "
                                "lane (drop one of them)")
        draft = None if (args.no_draft or args.kvpack) else (args.draft or shipped_drafter(path))
        if draft is not None:
            model.drafter(draft)  # loaded (and on CUDA warmed) with the model, before the request
        tok = model.tokenizer  # read from the GGUF once, with the model
        params.check_vocab(tok.vocab_size)
        t_start = time.perf_counter()  # the request starts once the model is loaded (TTFT)
        if messages is not None:
            rendered = model.chat(messages, add_generation_prompt=True)
            ids = P.encode_rendered(tok, rendered)
        else:
            rendered = DEFAULT_PROMPT if text is None else text
            ids = P.encode_text(tok, rendered, parse_special=args.special)
        n_ctx = P.context_size(len(ids), args.max_tokens, model.config.context_length, args.max_context,
                               name="--max-context")
        session = (model.spec_session(draft, n_ctx, args.verify_len) if draft is not None
                   else model.session(max_context=n_ctx, kvpack=args.kvpack))
        gen = generate(session, tok, ids, params, args.max_tokens, tuple(args.stop),
                       render_special=args.render_special, t_start=t_start)
        out = sys.stdout
        if args.echo and not args.json:
            out.write(rendered)
            out.flush()
        for ev in gen:
            if args.json:
                out.write(json.dumps(ev.to_json(), ensure_ascii=False) + "\n")
            elif ev.text:
                out.write(ev.text)
            out.flush()
        st = gen.stats()
        if args.json:
            summary = {"summary": True, "model": str(path), "device": args.device, "lane": model.lane,
                       "prompt_ids": ids, "ids": gen.tokens, "text": gen.text, **st,
                       "spec": session.stats() if draft is not None else None}
            if args.echo:
                summary["prompt"] = rendered
            out.write(json.dumps(summary, ensure_ascii=False) + "\n")
        else:
            out.write("\n")
        out.flush()
        print(stats_line(st), file=sys.stderr)
    finally:
        from ..kvpack import WarmSession

        if isinstance(session, WarmSession):
            session.close()  # the new prefix entries are stored when the command returns (reuse.py)
        model.close()
    return 0


def stats_line(st: dict) -> str:
    tps = st["decode_tokens_per_s"]
    ttft = "n/a" if st["ttft_s"] is None else f"{st['ttft_s'] * 1000:.1f} ms"
    return (f"[{st['generated_tokens']} tokens, finish {st['finish_reason']}, TTFT {ttft}, "
            f"{'n/a' if tps is None else f'{tps:.2f}'} tok/s decode, seed {st['seed']}]")
