#!/usr/bin/env bash
# The one script a GPU session runs: kiln's GPU tests and benchmarks, in order,
# each under its own timeout, sized to fit about 9 minutes of wall time on one
# H200. A step that fails or times out is recorded and the next one runs.
#
#   bash bench/gpu_session.sh [OUT]        # OUT: argument, else $OUT, else ./gpu-out
#
# Steps (timeouts in seconds, each overridable from the environment):
#   pytest             T_PYTEST=110      tests/test_triton_kernels.py tests/test_attention_backends.py
#                                        and tests/test_cuda_graphs.py when it exists (pytest-xdist
#                                        workers KILN_PYTEST_WORKERS=6, 0 for none)
#   attention_kernels  T_ATTENTION=45    python -m bench.attention_kernels (decode, prefill, KV write)
#   decode_batch1      T_DECODE=215      python -m bench.decode, Qwen3-0.6B shape, bf16, -O0/-O1/-O2
#                                        against transformers eager and compiled, batch 1, 64 tokens
#   decode_throughput  T_THROUGHPUT=165  the same with --throughput 64 (128 prompt + 128 new tokens)
# 535 s of timeouts in all. The benchmark model (Qwen3-0.6B's shape, random bf16
# weights, ~1.2 GB) is built in the background while pytest runs (T_BUILD=150).
# These sizes are estimates made without a GPU: the per-step seconds in
# summary.txt and each engine's load/warm-up seconds in the JSON say where the
# time went; adjust the T_* variables from them.
#
# The decode steps get a --time-budget DECODE_MARGIN (65) / THROUGHPUT_MARGIN
# (75) seconds short of their timeout: an engine whose set-up (load and warm-up,
# where kiln and torch.compile compile) would start after it is skipped and
# recorded, cheapest engines first, so the step still writes its JSON instead
# of being killed. The margin covers one set-up that overruns plus the timed
# rounds. Both steps share one kiln compile cache (--kiln-cache-dir): the
# throughput step reuses the batch-1 step's Inductor work and -O2 reuses -O1's,
# so kiln's load_seconds are not cold starts (the JSON says so).
#
# What lands in OUT (the device tool returns at most 8 files, so it stays flat):
#   summary.txt   versions, GPU, and each step's exit code, seconds and status
#   session.log   every step's full output
#   *.json        the benchmarks' reports (attention-kernels-cuda-*, decode-cuda-*,
#                 decode-throughput-cuda-*)
# Exit status: 0 when every step passed, else 1 (details in summary.txt).
#
# It installs nothing (the GPU machine has no network): it runs with the
# machine's python3 (PYTHON= to choose another) from the repository root, where
# `kiln` and `bench` import from the working tree. Caches (KILN_CACHE_DIR, the
# Inductor and Triton caches) live in a fresh directory under /tmp, removed at
# the end (KEEP_WORK=1 keeps it). A working tree copied without .git has no
# commit to record: pass it, e.g. KILN_GIT_COMMIT=abc1234 bash bench/gpu_session.sh.
#
# KILN_GPU_SESSION_SMOKE=1 runs the same plumbing on CPU at toy sizes (a few
# quick tests, the --tiny kernel bench under Triton's interpreter, the
# qwen3-tiny shape): a check of this script, not a measurement.

set -u -o pipefail
cd "$(dirname "$0")/.."

OUT="${1:-${OUT:-./gpu-out}}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
PY="${PYTHON:-python3}"
SMOKE="${KILN_GPU_SESSION_SMOKE:-0}"

T_PYTEST="${T_PYTEST:-110}"
T_ATTENTION="${T_ATTENTION:-45}"
T_DECODE="${T_DECODE:-215}"
T_THROUGHPUT="${T_THROUGHPUT:-165}"
T_BUILD="${T_BUILD:-150}"
DECODE_MARGIN="${DECODE_MARGIN:-65}"
THROUGHPUT_MARGIN="${THROUGHPUT_MARGIN:-75}"

WORK="$(mktemp -d /tmp/kiln-gpu-session.XXXXXX)"
RESULTS="$WORK/results"
mkdir -p "$RESULTS"
export KILN_CACHE_DIR="$WORK/kiln-cache"
export TORCHINDUCTOR_CACHE_DIR="$WORK/torchinductor"  # transformers' torch.compile: cold, like kiln's
export TRITON_CACHE_DIR="$WORK/triton"
export PYTHONUNBUFFERED=1
export PYTHONDONTWRITEBYTECODE=1
if [ -z "${KILN_GIT_COMMIT:-}" ]; then
    KILN_GIT_COMMIT="$(git rev-parse --short HEAD 2>/dev/null || true)"
    if [ -n "$KILN_GIT_COMMIT" ] && [ -n "$(git status --porcelain 2>/dev/null)" ]; then
        KILN_GIT_COMMIT="$KILN_GIT_COMMIT-dirty"
    fi
