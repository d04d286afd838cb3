"""Run the pinned llama.cpp HF -> GGUF converter (llama-cpp-python 0.3.36's vendored
convert_hf_to_gguf.py, its conversion/ package and gguf-py) on a checkpoint, to record the
reference bytes `muser convert` is held to (docs/convert.md).

    PYTHONPATH=/tmp/convert-deps python tools/lcp_convert_reference.py LLAMA_CPP_DIR HF_DIR OUT.gguf \
        --pre gpt-2 [--outtype auto|f32|f16|bf16|q8_0]

Needs torch, numpy and transformers==4.57.6 (the converter's requirements) importable; nothing of
Muser is imported. One change to the run, stated: the converter identifies the BPE pre-tokenizer
by hashing the token ids of a fixed text against a table of published models, which a synthetic
tokenizer can never match, so `get_vocab_base_pre` answers the name given with --pre (`muser
convert --pre` takes the same name). Everything else is the pinned code as shipped.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("llama_cpp", type=Path)
    ap.add_argument("hf_dir", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--pre", required=True)
    ap.add_argument("--outtype", default="auto")
    a = ap.parse_args()
    sys.path[:0] = [str(a.llama_cpp / "gguf-py"), str(a.llama_cpp)]
    from conversion.base import TextModel

    TextModel.get_vocab_base_pre = lambda self, tokenizer: a.pre
    import convert_hf_to_gguf

    sys.argv = ["convert_hf_to_gguf.py", str(a.hf_dir), "--outfile", str(a.out), "--outtype", a.outtype]
    convert_hf_to_gguf.main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
