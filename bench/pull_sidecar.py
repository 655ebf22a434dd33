"""A local decode sidecar that also answers ``bench_pull``: the pull baseline's READ
(``bench/pull_baseline.py``), run inside a real sidecar over its own NIXL agent (a
``NixlTransport`` that can READ, given to the sidecar as its transport factory).
The production sidecar has no such op; ``bench/push.py`` starts its decode side with
``python -m bench.pull_sidecar`` instead of ``python -m kvpush.sidecar.sidecar``."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.pull_baseline import pull, reading_transport  # noqa: E402
from kvpush.contract.states import DECODE  # noqa: E402
from kvpush.sidecar.decode import DecodeSidecar  # noqa: E402
from kvpush.sidecar.sidecar import main, make_sidecar  # noqa: E402


class PullingDecodeSidecar(DecodeSidecar):
    def on_admin(self, conn, request: dict):
        if request.get("op") == "bench_pull":
            return pull(self.transport, self.driver, request, self.config.push.transfer_timeout_s)
        return super().on_admin(conn, request)


def factory(config):
    if config.role == DECODE:
        return PullingDecodeSidecar(config, transport_factory=reading_transport)
    return make_sidecar(config)


if __name__ == "__main__":
    main(factory=factory)
