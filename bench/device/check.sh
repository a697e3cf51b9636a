#!/usr/bin/env bash
# GPU checks for issue 6, in one call on a lent GPU machine (H200, 16 cores, no network).
#
# What it does, in this order (cheapest and most important first), each step under
# its own `timeout` and all of it under one time budget (--budget, default 540 s):
#   1. race test: builds kvflash's own CUDA sources with the compile-only CMake
#      config (seconds, no ggml), runs copy_engine_selftest: bit-exact round trip
#      through pinned memory with shuffled blocks, then thousands of random
#      page-out / page-in / block-reuse steps against a CPU mirror, on a
#      non-blocking compute stream, on the legacy stream, in deferred-wait mode,
#      and once with the ordering events switched off (must be DETECTED: proves
#      the test sees the reference's race).
#   2. full build: -DKVFLASH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90
#      -DGGML_CUDA_NO_VMM=ON into build-cuda with all cores (ggml-cuda is the long part).
#   3. pytest tests/test_gpu.py, the device suite CI runs on Vulkan (lavapipe), here on CUDA
#      (KVFLASH_TEST_DEVICE=cuda:0): GPU vs CPU logits in both cache modes, greedy tokens, host
#      reads of the pool after paging, paging bit-exact through device buffers and its race
#      test, a device snapshot continued on the CPU, Model(device=...) API; and
#      tests/test_device.py (device strings, Session(device="auto"), auto pool) with the
#      module just built.
#   4. decode curve (tok/s vs context, full cache vs kvflash) for a 0.5B random-weight
#      model, 8K..128K, with what time is left: results + plot.
# Writes $OUT/summary.md (verdicts, numbers, GPU name) and at most 7 more files
# under $OUT (the run tool returns 8 files at most).
#
# Before the call (on the machine without a GPU), the caller must:
#   - place the ggml source under an ignored path of the repo, e.g.
#       python python/kvflash/_registry.py ggml-sdist build-dev/_sdist   # prints the ggml dir
#       mkdir -p build-dev && cp -r <printed dir> build-dev/ggml-src
#     and trim it to what a CUDA build needs (the run tool carries 64 MiB in all):
#       bash bench/device/check.sh --trim-ggml build-dev/ggml-src
#     then pass it: run(carry=["build-dev/ggml-src", ".whl"],
#       command="KVFLASH_GGML_SOURCE=build-dev/ggml-src bash bench/device/check.sh", timeout_s=600)
#   - carry the `gguf` wheel (tests and the bench write GGUFs with it; the GPU image
#     lacks it) in .whl/ (see /work/.library/device/README.md for pip download flags):
#       python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#         --implementation cp --platform manylinux2014_x86_64 -d .whl gguf==0.19.0
#     (gguf is pure Python; its needs numpy, pyyaml, requests, tqdm are in the GPU image).
# cuBLAS: ggml-cuda needs it.  Taken from the toolkit if it has it, else from the
# `nvidia-cublas` wheel installed in the GPU image's python3 (the image has it, with
# torch); unversioned .so links are made in /tmp.  Without either, step 2-4 are
# skipped and the summary says so (the race test needs only cudart).
#
# Options: --dry-run      no CUDA build; race test compiled (and skipped without a
#                         GPU); pytest and the bench run against the installed CPU
#                         module with a tiny model; for checking this script on a CPU box.
#          --budget S     total seconds (default 540; the run tool allows 600 a call)
#          --out DIR      results folder (default: $OUT, else ./build-dev/check-out)
#          --skip-build   reuse an existing build-cuda
#          --trim-ggml D  delete from ggml source tree D what a CUDA+CPU build does
#                         not need (other backends), print its size, and exit
set -u
set -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"

DRY=0; BUDGET=540; OUTDIR="${OUT:-}"; SKIP_BUILD=0
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --budget) BUDGET="$2"; shift ;;
        --out) OUTDIR="$2"; shift ;;
        --skip-build) SKIP_BUILD=1 ;;
        --trim-ggml)
            d="$2"
            [ -f "$d/include/ggml.h" ] || { echo "not a ggml tree: $d" >&2; exit 2; }
            for b in "$d"/src/ggml-*/; do
                case "$(basename "$b")" in ggml-cpu|ggml-cuda) ;; *) rm -rf "$b" ;; esac
            done
            rm -rf "$d"/src/ggml-cuda/vendors/hip* "$d"/src/ggml-cuda/vendors/musa* 2>/dev/null
            du -sh "$d"; exit 0 ;;
        -h|--help) sed -n 2,49p "$0"; exit 0 ;;
        *) echo "unknown option $1" >&2; exit 2 ;;
    esac
    shift
done
[ -n "$OUTDIR" ] || OUTDIR="$ROOT/build-dev/check-out"
mkdir -p "$OUTDIR"
SUMMARY="$OUTDIR/summary.md"
T0=$(date +%s)
NPROC=$(nproc 2>/dev/null || echo 4)

