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
#
#   bash tools/device_train.sh drafter [distill-device options]
#
# The drafter alone, for the shipped target (tools/train_drafter.py distill-device): the tree's own
# tools/ and src/ and models/muse-glimmer-micro-q8_0.gguf (+ .pin.json), with one folder carried:
#   .device/drafter   tools/train_drafter.py carry (train.xz, heldout.xz, bench-heldout.u16,
#                     drafter-carry.json; 2.4 MB)
# Needs only the machine's torch, numpy and tokenizers. Writes into $OUT: drafter-weights.npz,
# drafter-run.json, device-stdout.txt. The script keeps its own deadline (DEADLINE_S, default 380 s);
# `timeout` sends SIGTERM at 398 s (the script evaluates briefly and saves) and SIGKILL 12 s later, so one
# call stays under 420 s. Then, here: tools/train_drafter.py export --weights <fetched OUT> (models/README.md).
set -uo pipefail
: "${OUT:?OUT must name the folder whose files come back}"
if [ "${1:-}" = drafter ]; then
    shift
    D=${CARRY:-.device/drafter}
    for f in "$D/drafter-carry.json" "$D/train.xz" "$D/heldout.xz" "$D/bench-heldout.u16" \
             models/muse-glimmer-micro-q8_0.gguf models/muse-glimmer-micro-q8_0.pin.json; do
        if [ ! -s "$f" ]; then
            echo "device_train: $f is missing: carry .device/drafter (tools/train_drafter.py carry)" >&2
            exit 2
        fi
    done
    mkdir -p "$OUT"
    export PYTHONPATH="$PWD/tools:$PWD/src" PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    timeout -s TERM -k 12 "${KILL_S:-398}" python3 -u tools/train_drafter.py distill-device \
        --target models/muse-glimmer-micro-q8_0.gguf --carry "$D" --out "$OUT" --deadline-s "${DEADLINE_S:-380}" \
        --baseline models/muse-glimmer-micro-dflash.gguf "$@" 2>&1 | tee "$OUT/device-stdout.txt"
    rc=${PIPESTATUS[0]}
    ls -l "$OUT"
    exit "$rc"
fi
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
