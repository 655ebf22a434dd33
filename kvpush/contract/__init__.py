"""The contract between kvpush's processes; it imports nothing else of ours.

    v1/                 gRPC stubs generated from proto/kvpush/contract/v1 (not committed)
    layout.py           KvLayout: how an engine's KV bytes are arranged; its proto conversion
    engine.py           EngineRecord: one engine, stored, served and cached in this one shape
    target.py           PushTarget: where one request's KV goes
    transfer_params.py  PushParams / AwaitParams: what a request carries in vLLM's kv_transfer_params
    states.py           the reservation lifecycle (the proto enum), PushState, LandingState, roles
    limits.py           limits both ends of the API agree on
    protogen.py         generates v1/ (run by scripts/setup.sh)
"""
