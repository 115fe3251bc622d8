"""A program's identity is its executable and its GNU build id, read from
/proc/<pid>/exe (README "hakmem-learnd": a program is the executable and its
build id, and the user). The build id must be the one the linker wrote,
as readelf reports it, not another note's bytes."""
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import LIB, WORKLOAD
from hakmem.identity import elf_build_id, program_identity


def readelf_build_id(path):
    out = subprocess.run(["readelf", "-n", str(path)], capture_output=True, text=True, check=True).stdout
    m = re.search(r"Build ID: ([0-9a-f]+)", out)
    return m.group(1) if m else None


@pytest.mark.skipif(shutil.which("readelf") is None, reason="needs readelf (Debian: binutils, part of build-essential)")
@pytest.mark.parametrize("path", [WORKLOAD, LIB, os.path.realpath(sys.executable)])
def test_build_id_is_the_linkers(path):
    want = readelf_build_id(path)
    assert want, f"{path} has no build id to compare with"
    assert elf_build_id(str(path)) == want


def test_a_live_process_is_its_executable_and_build_id():
    exe, bid = program_identity(os.getpid())
    assert exe == os.path.realpath(f"/proc/{os.getpid()}/exe")
    if shutil.which("readelf"):
        assert bid == readelf_build_id(exe)


def test_a_file_without_a_build_id(tmp_path):
    f = tmp_path / "not-elf"
    f.write_bytes(b"#!/bin/sh\necho hi\n")
    assert elf_build_id(str(f)) is None
