# vLLM with the kvpush connector: the kvpush package installed with its [connector]
# extra (nothing vLLM's image lacks but protobuf's runtime), whose vLLM plugin registers
# the connector by name: --kv-transfer-config '{"kv_connector": "KVPushConnector", ...}'.
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
COPY pyproject.toml setup.py MANIFEST.in README.md ./
COPY proto/ proto/
COPY kvpush/ kvpush/
# The build generates the gRPC stubs (setup.py); the extra never pulls torch or vLLM.
# This checkout's package: its one dependency beyond vLLM's is a range (protobuf's runtime).
# hadolint ignore=DL3013
RUN pip install ".[connector]"
WORKDIR /
