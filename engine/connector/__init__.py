"""kvpush's vLLM KV connector: lives inside vLLM, talks only to its local sidecar.

    kvpush_connector.py  KVPushConnector, the class vLLM loads (facade)
    scheduler.py         scheduler side: who pushes, who loads, each step's plan
    worker.py            worker side: BEGIN/PUSH/END (prefill), SUBSCRIBE/copy/CONSUMED (decode)
    metadata.py          the step's plan, scheduler -> worker
    cache_codec.py       vLLM's paged cache <-> kvpush's canonical block layout (probed from the kernel)
    sidecar_link.py      connecting to the sidecar, HELLO
    config.py            kv_connector_extra_config
    stats.py             counters, written as JSON for readers outside the engine

Load it with ``kv_connector="KVPushConnector"``,
``kv_connector_module_path="engine.connector.kvpush_connector"`` (see kvpush_connector.py).
"""
