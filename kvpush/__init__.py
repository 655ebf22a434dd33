"""kvpush: push-based KV cache transfer for disaggregated vLLM serving.

The ground floor, which every other package may import and which imports none of
them: ``contract/`` (the generated gRPC stubs, the KV layout, the engine record, the
push target and parameters, every state vocabulary), ``log`` (structlog set-up),
``aio`` (event-loop helpers) and ``trace`` (the opt-in request timeline).
"""

__version__ = "0.1.0"
