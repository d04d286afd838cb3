"""The public surface (DESIGN.md "Public surface"):

    import muser
    m = muser.load(path=None, device="cpu" | "cuda", lane="exact" | "fast", kv="f16" | "f32", pin=None)
    m.config, m.identity, m.tokenizer, m.chat(messages, add_generation_prompt=True)
    s = m.session(max_context=...)        # prefill / decode / verify / checkpoint / rollback
    for piece in m.generate(prompt, max_tokens, sampling=muser.SamplingParams(...)): ...

`load` fails closed: an unknown device, lane or KV type, a file that breaks the model contract,
a mismatched pin, or a weight the engine cannot decode exactly is a typed error before any
weight reaches the device. `path=None` loads `default_model_path()` (the shipped micro model
is checked against the pin file shipped beside it).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence


REPO_ROOT = Path(__file__).resolve().parents[2]
MODELS_DIR = REPO_ROOT / "models"


def cache_dir() -> Path:
    """Muser's cache folder: $MUSER_CACHE, else $XDG_CACHE_HOME/muser, else ~/.cache/muser."""
    base = os.environ.get("MUSER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "muser")
    return Path(base)


def shipped_model() -> Path | None:
    """The micro model shipped in models/ (its Q8_0 file, else F16), if the repository has one."""
    if not MODELS_DIR.is_dir():
        return None
    for suffix in ("-q8_0.gguf", "-f16.gguf"):
        found = sorted(p for p in MODELS_DIR.glob(f"*{suffix}") if p.is_file())
        if found:
            return found[0]
    return None


SHIPPED_DRAFTER = "muse-glimmer-micro-dflash.gguf"


def shipped_drafter(model_path: str | os.PathLike) -> Path | None:
    """The DFlash drafter shipped for the micro model, when `model_path` is one of its shipped files."""
    p = Path(model_path).resolve()
    d = MODELS_DIR / SHIPPED_DRAFTER
    if p.parent == MODELS_DIR.resolve() and p.name.startswith("muse-glimmer-micro-") and p.suffix == ".gguf" \
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

    def chat(self, messages: Sequence[dict], add_generation_prompt: bool = True, **kw) -> str:
        """The GGUF's chat template rendered over `messages` (sandboxed)."""
        return self.template.render(messages, add_generation_prompt=add_generation_prompt, **kw)

    # -- running -------------------------------------------------------------------------------
    def session(self, max_context: int | None = None, chunk: int | None = None,
                capture: Iterable[int] = (), graphs: bool | None = None):
        from .engine.session import PREFILL_CHUNK

        return self.engine.session(max_context, PREFILL_CHUNK if chunk is None else chunk, capture, graphs)

    def stream(self, prompt: str | Sequence[int], max_tokens: int, sampling: Any = None,
               draft: Any = None, stop: Sequence[str] | None = None, max_context: int | None = None,
               add_special: bool = True, parse_special: bool = True, verify_len: int = 7):
        """The generation as a muser.generation.Generation: GenEvents (token, text, logprob,
        finish_reason) and, once exhausted, its record (finish reason, TTFT, decode tok/s).

        A text prompt is tokenized with BOS as the GGUF asks (add_special) and special-token text
        parsed (parse_special), as llama.cpp's CLI does; pass add_special=False for text rendered
        by `chat`, which already starts with the template's BOS. `sampling=None` is greedy.
        `draft` = a DFlash drafter path: speculative decoding with `verify_len` proposals a round
        (3, 7 or 15), the same tokens as without it; its record is `gen.spec.stats()`."""
        from . import generation
        from .sample import SamplingParams

        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special=add_special, parse_special=parse_special)
        else:
            ids = [int(t) for t in prompt]
        params = sampling if sampling is not None else SamplingParams(temperature=0.0)
        n_ctx = max(1, max_context if max_context is not None else len(ids) + int(max_tokens))
        if draft is None:
            return generation.generate(self.session(max_context=n_ctx), self.tokenizer, ids, params, max_tokens, stop)
        spec = self.spec_session(draft, n_ctx, verify_len)
        gen = generation.generate(spec, self.tokenizer, ids, params, max_tokens, stop)
        gen.spec = spec  # the speculative record: gen.spec.stats()
        return gen

    def drafter(self, path: str | os.PathLike):
        """The DFlash drafter at `path`, validated against this model (cached per path)."""
        from .bench.receipt import DEFAULT_RECEIPTS
        from .errors import LaneError
        from .spec.drafter import Drafter

        if not isinstance(path, (str, os.PathLike)):
            raise LaneError(f"draft must be the path of a DFlash drafter GGUF, got {type(path).__name__}")
        key = str(Path(path).resolve())
        cache = self.__dict__.setdefault("_drafters", {})
        if key not in cache:
            cache[key] = Drafter.load(path, self.engine, receipts=DEFAULT_RECEIPTS)
        return cache[key]

    def spec_session(self, draft: str | os.PathLike, max_context: int, verify_len: int = 7):
        """A speculative session (muser.spec.SpecSession) over a new target session."""
        from .spec.session import SpecSession

        d = self.drafter(draft)
        return SpecSession(self.session(max_context=max_context, capture=d.cfg.target_layers), d, verify_len)

    def generate(self, prompt: str | Sequence[int], max_tokens: int, sampling: Any = None,
                 draft: Any = None, **kw) -> Iterator[str]:
        """Stream the text pieces of `stream(...)`: stops at an end-of-generation token (EOS or
        EOT), a stop string or max_tokens."""
        gen = self.stream(prompt, max_tokens, sampling, draft, **kw)
        for ev in gen:
            if ev.text:
                yield ev.text

    def close(self) -> None:
        self.engine.model_file.close()


def load(path: str | os.PathLike | None = None, device: str = "cpu", lane: str = "exact",
         kv: str = "f16", pin: Any = None) -> Model:
    """Open, validate and upload a model (fails closed; see module doc)."""
    from .engine import Engine
    from .engine.lanes import Lane, parse_device, parse_kv

    Lane.parse(lane)  # refuse unknown choices before touching the file
    parse_kv(kv)
    parse_device(device)
    if path is None:
        p = default_model_path()
        if pin is None and shipped_model() == p:
            shipped_pin = p.with_name(p.name[: -len(".gguf")] + ".pin.json")
            if shipped_pin.is_file():
                pin = shipped_pin  # the embedded model is held to the identity shipped beside it
    else:
        p = Path(path)
    return Model(Engine.open(p, device=device, lane=lane, kv=kv, pin=pin), p)


__all__ = ["Model", "load", "default_model_path", "cache_dir", "shipped_model", "shipped_drafter"]
