"""Vocabulary from GGUF tokenizer metadata, with the token attributes, special ids, end-of-
generation set and special-token cache order the pinned llama.cpp derives from the same keys
(src/llama-vocab.cpp, llama_vocab::impl::load). Fails closed where llama.cpp would warn and guess.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import MetadataError, TokenizerError
from ..gguf.reader import GGUFFile, ValueType
from . import stl

# llama_token_attr bits (include/llama.h)
ATTR_UNDEFINED = 0
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5

# llama_token_type (tokenizer.ggml.token_type values) -> attribute
_TYPE_TO_ATTR = {0: ATTR_UNDEFINED, 1: ATTR_NORMAL, 2: ATTR_UNKNOWN, 3: ATTR_CONTROL,
                 4: ATTR_USER_DEFINED, 5: ATTR_UNUSED, 6: ATTR_BYTE}

MODELS = {"gpt2": "bpe", "llama": "spm"}

# Texts llama.cpp recognises when the id keys are absent (load(): "auto-detect special tokens").
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
              "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>",
              "<end_of_utterance>")
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_PRE_TEXTS = ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
                  "▁<PRE>", "<|code_prefix|>", "<|prefix|>")
_FIM_SUF_TEXTS = ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
                  "▁<SUF>", "<|code_suffix|>", "<|suffix|>")
_FIM_MID_TEXTS = ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
                  "▁<MID>", "<|code_middle|>", "<|middle|>")
_FIM_PAD_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")
_FIM_REP_TEXTS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
_FIM_SEP_TEXTS = ("<|file_sep|>",)
# Texts that are end-of-generation wherever they appear in a vocabulary.
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>",
              "<|calls|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>",
              "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>",
              "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[")
_ALWAYS_USER_DEFINED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")

_SPECIAL_KEYS = ("bos", "eos", "eot", "eom", "unknown", "seperator", "padding", "mask",
                 "fim_pre", "fim_suf", "fim_mid", "fim_pad", "fim_rep", "fim_sep")


@dataclass
class Vocab:
    kind: str  # "bpe" | "spm"
    model: str  # tokenizer.ggml.model
    pre: str | None  # tokenizer.ggml.pre (BPE only)
    tokens: tuple[str, ...]
    attrs: np.ndarray  # int32 [n] llama_token_attr
    scores: np.ndarray | None  # float32 [n] (SPM)
    merges: tuple[tuple[str, str], ...]  # BPE, priority order, first occurrence kept
    token_to_id: dict[str, int]
    special: dict[str, int | None]  # bos, eos, eot, eom, unk, ... (None = absent)
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    eog_ids: frozenset[int]
    special_ids: tuple[int, ...]  # control/user-defined/unknown ids, in id order
    suppress_tokens: tuple[int, ...] = ()  # common_sampler bans these with a -inf logit bias
    _cache_order: tuple[int, ...] | None = None

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def special_cache(self) -> tuple[int, ...]:
        """llama.cpp's cache_special_tokens: the special ids std::sort-ed by text length, longest
        first (equal lengths in introsort's order). Computed on first use (it can take seconds
        for a vocabulary with 10^5 reserved tokens); the partition needs it only when two
        equal-length special tokens overlap in a text."""
        if self._cache_order is None:
            cache = list(self.special_ids)
            lens = {i: len(self.tokens[i].encode("utf-8")) for i in cache}
            stl.sort(cache, 0, len(cache), lambda a, b: lens[a] > lens[b])
            self._cache_order = tuple(cache)
        return self._cache_order


def _get(f: GGUFFile, key: str, vt: set[ValueType] | ValueType | None = None):
    if key not in f:
        return None
    fld = f.field(key)
    if vt is not None:
        allowed = {vt} if isinstance(vt, ValueType) else vt
        if fld.vtype not in allowed:
            raise TokenizerError(f"metadata key {key!r} has type {fld.type_name}, expected "
                                 f"{'/'.join(sorted(t.name for t in allowed))}")
    return fld.value


def _check_name_rules(f: GGUFFile, pre: str | None) -> None:
    """llama.cpp sets lstrip/rstrip token attributes for a few model names, which this tokenizer
    does not implement: refuse those files rather than tokenize them differently."""
    name = str(f.get("general.name") or "").lower()
    arch = str(f.get("general.architecture") or "")
    pre_s = pre or ""
    if (any(s in pre_s for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code"))
            or any(s in arch for s in ("nomic-bert-moe", "jina-bert-v3"))
            or any(s in name for s in ("phi-3", "phi3", "modern-bert"))):
        raise TokenizerError(
            f"general.name {name!r} / pre {pre_s!r} selects llama.cpp's per-token strip attributes, "
            "which Muser does not implement"
        )


def load_vocab(f: GGUFFile) -> Vocab:
    model = _get(f, "tokenizer.ggml.model", ValueType.STRING)
    if model is None:
        raise TokenizerError("missing metadata key 'tokenizer.ggml.model'")
    if model not in MODELS:
        raise TokenizerError(f"unsupported tokenizer.ggml.model {model!r} (supported: gpt2, llama)")
    kind = MODELS[model]
    pre = _get(f, "tokenizer.ggml.pre", ValueType.STRING)
    if kind == "bpe" and pre is None:
        # llama.cpp would fall back to 'default' with a warning; Muser refuses to guess.
        raise TokenizerError("missing metadata key 'tokenizer.ggml.pre' for a gpt2 (BPE) tokenizer")
    _check_name_rules(f, pre)

    raw_tokens = _get(f, "tokenizer.ggml.tokens")
    if raw_tokens is None:
        raise TokenizerError("missing metadata key 'tokenizer.ggml.tokens'")
    if f.field("tokenizer.ggml.tokens").elem_type != ValueType.STRING:
        raise TokenizerError("tokenizer.ggml.tokens must be an array of strings")
    n = len(raw_tokens)
    if n == 0:
        raise TokenizerError("tokenizer.ggml.tokens is empty")
    tokens = tuple(t if t else f"[EMPTY_{i}]" for i, t in enumerate(raw_tokens))
    token_to_id: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if t in token_to_id:
            raise TokenizerError(f"token text {t!r} appears twice (ids {token_to_id[t]} and {i})")
        token_to_id[t] = i

    # 9.13: every per-token array must have exactly one entry per token.
    types = _get(f, "tokenizer.ggml.token_type")
    if types is not None:
        if f.field("tokenizer.ggml.token_type").elem_type != ValueType.INT32:
            raise TokenizerError("tokenizer.ggml.token_type must be an array of INT32")
        if len(types) != n:
            raise TokenizerError(f"vocab length mismatch: {n} tokens but {len(types)} token types")
        attrs = np.array([_TYPE_TO_ATTR.get(int(t), ATTR_UNDEFINED) for t in types], dtype=np.int32)
    else:
        attrs = np.full(n, ATTR_NORMAL, dtype=np.int32)
    scores = _get(f, "tokenizer.ggml.scores")
    if scores is not None:
        et = f.field("tokenizer.ggml.scores").elem_type
        if et not in (ValueType.FLOAT32, ValueType.INT32):
            raise TokenizerError(f"tokenizer.ggml.scores must be FLOAT32 or INT32, got {et.name}")
        if len(scores) != n:
            raise TokenizerError(f"vocab length mismatch: {n} tokens but {len(scores)} scores")
        scores = np.asarray(scores).astype(np.float32)

    merges: list[tuple[str, str]] = []
    if kind == "bpe":
        raw = _get(f, "tokenizer.ggml.merges")
        if raw is None:
            raise TokenizerError("missing metadata key 'tokenizer.ggml.merges' for a gpt2 (BPE) tokenizer")
        if f.field("tokenizer.ggml.merges").elem_type != ValueType.STRING:
            raise TokenizerError("tokenizer.ggml.merges must be an array of strings")
        seen: set[tuple[str, str]] = set()
        for i, m in enumerate(raw):
            pos = m.find(" ", 1)
            if pos < 0 or " " in m[pos + 1 :]:
                raise TokenizerError(f"tokenizer.ggml.merges[{i}] = {m!r} is not 'left right'")
            pair = (m[:pos], m[pos + 1 :])
            if pair in seen:
                continue  # llama.cpp keeps the first rank (bpe_ranks.emplace)
            seen.add(pair)
            for part in (*pair, pair[0] + pair[1]):
                if part not in token_to_id:
                    raise TokenizerError(f"tokenizer.ggml.merges[{i}] = {m!r}: {part!r} is not in the vocab")
            merges.append(pair)

    if kind == "spm":
        if scores is None:
            raise TokenizerError("a llama (SPM) tokenizer needs tokenizer.ggml.scores")
        defaults = {"bos": 1, "eos": 2, "unknown": 0}
        add_bos, add_eos, add_space_prefix = True, False, True
    else:
        defaults = {"bos": 11, "eos": 11}
        add_bos, add_eos, add_space_prefix = False, False, False

    special: dict[str, int | None] = {}
    for k in _SPECIAL_KEYS:
        v = defaults.get(k)
        if v is not None and v >= n:
            v = None  # llama.cpp disables an out-of-range default
        key = f"tokenizer.ggml.{k}_token_id"
        if key in f:
            try:
                kv = f.get_int(key)
            except MetadataError as e:
                raise TokenizerError(str(e)) from None
            if not 0 <= kv < n:
                raise TokenizerError(f"metadata key {key!r} = {kv} is outside the vocab [0, {n})")
            v = kv
        special[k] = v
    for old, new in (("prefix", "fim_pre"), ("suffix", "fim_suf"), ("middle", "fim_mid")):
        key = f"tokenizer.ggml.{old}_token_id"  # deprecated names, read after the new ones
        if key in f:
            kv = f.get_int(key)
            if not 0 <= kv < n:
                raise TokenizerError(f"metadata key {key!r} = {kv} is outside the vocab [0, {n})")
            special[new] = kv

    for key, attr_name in (("tokenizer.ggml.add_bos_token", "bos"), ("tokenizer.ggml.add_eos_token", "eos"),
                           ("tokenizer.ggml.add_space_prefix", "space")):
        if key in f:
            try:
                v = f.get_bool(key)
            except MetadataError as e:
                raise TokenizerError(str(e)) from None
            if attr_name == "bos":
                add_bos = v
            elif attr_name == "eos":
                add_eos = v
            else:
                add_space_prefix = v
    if add_bos and special["bos"] is None:
        raise TokenizerError("tokenizer.ggml.add_bos_token is true but there is no BOS token")
    if add_eos and special["eos"] is None:
        raise TokenizerError("tokenizer.ggml.add_eos_token is true but there is no EOS token")

    # Text-based detection of EOT/EOM/FIM ids (first match in token_to_id iteration order is
    # llama.cpp's unordered_map order; only ambiguous when two candidate texts coexist).
    def detect(key: str, texts: tuple[str, ...]) -> None:
        if special[key] is not None:
            return
        found = [token_to_id[t] for t in texts if t in token_to_id]
        if len(found) > 1:
            raise TokenizerError(
                f"several tokens could be the {key} token ({[tokens[i] for i in found]}); "
                f"set tokenizer.ggml.{key}_token_id"
            )
        if found:
            special[key] = found[0]
            attrs[found[0]] |= ATTR_CONTROL

    detect("eot", _EOT_TEXTS)
    detect("eom", _EOM_TEXTS)
    detect("fim_pre", _FIM_PRE_TEXTS)
    detect("fim_suf", _FIM_SUF_TEXTS)
    detect("fim_mid", _FIM_MID_TEXTS)
    detect("fim_pad", _FIM_PAD_TEXTS)
    detect("fim_rep", _FIM_REP_TEXTS)
    detect("fim_sep", _FIM_SEP_TEXTS)

    eog: set[int] = set()
    for k in ("fim_pad", "fim_rep", "fim_sep"):
        if special[k] is not None:
            eog.add(special[k])
    for t in _EOG_TEXTS:
        i = token_to_id.get(t)
        if i is not None:
            eog.add(i)
            attrs[i] |= ATTR_CONTROL
    for t in _ALWAYS_USER_DEFINED:
        i = token_to_id.get(t)
        if i is not None:
            attrs[i] = ATTR_USER_DEFINED
    for k in ("eos", "eot", "eom"):
        if special[k] is not None:
            eog.add(special[k])
    texts_in = {tokens[i] for i in eog}
    has_call = "<|call|>" in texts_in or "<|calls|>" in texts_in
    if "<|end|>" in texts_in and has_call and ("<|return|>" in texts_in or "<|flush|>" in texts_in):
        end = token_to_id["<|end|>"]
        eog.discard(end)
        attrs[end] = ATTR_USER_DEFINED
    texts_in = {tokens[i] for i in eog}
    if "</s>" in texts_in and ("<|tool_response>" in texts_in or "<|plamo:eos|>" in texts_in):
        s_id = token_to_id["</s>"]
        eog.discard(s_id)
        attrs[s_id] = ATTR_NORMAL

    # Special tokens: ids with control/user-defined/unknown attributes (the partition's candidates).
    mask = ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN
    special_ids = np.flatnonzero(attrs & mask).tolist()

    suppress: list[int] = []
    raw_sup = _get(f, "tokenizer.ggml.suppress_tokens")
    if raw_sup is not None:
        if f.field("tokenizer.ggml.suppress_tokens").elem_type != ValueType.INT32:
            raise TokenizerError("tokenizer.ggml.suppress_tokens must be an array of INT32")
        suppress = [int(t) for t in raw_sup if 0 <= int(t) < n]  # llama.cpp drops out-of-range ids

    return Vocab(
        kind=kind, model=model, pre=pre if kind == "bpe" else None, tokens=tokens, attrs=attrs,
        scores=scores, merges=tuple(merges), token_to_id=token_to_id, special=special,
        add_bos=add_bos, add_eos=add_eos, add_space_prefix=add_space_prefix,
        eog_ids=frozenset(eog), special_ids=tuple(special_ids), suppress_tokens=tuple(suppress),
    )
