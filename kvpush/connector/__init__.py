"""kvpush's vLLM KV connector: lives inside vLLM, talks only to its local sidecar.
Its bytes are copied by a CacheCopier (``engine/copier.py``).

    kvpush_connector.py  KVPushConnector, the class vLLM loads (facade)
    scheduler.py         scheduler side: who pushes, who loads, each step's plan
    worker.py            worker side: BEGIN/PUSH/END (prefill), copy/CONSUMED (decode)
    metadata.py          the step's plan, scheduler -> worker
    ordered_sends.py     the frames that wait for a GPU copy (PUSH, CONSUMED), in order
    landing_watch.py     decode scheduler side: what the sidecar says of awaited reservations
    handover_watch.py    prefill scheduler side: reservations of requests that arrived first
    sidecar_link.py      connecting to the sidecar, HELLO
    config.py            kv_connector_extra_config
    stats.py             counters, written as JSON for readers outside the engine

Load it with ``kv_connector="KVPushConnector"``,
``kv_connector_module_path="engine.connector.kvpush_connector"`` (see kvpush_connector.py).
"""
