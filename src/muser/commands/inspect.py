"""`muser inspect FILE [--json] [--check]`: geometry, dtype mix, bytes, identities, KV footprint,
verdict.

Without --check the verdict covers the metadata, the tensor contract and the identities. With
--check every tensor is also dequantized, block by block, and scanned: a non-finite scale or value
(ggml_validate_row_data's rule, the one the engine applies at load) or a dequantized value that is
not finite makes the verdict `invalid`, naming the tensor and the block (exit status 1); the
`engine` line says whether the engine decodes every matrix or only the oracle can run the file
(NVFP4). A progress bar goes to stderr."""

from __future__ import annotations

import argparse
import json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="validate a Muse Glimmer GGUF and describe it")
    p.add_argument("file", help="path to a GGUF file")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--no-hash", action="store_true", help="skip the streamed artifact SHA-256")
    p.add_argument("--check", action="store_true",
                   help="dequantize and scan every tensor (non-finite scales or values), with a progress bar")
    p.set_defaults(func=run)


KV_CONTEXTS = (2048, 32768, 131072)


CHECK_CHUNK_BYTES = 32 << 20  # stored bytes decoded at a time: bounded memory on any file


def check_tensors(gguf, progress=None) -> list[dict]:
    """Dequantize every tensor in row chunks; the problems found, one per tensor (the first)."""
    import numpy as np

    from ..errors import MuserError
    from ..quant.dequant import dequantize_rows

    problems: list[dict] = []
    for name, t in gguf.tensors.items():
        rows = max(1, CHECK_CHUNK_BYTES // max(1, t.row_bytes))
        try:
            if name.endswith((".nvfp4_scale", ".nvfp4_scale2")):
                # NVFP4 companions: decoded with (and checked through) their payload tensor
                if progress is not None:
                    progress.advance(t.nbytes, name)
                continue
            for r0 in range(0, t.n_rows, rows):
                r1 = min(t.n_rows, r0 + rows)
                x = dequantize_rows(gguf, name, np.arange(r0, r1))  # [rows, ne0]; scales validated
                bad = ~np.isfinite(x)
                if bad.any():
                    r, c = (int(v[0]) for v in np.nonzero(bad))
                    raise MuserError(f"tensor {name!r}: dequantized value {float(x[r, c])!r} at row {r0 + r}, "
                                     f"column {c} is not finite")
                if progress is not None:
                    progress.advance((r1 - r0) * t.row_bytes, name)
        except MuserError as e:
            problems.append({"tensor": name, "error": str(e)})
            if progress is not None:
                progress.advance(t.nbytes, name)
    return problems


def engine_support(m) -> str:
    """'all' when the engine has an exact decoder for every matrix, else which dtypes only the
    oracle serves (muser.engine.forward refuses those at load)."""
    from ..engine.weights import DEVICE_FORMATS

    oracle_only = sorted({m.gguf.tensors[n].type.ggml_type.name for n in m.contract.dtypes
                          if len(m.gguf.tensors[n].shape) == 2
                          and m.gguf.tensors[n].type.ggml_type not in DEVICE_FORMATS})
    return "all" if not oracle_only else f"oracle only ({', '.join(oracle_only)}: no exact engine decoder)"


def describe(path: str, hash_artifact: bool = True, check: bool = False, progress: bool = True) -> dict:
    from pathlib import Path

    from ..gguf.identity import template_sha256, tokenizer_sha256
    from ..model.loader import open_model
    from ..progress import Progress

    if Path(path).is_dir():
        raise IsADirectoryError(21, "is a directory, not a GGUF file", str(path))
    m = open_model(path)
    try:
        cfg = m.config
        mix: dict[str, dict] = {}
        for name, dt in m.contract.dtypes.items():
            e = mix.setdefault(dt, {"tensors": 0, "bytes": 0})
            e["tensors"] += 1
            e["bytes"] += m.gguf.tensors[name].nbytes
        kv = {str(c): {"per_slot_bytes": cfg.kv_bytes(c), "four_slots_bytes": 4 * cfg.kv_bytes(c)}
              for c in KV_CONTEXTS}
        ident = {
            "tokenizer_sha256": tokenizer_sha256(m.gguf),
            "template_sha256": template_sha256(m.gguf),
            "eog_ids": sorted(cfg.eog_ids),
        }
        if hash_artifact:
            ident["artifact_sha256"] = m.identity.artifact_sha256
        out = {
            "file": str(path),
            "file_bytes": m.gguf.size,
            "gguf_version": m.gguf.version,
            "alignment": m.gguf.alignment,
            "config": cfg.describe(),
            "q_scale": m.contract.q_scale,
            "parameters": m.n_params,
            "dtype_mix": mix,
            "bytes_by_class": m.bytes_by_class(),
            "weight_bytes_per_token": m.weight_bytes_per_token(),
            "kv_bytes_per_row_all_layers": cfg.kv_bytes(1),
            "kv": kv,
            "identity": ident,
            "weight_precision": m.gguf.get("muser.weight_precision"),
        }
        out["verdict"] = "valid"
        if check:
            bar = Progress("check", sum(t.nbytes for t in m.gguf.tensors.values()), enabled=progress)
            problems = check_tensors(m.gguf, bar)
            bar.close()
            out["checked"] = {"tensors": len(m.gguf.tensors), "problems": problems,
                              "engine": engine_support(m)}
            if problems:
                out["verdict"] = "invalid"
        return out
    finally:
        m.close()


def _human(d: dict) -> str:
    c = d["config"]
    lines = [
        f"file            {d['file']} ({d['file_bytes']:,} B, GGUF v{d['gguf_version']}, align {d['alignment']})",
        f"geometry        {c['n_layers']} layers, hidden {c['hidden']}, {c['n_heads']} q heads / {c['n_kv_heads']} kv heads, "
        f"head_dim {c['head_dim']}, ffn {c['ffn']}, vocab {c['vocab']}",
        f"derived         attn_dim {c['attn_dim']}, kv_dim {c['kv_dim']}, heads_per_kv {c['heads_per_kv']}, "
        f"attn_scale {c['attn_scale']:.7g}",
        f"collar          [{c['collar']}]  ({c['n_swa']} sliding RoPE, {c['n_full']} full NoPE), window {c['sliding_window']}",
        f"rope            freq_base_swa {c['rope_base_swa']:g} (sliding only), freq_base {c['rope_base']:g} (unused: NoPE)",
        f"norms           eps {c['rms_eps']:g}, post-norm eps {c['post_norm_eps']:g}, q_norm constant {d['q_scale']:.7g}",
        f"logits          x {c['logit_scale']:.6g}, then {c['softcap']:g}*tanh(l/{c['softcap']:g})",
        f"context         {c['context_length']:,}; BOS {c['bos_id']}, EOS {c['eos_id']}, EOT {c['eot_id']}, EOG {c['eog_ids']}",
        f"parameters      {d['parameters']:,}",
        "dtype mix",
    ]
    for dt, e in sorted(d["dtype_mix"].items()):
        lines.append(f"  {dt:<11} {e['tensors']:>5} tensors  {e['bytes']:>16,} B")
    lines.append("bytes by class")
    for k, v in sorted(d["bytes_by_class"].items()):
        lines.append(f"  {k:<11} {v:>22,} B")
    lines.append(f"per token       {d['weight_bytes_per_token']:,} B of weights streamed per decoded token")
    lines.append(f"KV (f16)        {d['kv_bytes_per_row_all_layers']:,} B per position across all layers (until the window fills)")
    for ctx, e in d["kv"].items():
        lines.append(f"  context {int(ctx):>7,}: {e['per_slot_bytes']:>16,} B per slot, {e['four_slots_bytes']:>16,} B for 4 slots")
    ident = d["identity"]
    if "artifact_sha256" in ident:
        lines.append(f"artifact        sha256 {ident['artifact_sha256']}")
    lines.append(f"tokenizer       sha256 {ident['tokenizer_sha256']}")
    lines.append(f"template        sha256 {ident['template_sha256']}")
    if d.get("weight_precision"):
        lines.append(f"precision       {d['weight_precision']}")
    if "checked" in d:
        lines.append(f"checked         {d['checked']['tensors']} tensors dequantized and scanned")
        lines.append(f"engine          {d['checked']['engine']}")
        for p in d["checked"]["problems"]:
            lines.append(f"  problem       {p['error']}")
    lines.append(f"verdict         {d['verdict']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..gguf.reader import read_gguf

    if Path(args.file).is_dir():
        raise IsADirectoryError(21, "is a directory, not a GGUF file", str(args.file))
    with read_gguf(args.file) as f:
        drafter = f.get("general.architecture") == "dflash"
    if drafter:  # a DFlash sidecar (muser.spec.format)
        from ..spec.format import describe_drafter, drafter_lines

        d = describe_drafter(args.file, hash_artifact=not args.no_hash)
        print(json.dumps(d, indent=2) if args.json else drafter_lines(d))
        return 0
    d = describe(args.file, hash_artifact=not args.no_hash, check=args.check)
    print(json.dumps(d, indent=2) if args.json else _human(d))
    return 0 if d["verdict"] == "valid" else 1
