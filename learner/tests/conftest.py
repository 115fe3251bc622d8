"""Shared fixtures: the built library and workload, a telemetry directory,
and a way to start a preloaded workload and find its telemetry file.

Time. Every wall-clock limit in these tests is multiplied by one factor,
HAKMEM_TEST_TIME_FACTOR (a positive number, default 1; e.g. 3 on a slow or
loaded machine, or under valgrind): `scaled(s)` gives s times the factor, and
`wait_for` scales its own timeout. That covers both kinds of limit: a bound
that is the thing under test ("applied within 0.2 s" is `took <=
scaled(0.2)`) and a guard against hanging. Readiness is waited for by
polling (`wait_for`), never by a sleep of a guessed length; a sleep left in
a test is a stimulus or a measuring interval, and says so."""
import os
import pathlib
import pwd
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("BUILD", ROOT / "build"))
if not BUILD.is_absolute():
    BUILD = ROOT / BUILD
LIB = BUILD / "libhakmem.so"
WORKLOAD = BUILD / "learner" / "workload"
HAKMEM = [sys.executable, "-m", "hakmem"]


def _time_factor():
    raw = os.environ.get("HAKMEM_TEST_TIME_FACTOR", "").strip() or "1"
    try:
        f = float(raw)
    except ValueError:
        f = float("nan")
    if not (0 < f < float("inf")):
        raise pytest.UsageError(f"HAKMEM_TEST_TIME_FACTOR={raw!r}: expected a positive number (default 1)")
    return f


TIME_FACTOR = _time_factor()


def scaled(seconds):
    """A wall-clock limit of `seconds` on a reference machine, on this one."""
    return seconds * TIME_FACTOR


def pytest_sessionstart(session):
    missing = [str(p) for p in (LIB, WORKLOAD) if not p.exists()]
    if missing:
        pytest.exit(f"missing {', '.join(missing)}: run `make tests` first", returncode=2)


sys.path.insert(0, str(ROOT / "learner"))
from hakmem.lease import Lease  # noqa: E402


@pytest.fixture
def shm(tmp_path):
    """A telemetry directory with its lease held, as a running learnd would:
    processes make their files only while somebody holds it."""
    d = tmp_path / "shm"
    d.mkdir()
    with Lease(d, "pytest"):
        yield d


# ---- another user -------------------------------------------------------------
# The trust tests act as a hostile local user: an unprivileged account of
# their own (created once, kept: useradd is slow and CI machines are fresh),
# running the workload with setpriv. They need root; elsewhere they skip and
# say why.
USERS = ("hakmem-mallory", "hakmem-alice")


def need_root(why="creates accounts (useradd) and runs as them (setpriv)"):
    if os.geteuid() != 0:
        pytest.skip(f"needs root: {why}")


def need_accounts():
    need_root()
    for tool in ("useradd", "setpriv"):
        if not shutil.which(tool):
            pytest.skip(f"needs {tool} (Debian: passwd, util-linux)")


def user(name):
    """(uid, gid) of a test account, created when missing."""
    need_accounts()
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                       check=True, capture_output=True)
        pw = pwd.getpwnam(name)
    return pw.pw_uid, pw.pw_gid


@pytest.fixture(scope="session")
def mallory():
    return user(USERS[0])


@pytest.fixture(scope="session")
def alice():
    return user(USERS[1])


@pytest.fixture(scope="session")
def public_bin():
    """libhakmem.so and the workload where any user can run them (the
    checkout may sit under a 0700 home directory)."""
    need_root()
    d = pathlib.Path(tempfile.mkdtemp(prefix="hakmem-bin-"))
    d.chmod(0o755)
    for src in (LIB, WORKLOAD):
        shutil.copy2(src, d / src.name)
        (d / src.name).chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def shared_shm():
    """A telemetry directory as learnd makes it for every user: root's,
    1777 (world-writable, sticky), on tmpfs."""
    need_root()
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    d = pathlib.Path(tempfile.mkdtemp(prefix="hakmem-test-", dir=base))
    d.chmod(0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def as_user(ids, argv, env=None, **kw):
    """Popen of argv as (uid, gid), with no supplementary groups."""
    uid, gid = ids
    return subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--",
                             *map(str, argv)], env=env, cwd="/", **kw)


def start_as(ids, bindir, args, shm_dir, **env):
    """The workload as another user, hakmem preloaded, telemetry in shm_dir."""
    e = clean_env(LD_PRELOAD=str(bindir / LIB.name), HAKMEM_SHM_DIR=str(shm_dir), **env)
    return as_user(ids, [bindir / WORKLOAD.name, *args], env=e, stdout=subprocess.PIPE,
                   stderr=subprocess.PIPE, text=True)


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAKMEM_")}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def start(args, shm_dir, **env):
    """Starts the workload with hakmem preloaded and telemetry in shm_dir."""
    e = clean_env(LD_PRELOAD=str(LIB), HAKMEM_SHM_DIR=str(shm_dir), **env)
    return subprocess.Popen([str(WORKLOAD), *map(str, args)], env=e, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def processes_with(*needles: bytes) -> list[int]:
    """Live processes whose command line holds any of needles: what a
    tool that starts services may have left running."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                cmd = pathlib.Path(f"/proc/{d}/cmdline").read_bytes()
            except OSError:
                continue
            if any(n in cmd for n in needles):
                out.append(int(d))
    return out


def proc_start_time(pid):
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    return int(data[data.rindex(b")") + 2:].split()[19])


def wait_for(pred, timeout=5.0, what="condition"):
    """pred()'s first true value, polled every 5 ms for timeout seconds
    (scaled by HAKMEM_TEST_TIME_FACTOR); AssertionError naming `what` after
    (a string, or a function giving one, called then: a log's end at timeout)."""
    limit = scaled(timeout)
    end = time.monotonic() + limit
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() >= end:
            break
        time.sleep(0.005)
    factor = f" ({timeout} s x HAKMEM_TEST_TIME_FACTOR {TIME_FACTOR:g})" if TIME_FACTOR != 1 else ""
    raise AssertionError(f"timed out after {limit:g} s{factor} waiting for {what() if callable(what) else what}")


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
                          cwd=ROOT, timeout=scaled(60), **kw)
