"""A throwaway certificate authority for the TLS tests: a CA and certificates it signed,
valid for 127.0.0.1 and localhost (openssl, as an operator would make them)."""

from __future__ import annotations

import pathlib
import subprocess
from typing import Callable


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_pki(directory: pathlib.Path, names: tuple[str, ...]) -> Callable[[str], str]:
    """``ca.pem``/``ca.key`` and ``<name>.pem``/``<name>.key`` for each name (its CN) in
    ``directory``; returns ``path(filename)``."""
    p = lambda name: str(directory / name)  # noqa: E731
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=kvpush-test-ca",
            "-keyout", p("ca.key"), "-out", p("ca.pem"))
    (directory / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name in names:
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", p(f"{name}.key"),
                "-out", p(f"{name}.csr"))
        openssl("x509", "-req", "-in", p(f"{name}.csr"), "-CA", p("ca.pem"), "-CAkey", p("ca.key"),
                "-CAcreateserial", "-days", "2", "-extfile", p("san.ext"), "-out", p(f"{name}.pem"))
    return p
