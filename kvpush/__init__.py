"""kvpush: push-based KV cache transfer for disaggregated vLLM serving.

This package holds what every component shares: the KV layout record, logging,
the embedded etcd launcher, the CLI, and (under ``kvpush.contract.v1``) the gRPC stubs
generated from ``proto/kvpush/v1``.
"""

__version__ = "0.1.0"
