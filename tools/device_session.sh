#!/usr/bin/env bash
# One GPU-machine session in two back-to-back calls (the machine keeps /tmp while it stays warm).
#
#   bash tools/device_session.sh A   # bg: build the pinned llama.cpp (CUDA, sm_90) and write the
#                                    # 16.75 GB full-geometry GGUF; fg: engine env, kernels, Gate 2
#                                    # on CUDA, invariance, graphs; then
#                                    # llama-bench pp512/tg128 at depth 0 -> $OUT
#   bash tools/device_session.sh B   # llama-bench at depth 32768, the kernel table
#                                    # (tools/device_kernels.py), then the engine's full-geometry
#                                    # stage with llama.cpp's figures beside it -> $OUT
#
#   bash tools/device_session.sh K   # a pair: K (Gate 2 + kernels + the GEMM stage + llama
#   bash tools/device_session.sh F   # d0), then F (llama d32768 + full-geometry stage)
#
# Carry: .device (llama.cpp-src.tgz from ../shared/tools/pack-llama-src.sh) and .whl (gguf wheel).
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?OUT must name the folder whose files come back}"
phase=${1:?phase K, F, A, B or C}
W=/tmp/muser-dev
FULL=$W/full-q4_k_xl.gguf
LB=/tmp/llama-cuda
BENCH=$LB/llama.cpp/build/bin/llama-bench
mkdir -p "$W" "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:/tmp/site"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1 || true
# the CPU kernel library (a CPU engine without it refuses with a LaneError naming the fix)
python3 setup.py -q build_ext --inplace >/dev/null 2>&1 || echo "CPU kernel library not built: CPU engines will refuse" >&2
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }

build_llama() {
  [ -x $BENCH ] && return 0
  mkdir -p $LB && tar xzf .device/llama.cpp-src.tgz -C $LB
  ( cd $LB/llama.cpp && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF >$W/cmake.log 2>&1 \
    && cmake --build build -j12 --target llama-bench >$W/build.log 2>&1 )
}

# llama-bench as the pinned comparator runs it on the GPU (all layers offloaded, flash attention),
# pp512 and tg128, 5 reps, JSON; the copy kept in $W survives into phase B
llama_bench() {  # depth, limit_s, name
  [ -x $BENCH ] && [ -s $FULL ] || { echo "llama-bench: no build or no full file"; return 1; }
  timeout "$2" $BENCH -m $FULL -ngl 99 -fa 1 -p 512 -n 128 -d "$1" -r 5 -o json >$W/$3 2>$W/$3.err
  echo "llama-bench d=$1 rc=$? at $(el) s"; tail -2 $W/$3.err; cp $W/$3 "$OUT/$3"
}

# the 16.75 GB full-geometry file: written in the background (then waited for), or in the
# foreground when a warm machine's copy is gone
full_bg() {
  ( [ -s $FULL ] || python3 tools/make_fixture.py $FULL --full >$W/full.log 2>&1; \
    echo "full file rc=$? at $(el) s" >$W/full.done ) &
}
wait_full() {  # limit_s
  while [ ! -f $W/full.done ]; do [ "$(el)" -gt "$1" ] && break; sleep 2; done; cat $W/full.done
}
ensure_full() {
  if [ ! -s $FULL ]; then
    echo "machine was not warm: no full file; writing it"
    python3 tools/make_fixture.py $FULL --full >$W/full.log 2>&1
  fi
}
# this machine's llama-bench rows (depth 0 and 32768) as one JSON list -> $W/llama-bench.json
merge_llama_json() {
  python3 - "$W" >$W/llama-bench.json <<'EOF'
import json, sys, pathlib
rows = []
for n in ("llama-bench-d0.json", "llama-bench-d32768.json"):
    p = pathlib.Path(sys.argv[1]) / n
    try:
        rows += json.loads(p.read_text())
    except Exception:
        pass
print(json.dumps(rows))
EOF
}

if [ "$phase" = K ]; then
  # call 1 of 2 (back to back): bg llama.cpp build + full file; fg Gate 2 and invariance, the
  # GEMM stage (tools/device_kernels.py), then llama-bench at depth 0
  ( build_llama; echo "llama build rc=$? at $(el) s" >$W/build.done ) &
  full_bg
  timeout -s TERM 230 python3 tools/device_engine.py --out "$OUT" --no-full \
      --stages env,kernels,gate2,invariance --budget 215 2>&1 | tail -40
  echo "--- kernels at $(el) s"
  timeout -s TERM $(( 520 - $(el) )) python3 tools/device_kernels.py --out "$OUT" \
      --budget $(( 505 - $(el) )) 2>&1 | tail -40
  while [ ! -f $W/build.done ] || [ ! -f $W/full.done ]; do
    [ "$(el)" -gt 540 ] && { echo "build/file not done at $(el) s"; break; }; sleep 3
  done
  cat $W/build.done $W/full.done 2>/dev/null; tail -2 $W/build.log 2>/dev/null
  [ "$(el)" -lt 545 ] && llama_bench 0 $(( 590 - $(el) )) llama-bench-d0.json
