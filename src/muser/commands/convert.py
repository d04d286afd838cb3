"""`muser convert HF_DIR OUT.gguf [--to TYPE] --pre NAME`: a Muse Glimmer Hugging Face checkpoint
(config.json, model*.safetensors, tokenizer.json, tokenizer_config.json) -> GGUF.

The output is byte-identical to the pinned llama.cpp converter's (convert_hf_to_gguf.py of
llama-cpp-python 0.3.36) for the same checkpoint and type: the same metadata in the same order,
the same tensors (norm +1 shifts, Q/K back to interleaved RoPE pairs, attn_q_norm carrying
qk_scale_factor). Tensors stream one at a time from the memory-mapped safetensors, with a
progress bar on stderr. A key, tensor or tokenizer feature the conversion does not know is
refused by name before OUT is created.

--to: auto (BF16 if the checkpoint is BF16, else F16; norms stay F32), f32, f16, bf16, q8_0.
--pre: the BPE pre-tokenizer name written as tokenizer.ggml.pre (llama.cpp identifies it from a
hash of published models' token ids; Muser does not guess), e.g. llama4, gpt-2.
See docs/convert.md.
"""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from ..convert.hf import TARGETS

    p = sub.add_parser("convert", help="Hugging Face safetensors checkpoint -> GGUF",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("hf_dir", metavar="HF_DIR")
    p.add_argument("out", metavar="OUT.gguf")
    p.add_argument("--to", default="auto", choices=TARGETS, help="tensor type (default auto)")
    p.add_argument("--pre", required=True, help="BPE pre-tokenizer name for tokenizer.ggml.pre")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..convert.hf import convert_hf

    out = Path(args.out)
    if out.exists() and not args.force:
        raise FileExistsError(17, "exists (pass --force to replace it)", str(out))
    path = convert_hf(args.hf_dir, out, target=args.to, pre=args.pre)
    print(f"wrote {path} ({path.stat().st_size:,} B)")
    return 0
