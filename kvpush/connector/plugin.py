"""kvpush's vLLM plugin: registers ``KVPushConnector`` with vLLM's connector factory.

Installed as the ``kvpush`` entry point of the ``vllm.general_plugins`` group
(pyproject.toml), which vLLM loads in each of its processes (API server, engine core,
workers), so an engine is configured with the connector's name alone::

    --kv-transfer-config '{"kv_connector": "KVPushConnector", "kv_role": "kv_consumer",
                           "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"sidecar_socket": "/run/kvpush/sidecar.sock"}}'

Nothing of the connector is imported here: vLLM imports it when an engine asks for it.
"""

from __future__ import annotations

import logging

NAME = "KVPushConnector"
MODULE = "kvpush.connector.kvpush_connector"

log = logging.getLogger(f"vllm.{__name__}")


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    try:
        KVConnectorFactory.register_connector(NAME, MODULE, NAME)
    except ValueError:
        pass  # vLLM may load its plugins more than once in a process: registered already
