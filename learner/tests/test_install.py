"""The hakmem package installs anywhere: a wheel built from the checkout,
installed into a fresh virtual environment outside it (as deploy/'s systemd
unit expects in /opt/hakmem/.venv), runs hakmem-learnd and every `hakmem`
command from a directory outside the checkout, with its SQL migrations and
protobuf messages from the wheel and nothing imported from the checkout.

How. The wheel is built with pip from a copy of the files the package is
made of (nothing is written into the checkout), without build isolation:
setuptools and wheel come from this environment (`.[test]`), and protoc
generates the messages during the build, as setup.py does for any wheel.
The new environment is made without pip and without the system's site
packages; pip runs from this environment against it (`pip --python`).
Its dependencies (numpy, scikit-learn, pyzmq, protobuf) are this
environment's own, reached through a .pth file, and the wheel is installed
with `--no-index`: no network, nothing downloaded, seconds instead of the
minutes a download and build of scikit-learn can take on CI, and pip still
resolves the wheel's declared dependencies against them (a dependency
missing from pyproject.toml would not be caught, one declared but absent
would). A .pth line adds a directory to sys.path only: the .pth files in it
(this environment's editable install of hakmem) are not read.
"""
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

from conftest import ROOT, clean_env, scaled, wait_for

# What the package is built from (pyproject.toml's view of the checkout).
SOURCES = ("pyproject.toml", "setup.py", "proto", "schemas/sql", "schemas/fleet", "learner/hakmem")


def _copy_sources(dst):
    for rel in SOURCES:
        src, out = ROOT / rel, dst / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, out, symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "_pb", "*.egg-info"))
        else:
            shutil.copy2(src, out)


def _run(cmd, cwd, env, timeout=120, check=True):
    r = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=scaled(timeout))
    if check:
        assert r.returncode == 0, f"{' '.join(map(str, cmd))}: exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r


@pytest.fixture(scope="module")
def installed():
    """(venv, env, work dir): the wheel installed into a new environment in a
    temporary directory outside the checkout."""
    if shutil.which("protoc") is None:
        pytest.fail("protoc is needed to build the wheel (make deps installs protobuf-compiler)")
    top = pathlib.Path(tempfile.mkdtemp(prefix="hk-install-"))
    assert not str(top).startswith(str(ROOT))
    try:
        env = clean_env()
        env.pop("PYTHONPATH", None)
        env.pop("VIRTUAL_ENV", None)
        env["PIP_NO_INPUT"] = "1"
        src, wheels, venv, work = top / "src", top / "wheels", top / "venv", top / "work"
        work.mkdir()
        _copy_sources(src)
        _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
              "-w", wheels, src], top, env)
        wheel, = wheels.glob("hakmem-*.whl")
        _run([sys.executable, "-m", "venv", "--without-pip", venv], top, env)
        py = venv / "bin" / "python"
        site = pathlib.Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], top,
                                 env).stdout.strip())
        deps = [p for p in sys.path if p.endswith("site-packages") and os.path.isdir(os.path.join(p, "numpy"))]
        assert deps, "no site-packages with numpy in this environment"
        (site / "hakmem-test-deps.pth").write_text(deps[0] + "\n")
        _run([sys.executable, "-m", "pip", "--python", py, "install", "--no-index", "-q", wheel], work, env)
        yield venv, env, work
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_the_wheel_holds_its_migrations_and_messages(installed):
    venv, env, work = installed
    probe = ("import json, pkgutil, sys, hakmem, hakmem.store as s, hakmem.fleet as f, hakmem._pb.hakmem_pb2 as pb\n"
             "for m in pkgutil.walk_packages(hakmem.__path__, 'hakmem.'):\n"
             "    if not m.name.endswith('__main__'):\n"
             "        __import__(m.name)\n"
             "mods = {n: getattr(m, '__file__', None) for n, m in sys.modules.items() if n.startswith('hakmem')}\n"
             "print(json.dumps({'file': hakmem.__file__, 'schema': str(s.SCHEMA_DIR), 'mods': mods,\n"
             "                  'migrations': [v for v, _, _ in s.migrations()],\n"
             "                  'fleet': [v for v, _, _ in f.migrations()],\n"
             "                  'messages': sorted(pb.DESCRIPTOR.message_types_by_name)[:3]}))\n")
    out = json.loads(_run([venv / "bin" / "python", "-c", probe], work, env).stdout)
    inside = str(venv.resolve())
    assert out["file"].startswith(inside), out["file"]
    assert out["schema"].startswith(inside) and out["migrations"] == list(range(1, len(out["migrations"]) + 1))
    assert len(out["migrations"]) == len(list((ROOT / "schemas" / "sql").glob("[0-9]*.sql")))
    assert out["fleet"] == list(range(1, len(list((ROOT / "schemas" / "fleet").glob("[0-9]*.sql"))) + 1)), out

    assert out["messages"], out
    assert "hakmem.cli.policy" in out["mods"] and "hakmem.backend" in out["mods"]
    outside = {n: f for n, f in out["mods"].items() if f and not f.startswith(inside)}
    assert not outside, outside


