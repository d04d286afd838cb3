"""`muser chat`: an interactive multi-turn chat over the GGUF's chat template.

    muser chat --system "Be brief." --temperature 0.7
    > hello
    ...streamed reply...
    > /stats

Each line typed is a user message; the reply streams to stdout as it is produced and joins the
history, and the whole history is rendered through the template for the next turn (one BOS,
roles checked; muser.prompt). Sampling defaults are `muser generate`'s (temperature 0.8).

The KV of the rendered history is kept between turns: a turn whose prompt extends the last one's
prefills only the new tokens. The reply is the one a fresh session would give as far as the lane
is row-invariant (DESIGN.md: the exact lane's logits do not depend on the prefill chunking). With repetition penalties on, the sampler must see the
whole prompt, so each turn then starts a fresh session.

Commands (a line starting with '/'):
  /reset        forget the history (the --system message stays)
  /save FILE    write the history as a JSON list of {role, content}
  /load FILE    replace the history with one written by /save (or any such list)
  /stats        TTFT, decode tok/s and token counts of the last reply (--stats: after every reply)
  /help         this list
  /quit         leave (end of input does too)
A bad command or file is one line on stderr; the chat goes on.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .generate import add_model_args, add_sampling_args, load_model, sampling_params, stats_line

DEFAULT_CONTEXT = 4096  # positions kept for the whole chat unless --max-context says otherwise
HELP = "commands: /reset, /save FILE, /load FILE, /stats, /help, /quit"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="interactive multi-turn chat over the chat template",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    add_sampling_args(p)
    p.add_argument("--system", help="system message at the start of the history")
    p.add_argument("--max-context", type=int,
                   help=f"positions for the whole chat (default: the model's context, at most {DEFAULT_CONTEXT})")
    p.add_argument("--stats", action="store_true", help="TTFT and tok/s on stderr after every reply")
    p.set_defaults(func=run)


def _load_history(path: str) -> list[dict]:
    from ..errors import TemplateError

    try:
        msgs = json.loads(Path(path).read_text(encoding="utf-8"))
    except ValueError as e:
        raise TemplateError(f"{path!r} is not valid JSON: {e}") from None
    if not isinstance(msgs, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                             and isinstance(m.get("content"), str) for m in msgs):
        raise TemplateError(f"{path!r} must hold a JSON list of {{role, content}} string messages")
    return msgs


class Chat:
    def __init__(self, model, params, args: argparse.Namespace, out=None, err=None):
        self.model, self.params, self.args = model, params, args
        self.out = sys.stdout if out is None else out
        self.err = sys.stderr if err is None else err
        self.base = [{"role": "system", "content": args.system}] if args.system else []
        self.history = list(self.base)
        self.last: dict | None = None
        model.chat(self.history + [{"role": "user", "content": ""}])  # the template takes these roles
        from .. import prompt as P

        limit = model.config.context_length
        self.n_ctx = P.context_size(1, 1, limit, args.max_context or min(limit, DEFAULT_CONTEXT), "--max-context")
        self.session = None
        self.kept: list[int] = []  # the prompt ids whose KV `self.snap` holds
        self.snap = None

    def command(self, line: str) -> bool:
        """Run one /command; False to leave."""
        from ..errors import MuserError

        cmd, _, rest = line.partition(" ")
        rest = rest.strip()
        try:
            if cmd in ("/quit", "/exit"):
                return False
            if cmd == "/reset":
                self.history = list(self.base)
                self.session, self.kept, self.snap = None, [], None
                self.err.write("[history cleared]\n")
            elif cmd == "/save" and rest:
                Path(rest).write_text(json.dumps(self.history, ensure_ascii=False, indent=1) + "\n",
                                      encoding="utf-8")
                self.err.write(f"[saved {len(self.history)} messages to {rest}]\n")
            elif cmd == "/load" and rest:
                msgs = _load_history(rest)
                self.model.chat(msgs)  # roles checked before the history is replaced
                self.history = msgs
                self.err.write(f"[loaded {len(msgs)} messages from {rest}]\n")
            elif cmd == "/stats":
                self.err.write(("[no reply yet]" if self.last is None else stats_line(self.last)) + "\n")
            elif cmd == "/help":
                self.err.write(HELP + "\n")
            else:
                self.err.write(f"muser: error: unknown command {line!r} ({HELP})\n")
        except (MuserError, OSError) as e:
            where = f" {e.filename!r}" if getattr(e, "filename", None) else ""
            self.err.write(f"muser: error:{where} {getattr(e, 'strerror', None) or e}\n")
        self.err.flush()
        return True

    def _start(self, ids: list[int]):
        """(session, ids still to process): the kept KV when `ids` extends its prompt."""
        from ..generation import generate

        p = self.params
        reuse = not p.penalties_on
        if reuse and self.snap is not None and len(ids) > len(self.kept) and ids[: len(self.kept)] == self.kept:
            self.session.restore(self.snap)
            new = ids[len(self.kept):]
        else:
            self.session = self.model.session(max_context=self.n_ctx)
            new = ids
        if reuse:
            # everything but the last prompt token now, so the KV can be kept at the prompt's end
            if len(new) > 1:
                self.session.prefill(new[:-1])
            self.kept, self.snap = ids[:-1], self.session.snapshot()
            new = new[-1:]
        return generate(self.session, self.model.tokenizer, new, p, p.max_tokens, p.stop)

    def turn(self, text: str) -> None:
        from .. import prompt as P

        msgs = self.history + [{"role": "user", "content": text}]
        ids = self.model.encode_chat(msgs)
        P.context_size(len(ids), self.params.max_tokens, self.model.config.context_length, self.n_ctx,
                       name="--max-context")
        t0 = time.perf_counter()
        gen = self._start(ids)
        t_first = None
        for ev in gen:
            if t_first is None:
                t_first = time.perf_counter()
            if ev.text:
                self.out.write(ev.text)
                self.out.flush()
        self.out.write("\n")
        self.out.flush()
        self.history = msgs + [{"role": "assistant", "content": gen.text}]
        # TTFT from the turn's start: the prefill of the new prompt tokens is part of it
        self.last = dict(gen.stats(), prompt_tokens=len(ids), ttft_s=t_first - t0)
        if self.args.stats:
            self.err.write(stats_line(self.last) + "\n")
            self.err.flush()

    def loop(self, lines) -> None:
        from ..errors import MuserError

        tty = sys.stdin.isatty()
        while True:
            if tty:
                self.err.write("> ")
                self.err.flush()
            line = lines.readline()
            if not line:
                return
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if line.startswith("/"):
                if not self.command(line.strip()):
                    return
                continue
            try:
                self.turn(line)
            except MuserError as e:  # e.g. the history outgrew the context: say so, keep chatting
                self.err.write(f"muser: error: {e} (/reset starts over)\n")
                self.err.flush()


def run(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    model = load_model(args)
    try:
        params.check_vocab(model.tokenizer.vocab_size)
        Chat(model, params, args).loop(sys.stdin)
    finally:
        model.close()
    return 0
