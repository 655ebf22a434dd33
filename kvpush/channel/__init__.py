"""The engine side: what runs inside vLLM's processes. It moves no bytes over the
network (no NIXL here) and imports nothing of the sidecar; the sidecar imports its
channel codec and pool types.

    connector/      the KV connector vLLM loads (scheduler side, worker side)
    channel.py      SidecarClient: the engine's end of the local channel
    frames.py       the channel's frames (both ends speak them)
    pool.py         PoolDescription and StagingAllocation: what crosses the channel about pools
    memory.py       PoolMemory (the seam), ShmMemory, attach_pool (description -> mapping)
    device_memory.py CudaPoolMemory: a VRAM pool and its CUDA IPC handle, and their refusals
    geometry.py     DestGeometry: a request's bytes in the destination's block geometry
    copier.py       the CacheCopier seam: engine cache <-> canonical blocks
    cpu_copier.py   CpuCopier: the CacheCopier for the CPU backend's packed caches
    torch_copier.py TorchCopier: the CacheCopier for vLLM's plain (GPU) layouts, in torch ops
    cache_codec.py  BlockCodec: a backend's block layout, probed from its kernel
    reblock.py      numpy re-blocking copies: paged cache <-> staging/landing
"""