def _commands(venv, env, work):
    """Every command path of the installed `hakmem` (("ring", "dump"), ...), from its own parser."""
    walk = ("import argparse, json\n"
            "from hakmem.cli import build_parser\n"
            "def walk(p, path):\n"
            "    subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]\n"
            "    out = [path] if path else []\n"
            "    for a in subs:\n"
            "        for name, sp in a.choices.items():\n"
            "            out += walk(sp, path + [name])\n"
            "    return out\n"
            "print(json.dumps(walk(build_parser(), [])))\n")
    return [tuple(c) for c in json.loads(_run([venv / "bin" / "python", "-c", walk], work, env).stdout)]


def test_every_command_runs_from_the_installed_package(installed):
    venv, env, work = installed
    hakmem, learnd = venv / "bin" / "hakmem", venv / "bin" / "hakmem-learnd"
    r = _run([learnd, "--help"], work, env)
    assert r.stdout.startswith("usage: hakmem-learnd")
    cmds = _commands(venv, env, work)
    assert {("status",), ("policy", "import"), ("ring", "hold"), ("events",)} <= set(cmds), cmds
    for c in cmds:
        r = _run([hakmem, *c, "--help"], work, env)
        assert r.stdout.startswith(f"usage: hakmem {' '.join(c)}"), (c, r.stdout)

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="hk", dir="/tmp"))     # ipc paths: short
    db, shm, run = tmp / "learn.db", tmp / "shm", tmp / "run"
    where = ["--db", db, "--run-dir", run]
    log = open(tmp / "learnd.log", "w")
    d = subprocess.Popen([str(learnd), "--foreground", "--learner", "static", "--db", str(db), "--shm-dir",
                          str(shm), "--run-dir", str(run)], cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        text = lambda: (tmp / "learnd.log").read_text()
        wait_for(lambda: "ready:" in text() or d.poll() is not None, 60, "learnd ready")
        assert d.poll() is None, text()
        st = json.loads(_run([hakmem, "status", "--json", *where], work, env).stdout)
        assert st["status"]["running"] and st["status"]["pid"] == d.pid and st["status"]["db_path"] == str(db)
        assert json.loads(_run([hakmem, "policy", "list", "--json", *where], work, env).stdout) == []
        assert json.loads(_run([hakmem, "procs", "--json", *where], work, env).stdout)["running"] is True
        assert json.loads(_run([hakmem, "ring", "list", "--json", "--dir", shm], work, env).stdout) == []
        d.send_signal(signal.SIGTERM)
        assert d.wait(scaled(30)) == 0, text()
        r = _run([hakmem, "status", *where], work, env)
        assert r.stdout.startswith(f"hakmem-learnd is not running; read from {db}"), r.stdout
        r = _run([hakmem, "policy", "show", "nothing", *where], work, env, check=False)
        assert r.returncode == 1 and r.stderr.startswith("hakmem: error: ") and len(r.stderr.splitlines()) == 1
    finally:
        if d.poll() is None:
            d.kill()
            d.wait()
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)
