"""Build hook: the gRPC stubs are generated from proto/ when the package is built
(``python -m build``, ``pip wheel .``, ``pip install .``), so a wheel carries them with no
setup step before it. Everything else about the package is in pyproject.toml."""

import importlib.util
import pathlib

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = pathlib.Path(__file__).resolve().parent


class BuildPyWithStubs(build_py):
    def run(self) -> None:
        # kvpush/contract/protogen.py is the one home of stub generation; loaded by path,
        # since the package itself is not importable before it is built.
        spec = importlib.util.spec_from_file_location("kvpush_protogen", ROOT / "kvpush/contract/protogen.py")
        protogen = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(protogen)
        protogen.generate()
        super().run()


setup(cmdclass={"build_py": BuildPyWithStubs})