fi
export KILN_GIT_COMMIT
if [ "$SMOKE" != "1" ]; then
    unset TRITON_INTERPRET  # compiled kernels, never the interpreter
fi

SUMMARY="$OUT/summary.txt"
LOG="$OUT/session.log"
: >"$SUMMARY"
: >"$LOG"
BUILD_PID=""

cleanup() {
    if [ -n "$BUILD_PID" ] && kill -0 "$BUILD_PID" 2>/dev/null; then
        kill "$BUILD_PID" 2>/dev/null
    fi
    if [ "${KEEP_WORK:-0}" = "1" ]; then
        echo "work directory kept: $WORK"
    else
        rm -rf "$WORK"
    fi
}
trap cleanup EXIT

say() { echo "$*" | tee -a "$LOG"; }

START=$SECONDS
FAILED=0

# step NAME TIMEOUT COMMAND...: run it under `timeout`, its output to the
# terminal and session.log, and one line of summary.txt.
step() {
    local name="$1" limit="$2"
    shift 2
    local t0=$SECONDS
    say ""
    say "=== [$name] $(date -u +%H:%M:%S) (t+$((SECONDS - START))s) timeout ${limit}s"
    say "    $*"
    timeout --kill-after=20 "$limit" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    local secs=$((SECONDS - t0)) status
    case "$rc" in
        0) status="ok" ;;
        124 | 137) status="TIMEOUT (killed after ${limit}s; no JSON from this step)" ;;
        2) status="FAILED to start (usage, or no usable device: see session.log)" ;;
        *) status="FAILED (exit $rc: a check failed or something was not measured; see session.log)" ;;
    esac
    [ "$rc" -eq 0 ] || FAILED=1
    printf '%-18s rc=%-4s %5ss  %s\n' "$name" "$rc" "$secs" "$status" >>"$SUMMARY"
    say "=== [$name] rc=$rc in ${secs}s: $status"
    collect
    return 0
}

