"""What both ends of the local channel speak: the engine's connector (``kvpush.connector``)
and its sidecar (``kvpush.sidecar``) import these, and never each other. Nothing here
moves bytes over the network (no NIXL).

    frames.py        the channel's frames
    pool.py          PoolDescription and StagingAllocation: what crosses the channel about pools
    memory.py        PoolMemory (the seam), ShmMemory, segment names and the sweep of dead owners'
    device_memory.py CudaPoolMemory: a VRAM pool and its CUDA IPC handle, and their refusals
    attach.py        attach_pool: a PoolDescription mapped into the engine's process
    geometry.py      DestGeometry: a request's bytes in the destination's block geometry
    head_plan.py     which heads each prefill rank sends to which decode rank
    reblock.py       numpy re-blocking copies: paged cache <-> staging/landing
"""
