"""`muser generate`: stream a completion from a Muse Glimmer GGUF.

    muser generate --prompt "def fib(n):" --max-tokens 64
    muser generate --chat "Explain the sliding window." --system "Be brief." --temperature 0
    muser generate --messages @conversation.json --json

The model comes from `muser.load(path, device, lane, kv)` (default: the embedded model). Text is
written to stdout as it is produced; time to first token and decode tokens/s go to stderr. With
--json, one JSON object per generated token (id, text piece, logprob) is written per line, then
a summary object.

Prompt handling: --prompt is tokenized with the BOS the GGUF asks for and without parsing special
token text (pass --parse-special to allow it); --chat / --messages are rendered through the
GGUF's chat template (which writes its own BOS) and tokenized with special tokens parsed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_PROMPT = "def fibonacci(n):\n"  # the embedded micro model knows Python source


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt or a chat",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="GGUF path (default: the embedded model)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help=f"raw prompt text (default, with no --chat/--messages: {DEFAULT_PROMPT!r})")
    src.add_argument("--chat", metavar="TEXT", help="one user message, rendered with the chat template")
    src.add_argument("--messages", metavar="JSON|@FILE",
                     help="a JSON list of {role, content} messages (or @path to a JSON file)")
    p.add_argument("--system", help="system message placed before --chat")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
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
    p.add_argument("--device", default="cpu", help="cpu | cuda (default cpu)")
    p.add_argument("--lane", default="exact", help="exact | fast (default exact)")
    p.add_argument("--kv", default="f16", help="KV cache type: f16 | f32 (default f16)")
    p.add_argument("--max-context", type=int, help="session context (default: prompt + max tokens)")
    p.add_argument("--parse-special", action="store_true", help="let --prompt text contain special tokens")
    p.add_argument("--render-special", action="store_true", help="show control tokens' text in the output")
    p.add_argument("--json", action="store_true", help="JSON lines: one per token, then a summary")
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


def run(args: argparse.Namespace) -> int:
    import muser

    from ..api import default_model_path
    from ..errors import ContextOverflow, SamplingError
    from ..generation import generate
    from ..sample import SamplingParams

    params = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        typical_p=args.typical_p, repeat_penalty=args.repeat_penalty,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        penalty_last_n=args.penalty_last_n, logit_bias=_bias(args.logit_bias), seed=args.seed,
        max_tokens=args.max_tokens, stop=tuple(args.stop),
    )
    messages = _messages(args)  # bad input is refused before the model is loaded
    path = args.model if args.model is not None else default_model_path()
    # no --model: load(None) also holds the shipped model to the pin file beside it
    model = muser.load(args.model, device=args.device, lane=args.lane, kv=args.kv)
    try:
        tok = model.tokenizer
        params.check_vocab(tok.vocab_size)
        if messages is not None:
            ids = tok.encode(model.chat(messages, add_generation_prompt=True), add_special=False,
                             parse_special=True)
        else:
            prompt = DEFAULT_PROMPT if args.prompt is None else args.prompt
            ids = tok.encode(prompt, add_special=True, parse_special=args.parse_special)
        n_ctx = args.max_context or len(ids) + args.max_tokens
        limit = model.config.context_length
        if n_ctx > limit:
            raise ContextOverflow(f"prompt ({len(ids)} tokens) + max tokens ({args.max_tokens}) = {n_ctx} "
                                  f"exceeds the model's context_length {limit}")
        if n_ctx < len(ids) + args.max_tokens - 1:
            raise SamplingError(f"--max-context {n_ctx} is smaller than prompt + max tokens")
        from ..api import shipped_drafter

        draft = None if args.no_draft else (args.draft or shipped_drafter(path))
        session = (model.spec_session(draft, n_ctx, args.verify_len) if draft is not None
                   else model.session(max_context=n_ctx))
        gen = generate(session, tok, ids, params, args.max_tokens, render_special=args.render_special)
        out = sys.stdout
        for ev in gen:
            if args.json:
                out.write(json.dumps(ev.to_json(), ensure_ascii=False) + "\n")
            elif ev.text:
                out.write(ev.text)
            out.flush()
        st = gen.stats()
        if args.json:
            summary = {"summary": True, "model": str(path), "device": args.device, "lane": args.lane,
                       "prompt_ids": ids, "ids": gen.tokens, "text": gen.text, **st,
                       "spec": session.stats() if draft is not None else None}
            out.write(json.dumps(summary, ensure_ascii=False) + "\n")
        else:
            out.write("\n")
        out.flush()
        tps = st["decode_tokens_per_s"]
        print(f"[{st['generated_tokens']} tokens, finish {st['finish_reason']}, "
              f"TTFT {st['ttft_s'] * 1000:.1f} ms, "
              f"{'n/a' if tps is None else f'{tps:.2f}'} tok/s decode, seed {st['seed']}]",
              file=sys.stderr)
    finally:
        model.close()
    return 0
