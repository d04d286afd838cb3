#!/usr/bin/env bash
# The micro model's training on the GPU machine (one H200, one call of at most 600 s), from the
# repository root, with two folders carried:
#   .device/corpus    the corpus carry (tools/corpus.py writes it: tokenizer.json, *.xz shards, corpus.json)
#   .device/trainer   tools/{device_train,train_micro,micro_net,train_drafter,corpus_carry}.py, the
#                     muser modules they import (src/muser/{__init__,errors,corpus}.py, spec/{__init__,net}.py),
#                     whl/ (the pinned tokenizers wheel for the machine's python 3.12) and
#                     stdlib-heldout.json (tools/export_micro.py --stdlib-list)
#
#   bash .device/trainer/tools/device_train.sh
#
# Writes into $OUT: micro-weights-N.npz, drafter-weights.npz, micro-run.json, device-stdout.txt
# (8 files at most). tools/device_train.py keeps its own deadline (DEADLINE_S, default 545 s); `timeout`
# sends SIGTERM at 570 s as a backstop (the script saves on SIGTERM) and SIGKILL 12 s later.
# Then, here: tools/export_micro.py --weights <fetched OUT> (see models/README.md).
set -uo pipefail
: "${OUT:?OUT must name the folder whose files come back}"
T=.device/trainer
C=${CARRY:-.device/corpus}
for f in "$C/corpus.json" "$C/tokenizer.json" "$T/stdlib-heldout.json" "$T/tools/device_train.py"; do
    if [ ! -s "$f" ]; then
        echo "device_train: $f is missing: carry .device/corpus and .device/trainer" >&2
        exit 2
    fi
done
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$T"/whl/*.whl || exit 3
export PYTHONPATH="/tmp/site:$T/tools:$T/src" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
timeout -s TERM -k 12 "${KILL_S:-570}" python3 -u "$T/tools/device_train.py" --carry "$C" --streams /tmp/streams \
    --stdlib-heldout "$T/stdlib-heldout.json" --out "$OUT" --deadline-s "${DEADLINE_S:-545}" "$@" 2>&1 \
    | tee "$OUT/device-stdout.txt"
rc=${PIPESTATUS[0]}
ls -l "$OUT"
exit "$rc"
