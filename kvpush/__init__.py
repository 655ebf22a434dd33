"""kvpush: push-based KV cache transfer for disaggregated vLLM serving.

Every module of the project lives here, one subpackage per process (or side of one):
``client`` (the control plane's SDK), ``controlplane``, ``router``, ``sidecar``,
``connector`` (inside vLLM), ``channel`` (what the connector and its sidecar both speak)
and ``app`` (the ``kvpush`` command). The rest of this package is the ground floor,
which all of them may import and which imports none of them: ``contract/`` (the
generated gRPC stubs, the KV layout, the engine record, the push target and
parameters, every state vocabulary), ``log`` (structlog set-up), ``aio`` (event-loop
helpers), ``trace`` (the opt-in request timeline) and ``tls``.
"""

__version__ = "0.1.0"
