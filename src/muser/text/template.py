"""The GGUF's chat template (tokenizer.chat_template), rendered in a Jinja2 immutable sandbox.

The environment matches what chat templates are written against (transformers'
apply_chat_template): trim_blocks, lstrip_blocks, loop controls, `raise_exception`,
`strftime_now`, a `tojson` that keeps non-ASCII text, `namespace`, `messages`, `tools`,
`add_generation_prompt`, `bos_token`, `eos_token` and any extra variables.

A template is data from a file, so it is treated as hostile (book 9.13 binds its identity; this
module bounds what it can do):
* before any rendering, the template's syntax tree is checked: no names or attributes with a
  leading underscore, no `cycler` / `lipsum` / `joiner` / `self`, no import/include/extends, no
  filter outside an allow-list -> TemplateSecurityError;
* at run time the sandbox refuses unsafe attributes (also when reached through computed keys),
  string formatting (`%`, `format`), and any multiplication, power, concatenation, filter or
  method call whose result would exceed the output bound; namespace attributes are size-checked;
* rendering stops with TemplateSecurityError past `max_output_chars` of output or `timeout_s`
  seconds of work (checked on every line the compiled template executes), or on runaway
  recursion or memory exhaustion.
"""

from __future__ import annotations

import datetime as _dt
import functools
import hashlib
import json
import re
import sys
import time
from typing import Any, Mapping, Sequence

from ..errors import TemplateError, TemplateSecurityError
from ..gguf.reader import GGUFFile

MAX_TEMPLATE_CHARS = 1 << 20
DEFAULT_MAX_OUTPUT = 1 << 22  # characters (a 131k-token context is well under this)
DEFAULT_TIMEOUT_S = 2.0
_MAX_INT_BITS = 1 << 16  # integers a template may build by * and **

_FORBIDDEN_NAMES = frozenset({"cycler", "lipsum", "joiner", "self", "environment", "context"})
_FORBIDDEN_ATTRS = frozenset({
    "mro", "format", "format_map", "translate", "maketrans", "func_globals", "f_globals", "f_locals", "f_back", "gi_frame",
    "gi_code", "cr_frame", "cr_code", "ag_frame", "ag_code", "tb_frame", "co_code",
})
_ALLOWED_FILTERS = frozenset({
    "abs", "attr", "batch", "capitalize", "center", "count", "d", "default", "dictsort", "e",
    "escape", "first", "float", "forceescape", "groupby", "indent", "int", "items", "join", "last",
    "length", "list", "lower", "map", "max", "min", "reject", "rejectattr", "replace", "reverse",
    "round", "safe", "select", "selectattr", "slice", "sort", "string", "striptags", "sum",
    "title", "tojson", "trim", "truncate", "unique", "upper", "wordcount", "wordwrap",
})


def _size(v: Any) -> int:
    """Items a value holds, counting strings one level down (a list of big strings is big)."""
    if isinstance(v, (str, bytes)):
        return len(v)
    if isinstance(v, (list, tuple, set, frozenset)):
        return len(v) + sum(len(x) for x in v if isinstance(x, (str, bytes)))
    if isinstance(v, dict):
        return len(v) + sum(len(x) for kv in v.items() for x in kv if isinstance(x, (str, bytes)))
    return 0


