"""The one build step pyproject.toml cannot say: the protobuf module.

proto/*.proto are the one definition of every message learnd, the CLI,
policy files and traces exchange; hakmem/_pb/*_pb2.py are generated from them,
never committed. `make` generates it into the checkout for the editable
install in .venv; a wheel (`pip wheel .`, `python -m build`) generates it
here, into the build directory, so an installed hakmem has its messages
without make. The SQL migrations are package data (pyproject.toml).
"""
import os
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_DIR = os.path.join(HERE, "proto")
PROTOS = sorted(os.path.join(PROTO_DIR, f) for f in os.listdir(PROTO_DIR) if f.endswith(".proto"))


class build_py_with_protobuf(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):     # the checkout's own, made by `make` (learner/hakmem/_pb)
            return
        out = os.path.join(self.build_lib, "hakmem", "_pb")
        protoc = shutil.which("protoc")
        if protoc is None:
            raise SystemExit("hakmem: protoc not found: it generates hakmem/_pb from proto/*.proto "
                             "(Debian: apt-get install protobuf-compiler)")
        os.makedirs(out, exist_ok=True)
        subprocess.run([protoc, f"-I{PROTO_DIR}", f"--python_out={out}", *PROTOS], check=True)
        with open(os.path.join(out, "__init__.py"), "w"):
            pass


setup(cmdclass={"build_py": build_py_with_protobuf})
