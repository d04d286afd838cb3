"""Muse Glimmer Hugging Face checkpoint -> GGUF, byte-identical to the pinned llama.cpp converter
(llama-cpp-python 0.3.36: convert_hf_to_gguf.py, conversion/muse_glimmer.py, conversion/base.py,
gguf-py) for the checkpoints it accepts; anything it does not know is refused by name.

Facts carried over from the pinned converter:
* hparams: config.json with `text_config` merged over the root; the GGUF keys, their order and
  types are TextModel.set_gguf_parameters' then MuseGlimmerModel's (softcap, logit scale,
  sliding window, sliding-window pattern = layer_types == "sliding_attention").
* tensors: every safetensors part in name order, each part's tensors sorted by name;
  "language_model." dropped from names; vision tensors skipped. Non-F16/F32 data goes to f32
  first; the four layer norms (names ending "layernorm.weight") get +1 (the final norm does not);
  Q and K are taken from transformers' rotate-half layout back to interleaved pairs
  (view(heads, 2, d/2, cols).transpose(1, 2)); before each layer's Q, an attn_q_norm of
  qk_scale_factor and an attn_k_norm of ones (f32) are emitted. 1-D tensors and "*_norm.weight"
  are F32; the rest take the target type (auto: BF16 if the first 2-D tensor is BF16, else F16).
* vocab (`_set_vocab_gpt2` + gguf.SpecialVocab): ids past the tokenizer's up to vocab_size are
  "[PAD{i}]" UNUSED; added tokens that are special or look special ("<|...|>") are CONTROL,
  other added tokens USER_DEFINED ("\u2581" -> " "), the rest NORMAL; merges from tokenizer.json;
  special ids from tokenizer_config.json (then config.json); add_bos/add_eos from the
  post-processor and tokenizer_config.json; the chat template; then the EOT id of "<|eot|>".
* tokenizer.ggml.pre: the pinned converter recognises a pre-tokenizer by hashing the ids of a
  fixed text against published models; here it is given (`pre=`) and must be one Muser's
  tokenizer implements.
* general.*: gguf.Metadata over the checkpoint folder (name from the folder when no card says).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..errors import FormatError, MetadataError
from .safetensors import SafetensorsFile

ARCH = "muse-glimmer"
ARCHITECTURE = "MuseGlimmerForConditionalGeneration"
TARGETS = ("auto", "f32", "f16", "bf16", "q8_0")
FILE_TYPES = {"f32": 0, "f16": 1, "q8_0": 7, "bf16": 32}  # llama_ftype (gguf LlamaFileType)
SPECIAL_TYPES = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")

# text_config keys the conversion reads, and keys it may carry without effect on the output.
USED_KEYS = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
             "layer_types", "sliding_window", "final_logit_softcapping", "output_multiplier", "qk_scale_factor"}
INERT_KEYS = {"model_type", "architectures", "torch_dtype", "dtype", "transformers_version", "bos_token_id",
              "eos_token_id", "pad_token_id", "mask_token_id", "tie_word_embeddings", "hidden_act",
              "initializer_range", "use_cache", "attention_dropout", "attention_bias", "text_config",
              "vision_config", "image_token_id", "_name_or_path"}
TOKENIZER_CONFIG_KEYS = {"tokenizer_class", "bos_token", "eos_token", "unk_token", "pad_token", "mask_token",
                         "cls_token", "sep_token",
                         "add_bos_token", "add_eos_token", "model_max_length", "chat_template",
                         "clean_up_tokenization_spaces", "added_tokens_decoder", "model_input_names",
                         "legacy", "extra_special_tokens"}

# HF layer-local name -> GGUF name (gguf-py tensor_mapping for MODEL_ARCH.MUSE_GLIMMER)
LAYER_MAP = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.gate_proj.weight": "attn_gate.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
GLOBAL_MAP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}
VISION_PREFIXES = ("model.vision_tower.", "model.vision_adapter.", "model.vision_projection.")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FormatError(f"{path} is missing") from None
    except ValueError as e:
        raise FormatError(f"{path} is not valid JSON: {e}") from None


def load_hparams(d: Path) -> dict:
    cfg = _read_json(d / "config.json")
    if not isinstance(cfg, dict) or cfg.get("architectures") != [ARCHITECTURE]:
        raise MetadataError(f"{d / 'config.json'}: architectures {cfg.get('architectures')!r} is not [{ARCHITECTURE!r}]")
    h = {**cfg, **cfg.get("text_config", {})}
    unknown = sorted(set(h) - USED_KEYS - INERT_KEYS)
    if unknown:
        raise MetadataError(f"{d / 'config.json'}: unknown keys {unknown} (the conversion would not carry them)")
    missing = sorted(USED_KEYS - set(h))
    if missing:
        raise MetadataError(f"{d / 'config.json'}: missing keys {missing}")
    rp = h["rope_parameters"]
    if not isinstance(rp, dict) or set(rp) != {"full_attention", "sliding_attention"} or any(
            not isinstance(v, dict) or set(v) != {"rope_type", "rope_theta"} or v["rope_type"] != "default"
            for v in rp.values()):
        raise MetadataError(f"rope_parameters {rp!r}: expected full_attention and sliding_attention, each "
                            "{rope_type: 'default', rope_theta}")
    if h.get("attention_bias"):
        raise MetadataError("attention_bias is true: Muse Glimmer has no attention biases")
    n = h["num_hidden_layers"]
    lt = h["layer_types"]
    if not isinstance(lt, list) or len(lt) != n or set(lt) - {"sliding_attention", "full_attention"}:
        raise MetadataError(f"layer_types {lt!r} must list {n} of 'sliding_attention' / 'full_attention'")
    return h


# --- vocab -----------------------------------------------------------------------------------


def _looks_special(t: str) -> bool:
    # conversion/base.py TextModel.does_token_look_special
    return (t in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (t.startswith("<|") and t.endswith("|>"))
            or (t.startswith("<\uff5c") and t.endswith("\uff5c>")) or (t.startswith("<unused") and t.endswith(">")))


def _content(entry: Any) -> str | None:
    if isinstance(entry, str):
        return entry
    if isinstance(entry, dict) and isinstance(entry.get("content"), str):
        return entry["content"]
    return None


def vocab_metadata(d: Path, h: dict, pre: str) -> list[tuple[str, Any]]:
    """(writer method, value) calls in the order the pinned converter makes them."""
    tj = _read_json(d / "tokenizer.json")
    tc = _read_json(d / "tokenizer_config.json")
    unknown = sorted(set(tc) - TOKENIZER_CONFIG_KEYS)
    if unknown:
        raise MetadataError(f"{d / 'tokenizer_config.json'}: unknown keys {unknown}")
    model = tj.get("model") or {}
    if model.get("type") != "BPE" or tj.get("normalizer") is not None:
        raise MetadataError(f"{d / 'tokenizer.json'}: a byte-level BPE without a normalizer is expected, got model "
                            f"{model.get('type')!r}, normalizer {tj.get('normalizer')!r}")
    pt = tj.get("pre_tokenizer") or {}
    if pt.get("type") != "ByteLevel":
        raise MetadataError(f"{d / 'tokenizer.json'}: pre_tokenizer {pt.get('type')!r} is not ByteLevel")
    from ..text.pretokenize import PreTokenizer

    PreTokenizer(pre)  # a pre-tokenizer Muser does not implement is refused here
    vocab: dict[str, int] = dict(model["vocab"])
    added = tj.get("added_tokens") or []
    added_by_id = {a["id"]: a for a in added}
    for a in added:
        vocab[a["content"]] = a["id"]
    n_vocab = h.get("vocab_size", len(vocab))
    if max(vocab.values()) >= n_vocab:
        raise MetadataError(f"tokenizer id {max(vocab.values())} is outside vocab_size {n_vocab}")
    reverse = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(n_vocab):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(5)  # UNUSED
            continue
        t = reverse[i]
        if i in added_by_id:
            if added_by_id[i].get("special") or _looks_special(t):
                types.append(3)  # CONTROL
            else:
                t = t.replace("\u2581", " ")
                types.append(4)  # USER_DEFINED
        else:
            types.append(1)  # NORMAL
        tokens.append(t)
    calls: list[tuple[str, Any]] = [("add_tokenizer_model", "gpt2"), ("add_tokenizer_pre", pre),
                                    ("add_token_list", tokens), ("add_token_types", types)]
    merges = model.get("merges") or []
    if merges and isinstance(merges[0], list):
        merges = [" ".join("".join(chr(ord(c) + 256) if c == " " else c for c in part) for part in pair)
                  for pair in merges]
    if merges:
        calls.append(("add_token_merges", merges))
    # gguf.SpecialVocab: the post-processor, then tokenizer_config.json, then config.json
    add_special: dict[str, bool] = {}
    tc = dict(tc)
    if not _content(tc.get("bos_token")) and _content(tc.get("cls_token")):
        tc["bos_token"] = tc["cls_token"]  # SpecialVocab: CLS stands in for a missing BOS
    if not _content(tc.get("eos_token")) and _content(tc.get("sep_token")):
        tc["eos_token"] = tc["sep_token"]  # and SEP for a missing EOS
    bos, eos, sep = (_content(tc.get(f"{k}_token")) for k in ("bos", "eos", "sep"))
    post = tj.get("post_processor")
    for proc in (post.get("processors", [post]) if post else []):
        kind = proc.get("type")
        if kind == "ByteLevel":
            add_special.setdefault("bos", False)
            add_special.setdefault("eos", False)
        elif kind == "TemplateProcessing":
            add_special.update(_template_processing(proc, bos, eos, sep))
        else:
            raise MetadataError(f"tokenizer.json post_processor {kind!r} is not handled")
    ids: dict[str, int] = {}
    for typ in SPECIAL_TYPES:
        flag = tc.get(f"add_{typ}_token")
        if isinstance(flag, bool) and typ not in add_special:
            add_special[typ] = flag
        text = _content(tc.get(f"{typ}_token"))
        if text is not None:
            tid = next((a.get("id") for a in added if a.get("content") == text), None)
            if isinstance(tid, int) and tid < n_vocab:
                ids.setdefault(typ, tid)
    for typ in SPECIAL_TYPES:
        tid = h.get(f"{typ}_token_id")  # config.json root, else text_config (merged)
        if isinstance(tid, int) and 0 <= tid < n_vocab:
            ids.setdefault(typ, tid)
    calls += [(f"add_{typ}_token_id", tid) for typ, tid in ids.items()]
    calls += [(f"add_add_{typ}_token", v) for typ, v in add_special.items()]
    template = tc.get("chat_template")
    if template is None and (d / "chat_template.jinja").is_file():
        if (d / "additional_chat_templates").is_dir():
            raise MetadataError("additional_chat_templates/ is not handled")
        template = (d / "chat_template.jinja").read_text(encoding="utf-8")
    if template is not None:
        if not isinstance(template, str):
            raise MetadataError("chat_template must be a string")
        calls.append(("add_chat_template", template))
    if "<|eot|>" not in vocab:
        raise MetadataError("the tokenizer has no '<|eot|>' token (Muse Glimmer's end of turn)")
    calls.append(("add_eot_token_id", vocab["<|eot|>"]))
    return calls


def _template_processing(proc: dict, bos: str | None, eos: str | None, sep: str | None) -> dict[str, bool]:
    """The simple TemplateProcessing forms: single = [BOS, A] (add BOS) or [A]; pair = single's
    lead, A, optional separators, B."""
    single, pair = proc.get("single", []), proc.get("pair", [])
    first = single[0].get("SpecialToken", {}).get("id") if len(single) > 1 else None
    last = single[-1].get("SpecialToken", {}).get("id") if len(single) > 1 else None
    if last is not None or (first is not None and first != bos):
        raise MetadataError(f"TemplateProcessing single {single!r} is not [bos, A] or [A]")
    out: dict[str, bool] = {"bos": True} if first is not None else {}
    if pair:
        start = 1 if first and pair[0].get("SpecialToken", {}).get("id") == first else 0
        body = pair[start:]
        if not body or body[0].get("Sequence", {}).get("id") != "A" or body[-1].get("Sequence", {}).get("id") != "B":
            raise MetadataError(f"TemplateProcessing pair {pair!r} is not lead, A, ..., B")
        middle = body[1:-1]
        if middle:
            seps = [m.get("SpecialToken", {}).get("id") for m in middle]
            if len(seps) > 2 or None in seps:
                raise MetadataError(f"TemplateProcessing pair separators {middle!r} are not handled")
            # SpecialVocab: a separator that is SEP or EOS means add_sep (single has no trailing token)
            out["sep"] = any(x in (sep, eos) for x in seps)
    return out


# --- tensors ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Planned:
    name: str  # GGUF name
    shape: tuple[int, ...]  # numpy shape
    qtype: str  # "f32" | "f16" | "bf16" | "q8_0"
    make: Callable[[], np.ndarray]  # -> float32 / float16 values, numpy shape


def _parts(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.is_file():
        wm = _read_json(index).get("weight_map")
        if not isinstance(wm, dict):
            raise FormatError(f"{index}: no weight_map")
        return [d / p for p in sorted(set(wm.values()))]
    parts = sorted(p for p in d.iterdir() if p.name.startswith("model") and p.name.endswith(".safetensors"))
    if not parts:
        raise FormatError(f"{d}: no model*.safetensors")
    return parts


def _unpermute(x: np.ndarray, heads: int) -> np.ndarray:
    """rotate-half rows -> interleaved pairs, per head (conversion/muse_glimmer.py)."""
    rows, cols = x.shape
    return x.reshape(heads, 2, rows // heads // 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


def _values(st: SafetensorsFile, name: str) -> np.ndarray:
    e = st.entries[name]
    a = st.array(name)
    if e.dtype == "BF16":  # to f32 (exact), as the converter does for any non-F16/F32 dtype
        return (a.astype(np.uint32) << 16).view(np.float32)
    return np.array(a)


def plan(d: Path, h: dict, target: str) -> tuple[list[Planned], str, list[SafetensorsFile]]:
    files = [SafetensorsFile(p) for p in _parts(d)]
    n_layers, heads, kv_heads = h["num_hidden_layers"], h["num_attention_heads"], h["num_key_value_heads"]
    head_dim, q_scale = h["head_dim"], float(h["qk_scale_factor"])
    if target == "auto":
        first2d = next((st.entries[n].dtype for st in files for n in st.names() if len(st.entries[n].shape) >= 2), None)
        target = "bf16" if first2d == "BF16" else "f16"
    out: list[Planned] = []
    seen: set[str] = set()
    for st in files:
        for raw in st.names():
            if raw.startswith(VISION_PREFIXES):
                continue
            name = raw.replace("language_model.", "")
            if name in GLOBAL_MAP:
                gname, bid, local = GLOBAL_MAP[name], None, name
            else:
                parts = name.split(".")
                if len(parts) < 4 or parts[:2] != ["model", "layers"] or not parts[2].isdecimal():
                    raise FormatError(f"{st.path}: unknown tensor {raw!r}")
                bid, local = int(parts[2]), ".".join(parts[3:])
                if local not in LAYER_MAP or bid >= n_layers:
                    raise FormatError(f"{st.path}: unknown tensor {raw!r}")
                gname = f"blk.{bid}.{LAYER_MAP[local]}"
            if gname in seen:
                raise FormatError(f"tensor {gname!r} comes twice (from {raw!r})")
            seen.add(gname)
            shape = st.entries[raw].shape
            if local == "self_attn.q_proj.weight":
                out.append(Planned(f"blk.{bid}.attn_q_norm.weight", (head_dim,), "f32",
                                   lambda: np.full((head_dim,), q_scale, dtype=np.float32)))
                out.append(Planned(f"blk.{bid}.attn_k_norm.weight", (head_dim,), "f32",
                                   lambda: np.ones((head_dim,), dtype=np.float32)))
            qt = "f32" if len(shape) <= 1 or gname.endswith("_norm.weight") else target
            out.append(Planned(gname, shape, qt, _maker(st, raw, local, heads, kv_heads)))
    return out, target, files


def _maker(st: SafetensorsFile, raw: str, local: str, heads: int, kv_heads: int) -> Callable[[], np.ndarray]:
    def make() -> np.ndarray:
        x = _values(st, raw)
        if local.endswith("layernorm.weight"):
            x = x + x.dtype.type(1)  # Gemma-style (1 + w) norms, in the stored float type
        if local == "self_attn.q_proj.weight":
            x = _unpermute(x, heads)
        elif local == "self_attn.k_proj.weight":
            x = _unpermute(x, kv_heads)
        return x
    return make


def encode(values: np.ndarray, qtype: str) -> np.ndarray:
    from ..gguf.types import GgmlType as G
    from ..quant.quantize import quantize

    if qtype == "f32":
        return values.astype(np.float32, copy=False)
    if qtype == "f16":
        return values.astype(np.float16)
    v = values.astype(np.float32, copy=False)
    return quantize(np.ascontiguousarray(v), G.BF16 if qtype == "bf16" else G.Q8_0)


# --- the conversion --------------------------------------------------------------------------


def convert_hf(hf_dir: str | os.PathLike, out: str | os.PathLike, target: str = "auto", pre: str | None = None,
               progress: bool = True) -> Path:
    """Convert; returns the written path. Everything is checked before OUT is created; OUT is
    written to a temporary file and renamed, so a failure leaves nothing."""
    import gguf

    from ..gguf.types import GgmlType as G
    from ..progress import Progress

    d, out = Path(hf_dir), Path(out)
    if target not in TARGETS:
        raise FormatError(f"--to {target!r}: expected one of {', '.join(TARGETS)}")
    if not d.is_dir():
        raise FormatError(f"{d} is not a Hugging Face checkpoint folder")
    if pre is None:
        raise MetadataError("the BPE pre-tokenizer name (--pre) is required: Muser does not guess it")
    h = load_hparams(d)
    vocab_calls = vocab_metadata(d, h, pre)
    planned, target, files = plan(d, h, target)
    qtypes = {"f32": G.F32, "f16": G.F16, "bf16": G.BF16, "q8_0": G.Q8_0}
    for p in planned:
        if p.qtype == "q8_0" and p.shape[-1] % 32:
            raise FormatError(f"tensor {p.name!r}: row length {p.shape[-1]} is not a multiple of 32 for Q8_0")
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent if str(out.parent) else ".")
    os.close(fd)
    try:
        w = gguf.GGUFWriter(tmp, ARCH)
        from ..gguf.types import type_info

        for p in planned:
            n = int(np.prod(p.shape, dtype=np.int64))
            w.add_tensor_info(p.name, list(p.shape), np.dtype(np.int8), type_info(qtypes[p.qtype]).nbytes(n),
                              raw_dtype=gguf.GGMLQuantizationType(int(qtypes[p.qtype])))
        _write_metadata(w, d, h, target, vocab_calls)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        bar = Progress("convert", sum(t.nbytes for t in w.tensors[0].values()), enabled=progress)
        for p in planned:  # one tensor in memory at a time
            data = encode(p.make(), p.qtype)
            w.write_tensor_data(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
            bar.advance(data.nbytes, p.name)
        w.close()
        bar.close()
        os.replace(tmp, out)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    finally:
        for st in files:
            st.close()
    return out


def _write_metadata(w: Any, d: Path, h: dict, target: str, vocab_calls: list[tuple[str, Any]]) -> None:
    import gguf

    total, shared, expert, n_expert = w.get_total_parameter_count()
    meta = gguf.Metadata.load(None, d, None, total)
    gen = d / "generation_config.json"
    if gen.is_file() and meta.sampling_penalty_repeat is None:
        # the pinned gguf-py also reads generation_config's repetition_penalty
        rp = (_read_json(gen) or {}).get("repetition_penalty")
        if rp is not None:
            meta.sampling_penalty_repeat = rp
    if meta.name is None:
        meta.name = d.name
    if meta.size_label is None and total > 0:
        meta.size_label = gguf.size_label(total, shared, expert, n_expert)
    w.add_type(gguf.GGUFType.MODEL)
    meta.set_gguf_meta_model(w)
    # TextModel.set_gguf_parameters, then MuseGlimmerModel's
    w.add_block_count(h["num_hidden_layers"])
    w.add_context_length(h["max_position_embeddings"])
    w.add_embedding_length(h["hidden_size"])
    w.add_feed_forward_length(h["intermediate_size"])
    w.add_head_count(h["num_attention_heads"])
    w.add_head_count_kv(h["num_key_value_heads"])
    rp = h["rope_parameters"]
    w.add_rope_freq_base(rp["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(rp["sliding_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(h["rms_norm_eps"])
    w.add_key_length(h["head_dim"])
    w.add_value_length(h["head_dim"])
    w.add_file_type(FILE_TYPES[target])
    w.add_final_logit_softcapping(h["final_logit_softcapping"])
    w.add_logit_scale(h["output_multiplier"])
    w.add_sliding_window(h["sliding_window"])
    w.add_sliding_window_pattern([t == "sliding_attention" for t in h["layer_types"]])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for method, value in vocab_calls:
        getattr(w, method)(value)

