#!/usr/bin/env bash
# One GPU-machine call: named stages, each time-boxed, each stage's receipts and log bundled into
# $OUT as soon as it finishes; a failed or skipped stage is recorded and the run goes on.
#
#   bash tools/device_session.sh [--cpu-dry] [--carry DIR] [--deadline S] [--depths 0,8192]
#                                [--kv-lengths 2048,8192,32768] [--nvfp4-mix nvfp4-ggml]
#                                [--kind-box S (150)] [--kvpack-box S (420)]
#                                [--llama-server PATH] [--reuse-gates] [--gates-only]
#                                [--lane exact|fast|split] [--kinds decode,prefill,verify]
#                                [--kernels-lane exact|fast|split] [--kernels-timings-only] [--install-tuning]
#                                [--kernels-shapes FMT:N_OUT:N_IN,...]
#                                [--profile-lanes exact,fast] [--profile-depths LIST] [--profile-rows 1,16]
#                                [--profile-modes eager,graph] [--profile-pdl on,off,N] [--profile-acts tails,separate]
#                                [--profile-parts "6;2,12"]
#                                [--cli-lanes exact,fast] [--counters-shape FMT:N_OUT:N_IN,...] [--counters-lanes exact,fast]
#                                [--attn-sweeps exact,f16,splits|none]
#                                STAGE...
#
# --reuse-gates takes a wide Gate 2 receipt of this tree and lane from an earlier call on this
# machine or, on a bare machine, from DIR/gates/ of the carry (a receipt fetched back from one).
# --kinds (default all three) are the speed kinds the speed and nvfp4 stages run, in that order;
# --kind-box is each kind's time box; decode runs once a depth of --depths, a box and a receipt each.
# --kernels-lane (default --lane) is the lane the kernels stage checks; --kernels-timings-only skips
# its invariance part (tools/device_kernels.py --no-invariance: a tree whose kernels an earlier call
# checked; the stage's receipt then says partial); --kernels-shapes times only those full-geometry shapes. --install-tuning: the kernels stage's sweep
# winners (DIR/kernels/v3_tuning.json for the exact lane, i8_tuning.json for the fast lane, checked by
# the module's load_tuning) replace this copy's kernels/<that file>'s entries of the swept shapes for
# the stages after it, the other shapes' entries kept (the speed receipts name the tables' SHA-256).
# --lane (default exact) is the lane the kernels, gate, speed and nvfp4 stages measure: with fast,
# the kernels stage checks the integer lane (tools/device_kernels.py --lane fast), the wide Gate 2 is
# the integer lane's (against the oracle's ggml-cpu arithmetic) and the speed kinds run --lane fast.
#
# Stages, in the order given (build and fixture start in the background at t = 0; the stages
# that need their outputs wait for them inside their own time box):
#   build    the pinned llama.cpp, CUDA sm_90, from DIR/llama.cpp-src.tgz: llama-bench (-j14; ~6.5 min),
#            then llama-server when the serve stage is named (~1 min more)
#   fixture  (implied by speed, kvpack, nvfp4, profile and cli)
#            the full geometry (tools/make_fixture.py --full: Q4_K mix, 16.75 GB) and, once that is
#            written and when the nvfp4 stage is named, its NVFP4 form by `muser quantize FULL NV
#            --to nvfp4-ggml` (ggml type 40, the file llama.cpp runs too; one process per core;
#            its time in nv.done and logs/fixture-<mix>.log)
#   kernels  python3 tools/device_kernels.py --out ...: row invariance on CUDA (every format, both
#            K/V types) and each full-geometry matvec shape timed at 1..16 rows, the 1- and
#            16-row tilings swept (the winners written as kernels/v3_tuning.json); DIR/qmatvec_v3_before.py,
#            when carried, an earlier matvec module whose 4- and 16-row calls are timed beside, 320 s
#   gate     Gate 2 at full width, 4 layers (tools/device_gate_wide.py), f16 K/V, Q4_K mix: the
#            receipt the speed stage is gated by; in the background from t = 0 (CPU-bound oracle),
#            boxed at the deadline - 60 s (236-476 s by machine, either lane: the oracle's dots run
#            on one BLAS thread, oracle/forward.py single_thread_blas); the speed stage waits for it
#            as long as that box
#   speed    muser bench decode|prefill|verify --device cuda on the full Q4_K file: decode at
#            --depths (default 0,8192), prefill at the first depth, verify at each (llama.cpp's beside
#            it at the first only); llama-bench's figures
#            on the same file beside them (pp512/pp16/tg128/tg1 at the first depth, tg128 deeper;
#            read as --llama-bench-json), a PNG of tok/s vs depth for both engines
#   kvpack   muser bench kvpack --device cuda --model FULL, documents of --kv-lengths tokens (default
#            2048,8192,32768) + a new 64-token question (--suffix-tokens 64), one repetition, exact lane
#   sampling python3 tools/device_sampling.py: device-filtered candidates vs the full chain on CUDA,
#            the load-time warm-up, `muser generate` TTFT and tok/s on the micro model
#   cli      `muser generate` as a user runs it on the full Q4_K file, once per lane of --cli-lanes
#            (default exact,fast): a prompt of 16 tokens (the longest prefix of README.md that
#            tokenizes to 16), 64 tokens, seed 0, --json; the process's seconds (load, warm-up,
#            request) in stages.tsv, its TTFT and tok/s in logs/cli-LANE.log
#   nvfp4    the same Gate 2 for the NVFP4 mix (background from t = 0), the speed kinds on the NVFP4 full file,
#            llama-bench (type 40) on that file beside them; the Q4_K receipts of the speed stage
#            are the K-quant side (same geometry, random valid blocks of each format)
#   serve    muser bench serve --device cuda at 1/4/16 clients on the full Q4_K file when it is
#            written (else, or when that run fails, the shipped micro model), the CUDA
#            llama-server beside it when built (or the one --llama-server names)
#   attn     python3 tools/device_attn.py: attention at the engine's shape, both operand kinds,
#            against attend_ref, row invariance, decode and 16-row times at depths 64 and 32,768, and
#            the sweeps of --attn-sweeps (default exact: the exact pass under each launch choice; none: no sweep;
#            f16: the f16 passes under each launch choice (warps, pipeline stages); splits: the f16
#            passes under each split length); DIR/attention_before.py, when carried, timed beside
#            it, 200 s; named before gate and speed it runs while the wide gate is computed
#   profile  python3 tools/device_profile.py on the full Q4_K file, --profile-lanes (exact,fast):
#            eager and/or graph steps (--profile-modes) of --profile-rows (1,16) rows at
#            --profile-depths (the first depth) under the torch profiler (GPU time per kernel,
#            launches) and the graph steps' host side under cProfile, with --profile-pdl's settings of
#            programmatic dependent launch (default on; on,off times both; a row count N: on for
#            launches of up to N rows, gdc.ROWS) and, in the fast lane,
#            --profile-acts's (tails: the tails quantize the projections' inputs, the default;
#            tails,separate times both) and --profile-parts's graph splits (engine/graphs.PART_LAYERS;
#            "6;2,12" times both; default the shipped one), 200 s; it waits for the
#            fixture only, so named before speed it runs while the wide gate is computed
#   counters python3 tools/device_counters.py: the projection kernels of --counters-lanes
#            (exact,fast; the integer lane on its tuning table's routes) on --counters-shape
#            (Q4_K:39936:6656; a comma list takes several) at 1 and 16 rows under ncu's hardware counters
#            (stall reasons per issued instruction, pipe and memory-path use, occupancy), 200 s;
#            synthetic weights, no fixture
#   spec     muser bench spec on the shipped micro target + drafter (natural and synthetic prompts,
#            greedy and sampled; Gate 3: speculative tokens == plain tokens) on CUDA
#
# --cpu-dry: the same stages on the CPU with tiny fixtures (8 layers of the default synthetic
# widths): no llama.cpp build (the venv's llama-cpp-python is the comparator), device_kernels in
# its --smoke form, Gate 2 at the tiny widths. Interpreter: $PY (default python3).
# Carry DIR (default .device/gpubench, written by tools/pack_device_carry.sh): llama.cpp-src.tgz and
# whl/ (gguf, starlette, uvicorn, pydantic and their wheels for python 3.12). Files back in $OUT: stages.tsv (stage, rc,
# seconds, note), receipts.tgz (receipts, PNGs, kernel JSON), logs.tgz (with gpu-clocks.csv: the card's
# SM and memory clocks, power, temperature and throttle reasons every 500 ms), summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?OUT must name the folder whose files come back}"
DRY=0 CARRY=.device/gpubench DEADLINE=585 LLAMA_SERVER="" DEPTHS=0,8192 NVFP4_MIX=nvfp4-ggml KV_LENGTHS=2048,8192,32768
KIND_BOX=150 KVPACK_BOX=420 REUSE_GATES=0 GATES_ONLY=0 LANE=exact KINDS=decode,prefill,verify
STAGES=() KLANE="" KARGS=() INSTALL_TUNING=0 PLANES=exact,fast PDEPTHS="" PROWS=1,16 PMODES=eager,graph PPDL=on PACTS=tails PPARTS=""
CLI_LANES=exact,fast CSHAPE=Q4_K:39936:6656 CLANES=exact,fast ASWEEPS=exact
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu-dry) DRY=1 ;;
    --carry) CARRY=${2:?--carry DIR}; shift ;;
    --deadline) DEADLINE=${2:?--deadline SECONDS}; shift ;;
    --depths) DEPTHS=${2:?--depths LIST}; shift ;;
    --nvfp4-mix) NVFP4_MIX=${2:?--nvfp4-mix nvfp4|nvfp4-ggml}; shift ;;
    --kv-lengths) KV_LENGTHS=${2:?--kv-lengths LIST}; shift ;;
    --llama-server) LLAMA_SERVER=${2:?--llama-server PATH}; shift ;;
    --kind-box) KIND_BOX=${2:?--kind-box SECONDS}; shift ;;
    --kvpack-box) KVPACK_BOX=${2:?--kvpack-box SECONDS}; shift ;;
    --reuse-gates) REUSE_GATES=1 ;;
    --kinds) KINDS=${2:?--kinds LIST}; shift
             [[ "$KINDS" =~ ^(decode|prefill|verify)(,(decode|prefill|verify))*$ ]] || {
               echo "--kinds $KINDS: expected a comma-separated list of decode, prefill, verify" >&2; exit 2; } ;;
    --gates-only) GATES_ONLY=1 ;;
    --kernels-lane) KLANE=${2:?--kernels-lane exact|fast}; shift
            [[ "$KLANE" =~ ^(exact|fast|split)$ ]] || { echo "--kernels-lane $KLANE: expected exact, fast or split" >&2; exit 2; } ;;
    --kernels-timings-only) KARGS+=(--no-invariance) ;;
    --kernels-shapes) KARGS+=(--shapes "${2:?--kernels-shapes LIST}"); shift ;;
    --install-tuning) INSTALL_TUNING=1 ;;
    --lane) LANE=${2:?--lane exact|fast}; shift
            [[ "$LANE" =~ ^(exact|fast|split)$ ]] || { echo "--lane $LANE: expected exact, fast or split" >&2; exit 2; } ;;
    --profile-lanes) PLANES=${2:?--profile-lanes LIST}; shift ;;
    --profile-depths) PDEPTHS=${2:?--profile-depths LIST}; shift ;;
    --profile-rows) PROWS=${2:?--profile-rows LIST}; shift ;;
    --profile-modes) PMODES=${2:?--profile-modes eager,graph}; shift ;;
    --profile-pdl) PPDL=${2:?--profile-pdl on,off,N}; shift ;;
    --profile-parts) PPARTS=${2:?--profile-parts "SPLITS;SPLITS"}; shift ;;
    --profile-acts) PACTS=${2:?--profile-acts tails,separate}; shift ;;
    --cli-lanes) CLI_LANES=${2:?--cli-lanes LIST}; shift
                 [[ "$CLI_LANES" =~ ^(exact|fast)(,(exact|fast))*$ ]] || {
                   echo "--cli-lanes $CLI_LANES: expected a comma-separated list of exact, fast" >&2; exit 2; } ;;
    --counters-shape) CSHAPE=${2:?--counters-shape FMT:N_OUT:N_IN[,...]}; shift ;;
    --counters-lanes) CLANES=${2:?--counters-lanes exact,fast}; shift
                      [[ "$CLANES" =~ ^(exact|fast)(,(exact|fast))*$ ]] || {
                        echo "--counters-lanes $CLANES: expected a comma-separated list of exact, fast" >&2; exit 2; } ;;
    --attn-sweeps) ASWEEPS=${2:?--attn-sweeps exact,f16,splits or none}; shift
                   [[ "$ASWEEPS" =~ ^((exact|f16|splits)(,(exact|f16|splits))*|none)$ ]] || {
                     echo "--attn-sweeps $ASWEEPS: expected a comma-separated list of exact, f16, splits, or none" >&2; exit 2; } ;;
    build|fixture|kernels|attn|gate|speed|kvpack|nvfp4|serve|sampling|spec|profile|cli|counters) STAGES+=("$1") ;;
    *) echo "unknown argument or stage: $1" >&2; exit 2 ;;
  esac
  shift
