#!/usr/bin/env bash
# Every GPU check in one prepared run, for a session lent the GPU machine (an H200 with NVDEC;
# /work/.library/device/README.md). From the repo root:
#
#   bash tests/gpu/run.sh --dry-run   here, on a CPU machine with .venv/: makes the carried folders
#                                     .gpu-carry/ (PyNvVideoCodec wheel, tiny model, chunks, manifest)
#                                     and .gpu-carry-nvcomp/ (nvCOMP's wheels, entropy chunks; the
#                                     stage: tests/gpu/carry.py) and .gpu-carry-triton/ (tritonserver,
#                                     its python backend and 3.12 stub and libraries as tar.xz, the gpu
#                                     repository: tests/gpu/triton_carry.py), checks each against
#                                     64 MiB, runs every check with PyAV and zstd on the CPU, runs
#                                     tests/gpu/ensemble_ttft.py --dry-run (tritonserver from .venv, the
#                                     CPU repository, 100 Mbit/s), prints the three device calls to
#                                     make, back to back
#   bash tests/gpu/run.sh --stage     there, first call (carries .gpu-carry-nvcomp/, which stays on
#                                     the warm machine): checks the staged files
#   bash tests/gpu/run.sh --stage-triton
#                                     there, second call (carries .gpu-carry-triton/, which stays on
#                                     the warm machine): checks the archive against its manifest
#   bash tests/gpu/run.sh             there, third call: installs the carried wheels (and the
#                                     stage's) into /tmp/site, runs tests/gpu/gpu_checks.py (NVDEC,
#                                     nvCOMP, CUDA), writes gpu_checks.json and gpu_checks.log to $OUT
#                                     (else here); then tests/gpu/ensemble_ttft.py (the ensemble on
#                                     tritonserver on the GPU, TTFT per rung at 1, 10, 40 Gbit/s):
#                                     gpu_ttft.json, gpu_ttft.png, gpu_ttft.log; exit 1 if either failed
#   bash tests/gpu/run.sh --trtllm [MODEL_DIR]
#                                     inside NVIDIA's tritonserver -trtllm-python container on its GPU
#                                     (TensorRT-LLM 1.2; the lent GPU machine has none, so this never
#                                     ran): the connector's first checks, tests/gpu/trtllm_checks.py
#                                     (bit-exact restore in single-process mode, concurrent distinct
#                                     long prompts against cold runs, a failed load with the executor
#                                     answering afterwards, per-process GPU memory with a full stage):
#                                     trtllm_checks.json, trtllm_checks.log; --dry-run runs its plan
#
# GPU_CARRY / GPU_STAGE / GPU_TRITON name other carried folders; PYTHON another interpreter (there: python3).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
CARRY=${GPU_CARRY:-.gpu-carry}
STAGE=${GPU_STAGE:-.gpu-carry-nvcomp}
TRITON=${GPU_TRITON:-.gpu-carry-triton}
LIMIT_S=360  # the checks' budgets (gpu_checks.BUDGETS) add up to 325 s
TTFT_LIMIT_S=200  # tests/gpu/ensemble_ttft.py's budget (BUDGET_S, 180 s) and the server's stop
TRTLLM_LIMIT_S=1800  # tests/gpu/trtllm_checks.py: four checks, several LLM() starts each (not a lent machine)
DRY_TTFT_LIMIT_S=300

dry_run() {
    local py=${PYTHON:-.venv/bin/python} t0=$SECONDS rc
    [ -x "$py" ] || { echo "run.sh --dry-run: $py is missing (make setup)" >&2; return 2; }
    export PYTHONPATH="$PWD/backends:$PWD:$PWD/perf:$PWD/clients" PYTHONUNBUFFERED=1
    "$py" -m tests.gpu.carry prepare --carry "$CARRY" --stage "$STAGE" || return 1
    "$py" -m tests.gpu.triton_carry prepare --stage "$TRITON" || return 1
    "$py" -m tests.gpu.carry verify-stage --stage "$STAGE" || return 1
    "$py" -m tests.gpu.gpu_checks --device-imports --carry "$CARRY" --stage "$STAGE" || return 1
    "$py" -m tests.gpu.gpu_checks --dry-run --carry "$CARRY" --stage "$STAGE" --json "${OUT:-$CARRY}/gpu_checks.dry-run.json"
    rc=$?
    timeout "$DRY_TTFT_LIMIT_S" "$py" -m tests.gpu.ensemble_ttft --dry-run --runs 2 --carry "$CARRY" \
        --stage "$STAGE" --triton "$TRITON" --json "${OUT:-$CARRY}/gpu_ttft.dry-run.json" || rc=1
    "$py" -m tests.gpu.trtllm_checks --dry-run --json "${OUT:-$CARRY}/trtllm_checks.dry-run.json" >/dev/null || rc=1
    "$py" -m tests.gpu.carry sizes --carry "$CARRY" --stage "$STAGE" --triton "$TRITON" || return 1
    echo "dry run: exit $rc after $((SECONDS - t0)) s"
    [ "$rc" -eq 0 ] || return "$rc"
    echo "On a session with a GPU, call the device tool 'run' with each of these, in order, back to back:"
    "$py" -m tests.gpu.carry run-call --carry "$CARRY" --stage "$STAGE" --triton "$TRITON"
}

stage_run() {
    # The first device call: what it carried (the stage folder) stays on the warm machine for the
    # checks' call; here it is only checked (files against the manifest).
    local py=${PYTHON:-python3}
    export PYTHONPATH="$PWD/backends:$PWD"
    "$py" -m tests.gpu.carry verify-stage --stage "$STAGE"
}

