"""The sidecar process (``kvpush sidecar``): one per engine; it owns the pool and the
transport and moves every byte between engines. Nothing here runs inside vLLM.

    service.py           the process: a sidecar wired to the control plane (main, signals, shutdown)
    sidecar.py           make_sidecar (the role's class); a local main for tests and benchmarks
    base.py              what every role has: pool, transport, progress, channel server, HELLO/ADMIN
    prefill.py           PrefillSidecar: BEGIN/PUSH/END/AWAIT
    decode.py            DecodeSidecar: QUERY/SUBSCRIBE/CONSUMED
    push.py              PushEngine: staged KV -> a decode engine's landing blocks
    landing.py           LandingTable: notifications -> landing states
    peers.py             decode engines as a pusher sees them (EngineRecord -> RemotePeer)
    handover.py          reservations the router named this prefill engine for
    notify.py            BEGIN / FINAL / LANDED / ABORT notifications
    descriptors.py       virtual ranges -> paired descriptors; checksums
    pools.py             landing pool (decode), staging pool and its allocator (prefill)
    progress.py          transport progress from asyncio: hot/fine/warm/idle polling on a timerfd
    channel_server.py    the channel's server end and the ChannelHandler interface
    membership.py        registration, heartbeat, the gRPC link and its retry vocabulary
    reporter.py          lifecycle reports to the control plane, off the data path
    reservation_watch.py reservations that end (cancel local work) or are granted (handover)
    transport/           the Transport seam: base.py, nixl.py (NIXL, UCX or LIBFABRIC), fake.py
"""
