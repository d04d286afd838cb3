#!/usr/bin/env bash
# Train the micro Muse Glimmer on the GPU machine (one H200), from the repository root:
#
#   bash tools/device_train.sh          # with .device/micro carried (tools/corpus.py build wrote it)
#
# Writes into $OUT: micro-weights-{0..3}.npz (f32, <= 16 MiB each), micro-weights.json,
# micro-train-log.json, micro-train-stdout.txt (7 files at most). Training stops itself at
# MICRO_BUDGET_S seconds (default 460) after start and saves; `timeout` sends SIGTERM at 575 s as a
# backstop (the script saves on SIGTERM) and SIGKILL 20 s later, inside the 600 s command limit.
# Then, here: tools/export_micro.py --weights <fetched OUT> (see models/README.md).
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?OUT must name the folder whose files come back}"
DATA="${MICRO_DATA:-.device/micro}"
for f in corpus.json train.u16 val.u16 heldout.u16; do
    if [ ! -s "$DATA/$f" ]; then
        echo "device_train: $DATA/$f is missing: carry .device/micro (tools/corpus.py build)" >&2
        exit 2
    fi
done
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import sys, torch, numpy; print('python', sys.version.split()[0], 'torch', torch.__version__, 'numpy', numpy.__version__, 'cuda', torch.cuda.is_available())"
timeout -s TERM -k 20 575 python3 -u tools/train_micro.py --data "$DATA" --out "$OUT" \
    --budget-s "${MICRO_BUDGET_S:-460}" "$@" 2>&1 | tee "$OUT/micro-train-stdout.txt"
rc=${PIPESTATUS[0]}
ls -l "$OUT"
exit "$rc"
