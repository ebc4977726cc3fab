#!/bin/sh
# The containers' entrypoint: writes the model repository variant, then runs tritonserver on it.
# Every KVCodec setting comes from the environment (KVCODEC_*: docs/deploy.md's settings table),
# read by the python backend's models; the chunk key as KVCODEC_CHUNK_KEY (from a Secret).
#   KVCODEC_VARIANT     cpu | gpu | trtllm | trtllm-llmapi   (default: the image's)
#   KVCODEC_GPUS        GPU ids for the gpu and trtllm variants (default 0)
#   KVCODEC_REPOSITORY  where the repository is written (default $KVCODEC_HOME/repository, i.e.
#                       /var/lib/kvcodec/repository: never under /models, where the model is mounted;
#                       `kvcodec repository` refuses a folder it did not write and deletes nothing of it)
# Triton's model control, shared memory, trace and logging APIs are restricted to callers that
# send the header "kvcodec-admin: $KVCODEC_ADMIN_KEY" (over gRPC the metadata
# "triton-grpc-protocol-kvcodec-admin"; a random value when not set).
# Arguments after the image name are passed to tritonserver.
set -eu
variant="${KVCODEC_VARIANT:-gpu}"
repository="${KVCODEC_REPOSITORY:-${KVCODEC_HOME:-/var/lib/kvcodec}/repository}"
admin="${KVCODEC_ADMIN_KEY:-$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')}"
if [ "$variant" = "cpu" ]; then
  kvcodec repository --variant cpu --out "$repository"
else
  kvcodec repository --variant "$variant" --gpus "${KVCODEC_GPUS:-0}" --out "$repository"
fi
exec tritonserver --model-repository "$repository" \
  --http-port 8000 --grpc-port 8001 --metrics-port 8002 --allow-metrics=true \
  --http-restricted-api "model-repository,shared-memory,trace,logging:kvcodec-admin=$admin" \
  --grpc-restricted-protocol "model-repository,shared-memory,trace,logging:kvcodec-admin=$admin" \
  "$@"
