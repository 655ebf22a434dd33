"""kvpush's vLLM KV connector: lives inside vLLM, talks only to its local sidecar. It
moves no bytes over the network (no NIXL here) and imports nothing of the sidecar; what
both speak is ``kvpush.channel``. Its bytes are copied by a CacheCopier (``copiers/``).

    kvpush_connector.py  KVPushConnector, the class vLLM loads (facade)
    scheduler.py         scheduler side: who pushes, who loads, each step's plan
    worker.py            worker side: BEGIN/PUSH/END (prefill), copy/CONSUMED (decode)
    metadata.py          the step's plan, scheduler -> worker
    ordered_sends.py     the frames that wait for a GPU copy (PUSH, CONSUMED), in order
    landing_watch.py     decode scheduler side: what the sidecar says of awaited reservations
    handover_watch.py    prefill scheduler side: reservations of requests that arrived first
    sidecar_link.py      connecting to the sidecar, HELLO, dialing again when it goes away
    sidecar_client.py    SidecarClient: the engine's end of the local channel
    copiers/             copier.py (the seam), cpu_copier.py and cache_codec.py (the CPU
                         backend's packed caches), torch_copier.py (vLLM's GPU layouts)
    config.py            kv_connector_extra_config
    stats.py             counters, written as JSON for readers outside the engine

    plugin.py            the vLLM plugin that registers the connector by name

Load it with ``kv_connector="KVPushConnector"`` (see kvpush_connector.py); the plugin,
an entry point of ``vllm.general_plugins``, makes the name known to vLLM.
"""
