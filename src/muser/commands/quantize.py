"""`muser quantize IN OUT --to FORMAT`: re-encode the weights of a Muse Glimmer GGUF, float or
quantized (book 6-7)."""

from __future__ import annotations

import argparse

TARGETS = ("q8_0", "q4_k", "q4_k_xl", "nvfp4", "nvfp4-w4a4", "nvfp4-ggml", "f32")  # = quant.convert.TARGETS (kept literal: no numpy at CLI start)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "quantize",
        help="re-encode a GGUF's weights (byte-identical to llama.cpp's reference quantizers)",
        description=(
            "Re-encode the 2-D weights of a Muse Glimmer GGUF: F32/F16/BF16, or quantized "
            "(Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, NVFP4: each weight decoded to f32, tensor by tensor, "
            "then encoded; a weight already in its target type is copied). Metadata, tokenizer "
            "and chat template are copied unchanged; muser.weight_precision is set to the target. "
            "q8_0/q4_k/q4_k_xl/nvfp4-ggml load in the pinned llama.cpp; nvfp4 and nvfp4-w4a4 are "
            "Muser's native NVFP4 (E2M1 payload + E4M3FN scale companions, F16 embedding and LM head). "
            "f32 writes every 2-D weight dequantized to F32 (exact for Q8_0). "
            "The output is written atomically: an interrupted run leaves no OUT."
        ),
    )
    p.add_argument("input", metavar="IN", help="source GGUF (any weight type muser decodes)")
    p.add_argument("output", metavar="OUT", help="destination GGUF")
    p.add_argument("--to", required=True, choices=TARGETS, help="target format")
    p.add_argument(
        "--input-scale-inv", type=float, default=1.0, metavar="X",
        help="nvfp4-w4a4 only: the activation global scale stored as <name>.nvfp4_input_scale_inv "
             "(activations are quantized per 16 against scale2 = 1/X; default 1.0, no calibration)",
    )
    p.add_argument(
        "--threads", type=int, default=None, metavar="N",
        help="worker processes, tensors or row ranges in parallel (default: one per core; 1: in this process)",
    )
    p.add_argument("--quiet", action="store_true", help="no per-tensor progress on stderr")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..errors import MuserError
    from ..quant.convert import convert, stderr_progress

    if args.to != "nvfp4-w4a4" and args.input_scale_inv != 1.0:
        raise MuserError(f"--input-scale-inv applies only to --to nvfp4-w4a4, not {args.to}")
    convert(args.input, args.output, args.to, input_scale_inv=args.input_scale_inv,
            progress=None if args.quiet else stderr_progress, threads=args.threads)
    return 0
