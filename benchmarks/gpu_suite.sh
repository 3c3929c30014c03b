#!/usr/bin/env bash
# Every GPU test and benchmark in one go, for a GPU machine with a limited time per command.
#
#   OUT=/path/to/results bash benchmarks/gpu_suite.sh [step ...]
#
# Ends with benchmarks/targets.py: the performance targets beside their measured values.
# Steps (default: all, in this order): tests (every GPU test not in the next three steps), families (fla's
# further kernel families, bf16), hf_tests (transformers models, bf16), monitor (training with the
# monitor, bf16 autocast), layers, phase1, replay, comparator, capture, e2e,
# e2e_stored, e2e_1b, memory, e2e_hf (realistic transformers-model layer shapes), wall (the paper-scale
# command as typed, timed from the shell: first run with an empty Triton cache of its own, then warm),
# monitor_bench (the monitor's cost to the built-in LM recipe's training); and, not in the default list,
# lm_recipe (the built-in language models' training recipe with the monitor on: the model cards'
# q_geo-by-step curves; needs the corpus in $LMDATA, returned as lm_recipe.tgz.part-*; resumable),
# scale_prepare and scale (examples/scale_study.py at one size, resumable), e2e_ddp (every
# GPU of the machine under torchrun) and device_map (the 1.3B shape spread over every GPU by
# --device-map, against the same on one GPU).
# Two lanes on a two-GPU machine: pin each to its own cores (taskset, OMP_NUM_THREADS), or the
# host-side work of one slows the other tenfold.
# Each step runs under its own time limit (seconds; override with e.g. LIMIT_tests=300) and its
# output goes to $OUT/<step>.txt (and .json for the benchmarks) as soon as it ends, so a step that
# runs out of time still leaves the others' results. Everything is also packed into $OUT/gpu_suite.tgz
# after every step (one file: some machines return only a few files per command, and a command that
# runs out of time still returns the steps it finished). The device_map step needs accelerate
# (the `multi-gpu` extra).
#
# The first call of each Triton kernel at a new shape compiles and autotunes (fla's chunk kernels:
# minutes). TRITON_CACHE_DIR keeps that work between steps of one run; point it at a directory that
# survives between runs to keep it longer.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_suite_out}
mkdir -p "$OUT"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/osdn_diag_triton_cache}
export PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-dev}
PY=${PYTHON:-python3}
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests families hf_tests monitor layers phase1 replay comparator capture e2e e2e_stored e2e_1b memory e2e_hf wall monitor_bench)
# lm_recipe: the built-in language models' recipe (osdn_diag/builtin/lm_train_summary.json's command)
# with the monitor on, from the corpus in $LMDATA, into $LM_OUT (a new or empty directory, or one this
# step left stopped, which it resumes; default: a new one under /tmp), stopped by --time-budget
# $LM_BUDGET (450 s) before the step's limit with its state saved; the checkpoints are returned once done.
# Keep LM_OUT and SCALE_OUT outside the repository: where each command arrives as a fresh copy of it, a
# folder inside is not there for the next command to resume from.
LMDATA=${LMDATA:-.lmdata}
LM_OUT=${LM_OUT:-}
# scale_prepare / scale: examples/scale_study.py's corpus, built here from this machine's own sources with
# the built-in LMs' tokenizer, into $SCALE_DATA; then DeltaNet and OSDN trained in lockstep at
# $SCALE_PRESET (h256 h512 h768 h1024) into $SCALE_OUT, stopped at $SCALE_BUDGET (480 s) with its state
# saved; the step again with the same SCALE_OUT on the same machine goes on, and at the last step
# returns results.json and monitor.parquet. $SCALE_ARGS: more of scale_study.py train's options.
SCALE_DATA=${SCALE_DATA:-/tmp/osdn_diag_scale_data}
SCALE_PRESET=${SCALE_PRESET:-h512}
SCALE_OUT=${SCALE_OUT:-/tmp/osdn_diag_scale_$SCALE_PRESET}
SCALE_ARGS=${SCALE_ARGS:-}
LM_RECIPE="--arch deltanet osdn:0.003 osdn:0.03 osdn:0.3 osdn-apf --steps 1600 --warmup 100 --eval-every 400 --eval-windows 32 --log-every 25 --monitor-every 100"
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)

limit() { local v="LIMIT_$1"; echo "${!v:-$2}"; }
# GPU tests spend much of their time compiling kernel variants, one at a time per process: with
# pytest-xdist installed they run in $TEST_WORKERS processes (default 8) sharing the GPU.
XDIST=""
"$PY" -c "import xdist" 2>/dev/null && XDIST="-n ${TEST_WORKERS:-8}"
# Verbose, so that a step cut at its limit still names the result of every test that finished; without
# the project's addopts, whose --dist loadfile would keep each file (kernel_exact_gpu: 40 tests) on one
# process.
PYTEST_OPTS="-v --tb=short -rfE -p no:cacheprovider -o addopts="

