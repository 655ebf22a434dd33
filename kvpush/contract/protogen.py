"""Generate the gRPC stubs in ``kvpush/contract/v1`` from ``proto/kvpush/contract/v1``.

Run by ``scripts/setup.sh`` (and therefore by the README's commands and CI).
The stubs are not committed: they are a build product of the pinned
grpcio-tools, so they can never drift from the .proto files.
"""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "proto"


def generate() -> list[pathlib.Path]:
    from grpc_tools import protoc
    import grpc_tools

    protos = sorted(PROTO_DIR.glob("kvpush/contract/v1/*.proto"))
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTO_DIR}", f"-I{include}", f"--python_out={ROOT}",
            f"--pyi_out={ROOT}", f"--grpc_python_out={ROOT}", *map(str, protos)]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return protos


if __name__ == "__main__":
    names = generate()
    print(f"generated stubs for {len(names)} protos into kvpush/contract/v1", file=sys.stderr)