left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
# step_timeout WANT RESERVE: WANT seconds, or what is left minus RESERVE, whichever is less (>= 0)
step_timeout() { local l=$(( $(left) - $2 )); [ "$l" -lt "$1" ] && echo $(( l > 0 ? l : 0 )) || echo "$1"; }
say() { echo "[check $(( $(date +%s) - T0 ))s] $*"; }
sum() { echo "$*" >> "$SUMMARY"; }

: > "$SUMMARY"
sum "# kvflash GPU checks (issue 6)"
sum ""
sum "- date: $(date -u +%Y-%m-%dT%H:%M:%SZ), budget ${BUDGET}s, mode: $([ $DRY = 1 ] && echo dry-run || echo full)"
GPU_NAME="none"
if command -v nvidia-smi >/dev/null 2>&1; then
    GPU_NAME=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)
    [ -n "$GPU_NAME" ] || GPU_NAME="nvidia-smi present, no GPU listed"
fi
sum "- GPU: ${GPU_NAME}"

NVCC="$(command -v nvcc 2>/dev/null || true)"
[ -n "$NVCC" ] || for c in /usr/local/cuda/bin/nvcc /usr/local/cuda-*/bin/nvcc; do [ -x "$c" ] && NVCC="$c" && break; done
if [ -z "$NVCC" ]; then
    sum "- nvcc: NOT FOUND: nothing CUDA can be built"
    say "no nvcc"; cat "$SUMMARY"; exit 1
fi
CUDA_HOME="$(dirname "$(dirname "$(readlink -f "$NVCC")")")"
export PATH="$CUDA_HOME/bin:$PATH"
sum "- nvcc: $("$NVCC" --version | tail -2 | head -1) ($NVCC)"
PY="$(command -v python3 || command -v python)"
sum "- python: $("$PY" --version 2>&1) ($PY), cores: $NPROC"
sum ""

