"""Shared fixtures: the built library and workload, a telemetry directory,
and a way to start a preloaded workload and find its telemetry file."""
import os
import pathlib
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("BUILD", ROOT / "build"))
if not BUILD.is_absolute():
    BUILD = ROOT / BUILD
LIB = BUILD / "libhakmem.so"
WORKLOAD = BUILD / "learner" / "workload"
HAKMEM = [sys.executable, "-m", "hakmem"]


def pytest_sessionstart(session):
    missing = [str(p) for p in (LIB, WORKLOAD) if not p.exists()]
    if missing:
        pytest.exit(f"missing {', '.join(missing)}: run `make tests` first", returncode=2)


@pytest.fixture
def shm(tmp_path):
    d = tmp_path / "shm"
    d.mkdir()
    return d


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAKMEM_")}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def start(args, shm_dir, **env):
    """Starts the workload with hakmem preloaded and telemetry in shm_dir."""
    e = clean_env(LD_PRELOAD=str(LIB), HAKMEM_SHM_DIR=str(shm_dir), **env)
    return subprocess.Popen([str(WORKLOAD), *map(str, args)], env=e, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def proc_start_time(pid):
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    return int(data[data.rindex(b")") + 2:].split()[19])


def wait_for(pred, timeout=5.0, what="condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.005)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def ring_path(shm_dir, pid, timeout=5.0):
    """The telemetry file of pid, once it exists with a complete header."""
    def find():
        for p in pathlib.Path(shm_dir).glob(f"{pid}-*"):
            with open(p, "rb") as f:
                if f.read(8) == b"HKRING01":
                    return p
        return None
    return wait_for(find, timeout, f"the telemetry file of pid {pid}")


def run_cli(*args, **kw):
    return subprocess.run([*HAKMEM, *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=60, **kw)
