"""Generated gRPC stubs for the kvpush v1 API (built by ``python -m kvpush.contract.protogen``)."""
