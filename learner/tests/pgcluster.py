"""A private PostgreSQL cluster for the fleet's tests and bench/fleet.py: made
by initdb in a temporary directory as the `postgres` account, listening only
on a unix socket there. `postgres` itself logs in without a password (the
fleet's owner here); every other role (the hosts) with its password
(scram-sha-256), so a host cannot log in as another."""
from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import tempfile
import time

PG_BIN = pathlib.Path("/usr/lib/postgresql/15/bin")


def _as(ids, argv, **kw):
    uid, gid = ids
    return subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--",
                             *map(str, argv)], cwd="/", **kw)


class Cluster:
    def __init__(self, ids, settings=()):
        self.ids = ids
        self.settings = list(settings)
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix="hakmem-fleet-pg-"))
        os.chown(self.dir, *ids)
        self.data = self.dir / "data"
        self.logpath = self.dir / "server.log"
        self.pm = None
        self._log = None

    def _env(self):
        return {"PATH": "/usr/bin:/bin", "LC_ALL": "C"}

    def _run(self, *argv, timeout=120):
        p = _as(self.ids, argv, env=self._env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out, _ = p.communicate(timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(map(str, argv))} failed ({p.returncode}):\n{out}")
        return out

    def initdb(self):
        self._run(PG_BIN / "initdb", "-D", self.data, "-U", "postgres", "--auth-local=scram-sha-256",
                  "--auth-host=reject", "-E", "UTF8", "--locale=C", "--no-sync")
        hba = self.data / "pg_hba.conf"
        hba.write_text("local all postgres trust\nlocal all all scram-sha-256\n")
        return self

    def start(self, timeout=30):
        self._log = open(self.logpath, "a")
        args = [PG_BIN / "postgres", "-D", self.data, "-c", "listen_addresses=",
                "-c", f"unix_socket_directories={self.dir}", "-c", "fsync=off", "-c", "synchronous_commit=off",
                "-c", "full_page_writes=off", "-c", "logging_collector=off"]
        for s in self.settings:
            args += ["-c", s]
        self.pm = _as(self.ids, args, env=self._env(), stdout=self._log, stderr=subprocess.STDOUT,
                      start_new_session=True)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.pm.poll() is not None:
                raise RuntimeError(f"postgres exited at start ({self.pm.returncode}):\n{self.text()}")
            try:
                lines = (self.data / "postmaster.pid").read_text().splitlines()
                if len(lines) >= 8 and lines[7].strip() == "ready":
                    return self
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"postgres not ready in {timeout} s:\n{self.text()}")

    def url(self, role="postgres", password=None, db="postgres"):
        auth = f"{role}:{password}" if password else role
        return f"postgresql://{auth}@/{db}?host={self.dir}"

    def text(self):
        try:
            return self.logpath.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, mode="fast"):
        """pg_ctl stop; whatever is still alive after it is killed. Safe twice."""
        if self.pm is None:
            return
        if self.pm.poll() is None:
            try:
                self._run(PG_BIN / "pg_ctl", "stop", "-D", self.data, "-m", mode, "-w", "-t", "30", timeout=40)
            except (RuntimeError, subprocess.TimeoutExpired):
                pass
        if self.pm.poll() is None:
            try:
                os.killpg(self.pm.pid, signal.SIGKILL)
            except OSError:
                pass
        self.pm.wait()
        self.pm = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def cleanup(self):
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
