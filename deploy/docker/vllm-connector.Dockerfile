# vLLM with the kvpush connector: the connector is a Python package on the engine's
# path (kvpush/ of this repository: kvpush.connector), loaded by vLLM through
# kv_connector_module_path="kvpush.connector.kvpush_connector".
#
#   docker build -f deploy/docker/vllm-connector.Dockerfile -t kvpush-vllm:0.32.0 .
#   (GPU: the default base; CPU: --build-arg VLLM_IMAGE=<your vllm-cpu 0.32.0 image>)
#
# The connector imports no NIXL (the sidecar moves the bytes), only torch and vLLM, which
# the base image has, and protobuf for its stubs.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0

FROM ${VLLM_IMAGE}
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/kvpush-src
COPY pyproject.toml README.md ./
COPY proto/ proto/
COPY kvpush/ kvpush/
RUN pip install grpcio-tools==1.85.1 \
    && python3 -m kvpush.contract.protogen \
    && pip install --no-deps . \
    && pip uninstall -y grpcio-tools
WORKDIR /
