#!/usr/bin/env bash
# The carry of tools/device_session.sh: DIR/llama.cpp-src.tgz (the pinned llama.cpp sources, trimmed
# by ../shared/tools/pack-llama-src.sh, plus the four files of tools/ui that CMake needs to configure
# llama-server without its web UI), DIR/whl/ (the wheels the GPU machine lacks, python 3.12) and
# DIR/heldout.tgz (the micro model's held-out corpus split).
#
#   bash tools/pack_device_carry.sh [DIR]      (default .device/gpubench)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.device/gpubench}
mkdir -p "$out/whl"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
bash ../shared/tools/pack-llama-src.sh "$tmp/trimmed" >/dev/null
python3 -m pip download -q --no-deps --no-binary :all: -d "$tmp" llama-cpp-python==0.3.36
tar xzf "$tmp"/llama_cpp_python-0.3.36.tar.gz -C "$tmp" llama_cpp_python-0.3.36/vendor/llama.cpp/tools/ui
mkdir -p "$tmp/src" && tar xzf "$tmp/trimmed/llama.cpp-src.tgz" -C "$tmp/src"
mkdir -p "$tmp/src/llama.cpp/tools/ui"
for f in CMakeLists.txt ui.cpp.in ui.h.in sources.cmake; do  # configure + an empty embedded UI
  cp "$tmp/llama_cpp_python-0.3.36/vendor/llama.cpp/tools/ui/$f" "$tmp/src/llama.cpp/tools/ui/"
done
tar czf "$out/llama.cpp-src.tgz" -C "$tmp/src" llama.cpp
for p in gguf==0.19.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic-core==2.50.5 \
         annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$out/whl" "$p"
done
# the micro model's held-out split (muser.corpus rule: the files, their stdlib-relative paths, and
# os.py, which marks a standard-library root): muser bench spec --corpus-root on the GPU machine,
# whose python is not the one the model was trained from; the bench checks the split's SHA-256
PYTHONPATH=src python3 - "$tmp/heldout" <<'PY'
import shutil, sys
from pathlib import Path
from muser import corpus
dst = Path(sys.argv[1])
rels, _ = corpus.list_sources()
for rel in ["os.py"] + [r for r in rels if corpus.split_of(r) == "heldout"]:
    (dst / rel).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(corpus.DEFAULT_ROOT / rel, dst / rel)
PY
tar czf "$out/heldout.tgz" -C "$tmp/heldout" .
ls -la "$out" "$out/whl"
