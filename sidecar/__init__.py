"""The sidecar's data plane: everything that moves KV bytes between engines.

    memory.py        shared-memory segments (PoolMemory seam for device memory)
    pools.py         landing pool (decode) and staging pool + allocator (prefill)
    geometry.py      which bytes a push moves; descriptor pairing and coalescing
    reblock.py       engine-side copies paged cache <-> staging/landing (re-blocking)
    agent.py         the NIXL agent wrapper (progress thread off)
    progress.py      progress driven from asyncio: hot/warm/idle polling on a timerfd
    peers.py         EngineRecord (Engine proto) -> cached RemotePeer
    notify.py        BEGIN / LANDED / ABORT notifications
    push.py          PushEngine (prefill side)
    landing.py       LandingTable (decode side)
    frames.py        local channel wire format
    channel.py       local channel: asyncio server, synchronous client, RTT
    sidecar.py       Sidecar: all of the above for one engine; local process main
    xfer_cost.py     measurement: prepped descriptor lists vs initialize_xfer
    pull_baseline.py the READ-after-prefill baseline used by bench/push.py
"""
