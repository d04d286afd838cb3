"""The public surface (DESIGN.md "Public surface"):

    import muser
    m = muser.load(path=None, device="cpu" | "cuda", lane=None | "exact" | "fast", kv="f16" | "f32",
                   pin=None, warm_up=True)   # lane None: the device's default (exact cpu, fast cuda);
                                             # CUDA: kernels compiled, graphs captured at load
    m.config, m.identity, m.tokenizer, m.chat(messages, add_generation_prompt=True)
    s = m.session(max_context=...)        # prefill / decode / verify / checkpoint / rollback
    for piece in m.generate(prompt, max_tokens=None, sampling=muser.SamplingParams(...)): ...
    gen = m.stream_chat(messages, sampling=...)   # the template's prompt, one BOS

`load` fails closed: an unknown device, lane or KV type, a file that breaks the model contract,
a mismatched pin, or a weight the engine cannot decode exactly is a typed error before any
weight reaches the device. `path=None` loads `default_model_path()` (the shipped micro model
is checked against the pin file shipped beside it); the shipped model is looked up along
`model_search_path()`.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence


PACKAGE_DIR = Path(__file__).resolve().parent  # .../muser
MODEL_PATH_ENV = "MUSER_MODEL_PATH"


def cache_dir() -> Path:
    """Muser's cache folder: $MUSER_CACHE, else $XDG_CACHE_HOME/muser, else ~/.cache/muser."""
    base = os.environ.get("MUSER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "muser")
    return Path(base)


def source_checkout() -> Path | None:
    """The repository root when this package runs from its source checkout (src/muser beside a
    pyproject.toml naming the project), else None (an installed package)."""
    root = PACKAGE_DIR.parent.parent
    if PACKAGE_DIR.parent.name != "src" or not (root / "pyproject.toml").is_file():
        return None
    return root


def model_search_path() -> list[Path]:
    """Folders searched for the shipped micro model, in order: each entry of $MUSER_MODEL_PATH
    (os.pathsep-separated), then the repository's models/ when running from a source checkout,
    then the package's own models/ folder (package data of an installed build)."""
    out = [Path(p) for p in os.environ.get(MODEL_PATH_ENV, "").split(os.pathsep) if p]
    root = source_checkout()
    if root is not None:
        out.append(root / "models")
    out.append(PACKAGE_DIR / "models")
    return out


def shipped_model() -> Path | None:
    """The micro model in the first folder of model_search_path() holding one (its Q8_0 file,
    else its F16 file), or None."""
    for d in model_search_path():
        if not d.is_dir():
            continue
        for suffix in ("-q8_0.gguf", "-f16.gguf"):
            found = sorted(p for p in d.glob(f"*{suffix}") if p.is_file())
            if found:
                return found[0]
    return None


SHIPPED_DRAFTER = "muse-glimmer-micro-dflash.gguf"


def shipped_drafter(model_path: str | os.PathLike) -> Path | None:
    """The DFlash drafter shipped for the micro model, when `model_path` is one of its shipped files."""
    p = Path(model_path).resolve()
    d = p.parent / SHIPPED_DRAFTER
    shipped_dirs = {q.resolve() for q in model_search_path() if q.is_dir()}
    if p.parent in shipped_dirs and p.name.startswith("muse-glimmer-micro-") and p.suffix == ".gguf" \
            and p.name != SHIPPED_DRAFTER and d.is_file():
        return d
    return None


def default_model_path() -> Path:
    """The embedded default: the shipped micro model when present, else the tiny synthetic
    fixture (muser.model.synth, SynthSpec defaults) written once into the cache folder."""
    shipped = shipped_model()
    if shipped is not None:
        return shipped
    from .model.synth import SynthSpec, write_fixture

    spec = SynthSpec()
    key = hashlib.sha256(json.dumps(asdict(spec), sort_keys=True).encode()).hexdigest()[:16]
    path = cache_dir() / f"synth-tiny-{key}.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_fixture(path, spec)  # atomic: temp file + rename
    return path


class Model:
    """A loaded model: the validated file, the engine (weights on the device), text surfaces."""

    def __init__(self, engine, path: Path):
        self.engine = engine
        self.path = path
        self.warm_record: dict | None = None  # Model.warm_up's record once it ran

    # -- identity ------------------------------------------------------------------------------
    @property
    def config(self):
        return self.engine.cfg

    @property
    def identity(self):
        return self.engine.model_file.identity

    @property
    def device(self) -> str:
        return self.engine.device.type

    @property
    def lane(self) -> str:
        return self.engine.lane.value

    @property
    def kv(self) -> str:
        return self.engine.kv

    # -- text ----------------------------------------------------------------------------------
    @cached_property
    def tokenizer(self):
        from .text import Tokenizer

        return Tokenizer.from_gguf(self.engine.model_file.gguf)

    @cached_property
    def template(self):
        from .text import ChatTemplate

        return ChatTemplate.from_gguf(self.engine.model_file.gguf)

    def encode(self, text: str, parse_special: bool = False) -> list[int]:
        """A text prompt's ids as generate/stream and the CLI take it (muser.prompt.encode_text):
        the GGUF's BOS, special-token text literal unless `parse_special`."""
        from . import prompt as P

        return P.encode_text(self.tokenizer, text, parse_special)

    def chat(self, messages: Sequence[dict], add_generation_prompt: bool = True, **kw) -> str:
        """The GGUF's chat template rendered over `messages` (sandboxed)."""
        return self.template.render(messages, add_generation_prompt=add_generation_prompt, **kw)

    # -- running -------------------------------------------------------------------------------
    def session(self, max_context: int | None = None, chunk: int | None = None,
                capture: Iterable[int] = (), graphs: bool | None = None, kvpack: Any = None):
        """A new sequence; with `kvpack` (a directory or a muser.kvpack.Store) its first prefill
        reuses the longest stored prefix and persists new chunks (muser.kvpack.WarmSession)."""
        from .engine.session import PREFILL_CHUNK

        s = self.engine.session(max_context, PREFILL_CHUNK if chunk is None else chunk, capture, graphs)
        if kvpack is None:
            return s
        from .kvpack import warm_session

        return warm_session(s, kvpack)

    def stream(self, prompt: str | Sequence[int], max_tokens: int | None = None, sampling: Any = None,
               draft: Any = None, stop: Sequence[str] | None = None, max_context: int | None = None,
               parse_special: bool = False, verify_len: int = 7, gate: Any = None):
        """The generation as a muser.generation.Generation: GenEvents (token, text, logprob,
        finish_reason) and, once exhausted, its record (finish reason, TTFT, decode tok/s).

        The defaults are muser.prompt's, the same as the CLI's: a text prompt gets the GGUF's BOS
        and its special-token text is literal unless `parse_special=True`; token ids are taken as
        given. A chat goes through `stream_chat` (or `encode_chat`), which never doubles the BOS.
        `sampling=None` is SamplingParams() (temperature 0.8); max_tokens and stop come from the
        arguments or from `sampling` (both given and different is refused); max_tokens defaults to
        muser.prompt.DEFAULT_MAX_TOKENS. `draft` = a DFlash drafter path: speculative decoding with
        `verify_len` proposals a round (3, 7 or 15), the same tokens as without it, drafting while
        `gate` (a muser.spec.AcceptanceGate, default the book's) is open; its record is
        `gen.spec.stats()`."""
        from . import prompt as P

        params, n, stops = P.resolve_sampling(sampling, max_tokens, stop)
        ids = P.encode_prompt(self.tokenizer, prompt, parse_special)
        return self._run(ids, params, n, stops, max_context, draft, verify_len, gate)

    def stream_chat(self, messages: Sequence[dict], max_tokens: int | None = None, sampling: Any = None,
                    stop: Sequence[str] | None = None, max_context: int | None = None):
        """`stream` over the chat template rendered for `messages` (with the generation prompt)."""
        from . import prompt as P

        params, n, stops = P.resolve_sampling(sampling, max_tokens, stop)
        return self._run(self.encode_chat(messages), params, n, stops, max_context)

    def encode_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> list[int]:
        """The ids of the rendered chat: specials parsed, one BOS (muser.prompt.encode_chat)."""
        from . import prompt as P

        return P.encode_chat(self.tokenizer, self.template, messages, add_generation_prompt)

    def _run(self, ids: list[int], params: Any, n: int, stops: tuple[str, ...], max_context: int | None,
             draft: Any = None, verify_len: int = 7, gate: Any = None):
        from . import generation
        from . import prompt as P
        from .errors import LaneError

        n_ctx = P.context_size(len(ids), n, self.config.context_length, max_context)
        params.check_vocab(self.tokenizer.vocab_size)
        if draft is None:
            if gate is not None:
                raise LaneError("an acceptance gate is given without a draft")
            return generation.generate(self.session(max_context=n_ctx), self.tokenizer, ids, params, n, stops)
        spec = self.spec_session(draft, n_ctx, verify_len, gate)
        gen = generation.generate(spec, self.tokenizer, ids, params, n, stops)
        gen.spec = spec  # the speculative record: gen.spec.stats()
        return gen

    def drafter(self, path: str | os.PathLike):
        """The DFlash drafter at `path`, validated against this model (cached per path)."""
        from .bench.receipt import default_receipts_dir
        from .errors import LaneError
        from .spec.drafter import Drafter

        if not isinstance(path, (str, os.PathLike)):
            raise LaneError(f"draft must be the path of a DFlash drafter GGUF, got {type(path).__name__}")
        key = str(Path(path).resolve())
        cache = self.__dict__.setdefault("_drafters", {})
        if key not in cache:
            d = Drafter.load(path, self.engine, receipts=default_receipts_dir())
            if self.engine.device.type == "cuda" and self.warm_record is not None:
                self._warm_drafter(d)  # a warmed engine gets a warmed drafter
            cache[key] = d
        return cache[key]

    def spec_session(self, draft: str | os.PathLike, max_context: int, verify_len: int = 7, gate: Any = None):
        """A speculative session (muser.spec.SpecSession) over a new target session; `gate` = its
        muser.spec.AcceptanceGate (default: the book's)."""
        from .spec.session import SpecSession

        d = self.drafter(draft)
        return SpecSession(self.session(max_context=max_context, capture=d.cfg.target_layers), d, verify_len, gate)

    def generate(self, prompt: str | Sequence[int], max_tokens: int | None = None, sampling: Any = None,
                 draft: Any = None, **kw) -> Iterator[str]:
        """Stream the text pieces of `stream(...)` (same defaults): stops at an end-of-generation
        token (EOS or EOT), a stop string or max_tokens."""
        gen = self.stream(prompt, max_tokens, sampling, draft, **kw)
        for ev in gen:
            if ev.text:
                yield ev.text

    def warm_up(self, enabled: bool = True) -> dict:
        """Compile the engine's CUDA kernels and capture its step graphs now (muser.engine.warmup)
        and load the device sampler's kernels (muser.sample.candidates); `load` does this on CUDA.
        A progress line goes to stderr (`enabled=False`: none). CUDA only."""
        from .engine.warmup import warm_up
        from .sample.candidates import warm_up as warm_sampler

        rec = warm_up(self.engine, enabled=enabled)
        warm_sampler(self.engine.device, self.config.vocab)
        self.warm_record = rec
        return rec

    def _warm_drafter(self, d) -> None:
        """One speculative round per verify length on a throwaway session (CUDA): the drafter's
        kernels and the target's capturing verify graphs (which serve every later session of
        its context bound: engine/graphs.py) are built before the first request."""
        from .spec.format import VERIFY_LENGTHS
        from .spec.session import SpecSession

        for k in [k for k in VERIFY_LENGTHS if k <= d.cfg.max_proposals]:
            t = self.session(max_context=min(self.config.context_length, 4 * (k + 1) + 16),
                             capture=d.cfg.target_layers)
            s = SpecSession(t, d, k)
            row = s.prefill([0] * 8)
            for _ in range(3):
                row = s.decode(int(row.argmax()))

    def close(self) -> None:
        self.engine.model_file.close()


def load(path: str | os.PathLike | None = None, device: str = "cpu", lane: str | None = None,
         kv: str = "f16", pin: Any = None, warm_up: bool = True) -> Model:
    """Open, validate and upload a model (fails closed; see module doc). `lane` None: the device's
    default lane (engine.lanes.DEFAULT_LANES: exact on the CPU, fast on CUDA; `Model.lane` says
    which). On CUDA, `warm_up` compiles the kernels and captures the step graphs now
    (Model.warm_up, a progress line on stderr), not inside the first request; on the CPU there is
    nothing to warm."""
    from .engine import Engine
    from .engine.lanes import Lane, parse_device, parse_kv, resolve_lane

    if lane is not None:
        Lane.parse(lane)  # refuse unknown choices before touching the file
    parse_kv(kv)
    parse_device(device)
    lane = resolve_lane(lane, device)
    if path is None:
        p = default_model_path()
        if pin is None and shipped_model() == p:
            shipped_pin = p.with_name(p.name[: -len(".gguf")] + ".pin.json")
            if shipped_pin.is_file():
                pin = shipped_pin  # the embedded model is held to the identity shipped beside it
    else:
        p = Path(path)
    m = Model(Engine.open(p, device=device, lane=lane, kv=kv, pin=pin), p)
    if warm_up and m.engine.device.type == "cuda":
        m.warm_up()
    return m


__all__ = ["Model", "load", "default_model_path", "cache_dir", "model_search_path", "shipped_model",
           "shipped_drafter", "source_checkout"]