# Everything in $OUT so far, as $OUT/gpu_suite.tgz: written beside $OUT and moved in, so the archive
# is never half-written and never reads itself.
pack() {
    local tmp="${OUT%/}.gpu_suite.tgz.tmp"
    tar czf "$tmp" --exclude=gpu_suite.tgz --exclude='lm_recipe.tgz.part-*' -C "$OUT" . && mv -f "$tmp" "$OUT/gpu_suite.tgz"
}

run_step() {
    local name=$1 default=$2; shift 2
    local t0=$SECONDS
    echo "== $name (limit $(limit "$name" "$default") s): $*"
    timeout "$(limit "$name" "$default")" "$@" >"$OUT/$name.txt" 2>&1
    local rc=$?
    echo "== $name: rc=$rc, $((SECONDS - t0)) s"
    tail -n 25 "$OUT/$name.txt"
    pack  # after every step: a command cut short still leaves one file with the steps it finished
}

for step in "${steps[@]}"; do
    case $step in
        tests)      run_step tests 420 "$PY" -m pytest $PYTEST_OPTS $XDIST tests/ops/test_phase1_parallel_kernel.py \
                        tests/ops/test_phase1_kernel.py tests/layers/test_layers_gpu.py tests/ops \
                        tests/capture/test_kernel_exact_gpu.py tests/capture/test_generation_gpu.py \
                        tests/capture/test_capture.py tests/models/test_loading_dtypes_gpu.py tests/models/test_osdn_models.py \
                        tests/metrics/test_ratios.py tests/metrics/test_retention.py tests/replay/test_triton_replay.py tests/replay/test_overflow.py \
                        tests/pipeline/test_beside_the_replay.py tests/test_cli_warmup.py tests/test_cli_errors.py \
                        tests/test_host.py tests/test_tuning_table.py tests/pipeline/test_determinism_gpu.py ;;
        monitor)    run_step monitor 300 "$PY" -m pytest $PYTEST_OPTS $XDIST tests/test_monitor_gpu.py \
                        tests/examples/test_train_lm_gpu.py ;;
        families)   run_step families 540 "$PY" -m pytest $PYTEST_OPTS $XDIST tests/capture/test_family_*_gpu.py ;;
        hf_tests)   run_step hf_tests 420 "$PY" -m pytest $PYTEST_OPTS $XDIST tests/transformers/test_hf_capture_gpu.py ;;
        e2e_hf)     run_step e2e_hf 400 bash -c '
                        set -e; for m in qwen3.5-0.8b-shape kimi-linear-48b-a3b-shape; do
                            "$0" benchmarks/bench_e2e.py --model random:$m --mode stream --json "$1/e2e_$m.json"; done' "$PY" "$OUT" ;;
        layers)     run_step layers 400 "$PY" benchmarks/bench_layers.py --profile --json "$OUT/layers.json" ;;
        phase1)     run_step phase1 200 "$PY" benchmarks/bench_phase1.py --json "$OUT/phase1.json" ;;
        replay)     run_step replay 360 bash -c '
                        set -e; "$0" benchmarks/bench_replay.py --sweep --chunk --json "$1/replay.json"
                        for kv in 64 256; do
                            "$0" benchmarks/bench_replay.py --K $kv --V $kv --skip-torch --json "$1/replay_k$kv.json"; done
                        for gate in head channel; do for kv in 64 128 256; do
                            "$0" benchmarks/bench_replay.py --K $kv --V $kv --gate $gate --skip-torch \
                                --json "$1/replay_${gate}_k$kv.json"; done; done' "$PY" "$OUT" ;;
        comparator) run_step comparator 120 "$PY" benchmarks/bench_comparator.py --json "$OUT/comparator.json" ;;
        capture)    run_step capture 300 "$PY" benchmarks/bench_capture.py --json "$OUT/capture.json" ;;
        e2e)        run_step e2e 300 "$PY" benchmarks/bench_e2e.py --mode stream --stages --json "$OUT/e2e.json" ;;
        e2e_stored) run_step e2e_stored 300 "$PY" benchmarks/bench_e2e.py --prompts 8 --mode stream,stored \
                        --json "$OUT/e2e_stored.json" ;;
        e2e_1b)     run_step e2e_1b 300 "$PY" benchmarks/bench_e2e.py --model random:deltanet-1.3b --mode stream \
                        --json "$OUT/e2e_1b.json" ;;
        memory)     run_step memory 300 "$PY" benchmarks/bench_e2e.py --prompts 1 --T 20000 --batch-size 1 \
                        --json "$OUT/memory.json" ;;
        wall)       run_step wall 570 "$PY" benchmarks/bench_e2e.py --wall "${WALL_RUNS:-4}" --mode stream \
                        --json "$OUT/wall.json" ;;
        device_map) run_step device_map 420 bash -c '
                        set -e; common=(--model random:deltanet-1.3b --prompts 8 --mode stream)
                        "$0" benchmarks/bench_e2e.py "${common[@]}" --device-map balanced --dir /tmp/osdn_dm \
                            --json "$1/device_map.json"
                        CUDA_VISIBLE_DEVICES=0 "$0" benchmarks/bench_e2e.py "${common[@]}" --device-map balanced --dir /tmp/osdn_1gpu \
                            --json "$1/device_map_1gpu.json"
                        "$0" benchmarks/compare_runs.py --rtol 1e-5 /tmp/osdn_dm/stream /tmp/osdn_1gpu/stream' "$PY" "$OUT" ;;
        monitor_bench) run_step monitor_bench 420 "$PY" benchmarks/bench_monitor.py --arch deltanet osdn \
                        --json "$OUT/monitor_bench.json" ;;
        lm_recipe)  if [ ! -f "$LMDATA/train.bin" ]; then
                        echo "== lm_recipe: $LMDATA/train.bin is missing: make it with 'python examples/train_lm.py prepare --data $LMDATA' under Python 3.11.7 (the standard library the built-in corpus was read from: osdn_diag/builtin/lm-corpus/corpus.json) and carry it, or set LMDATA"
                        continue
                    fi
                    # a new directory of its own, never one the user named that already holds something —
                    # but for a run of this step stopped at its budget (train_lm.py's state.pt), which it resumes
                    if [ -n "$LM_OUT" ] && [ -e "$LM_OUT" ] && [ -n "$(ls -A "$LM_OUT" 2>/dev/null)" ] \
                            && [ ! -f "$LM_OUT/state.pt" ]; then
                        echo "== lm_recipe: LM_OUT=$LM_OUT is not empty: name a new directory (or leave LM_OUT unset)"
                        continue
                    fi
                    lm_out=${LM_OUT:-$(mktemp -d /tmp/osdn_diag_lm_recipe.XXXXXX)}
                    # --time-budget: stopped there, train_lm.py saves its whole state (state.pt) beside the
                    # checkpoints as they stand; the step run again with the same LM_OUT goes on from it
                    run_step lm_recipe 580 "$PY" examples/train_lm.py train --data "$LMDATA" --out "$lm_out" $LM_RECIPE \
                        --time-budget "${LM_BUDGET:-450}"
                    # the parts of an earlier run first removed, or `cat` would join them to these
                    rm -f "$OUT"/lm_recipe.tgz.part-*
                    if [ -f "$lm_out/state.pt" ]; then
                        echo "== lm_recipe: stopped at its budget; its state is in $lm_out/state.pt: run this step again with LM_OUT=$lm_out on this machine to go on"
                    elif [ -d "$lm_out" ]; then  # done: the checkpoints in parts of at most 15 MB (some machines return no larger file)
                        tar czf - -C "$lm_out" . | split -b 15M - "$OUT/lm_recipe.tgz.part-"
                    fi ;;
        scale_prepare) run_step scale_prepare 400 "$PY" examples/scale_study.py prepare --data "$SCALE_DATA" \
                        --tokenizer osdn_diag/builtin/lm-corpus/ ;;
        scale)      if [ ! -f "$SCALE_DATA/train.bin" ]; then
                        echo "== scale: $SCALE_DATA/train.bin is missing: run the scale_prepare step first (or set SCALE_DATA)"
                        continue
                    fi
                    # resumable: the same step again (same SCALE_OUT, on this machine) goes on from its state.pt
                    run_step "scale_$SCALE_PRESET" 580 "$PY" examples/scale_study.py train --data "$SCALE_DATA" \
                        --out "$SCALE_OUT" --preset "$SCALE_PRESET" --time-budget "${SCALE_BUDGET:-480}" $SCALE_ARGS
                    for f in results.json monitor.parquet; do
                        [ -f "$SCALE_OUT/$f" ] && cp "$SCALE_OUT/$f" "$OUT/scale_${SCALE_PRESET}_$f"
                    done
                    pack ;;
        e2e_ddp)    run_step e2e_ddp 420 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NGPU" \
                        benchmarks/bench_e2e.py --mode stream --json "$OUT/e2e_ddp.json" ;;
        *) echo "unknown step $step (tests families hf_tests monitor layers phase1 replay comparator capture e2e e2e_stored e2e_1b memory e2e_hf wall monitor_bench lm_recipe scale_prepare scale e2e_ddp device_map)"; exit 2 ;;
    esac
done
# The targets, each beside its measured value, from whatever the steps above left in $OUT.
"$PY" benchmarks/targets.py "$OUT" --json "$OUT/targets.json" | tee "$OUT/targets.txt"
pack
echo "results: $OUT/gpu_suite.tgz"
