#!/usr/bin/env bash
# perf_analyzer in its own venv (.venv-pa/): the real binary ships inside the tritonclient 2.51.0
# wheel (bin/perf_analyzer); it needs libcudart from nvidia-cuda-runtime-cu12 and Debian's
# libb64-0d. Not the `perf-analyzer` PyPI package: here that installs a placeholder that always
# exits 0. Installs with --no-deps (only these two wheels), so it takes seconds.
#
#   perf/perf_analyzer_env.sh          create or check .venv-pa/, then check `perf_analyzer --version/--help`
#   perf/perf_analyzer_env.sh --print  the same, then print the binary path and LD_LIBRARY_PATH
#
# Idempotent: a venv that already answers --help is left as it is.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVCODEC_PA_VENV:-$ROOT/.venv-pa}"
PYTHON="${PYTHON:-python3}"
TRITONCLIENT="tritonclient==2.51.0"
CUDART="nvidia-cuda-runtime-cu12==12.9.79"

log() { echo "perf_analyzer_env: $*" >&2; }

if ! /sbin/ldconfig -p 2>/dev/null | grep -q 'libb64\.so\.0d'; then
    if [ "$(id -u)" != 0 ]; then
        log "libb64-0d is missing; install it as root: apt-get install -y libb64-0d"
        exit 1
    fi
    log "installing Debian's libb64-0d"
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q libb64-0d >&2; then
        apt-get update -q >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q libb64-0d >&2
    fi
fi

if [ ! -x "$VENV/bin/python" ]; then
    log "creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
PA="$VENV/bin/perf_analyzer"
CUDA_LIB="$SITE/nvidia/cuda_runtime/lib"
if [ ! -x "$PA" ] || [ ! -d "$CUDA_LIB" ]; then
    log "installing $TRITONCLIENT and $CUDART (no dependencies)"
    "$VENV/bin/pip" install -q --no-deps "$TRITONCLIENT" "$CUDART" >&2
fi
export LD_LIBRARY_PATH="$CUDA_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# `perf_analyzer --help` prints its usage and exits 99; `--version` exits 0. Check both outputs.
VERSION_OUT="$("$PA" --version 2>&1 || true)"
HELP_OUT="$("$PA" --help 2>&1 || true)"
if [[ "$VERSION_OUT" != *"Perf Analyzer Version 2.51"* || "$HELP_OUT" != *"--profile-export-file"* ]]; then
    log "$PA does not run:"
    echo "$VERSION_OUT" | tail -5 >&2
    ldd "$PA" | grep "not found" >&2 || true
    exit 1
fi
if [ "${1:-}" = "--print" ]; then
    echo "PERF_ANALYZER=$PA"
    echo "LD_LIBRARY_PATH=$CUDA_LIB"
fi
log "ok: $PA"