done
[ ${#STAGES[@]} -gt 0 ] || { echo "name at least one stage" >&2; exit 2; }
[ -n "$KLANE" ] || KLANE=$LANE
if [ -n "${MUSER_GIT_SHA:-}" ] && ! [[ "$MUSER_GIT_SHA" =~ ^[0-9a-f]{40}$ ]]; then  # receipts must name the full SHA
  echo "MUSER_GIT_SHA '$MUSER_GIT_SHA' is not a full 40-hex SHA (git rev-parse HEAD)" >&2; exit 2; fi
PY=${PY:-python3}
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( DEADLINE - $(el) )); }
has() { local s; for s in "${STAGES[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }

W=${MUSER_DEVICE_WORK:-/tmp/muser-dev}
R=$W/out/receipts L=$W/out/logs
# the wide Gate 2 receipts of earlier calls on this (warm) machine are kept: --reuse-gates gates this
# call's speed kinds by one of them when it names this tree's SHA and the mix (gate_receipt)
mkdir -p "$W/gates" && cp "$W"/out/receipts/*-engine-gate2-wide-*.json "$W/gates/" 2>/dev/null
rm -f "$W"/gate-*.done
rm -rf "$W/out" && mkdir -p "$R" "$L" "$OUT"
LB=/tmp/llama-cuda
BENCH=$LB/llama.cpp/build/bin/llama-bench SERVER=$LB/llama.cpp/build/bin/llama-server
if [ $DRY = 1 ]; then
  DEV=cpu FULL=$W/dry-q4_k_xl.gguf NV=$W/dry-$NVFP4_MIX.gguf
  DEPTHS=0,40 KV_LENGTHS=600,1100 SPEED_TOKENS="--tokens 4" REPS=2 GEOM=tiny
else
  DEV=cuda FULL=$W/full-q4_k_xl.gguf NV=$W/full-$NVFP4_MIX.gguf
  SPEED_TOKENS="" REPS=5 GEOM=full
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
if [ $DRY = 0 ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "$CARRY"/whl/*.whl >"$L/pip.log" 2>&1 || echo "wheels from $CARRY/whl not installed (see logs/pip.log)"
fi
# the CPU kernel library (CPU engines refuse without it; the oracle and the micro fallback use it)
$PY setup.py -q build_ext --inplace >"$L/build_ext.log" 2>&1 || echo "CPU kernel library not built" >&2
echo -e "stage\trc\tseconds\tnote" >"$W/stages.tsv"
# the card's clocks, power, temperature and throttle reasons every 500 ms for the whole call
# (logs/gpu-clocks.csv): a compute-bound figure that moves between machines or repetitions is read
# against the SM clock it ran at
CLOCKS_PID=""
if [ $DRY = 0 ] && command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv,nounits -lms 500 >"$L/gpu-clocks.csv" 2>&1 &
  CLOCKS_PID=$!
fi

bundle() {  # everything so far into $OUT (at most 4 files back; background jobs bundle too)
  local x=.tmp$BASHPID
  tar czf "$W/receipts.tgz$x" -C "$W/out" receipts 2>/dev/null && mv "$W/receipts.tgz$x" "$OUT/receipts.tgz"
  tar czf "$W/logs.tgz$x" -C "$W/out" logs 2>/dev/null && mv "$W/logs.tgz$x" "$OUT/logs.tgz"
  cp "$W/stages.tsv" "$W/stages.tsv$x" && mv "$W/stages.tsv$x" "$OUT/stages.tsv"
}
record() { echo -e "$1\t$2\t$3\t$4" >>"$W/stages.tsv"; echo "== $1 rc=$2 ${3}s $4 (t=$(el) s)"; bundle; }
# run_stage NAME BOX_S MIN_S CMD...: CMD under a timeout of min(BOX, time left - 5); skipped when
# less than MIN is left; its output in logs/NAME.log (last lines echoed)
run_stage() {
  local name=$1 box=$2 min=$3; shift 3
  local lim=$(( $(left) - 5 )); [ $lim -gt $box ] && lim=$box
  if [ $lim -lt $min ]; then record "$name" - 0 "skipped: ${lim} s left, needs ${min}"; return 1; fi
  local t=$(date +%s)
  timeout -k 10 -s TERM $lim "$@" >>"$L/$name.log" 2>&1
  local rc=$?
  tail -6 "$L/$name.log" | sed "s/^/  [$name] /"
  record "$name" $rc $(( $(date +%s) - t )) "box ${lim} s$([ $rc = 124 ] && echo ', timed out')"
  return $rc
}
# wait_for FILE LIMIT_S: until FILE exists or LIMIT seconds of the session have passed
wait_for() { while [ ! -e "$1" ] && [ "$(el)" -lt "$2" ]; do sleep 2; done; [ -e "$1" ]; }

# --- background: the llama.cpp build and the fixture writes --------------------------------------
if has build; then
  if [ $DRY = 1 ]; then
    record build - 0 "dry run: no llama.cpp build here (llama-cpp-python is the CPU comparator)"
  elif [ -x $BENCH ] && { ! has serve || [ -x $SERVER ]; }; then  # a warm machine still holds this call's build
    echo "llama-bench rc=0 0 s (warm)" >"$W/llama-bench.done"
    has serve && echo "llama-server rc=0 0 s (warm)" >"$W/llama-server.done"
  else
    ( t=$(date +%s)
      if [ ! -x $BENCH ]; then
        mkdir -p $LB && tar xzf "$CARRY/llama.cpp-src.tgz" -C $LB \
        && cmake -S $LB/llama.cpp -B $LB/llama.cpp/build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF \
             -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF \
             -DLLAMA_USE_PREBUILT_UI=OFF >"$L/llama-cmake.log" 2>&1 \
        && cmake --build $LB/llama.cpp/build -j14 --target llama-bench >"$L/llama-build.log" 2>&1
      fi
      echo "llama-bench rc=$? $(( $(date +%s) - t )) s" >"$W/llama-bench.done"
      # llama-server only for the serve stage: its compile would share the host's cores with the
      # speed stages' timings (llama-bench's and Muser's) that follow llama-bench's build
      if has serve; then
        [ -x $BENCH ] && cmake --build $LB/llama.cpp/build -j14 --target llama-server >>"$L/llama-build.log" 2>&1
        echo "llama-server rc=$? $(( $(date +%s) - t )) s" >"$W/llama-server.done"
      fi ) &
  fi
fi
# the stages that read the full file write it when it is absent, named or not (a bare machine)
if has fixture || has speed || has kvpack || has nvfp4 || has profile || has cli; then
  if [ $DRY = 1 ]; then FX_Q4=(tools/make_fixture.py "$FULL" --dtype q4_k_xl --source blocks --layers 8)
  else FX_Q4=(tools/make_fixture.py "$FULL" --full); fi
  ( t=$(date +%s); [ -s "$FULL" ] || $PY "${FX_Q4[@]}" >"$L/fixture-q4_k_xl.log" 2>&1
    echo "rc=$? $(( $(date +%s) - t )) s $(stat -c %s "$FULL" 2>/dev/null) B" >"$W/full.done"
    if has nvfp4; then  # the NVFP4 file only for the stage that reads it: the Q4_K file re-encoded
      t=$(date +%s); rc=0
      [ -s "$NV" ] || { [ -s "$FULL" ] && $PY -m muser quantize "$FULL" "$NV" --to "$NVFP4_MIX" \
                          >"$L/fixture-$NVFP4_MIX.log" 2>&1; } || rc=$?
      echo "rc=$rc $(( $(date +%s) - t )) s $(stat -c %s "$NV" 2>/dev/null) B (muser quantize --to $NVFP4_MIX)" >"$W/nv.done"
    fi ) &
  FX_PIDS="$!"
fi

# Gate 2 at full width, 4 layers, f16 K/V (the speed kinds' --gate-receipt): mostly CPU work (the
# f32 oracle; ~240 s at full width on the last device run), so it runs beside the GPU stages from
# t = 0, one process per mix, BLAS threads capped; GATE_DONE_<mix> marks it finished
wide_gate_bg() {  # MIX
  ( OMP_NUM_THREADS=4 OPENBLAS_NUM_THREADS=4 MKL_NUM_THREADS=4 \
      run_stage "gate-$1" $(( DEADLINE - 60 )) 60 $PY tools/device_gate_wide.py "$R" --dtype "$1" --device $DEV \
      --geometry $GEOM --kv f16 --gate-tokens 16 --budget $(( DEADLINE - 70 )) --workdir "$W" --lane $LANE
    touch "$W/gate-$1.done" ) &
  GATE_PIDS="${GATE_PIDS:-} $!"
}
earlier_gate() {  # MIX -> an earlier call's wide Gate 2 receipt for MIX of this tree (copied into $R)
  local f
  [ -n "${MUSER_GIT_SHA:-}" ] || return 1
  # this machine's earlier calls, then receipts carried in DIR/gates/ (a bare machine: a gate of an
  # earlier machine of this tree, fetched back and carried)
  for f in "$W"/gates/*-engine-gate2-wide-$DEV.json "$CARRY"/gates/*-engine-gate2-wide-$DEV.json; do  # (an unmatched glob stays literal)
    if [ -f "$f" ] && grep -q "\"dtype\": \"$1\"" "$f" && grep -q "\"git_sha\": \"$MUSER_GIT_SHA\"" "$f" \
       && grep -q "^  \"lane\": \"$LANE\"" "$f"; then
      cp "$f" "$R/" && echo "$R/$(basename "$f")" && return 0
    fi
  done
  return 1
}
gate_bg() {  # MIX: this call's gate, or with --reuse-gates an earlier one of this tree
  local g
  if [ $REUSE_GATES = 1 ] && g=$(earlier_gate "$1"); then
    record "gate-$1" 0 0 "reused $(basename "$g") (an earlier call on this machine, same tree)"
    touch "$W/gate-$1.done"
  else wide_gate_bg "$1"; fi
}
has gate && gate_bg q4_k_xl
has nvfp4 && gate_bg "$NVFP4_MIX"

# --- the comparator's figures: one llama-bench run per file (read by the speed kinds) -------------
llama_json() {  # GGUF NAME -> $W/NAME.json: pp512, pp16, tg128, tg1 at the first depth (5 reps), and
  # tg128 at each deeper depth (3 reps: llama-bench re-fills the depth before every repetition)
  [ $DRY = 1 ] && return 1
  has build && wait_for "$W/llama-bench.done" $(( DEADLINE - 60 ))  # a warm machine may hold a build
  [ -x $BENCH ] || { record "llama-bench-$2" - 0 "no llama-bench build ($(cat "$W/llama-bench.done" 2>/dev/null))"; return 1; }
  local d0=${DEPTHS%%,*} deep=""; [ "$DEPTHS" != "$d0" ] && deep=${DEPTHS#*,}
  run_stage "llama-bench-$2" 150 30 bash -c "$BENCH -m '$1' -ngl 99 -fa 1 -p 512,16 -n 128,1 -d $d0 -r 5 \
      -o json >'$W/$2-d0.json' 2>'$L/llama-bench-$2.err'" || return 1
  if [ -n "$deep" ]; then
    run_stage "llama-bench-$2-deep" 150 30 bash -c "$BENCH -m '$1' -ngl 99 -fa 1 -p 0 -n 128 -d $deep -r 3 \
        -o json >'$W/$2-deep.json' 2>>'$L/llama-bench-$2.err'"
  fi
  $PY -c "import json,sys; json.dump([t for f in sys.argv[2:] for t in json.load(open(f))], open(sys.argv[1], 'w'))" \
      "$W/$2.json" "$W/$2-d0.json" $([ -s "$W/$2-deep.json" ] && echo "$W/$2-deep.json") \
    && cp "$W/$2.json" "$R/llama-bench-$2.json"
  [ -s "$W/$2.json" ]
}

# speed_kinds LABEL GGUF GATE_RECEIPT LLAMA_JSON|"": decode, prefill, verify; a PNG of tok/s vs depth
speed_kinds() {
  local label=$1 model=$2 gate=$3 lj=$4 kind against=()
  if [ $DRY = 1 ]; then against=(--against llama.cpp); elif [ -n "$lj" ]; then
    against=(--against llama.cpp --llama-bench-json "$lj"); fi
  for kind in ${KINDS//,/ }; do
    local plot=(); plot_flag $kind && plot=(--plot)
    # prefill and verify at the first depth; decode at each depth, one run and receipt a depth, each
    # in its own box (a deep run first prefills its context: 32,768 tokens are ~110 s of the exact
    # lane's prefill on an H100), so a deadline that cuts the deep run keeps the shallower receipts
    local ds=${DEPTHS%%,*} d
    [ $kind = decode ] && ds=${DEPTHS//,/ }
    for d in $ds; do  # one log a kind (run_stage appends): speed_plot reads every receipt line of it
      run_stage "$label-$kind" $KIND_BOX 40 $PY -m muser bench $kind --model "$model" --device $DEV --lane $LANE \
          --depths "$d" --reps $REPS --warmup 1 $SPEED_TOKENS --gate-receipt "$gate" --out-dir "$R" "${against[@]}" "${plot[@]}"
    done
    d=${DEPTHS%%,*}
    # verify deeper too, Muser's side alone: its figure is its own verify/decode1 ratio, and
    # llama-bench would re-fill a deep context before each repetition of pp16 and of tg1
    if [ $kind = verify ] && [ "$DEPTHS" != "$d" ]; then
      run_stage "$label-verify-deep" $(( KIND_BOX * ($(echo "$DEPTHS" | tr ',' '\n' | wc -l) - 1) )) 40 \
          $PY -m muser bench verify --model "$model" --device $DEV --lane $LANE --depths "${DEPTHS#*,}" \
          --reps $REPS --warmup 1 $SPEED_TOKENS --gate-receipt "$gate" --out-dir "$R"
    fi
  done
}


speed_plot() {  # LABEL: tok/s vs depth of this stage's decode and prefill receipts, both engines
  local rs
  rs=$(cat "$L/$1-decode.log" "$L/$1-prefill.log" 2>/dev/null | sed -n 's/.*; receipt: \(\S*\.json\)$/\1/p')
  [ -n "$rs" ] || return 0
  if $PY -m muser bench plot --help >/dev/null 2>&1; then
    mkdir -p "$R/plots"  # beside, not among, the receipts (each receipt keeps only its own PNG)
    run_stage "$1-plot" 60 10 $PY -m muser bench plot $rs --out "$R/plots/$1-tok-s-vs-depth.png"
  else
    record "$1-plot" - 0 "muser bench plot is absent from this tree"
  fi
}

plot_flag() { $PY -m muser bench "$1" --help 2>/dev/null | grep -q -- "--plot"; }  # KIND writes its PNG

gate_receipt() {  # MIX -> path of this call's passing-or-not wide Gate 2 receipt for MIX, this lane
  grep -l "^  \"lane\": \"$LANE\"" $(grep -l "\"dtype\": \"$1\"" "$R"/*-engine-gate2-wide-$DEV.json 2>/dev/null) \
    2>/dev/null | head -1
}

for st in "${STAGES[@]}"; do
  case $st in
    build|fixture) ;;
    kernels)
      if [ -f tools/device_kernels.py ]; then
        mkdir -p "$R/kernels"
        if [ $DRY = 1 ]; then run_stage kernels 150 20 $PY tools/device_kernels.py --out "$R/kernels" --device cpu --smoke --budget 130 --lane $LANE
        else  # the tool's own budget (its cases, then its attention run, up to 60 s) ends inside the box
          kb=$(( $(left) - 75 )); [ $kb -gt 290 ] && kb=290
          if [ $KLANE = fast ]; then  # GEMM shapes with tilings and the attention check besides the invariance
            run_stage kernels 320 60 $PY tools/device_kernels.py --out "$R/kernels" --budget $kb --lane fast "${KARGS[@]}"
          else
            vb=(); [ -s "$CARRY/qmatvec_v3_before.py" ] && vb=(--before "$CARRY/qmatvec_v3_before.py")
            run_stage kernels 320 60 $PY tools/device_kernels.py --out "$R/kernels" --budget $kb --lane $KLANE "${KARGS[@]}" "${vb[@]}"; fi
        fi
        if [ $INSTALL_TUNING = 1 ]; then  # the sweep's winners become this copy's table for the stages after it
          if [ $KLANE = fast ]; then tf=i8_tuning.json tm=qtile_i8; else tf=v3_tuning.json tm=qmatvec_v3; fi
          # merged: the swept shapes' entries replace the tree's for those shapes, the others stay
          # (a sweep of --kernels-shapes leaves the rest of the table as it was)
          if [ -s "$R/kernels/$tf" ] && $PY -c "import json, sys; sys.path.insert(0, 'src')
from muser.engine.kernels import $tm as q
new, old = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
key = lambda e: (e['fmt'], e['rows'], e['n_out'], e['n_in'])
swept = {(e['fmt'], e['n_out'], e['n_in']) for e in new}
merged = [e for e in old if (e['fmt'], e['n_out'], e['n_in']) not in swept] + new
open(sys.argv[3], 'w').write(json.dumps(sorted(merged, key=key), indent=1) + chr(10))
q.load_tuning(sys.argv[3])" "$R/kernels/$tf" "src/muser/engine/kernels/$tf" "$R/kernels/merged-$tf"; then
            cp "$R/kernels/merged-$tf" "src/muser/engine/kernels/$tf"
            record tuning 0 0 "installed the sweep's $tf (merged over the tree's), sha256 $(sha256sum "src/muser/engine/kernels/$tf" | cut -c1-16)"
          else record tuning 1 0 "no valid sweep table ($tf): the tree's own stays"; fi
        fi
      else record kernels - 0 "tools/device_kernels.py is absent"; fi ;;
    gate) ;;  # in the background from t = 0 (wide_gate_bg)
    spec)
      croot=()  # the held-out split from the carry where this python is not the one the model was trained from
      if [ -s "$CARRY/heldout.tgz" ]; then
        rm -rf "$W/heldout" && mkdir -p "$W/heldout" && tar xzf "$CARRY/heldout.tgz" -C "$W/heldout" && croot=(--corpus-root "$W/heldout")
      fi
      run_stage spec 150 40 $PY -m muser bench spec --device $DEV --prompts 3 --max-tokens 64 --reps 1 "${croot[@]}" --out-dir "$R" ;;
    cli)
      if ! wait_for "$W/full.done" $(( DEADLINE - 60 )) || [ ! -s "$FULL" ]; then
        record cli - 0 "no $FULL ($(cat "$W/full.done" 2>/dev/null || echo 'fixture not done'))"; continue; fi
      # the longest prefix of README.md that the file's tokenizer makes 16 tokens (BOS included)
      if ! $PY - "$FULL" README.md "$W/cli-prompt.txt" >"$L/cli-prompt.log" 2>&1 <<'PYEOF'
import sys
from muser import prompt as P
from muser.gguf.reader import GGUFFile
from muser.text import Tokenizer

f = GGUFFile(sys.argv[1])
tok = Tokenizer.from_gguf(f)
text, best = open(sys.argv[2], encoding="utf-8").read(), None
for c in range(1, 2000):
    n = len(P.encode_text(tok, text[:c]))
    if n == 16:
        best = text[:c]
    elif n > 16:
        break
f.close()
if best is None:
    sys.exit("no prefix of 16 tokens")
open(sys.argv[3], "w", encoding="utf-8").write(best)
print(f"prompt of 16 tokens: {best!r}")
PYEOF
      then record cli 1 0 "no 16-token prompt (logs/cli-prompt.log)"; continue; fi
      for l in ${CLI_LANES//,/ }; do
        run_stage "cli-$l" 200 40 $PY -m muser generate --model "$FULL" --device $DEV --lane $l --max-tokens 64 \
          --seed 0 --json --prompt-file "$W/cli-prompt.txt"
      done ;;
    sampling)
      if [ $DRY = 1 ]; then record sampling - 0 "dry run: the device-side candidates and the warm-up need CUDA"
      else mkdir -p "$R/sampling"; run_stage sampling 120 30 $PY tools/device_sampling.py --out "$R/sampling"; fi ;;
    speed|nvfp4)
      # --gates-only: this call writes the file and the gate (a later call on the warm machine runs the
      # speed kinds with --reuse-gates)
      if [ $GATES_ONLY = 1 ]; then record $st - 0 "--gates-only: the file and the wide Gate 2 only"; continue; fi
      if [ $st = speed ]; then model=$FULL mix=q4_k_xl done_file=$W/full.done
      else model=$NV mix=$NVFP4_MIX done_file=$W/nv.done; fi
      # as long as the gate's own box (DEADLINE - 60, and the 10 s its kill may take)
      { [ $st = nvfp4 ] || has gate; } && wait_for "$W/gate-$mix.done" $(( DEADLINE - 45 ))
      if ! wait_for "$done_file" $(( DEADLINE - 120 )) || [ ! -s "$model" ]; then
        record $st - 0 "no $model ($(cat "$done_file" 2>/dev/null || echo 'fixture not done'))"; continue; fi
      g=$(gate_receipt "$mix")
      if [ -z "$g" ]; then record $st - 0 "no wide Gate 2 receipt for $mix (the speed stage needs the gate stage)"; continue; fi
      lj=""; llama_json "$model" "$st" && lj=$W/$st.json
      speed_kinds $st "$model" "$g" "$lj"
      speed_plot $st ;;
    profile)
      if [ $DRY = 1 ]; then record profile - 0 "dry run: the step profile needs CUDA"; continue; fi
      if ! wait_for "$W/full.done" $(( DEADLINE - 60 )) || [ ! -s "$FULL" ]; then
        record profile - 0 "no $FULL"; continue; fi
      g=$(gate_receipt q4_k_xl); gr=(); [ -n "$g" ] && gr=(--gate-receipt "$g")
      run_stage profile 200 60 $PY tools/device_profile.py "$FULL" "$R" --lanes "$PLANES" \
          --depths "${PDEPTHS:-${DEPTHS%%,*}}" --rows "$PROWS" --modes "$PMODES" --pdl "$PPDL" --acts "$PACTS" --parts "$PPARTS" --steps 8 "${gr[@]}" ;;
    counters)
      if [ $DRY = 1 ]; then record counters - 0 "dry run: the hardware counters need CUDA"; continue; fi
      run_stage counters 200 60 $PY tools/device_counters.py "$R/counters" --shape "$CSHAPE" --lanes "$CLANES" ;;
    attn)
      if [ $DRY = 1 ]; then run_stage attn 150 20 $PY tools/device_attn.py --smoke --json "$R/attn-cpu.json"
      else
        before=(); [ -s "$CARRY/attention_before.py" ] && before=(--before "$CARRY/attention_before.py")
        sweeps=(); for sw in ${ASWEEPS//,/ }; do
          case $sw in exact) sweeps+=(--sweep) ;; f16) sweeps+=(--sweep-f16) ;; splits) sweeps+=(--sweep-splits) ;; esac; done
        run_stage attn 200 30 $PY tools/device_attn.py --depths 64,32768 "${sweeps[@]}" --reps 100 \
            --json "$R/attn-cuda.json" "${before[@]}"
      fi ;;
    kvpack)
      if ! wait_for "$W/full.done" $(( DEADLINE - 120 )) || [ ! -s "$FULL" ]; then
        record kvpack - 0 "no $FULL"; continue; fi
      plot=(); plot_flag kvpack && plot=(--plot)
      run_stage kvpack $KVPACK_BOX 60 $PY -m muser bench kvpack --model "$FULL" --device $DEV --lengths $KV_LENGTHS \
          --suffix-tokens 64 --reps 1 --warmup 0 --gate-tokens 16 --dir "$W/kvpack-store" --out-dir "$R" "${plot[@]}" ;;
    serve)
      model=(); [ -s "$FULL" ] && model=(--model "$FULL")
      # the comparator beside it, once built: both servers on the full file take ~60 s, so wait up to 130 s before the end
      has build && { wait_for "$W/llama-server.done" $(( DEADLINE - 130 )) ||
                     echo "serve: llama-server not built by t=$(el) s: this run has no comparator beside it"; }
      ls_=(); [ -x $SERVER ] && ls_=(--against llama-server --llama-server $SERVER)
      [ -n "$LLAMA_SERVER" ] && ls_=(--against llama-server --llama-server "$LLAMA_SERVER")
      plot=(); plot_flag serve && plot=(--plot)
      run_stage serve 300 60 $PY -m muser bench serve --device $DEV "${model[@]}" "${ls_[@]}" --clients 1,4,16 \
          --max-tokens 16 --slots 16 --ctx 1024 --out-dir "$R" "${plot[@]}"
      rc=$?  # 1: a receipt with a failed load == alone gate; anything else with the full file: the micro model
      if [ $rc -gt 1 ] && [ ${#model[@]} -gt 0 ] && [ $DRY = 0 ]; then
        run_stage serve-micro 120 60 $PY -m muser bench serve --device $DEV "${ls_[@]}" --clients 1,4,16 \
            --max-tokens 16 --slots 16 --ctx 1024 --out-dir "$R" "${plot[@]}"
      fi ;;
  esac
done

# the fixture writers and the background gates finish (a later call on a warm machine reuses them)
# while time is left
for pid in ${FX_PIDS:-} ${GATE_PIDS:-}; do
  while kill -0 "$pid" 2>/dev/null && [ "$(left)" -gt 5 ]; do sleep 2; done
done
cat "$W"/*.done 2>/dev/null | sed 's/^/background: /'
speed_table() {  # one line per speed cell of this call's receipts: model, kind, depth, both engines
  $PY - "$R" <<'EOF'
import json, pathlib, sys
for p in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    try:
        r = json.loads(p.read_text())
    except ValueError:
        continue
    if not isinstance(r, dict) or r.get("kind") not in ("decode", "prefill", "verify"):
        continue
    name, res = pathlib.Path(r["model"]["path"]).name, r["results"]
    for d, c in res["per_depth"].items():
        if r["kind"] == "verify":
            mu = c.get("muser", {})
            print(f"{name:28} verify  d{d:>6}  verify/decode1 {mu.get('ratio_verify_over_decode1', 0):.3f}  {res['status']}")
            continue
        mu, ll = c["muser"]["tok_s"], c.get("llama.cpp", {}).get("tok_s", {})
        gb = mu.get("achieved_gbps", {}).get("mean")
        print(f"{name:28} {r['kind']:7} d{d:>6}  muser {mu['mean']:9.2f} tok/s" + (f" {gb:8.1f} GB/s" if gb else "")
              + (f" | llama.cpp {ll['mean']:9.2f} | ratio {c['ratio_muser_over_llamacpp']:.3f}" if ll else "")
              + f"  {res['status']}")
EOF
}
[ -n "$CLOCKS_PID" ] && kill "$CLOCKS_PID" 2>/dev/null
{ echo "session $(el) s, stages: ${STAGES[*]} (dry=$DRY)"; cat "$W/stages.tsv"
  cat "$W"/*.done 2>/dev/null | sed 's/^/background: /'; speed_table; ls -la "$R"; df -h "$W" | tail -1
} >"$OUT/summary.txt"
bundle
cat "$OUT/summary.txt"