# Python packages carried as wheels (gguf).
if ! "$PY" -c "import gguf" 2>/dev/null; then
    if ls .whl/*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
            && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    fi
fi
"$PY" -c "import gguf" 2>/dev/null && HAVE_GGUF=1 || HAVE_GGUF=0

# ------------------------------------------------------------------ 1. race test
say "1. race test: compile-only build"
sum "## 1. Copy-engine race test (csrc/cuda/copy_engine_selftest.cu)"
sum ""
ST_LOG="$OUTDIR/selftest.log"
: > "$ST_LOG"
RACE_VERDICT="not run"
T=$(step_timeout 150 60)
# KVFLASH_CUDA_CHECK_HOST=OFF: the race test needs no ggml (CI compiles the host code; step 2 builds it for real).
if timeout "$T" cmake -S . -B build-cuda-check -G Ninja -DKVFLASH_CUDA_COMPILE_ONLY=ON -DKVFLASH_CUDA_CHECK_HOST=OFF \
        -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_CUDA_COMPILER="$NVCC" >> "$ST_LOG" 2>&1 \
   && timeout "$T" cmake --build build-cuda-check -j "$NPROC" >> "$ST_LOG" 2>&1; then
    ST=build-cuda-check/kvflash_cuda_selftest
    RACE_VERDICT="PASS"
    n_run=0
    # name | args | expected exit
    while IFS='|' read -r name args want; do
        [ -n "$name" ] || continue
        T=$(step_timeout 90 40)
        [ "$T" -gt 5 ] || { sum "- $name: skipped (time)"; continue; }
        echo "=== $name: $ST $args" >> "$ST_LOG"
        timeout "$T" "$ST" $args >> "$ST_LOG" 2>&1; rc=$?
        line=$(grep -E '^(RESULT|SKIP)' "$ST_LOG" | tail -1)
        stats=$(grep -E '^(paging|mismatches)' "$ST_LOG" | tail -2 | tr '\n' ' ')
        sum "- $name (\`$args\`): exit $rc, ${line:-no result line} ${stats:+— $stats}"
        if [ "$rc" = 77 ]; then RACE_VERDICT="SKIPPED (no CUDA device)"; break; fi
        n_run=$((n_run + 1))
        if [ "$rc" != "$want" ]; then
            case "$name" in
                unsafe*) [ "$RACE_VERDICT" = PASS ] && RACE_VERDICT="PASS (but the unsafe run did not show the race: test sensitivity unproven)" ;;
                *) RACE_VERDICT="FAIL" ;;
            esac
        fi
    done <<'EOF'
nonblocking-stream|--steps 6000 --check-every 300 --seed 1|0
legacy-stream|--steps 3000 --check-every 300 --seed 2 --legacy-stream|0
deferred-wait|--steps 3000 --check-every 300 --seed 3 --deferred|0
big-rows|--steps 2000 --check-every 250 --seed 4 --layers 8 --row-k 1024 --row-v 1024 --blocks 32 --chunks 160|0
unsafe-no-events|--steps 2000 --check-every 200 --seed 5 --unsafe --row-k 2048 --row-v 2048|0
EOF
else
    RACE_VERDICT="BUILD FAILED (see selftest.log)"
    tail -30 "$ST_LOG"
fi
sum ""
sum "**race test verdict: ${RACE_VERDICT}**"
sum ""
say "race test: $RACE_VERDICT"

# ------------------------------------------------------------------ 2. full CUDA build
BUILD_OK=0
BUILD_LOG="$OUTDIR/build.log"
: > "$BUILD_LOG"
sum "## 2. CUDA build (KVFLASH_CUDA=ON, sm_90)"
sum ""
if [ $DRY = 1 ]; then
    sum "- dry run: skipped"
elif [ $SKIP_BUILD = 1 ] && ls build-cuda/_core*.so >/dev/null 2>&1; then
    sum "- reused build-cuda"; BUILD_OK=1
else
    GGML_SRC="${KVFLASH_GGML_SOURCE:-}"
    CUBLAS_ARGS=(); CUBLAS_FROM=""
    if ls "$CUDA_HOME"/lib64/libcublas.so* >/dev/null 2>&1 && [ -f "$CUDA_HOME/include/cublas_v2.h" ]; then
        CUBLAS_FROM="toolkit"
    else
        # The nvidia-cublas wheel: nvidia/cublas/{lib,include} (or nvidia/cu13/...) in site-packages.
        WHEEL_LIB=$("$PY" - <<'EOF' 2>/dev/null
import glob, os, site
roots = site.getsitepackages() + [site.getusersitepackages()]
for r in roots:
    hits = sorted(glob.glob(os.path.join(r, "nvidia", "**", "libcublas.so*"), recursive=True))
    if hits:
        print(os.path.dirname(hits[0])); break
EOF
)
        if [ -n "$WHEEL_LIB" ]; then
            WHEEL_INC=$(dirname "$(find "$(dirname "$WHEEL_LIB")" -name cublas_v2.h 2>/dev/null | head -1)" 2>/dev/null)
            LNK=/tmp/kvflash-cublas; mkdir -p "$LNK"
            for so in "$WHEEL_LIB"/libcublas.so.* "$WHEEL_LIB"/libcublasLt.so.*; do
                [ -e "$so" ] || continue
                base=$(basename "$so"); ln -sf "$so" "$LNK/$base"; ln -sf "$so" "$LNK/${base%%.so*}.so"
            done
            CUBLAS_ARGS=(-DCUDA_cublas_LIBRARY="$LNK/libcublas.so" -DCUDA_cublasLt_LIBRARY="$LNK/libcublasLt.so")
            if [ -n "$WHEEL_INC" ] && [ -f "$WHEEL_INC/cublas_v2.h" ]; then
                CUBLAS_ARGS+=(-DCMAKE_CUDA_FLAGS="-I$WHEEL_INC" -DCMAKE_CXX_FLAGS="-I$WHEEL_INC")
            fi
            export LD_LIBRARY_PATH="$LNK${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
            CUBLAS_FROM="nvidia-cublas wheel ($WHEEL_LIB, headers ${WHEEL_INC:-not found})"
        fi
    fi
    if [ -z "$GGML_SRC" ] || [ ! -f "$GGML_SRC/include/ggml.h" ]; then
        sum "- SKIPPED: no ggml source (set KVFLASH_GGML_SOURCE to a carried ggml tree; see this script's header)"
    elif [ -z "$CUBLAS_FROM" ]; then
        sum "- SKIPPED: no cuBLAS (neither in $CUDA_HOME nor as the nvidia-cublas wheel in $PY)"
    else
        GGML_SRC="$(cd "$GGML_SRC" && pwd)"
        sum "- ggml: $GGML_SRC; cuBLAS from: $CUBLAS_FROM"
        PYBIND_DIR=$("$PY" -m pybind11 --cmakedir 2>/dev/null || true)
        say "2. configure + build (timeout $(step_timeout 420 150)s)"
        tb=$(date +%s)
        T=$(step_timeout 420 150)
        if timeout "$T" cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release \
                -DKVFLASH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_NO_VMM=ON \
                -DCMAKE_CUDA_COMPILER="$NVCC" -DKVFLASH_GGML_SOURCE="$GGML_SRC" -DKVFLASH_TESTS=OFF \
                -DPython_EXECUTABLE="$PY" ${PYBIND_DIR:+-Dpybind11_DIR="$PYBIND_DIR"} "${CUBLAS_ARGS[@]}" \
                >> "$BUILD_LOG" 2>&1 \
           && timeout "$(step_timeout 420 150)" cmake --build build-cuda -j "$NPROC" --target _core kvflash_cuda_selftest \
                >> "$BUILD_LOG" 2>&1; then
            BUILD_OK=1
            sum "- build OK in $(( $(date +%s) - tb ))s"
        else
            sum "- build FAILED or timed out after $(( $(date +%s) - tb ))s (last lines in build.log)"
            grep -E "error|Error" "$BUILD_LOG" | head -5 | sed 's/^/    /' >> "$SUMMARY"
        fi
        # keep the log small enough to come back
        tail -400 "$BUILD_LOG" > "$BUILD_LOG.tmp" && mv "$BUILD_LOG.tmp" "$BUILD_LOG"
    fi
fi
sum ""

# The module under test: the CUDA build's _core over this tree's python/kvflash.
if [ $BUILD_OK = 1 ]; then
    rm -rf /tmp/kvf && mkdir -p /tmp/kvf && cp -r python/kvflash /tmp/kvf/kvflash && cp build-cuda/_core*.so /tmp/kvf/kvflash/ \
        && mkdir -p /tmp/kvf/kvflash/lib && cp build-cuda/libkvflash.so /tmp/kvf/kvflash/lib/  # _core links it ($ORIGIN/lib)
    export PYTHONPATH="/tmp/kvf${PYTHONPATH:+:$PYTHONPATH}"
fi

# ------------------------------------------------------------------ 3. parity tests
sum "## 3. Backend parity (tests/test_gpu.py, tests/test_device.py)"
sum ""
PT_LOG="$OUTDIR/pytest.log"
if [ $HAVE_GGUF = 0 ]; then
    sum "- SKIPPED: python package gguf missing (carry its wheel in .whl/)"
elif [ $BUILD_OK = 1 ] || [ $DRY = 1 ]; then
    T=$(step_timeout 150 90)
    say "3. pytest (timeout ${T}s)"
    # -m "not model": the SmolLM2 test fetches the model from the registry, which the GPU machine cannot reach
    # (and its 93 MB exceed what a call carries); CI runs it on lavapipe.
    PYTHONUNBUFFERED=1 KVFLASH_TEST_DEVICE=cuda:0 timeout "$T" "$PY" -m pytest tests/test_gpu.py tests/test_device.py -v -s -rs \
        -m "not model" -p no:cacheprovider > "$PT_LOG" 2>&1; rc=$?
    [ $DRY = 1 ] || "$PY" -c "import kvflash._core as c; print('build_info:', c.build_info())" >> "$PT_LOG" 2>&1
    grep -E "^build_info:" "$PT_LOG" | cut -c1-400 | sed 's/^/    /' >> "$SUMMARY"
    sum "- pytest exit $rc: $(tail -1 "$PT_LOG")"
    grep -E "^DEVICE-(PARITY|PAGING)" "$PT_LOG" | sed 's/^/    /' >> "$SUMMARY"
    grep -E "^(FAILED|SKIPPED)" "$PT_LOG" | head -20 | sed 's/^/    /' >> "$SUMMARY"
else
    sum "- SKIPPED: no CUDA build"
fi
sum ""

# ------------------------------------------------------------------ 4. decode curve
sum "## 4. Decode curve (bench/device/decode_curve.py)"
sum ""
if [ $HAVE_GGUF = 0 ]; then
    sum "- SKIPPED: python package gguf missing"
elif [ $BUILD_OK = 1 ] || [ $DRY = 1 ]; then
    if [ $DRY = 1 ]; then
        DC_ARGS=(--device cpu --geometry tiny --contexts 512,1024 --pool 512 --decode-steps 4 --threads 2)
    else
        DC_ARGS=(--device cuda --geometry 0.5b --contexts 8k,16k,32k,64k,128k --pool 4096 --decode-steps 16)
    fi
    T=$(step_timeout 600 15)
    say "4. decode curve (timeout ${T}s)"
    PYTHONUNBUFFERED=1 timeout "$T" "$PY" bench/device/decode_curve.py "${DC_ARGS[@]}" --out "$OUTDIR" \
        --budget $(( T > 40 ? T - 30 : 10 )) > "$OUTDIR/decode_curve.log" 2>&1; rc=$?
    sum "- exit $rc, args: ${DC_ARGS[*]}"
    grep -E "^\[decode-curve\]" "$OUTDIR/decode_curve.log" | sed 's/^/    /' >> "$SUMMARY"
    rm -f "$OUTDIR/decode_curve.log"   # its lines are in the summary; keep the file count <= 8
else
    sum "- SKIPPED: no CUDA build"
fi
sum ""
sum "total: $(( $(date +%s) - T0 ))s"
say "done"
cat "$SUMMARY"
case "$RACE_VERDICT" in FAIL*|BUILD*) exit 1 ;; esac
exit 0