def _estimate(name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> int:
    """Upper bound on the result size of the operations that can amplify their input."""
    a = list(args) + list(kwargs.values())
    s = a[0] if a else None
    if name == "join":
        second = a[1] if len(a) > 1 else ""
        if isinstance(s, str) and not isinstance(second, str):
            sep, seq = s, second  # sep.join(iterable)
        else:
            seq, sep = s, second  # filter: value|join(d)
        n = len(seq) if isinstance(seq, (list, tuple, set, frozenset, dict, str)) else 0
        return _size(seq) + (len(sep) if isinstance(sep, str) else 0) * n
    if name == "replace" and isinstance(s, str) and len(a) >= 3 and isinstance(a[1], str) and isinstance(a[2], str):
        return (len(s) + 1) * (len(a[2]) + 1)
    if name == "expandtabs" and isinstance(s, str):
        tab = next((x for x in a[1:] if isinstance(x, int) and not isinstance(x, bool)), 8)
        return len(s) * max(1, tab)
    if name in ("indent", "wordwrap") and isinstance(s, str):
        extra = max([len(x) if isinstance(x, str) else x for x in a[1:] if isinstance(x, (str, int))] + [0])
        return len(s) + max(extra, 0) * (s.count("\n") + 1 + len(s) // 8)
    ints = [x for x in a if isinstance(x, int) and not isinstance(x, bool)]
    return max([_size(x) for x in a] + [abs(x) for x in ints] + [0])


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise TemplateError(f"chat template raised: {message}")


def _strftime_now(fmt: str) -> str:
    return _dt.datetime.now().strftime(fmt)


class _Env:
    """Builds the sandboxed environment lazily (jinja2 is imported on first use)."""

    _cls = None

    @classmethod
    def make(cls, max_output: int):
        if cls._cls is None:
            cls._cls = _build_env_class()
        return cls._cls(max_output)


def _build_env_class():
    from jinja2 import ext, nodes
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError
    from jinja2.utils import Namespace

    class _Gen(CodeGenerator):
        def visit_Concat(self, node, frame):  # `a ~ b ~ ...`: size-checked before joining
            self.write("environment.muser_concat((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class Env(ImmutableSandboxedEnvironment):
        code_generator_class = _Gen
        intercepted_binops = frozenset({"*", "**", "+", "%", "//"})

        def __init__(self, max_output: int):
            super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols])
            self.max_output = max_output
            self.deadline = float("inf")
            for name in ("cycler", "lipsum", "joiner"):
                self.globals.pop(name, None)
            limit = self

            class _Namespace(Namespace):
                def __setitem__(self, name, value):
                    limit.check_size(value, f"namespace attribute {name!r}")
                    super().__setitem__(name, value)

            self.globals.update(namespace=_Namespace, raise_exception=_raise_exception,
                                strftime_now=_strftime_now)
            self.filters = {k: self._checked(f) for k, f in self.filters.items() if k in _ALLOWED_FILTERS}
            self.filters["tojson"] = self._checked(_tojson)

        # -- bounds -----------------------------------------------------------------------------

        def check_size(self, v: Any, what: str) -> Any:
            if _size(v) > self.max_output:
                raise TemplateSecurityError(f"{what} would hold {_size(v):,} items, over the bound {self.max_output:,}")
            return v

        def check_call(self, name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
            est = _estimate(name, args, kwargs)
            if est > self.max_output:
                raise TemplateSecurityError(
                    f"{name}() could produce {est:,} items, over the bound {self.max_output:,}")

        def _checked(self, f):
            env = self
            name = getattr(f, "__name__", "filter").removeprefix("do_")

            @functools.wraps(f)
            def wrapper(*args, **kwargs):
                # environment/context arguments come first for pass_* filters: skip them
                plain = [x for x in args
                         if not isinstance(x, Env) and type(x).__name__ not in ("Context", "EvalContext")]
                env.check_call(name, plain, kwargs)
                return env.check_size(f(*args, **kwargs), f"result of filter {name!r}")

            return wrapper

        def wrap_str_format(self, value):
            if super().wrap_str_format(value) is not None:
                raise TemplateSecurityError("str.format is not allowed in a chat template")
            return None

        def muser_concat(self, parts: tuple) -> str:
            strs = [p if isinstance(p, str) else str(p) for p in parts]
            total = sum(map(len, strs))
            if total > self.max_output:
                raise TemplateSecurityError(
                    f"concatenation of {total:,} characters is over the bound {self.max_output:,}")
            return "".join(strs)

        def call_binop(self, context, operator, left, right):
            if operator == "%" and isinstance(left, str):
                raise TemplateSecurityError("string formatting with % is not allowed in a chat template")
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if _size(seq) and isinstance(n, int) and _size(seq) * max(n, 0) > self.max_output:
                        raise TemplateSecurityError(
                            f"repetition to {_size(seq) * n:,} items is over the bound {self.max_output:,}")
            ints = isinstance(left, int) and isinstance(right, int)
            if operator == "**" and isinstance(right, (int, float)) and abs(right) > 64:
                raise TemplateSecurityError(f"exponent {right} is not allowed in a chat template")
            if operator == "**" and ints and abs(left) > 1 and right * abs(left).bit_length() > _MAX_INT_BITS:
                raise TemplateSecurityError(f"{left} ** {right} is over {_MAX_INT_BITS} bits")
            if operator == "*" and ints and abs(left).bit_length() + abs(right).bit_length() > _MAX_INT_BITS:
                bits = abs(left).bit_length() + abs(right).bit_length()
                raise TemplateSecurityError(f"a product of {bits} bits is over {_MAX_INT_BITS}")
            if operator == "+" and _size(left) + _size(right) > self.max_output:
                raise TemplateSecurityError(
                    f"concatenation to {_size(left) + _size(right):,} items is over the bound {self.max_output:,}")
            return super().call_binop(context, operator, left, right)

        def is_safe_attribute(self, obj, attr, value):
            if attr in _FORBIDDEN_ATTRS:
                return False
            return super().is_safe_attribute(obj, attr, value)

        def unsafe_undefined(self, obj, attribute):
            raise TemplateSecurityError(
                f"chat template reached the unsafe attribute {attribute!r} of a {type(obj).__name__}")

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805
            if time.monotonic() > __self.deadline:
                raise TemplateSecurityError("chat template rendering exceeded its time bound")
            if not __self.is_safe_callable(__obj):
                raise TemplateSecurityError(f"{__obj!r} is not safely callable")
            what = getattr(__obj, "__name__", type(__obj).__name__)
            owner = getattr(__obj, "__self__", None)
            if isinstance(owner, str):  # str methods: the receiver is the first operand
                __self.check_call(what, (owner, *args), kwargs)
            try:
                result = __context.call(__obj, *args, **kwargs)
            except SecurityError as e:
                raise TemplateSecurityError(f"chat template: {e}") from None
            return __self.check_size(result, f"result of {what}()")

    Env.SecurityError = SecurityError
    Env.nodes = nodes
    return Env


def _static_check(ast, nodes) -> None:
    """Refuse templates whose syntax tree already shows an escape attempt."""
    for n in ast.find_all(nodes.Node):
        if isinstance(n, nodes.Name) and (n.name.startswith("_") or n.name in _FORBIDDEN_NAMES):
            raise TemplateSecurityError(f"chat template refers to {n.name!r}, which is not allowed")
        if isinstance(n, nodes.Getattr) and (n.attr.startswith("_") or n.attr in _FORBIDDEN_ATTRS):
            raise TemplateSecurityError(f"chat template reaches attribute {n.attr!r}, which is not allowed")
        if isinstance(n, nodes.Getitem) and isinstance(n.arg, nodes.Const) and isinstance(n.arg.value, str):
            if n.arg.value.startswith("_") or n.arg.value in _FORBIDDEN_ATTRS:
                raise TemplateSecurityError(f"chat template reaches item {n.arg.value!r}, which is not allowed")
        if isinstance(n, (nodes.Import, nodes.FromImport, nodes.Include, nodes.Extends)):
            raise TemplateSecurityError(f"chat template uses {type(n).__name__.lower()}, which is not allowed")
        if isinstance(n, nodes.Filter) and n.name not in _ALLOWED_FILTERS:
            raise TemplateSecurityError(f"chat template uses filter {n.name!r}, which is not allowed")


# Roles every chat template serves (Llama / OpenAI chat conventions); a template that compares the
# role against other literals (tool, ipython, developer, ...) serves those too.
STANDARD_ROLES = ("system", "user", "assistant")
_ROLE_TEST = re.compile(r"""role['"]?\]?\s*(?:==|!=|not\s+in|in)\s*(\[[^\]]*\]|\([^)]*\)|'[^']*'|"[^"]*")""")
_LITERAL = re.compile(r"""['"]([^'"]+)['"]""")


class ChatTemplate:
    """A compiled, checked chat template. `render(messages, ...)` -> the prompt text."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "",
                 max_output_chars: int = DEFAULT_MAX_OUTPUT, timeout_s: float = DEFAULT_TIMEOUT_S):
        if not isinstance(source, str) or not source:
            raise TemplateError("chat template is empty")
        if len(source) > MAX_TEMPLATE_CHARS:
            raise TemplateSecurityError(f"chat template is {len(source):,} characters, over {MAX_TEMPLATE_CHARS:,}")
        if max_output_chars < 1 or not timeout_s > 0:
            raise TemplateError(f"bad bounds: max_output_chars={max_output_chars}, timeout_s={timeout_s}")
        from jinja2 import TemplateSyntaxError

        self.source = source
        self.sha256 = hashlib.sha256(source.encode("utf-8")).hexdigest()
        self.bos_token, self.eos_token = bos_token, eos_token
        self.max_output_chars, self.timeout_s = max_output_chars, timeout_s
        self._env = _Env.make(max_output_chars)
        try:
            ast = self._env.parse(source)
        except TemplateSyntaxError as e:
            raise TemplateError(f"chat template syntax error at line {e.lineno}: {e.message}") from None
        _static_check(ast, self._env.nodes)
        self._template = self._env.from_string(source)

    @classmethod
    def from_gguf(cls, f: GGUFFile, **bounds: Any) -> "ChatTemplate":
        src = f.get("tokenizer.chat_template")
        if src is None:
            raise TemplateError("the GGUF has no tokenizer.chat_template")
        if not isinstance(src, str):
            raise TemplateError("tokenizer.chat_template is not a string")
        tokens = f.get("tokenizer.ggml.tokens") or []

        def text(key: str) -> str:
            i = f.get(key)
            return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else ""

        return cls(src, text("tokenizer.ggml.bos_token_id"), text("tokenizer.ggml.eos_token_id"), **bounds)

    @property
    def roles(self) -> frozenset[str]:
        """The roles this template renders: the standard chat roles plus every string literal the
        source compares a role with (`message['role'] == 'tool'`, `role in ['ipython']`)."""
        found = set(STANDARD_ROLES)
        for m in _ROLE_TEST.finditer(self.source):
            found.update(_LITERAL.findall(m.group(1)))
        return frozenset(found)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None, **extra: Any) -> str:
        if not isinstance(messages, (list, tuple)):
            raise TemplateError(f"messages must be a list, got {type(messages).__name__}")
        roles = self.roles
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
                raise TemplateError(f"messages[{i}] must be a mapping with a string 'role', got {m!r}")
            if m["role"] not in roles:
                raise TemplateError(f"messages[{i}] has role {m['role']!r}; this chat template renders "
                                    f"{', '.join(sorted(roles))}")
            c = m.get("content")
            if c is not None and not isinstance(c, (str, list, tuple)):
                raise TemplateError(f"messages[{i}] content must be a string, a list of parts or null, got {c!r}")
        ctx = dict(extra)
        ctx.update(messages=[dict(m) for m in messages], tools=tools,
                   add_generation_prompt=bool(add_generation_prompt),
                   bos_token=self.bos_token, eos_token=self.eos_token)
        env = self._env
        deadline = time.monotonic() + self.timeout_s
        env.deadline = deadline

        def tracer(frame, event, arg):
            if time.monotonic() > deadline:
                raise TemplateSecurityError(f"chat template rendering exceeded {self.timeout_s} s")
            return tracer

        out: list[str] = []
        n = 0
        previous = sys.gettrace()
        sys.settrace(tracer)
        try:
            for chunk in self._template.generate(**ctx):
                n += len(chunk)
                if n > self.max_output_chars:
                    raise TemplateSecurityError(f"chat template output exceeded {self.max_output_chars:,} characters")
                out.append(chunk)
        except (TemplateError, TemplateSecurityError):
            raise
        except env.SecurityError as e:
            raise TemplateSecurityError(f"chat template: {e}") from None
        except RecursionError:
            raise TemplateSecurityError("chat template recursed too deeply") from None
        except MemoryError:
            raise TemplateSecurityError("chat template exhausted memory") from None
        except Exception as e:  # a template bug: one clear line
            raise TemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
        finally:
            sys.settrace(previous)
            env.deadline = float("inf")
        return "".join(out)