# Copy the reports written so far into OUT (after every step: if this script is
# itself cut short, what ran is there). The -latest.json copies are left out.
JSONS=()
collect() {
    local f base
    for f in "$RESULTS"/*.json; do
        [ -e "$f" ] || continue
        base="$(basename "$f")"
        case "$base" in *-latest.json) continue ;; esac
        [ -e "$OUT/$base" ] && continue
        cp "$f" "$OUT/" && JSONS+=("$base")
    done
}

# ------------------------------------------------------------------ environment
{
    echo "kiln GPU session, $(date -u +%Y-%m-%dT%H:%M:%SZ), commit ${KILN_GIT_COMMIT:-unknown}$([ "$SMOKE" = "1" ] && echo ', SMOKE (CPU, toy sizes)')"
    "$PY" - <<'EOF' 2>&1
import importlib, platform
import torch
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda})", end="")
for name in ("triton", "transformers"):
    try:
        print(f", {name} {importlib.import_module(name).__version__}", end="")
    except Exception as e:  # noqa: BLE001
        print(f", {name} missing ({type(e).__name__})", end="")
print()
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"gpu: {p.name}, capability {p.major}.{p.minor}, {p.multi_processor_count} SMs, "
          f"{p.total_memory / 2**30:.0f} GiB, {torch.cuda.device_count()} device(s)")
else:
    print("gpu: none (CUDA not available)")
EOF
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used,memory.total --format=csv,noheader 2>/dev/null \
        | sed 's/^/nvidia-smi: /'
    echo "timeouts (s): pytest $T_PYTEST, attention $T_ATTENTION, decode $T_DECODE (budget margin $DECODE_MARGIN), throughput $T_THROUGHPUT (margin $THROUGHPUT_MARGIN)"
    echo
} | tee -a "$SUMMARY" "$LOG"

if [ "$SMOKE" != "1" ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    say "error: CUDA is not available to $PY: this script is for a GPU machine (KILN_GPU_SESSION_SMOKE=1 checks it on CPU)"
    echo "no steps run: CUDA not available" >>"$SUMMARY"
    exit 2
fi

if [ "$SMOKE" = "1" ]; then
    SHAPE=qwen3-tiny
    DEVICE=cpu
else
    SHAPE=qwen3-0.6b
    DEVICE=cuda
fi

# ------------------------------------------------ benchmark model, in background
say "building the $SHAPE benchmark model in the background (log in session.log after pytest)"
timeout "$T_BUILD" "$PY" -c "import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout); \
from bench.common.models import ensure_shape_model; ensure_shape_model('$SHAPE')" >"$WORK/build.log" 2>&1 &
BUILD_PID=$!

# ------------------------------------------------------------------- (a) pytest
TESTS=(tests/test_triton_kernels.py tests/test_attention_backends.py)
if [ -f tests/test_cuda_graphs.py ]; then
    TESTS+=(tests/test_cuda_graphs.py)
else
    echo "tests/test_cuda_graphs.py: not in this tree, skipped" >>"$SUMMARY"
fi
PYTEST_ARGS=(-q -p no:cacheprovider)
if [ "$SMOKE" = "1" ]; then
    PYTEST_ARGS+=(-k "test_empty_batch_is_a_no_op or test_backends_declare_cuda_graph_support or test_default_capture_sizes")
else
    # pytest-xdist and pytest-timeout are in the GPU image; use them when present
    WORKERS="${KILN_PYTEST_WORKERS:-6}"
    if [ "$WORKERS" != "0" ] && "$PY" -c "import xdist" 2>/dev/null; then
        PYTEST_ARGS+=(-n "$WORKERS")
    fi
    if "$PY" -c "import pytest_timeout" 2>/dev/null; then
        PYTEST_ARGS+=(--timeout "${KILN_PYTEST_TEST_TIMEOUT:-90}")
    fi
fi
step pytest "$T_PYTEST" "$PY" -m pytest "${PYTEST_ARGS[@]}" "${TESTS[@]}"
grep -E '(passed|failed|error|skipped).* in [0-9.]+s' "$LOG" | tail -1 | sed 's/^/pytest: /' >>"$SUMMARY"

if [ -n "$BUILD_PID" ]; then
    wait "$BUILD_PID"
    BUILD_RC=$?
    BUILD_PID=""
    { echo ""; echo "=== [build_model] rc=$BUILD_RC"; cat "$WORK/build.log"; } >>"$LOG"
    printf '%-18s rc=%-4s %6s  %s\n' build_model "$BUILD_RC" "" \
        "$([ "$BUILD_RC" -eq 0 ] && echo ok || echo 'FAILED (the decode steps try again)')" >>"$SUMMARY"
fi

# ------------------------------------------------------- (b) attention kernels
if [ "$SMOKE" = "1" ]; then
    step attention_kernels "$T_ATTENTION" "$PY" -m bench.attention_kernels --device cpu --tiny --out "$RESULTS"
else
    step attention_kernels "$T_ATTENTION" "$PY" -m bench.attention_kernels --out "$RESULTS"
fi

# -------------------------------------------------------- (c) decode, batch 1
if [ "$SMOKE" = "1" ]; then
    DECODE_SIZE=(--max-tokens 4 --prompt-len 8 --repeats 1 --levels 0 --baselines transformers)
    THROUGHPUT_SIZE=(--throughput 3 --max-tokens 4 --prompt-len 8 --repeats 1 --levels 0 --baselines transformers)
else
    DECODE_SIZE=(--max-tokens 64 --prompt-len 32 --repeats 3 --levels 0,1,2
                 --baselines transformers,transformers-compiled)
    THROUGHPUT_SIZE=(--throughput 64 --prompt-len 128 --max-tokens 128 --repeats 2 --levels 0,1,2
                     --baselines transformers,transformers-compiled)
fi
COMMON=(--shape "$SHAPE" --device "$DEVICE" --dtype bfloat16 --kiln-cache-dir "$WORK/kiln-compile"
        --out "$RESULTS")
budget() { local b=$(($1 - $2)); [ "$b" -ge 10 ] && echo "$b" || echo 10; }

step decode_batch1 "$T_DECODE" "$PY" -m bench.decode "${COMMON[@]}" "${DECODE_SIZE[@]}" \
    --time-budget "$(budget "$T_DECODE" "$DECODE_MARGIN")"

# ------------------------------------------------------ (d) decode, throughput
step decode_throughput "$T_THROUGHPUT" "$PY" -m bench.decode "${COMMON[@]}" "${THROUGHPUT_SIZE[@]}" \
    --time-budget "$(budget "$T_THROUGHPUT" "$THROUGHPUT_MARGIN")"

# ------------------------------------------------------------------ summary
{
    echo ""
    echo "total wall: $((SECONDS - START))s"
    if [ "${#JSONS[@]}" -gt 0 ]; then
        echo "json: ${JSONS[*]}"
    else
        echo "json: none"
    fi
} | tee -a "$SUMMARY" "$LOG"
echo ""
cat "$SUMMARY"
exit "$FAILED"