stage_triton() {
    # The second device call: checks the carried archive against its manifest; the carried folder
    # stays on the warm machine, where the run call (next) unpacks the server (a few seconds).
    local py=${PYTHON:-python3}
    export PYTHONPATH="$PWD/backends:$PWD"
    "$py" -m tests.gpu.triton_carry verify --stage "$TRITON"
}

nvdec_library_path() {
    # NVDEC's user-space library comes with the driver; put its folder on the loader's path when
    # the loader's cache does not have it (the driver's folder may be a mount outside it).
    ldconfig -p 2>/dev/null | grep -q 'libnvcuvid\.so\.1' && return
    local d
    for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/lib/wsl/lib; do
        if [ -e "$d/libnvcuvid.so.1" ]; then
            export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
            echo "libnvcuvid.so.1: $d (added to LD_LIBRARY_PATH)"
            return
        fi
    done
    echo "libnvcuvid.so.1: not found (the driver's video libraries are not mounted?); the NVDEC checks will say"
}

device_run() {
    local py=${PYTHON:-python3} out=${OUT:-.} site=/tmp/site rc
    [ -f "$CARRY/manifest.json" ] || { echo "no $CARRY/manifest.json: carry $CARRY (bash tests/gpu/run.sh --dry-run makes it)"; return 2; }
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        "$CARRY"/wheels/*.whl || echo "wheel install failed: the checks that need PyNvVideoCodec will fail"
    export PYTHONPATH="$site:$PWD/backends:$PWD" PYTHONUNBUFFERED=1
    if ls "$STAGE"/wheels/*.whl >/dev/null 2>&1; then
        "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
            "$STAGE"/wheels/*.whl || echo "nvCOMP wheel install failed: the nvcomp check will fail"
        "$py" -m tests.gpu.carry nvidia-namespace --site "$site"
    else
        echo "no $STAGE/wheels: the stage call did not run just before (or the machine went cold); the nvcomp check will say"
    fi
    nvdec_library_path
    timeout "$LIMIT_S" "$py" -m tests.gpu.gpu_checks --carry "$CARRY" --stage "$STAGE" --json "$out/gpu_checks.json"
    rc=$?
    [ "$rc" -eq 124 ] && echo "gpu checks: stopped after $LIMIT_S s; $out/gpu_checks.json holds the checks that finished"
    return "$rc"
}

ttft_run() {
    # The ensemble on the GPU (tests/gpu/ensemble_ttft.py): its own log, its own limit.
    local py=${PYTHON:-python3} out=${OUT:-.} rc
    [ -f "$TRITON/manifest.json" ] || { echo "no $TRITON/manifest.json: the --stage-triton call did not run just before"; return 2; }
    export PYTHONPATH="/tmp/site:$PWD/backends:$PWD:$PWD/perf:$PWD/clients" PYTHONUNBUFFERED=1
    nvdec_library_path
    timeout "$TTFT_LIMIT_S" "$py" -m tests.gpu.ensemble_ttft --carry "$CARRY" --stage "$STAGE" --triton "$TRITON" \
        --json "$out/gpu_ttft.json"
    rc=$?
    [ "$rc" -eq 124 ] && echo "ensemble ttft: stopped after $TTFT_LIMIT_S s; $out/gpu_ttft.json holds the rows that finished"
    return "$rc"
}

trtllm_run() {
    # Inside the NGC TensorRT-LLM container (its python3 has tensorrt_llm), the project installed there.
    local py=${PYTHON:-python3} out=${OUT:-.} model=${1:-} rc
    "$py" -c "import tensorrt_llm" 2>/dev/null || {
        echo "run.sh --trtllm: no tensorrt_llm in $py: run it inside nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3"
        return 2
    }
    [ -n "$model" ] || { echo "run.sh --trtllm MODEL_DIR: a Hugging Face folder (kvcodec repository --variant trtllm-llmapi makes one)"; return 2; }
    export PYTHONPATH="$PWD/backends:$PWD" PYTHONUNBUFFERED=1 TLLM_WORKER_USE_SINGLE_PROCESS=1
    timeout "$TRTLLM_LIMIT_S" "$py" -m tests.gpu.trtllm_checks --model "$model" --json "$out/trtllm_checks.json"
    rc=$?
    [ "$rc" -eq 124 ] && echo "trtllm checks: stopped after $TRTLLM_LIMIT_S s"
    return "$rc"
}

if [ "${1:-}" = "--dry-run" ]; then
    dry_run
    exit $?
elif [ "${1:-}" = "--stage" ]; then
    stage_run
    exit $?
elif [ "${1:-}" = "--stage-triton" ]; then
    stage_triton
    exit $?
elif [ "${1:-}" = "--trtllm" ]; then
    mkdir -p "${OUT:-.}"
    trtllm_run "${2:-}" 2>&1 | tee "${OUT:-.}/trtllm_checks.log"
    exit "${PIPESTATUS[0]}"
elif [ $# -gt 0 ]; then
    echo "usage: bash tests/gpu/run.sh [--dry-run | --stage | --stage-triton | --trtllm MODEL_DIR]" >&2
    exit 2
fi
mkdir -p "${OUT:-.}"
device_run 2>&1 | tee "${OUT:-.}/gpu_checks.log"
checks_rc=${PIPESTATUS[0]}
ttft_run 2>&1 | tee "${OUT:-.}/gpu_ttft.log"
ttft_rc=${PIPESTATUS[0]}
[ "$checks_rc" -eq 0 ] || exit "$checks_rc"
exit "$ttft_rc"
