"""The CacheCopier seam (``copier.py``) and its implementations: ``CpuCopier`` for the CPU
backend's packed caches (``cpu_copier.py``, its probed ``cache_codec.py``) and
``TorchCopier`` for vLLM's GPU layouts in torch ops (``torch_copier.py``)."""