elif [ "$phase" = F ]; then
  # call 2 of 2: llama-bench at depth 32768 (if call 1's build is still here), then the engine's
  # full-geometry stage: depths 0 and 32768, verify,
  # pp512 exact and fast, with llama.cpp's figures of this session beside them
  ensure_full
  [ -x $BENCH ] && llama_bench 32768 150 llama-bench-d32768.json
  merge_llama_json
  echo "--- engine full geometry at $(el) s"
  timeout -s TERM $(( 590 - $(el) )) python3 tools/device_engine.py --out "$OUT" --full $FULL --stages env,full \
      --depths 0,32768 --budget $(( 575 - $(el) )) --llama-bench-json $W/llama-bench.json 2>&1 | tail -30
elif [ "$phase" = P ]; then
  # profile call: the GEMM stage (tools/device_kernels.py), then where a decode step's GPU time goes
  # (tools/device_profile.py) at depths 0 and 32768 with two attention split caps
  full_bg
  timeout -s TERM 300 python3 tools/device_kernels.py --out "$OUT" --budget 285 2>&1 | tail -32
  wait_full 400
  echo "--- profile at $(el) s"
  timeout -s TERM $(( 590 - $(el) )) python3 tools/device_profile.py $FULL "$OUT" --depths 0,32768 \
      --split-positions 512,1024 2>&1 | tail -70
elif [ "$phase" = Z ]; then
  # closing call: Gate 2 + invariance + graphs with the default kernels (GEMM + stacks + fused
  # tails), the step profile at depths 0 and 32768, then the full-geometry stage with this session's llama.cpp rows (carried in .device/)
  full_bg
  timeout -s TERM 230 python3 tools/device_engine.py --out "$OUT" --no-full \
      --stages env,kernels,gate2,invariance --budget 215 2>&1 | tail -36
  wait_full 300
  echo "--- profile at $(el) s"
  timeout -s TERM 120 python3 tools/device_profile.py $FULL "$OUT" --depths 0,32768 --split-positions 512 \
      --gate-receipt "$(ls "$OUT"/*-engine-gate2-cuda.json | head -1)" 2>&1 | tail -34
  echo "--- engine full geometry at $(el) s"
  timeout -s TERM $(( 590 - $(el) )) python3 tools/device_engine.py --out "$OUT" --full $FULL --stages env,full \
      --depths 0,32768 --budget $(( 575 - $(el) )) \
      --gate-receipt "$(ls "$OUT"/*-engine-gate2-cuda.json | head -1)" \
      --llama-bench-json .device/llama-bench-session3.json 2>&1 | tail -24
elif [ "$phase" = A ]; then
  ( build_llama; echo "llama build rc=$? at $(el) s" >$W/build.done ) &
  full_bg
  timeout -s TERM 330 python3 tools/device_engine.py --out "$OUT" --no-full \
      --stages env,kernels,gate2,invariance --budget 310 2>&1 | tail -45
  while [ ! -f $W/build.done ] || [ ! -f $W/full.done ]; do
    [ "$(el)" -gt 500 ] && { echo "build/file not done at $(el) s"; break; }; sleep 3
  done
  cat $W/build.done $W/full.done 2>/dev/null; tail -3 $W/build.log 2>/dev/null; ls -la $FULL 2>/dev/null
  [ "$(el)" -lt 520 ] && llama_bench 0 $(( 575 - $(el) )) llama-bench-d0.json
elif [ "$phase" = C ]; then
  # one call on a cold machine, no llama.cpp build: engine correctness, then the full geometry
  # (llama.cpp's figures from an earlier call of this session, carried in .device/), then the
  # GEMM stage
  full_bg
  timeout -s TERM 250 python3 tools/device_engine.py --out "$OUT" --no-full \
      --stages env,kernels,gate2,invariance --budget 235 2>&1 | tail -45
  wait_full 330
  echo "--- engine full geometry at $(el) s"
  mkdir -p "$OUT/full"
  timeout -s TERM $(( 470 - $(el) )) python3 tools/device_engine.py --out "$OUT/full" --full $FULL \
      --stages full --depths 0,32768 --budget $(( 455 - $(el) )) \
      --gate-receipt "$(ls "$OUT"/*-engine-gate2-cuda.json | head -1)" \
      --llama-bench-json .device/llama-bench-d0.json 2>&1 | tail -16
  echo "--- kernel table at $(el) s"
  [ "$(el)" -lt 520 ] && timeout -s TERM $(( 560 - $(el) )) python3 tools/device_kernels.py --out "$OUT" \
      --budget $(( 545 - $(el) )) 2>&1 | tail -25
else
  ensure_full
  llama_bench 32768 190 llama-bench-d32768.json
  merge_llama_json
  if [ -f tools/device_kernels.py ]; then
    timeout -s TERM 100 python3 tools/device_kernels.py --out "$OUT" --budget 85 2>&1 | tail -30
  fi
  echo "--- engine full geometry at $(el) s"
  timeout -s TERM $(( 585 - $(el) )) python3 tools/device_engine.py --out "$OUT" --full $FULL --stages env,full \
      --depths 0,32768 --budget $(( 570 - $(el) )) --llama-bench-json $W/llama-bench.json 2>&1 | tail -30
fi
echo "phase $phase done at $(el) s"
ls -la "$OUT"
