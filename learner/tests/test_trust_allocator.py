"""Trust and faults, the allocator's side (issues 10 and 36): nothing another
user puts in or does to the telemetry directory can kill, hang or steer a
preloaded process, and what turns telemetry off is said in its stats; nor can
a file size limit kill it, nor the caller's environment steer a setuid program.

One test per finding; each docstring says what main did
before the fix and what it does now. The tests that need root (mounting a
filesystem, another account, a setuid program) skip with the reason elsewhere."""
import errno
import json
import os
import pathlib
import re
import resource
import shutil
import subprocess
import tempfile
import time

import pytest

from conftest import (BUILD, LIB, ROOT, WORKLOAD, as_user, clean_env, need_root, proc_start_time, ring_path,
                      scaled, start, start_as, wait_for)
from hakmem.lease import Lease

PY = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else shutil.which("python3")


def ring_files(d):
    """What processes left in a telemetry directory: not the lease, not the
    tests' own files."""
    return sorted(p.name for p in d.iterdir() if p.name not in ("learnd.lock", "fill"))


def telemetry_line(stderr):
    """The HAKMEM_STATS=1 table's telemetry line, without its label."""
    m = re.search(r"^  telemetry: (.*)$", stderr, re.M)
    assert m, f"no telemetry line in the stats table:\n{stderr[-2000:]}"
    return m.group(1)


def run_stats(shm_dir, seconds=0.6, watch=None, **env):
    """The workload for a while with HAKMEM_STATS=1: (exit status, stderr,
    the files seen in `watch` while it ran: a file is removed at exit)."""
    p = start(["burst", 64, 2000, seconds], shm_dir, HAKMEM_STATS=1, **env)
    seen = set()
    while p.poll() is None:
        seen.update(ring_files(watch or shm_dir))
        time.sleep(0.01)        # the sampling interval
    out, err = p.communicate(timeout=scaled(60))
    return p.returncode, err, sorted(seen)


# ---- 1. a full filesystem ------------------------------------------------------
@pytest.fixture
def small_fs(tmp_path):
    """A private 4 MiB tmpfs, unmounted at the end."""
    need_root("mounts a small tmpfs to fill")
    if not shutil.which("mount"):
        pytest.skip("needs mount (util-linux)")
    d = tmp_path / "fs"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0755", "hakmem-test", str(d)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


def fill(d):
    """Fills the filesystem of d to the last block."""
    fd = os.open(d / "fill", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for chunk in (1 << 16, 4096, 512):
            while True:
                try:
                    os.write(fd, bytes(chunk))
                except OSError as e:
                    assert e.errno == errno.ENOSPC, e
                    break
    finally:
        os.close(fd)
    assert os.statvfs(d).f_bavail == 0


def test_full_filesystem_never_kills_the_process(small_fs):
    """Before: the file was grown sparse with ftruncate and written through
    the mapping, so a full filesystem killed the program with SIGBUS (exit
    135), at creation when it was full already, or at its next record when
    it filled later. After: the file's blocks are reserved (fallocate) when
    it is made; a full filesystem means no file, a counted failure and a line
    in the stats, and a process whose file exists runs on."""
    with Lease(small_fs, "test"):
        # (a) full before the program starts
        fill(small_fs)
        rc, err, _ = run_stats(small_fs)
        assert rc == 0, f"exit {rc} (-7: SIGBUS)\n{err[-1000:]}"
        line = telemetry_line(err)
        assert line.startswith("off: no space") and re.search(r"\(\d+ failures\)", line), line
        assert ring_files(small_fs) == []
        # (b) the file made, then the filesystem filled to the last block
        os.unlink(small_fs / "fill")
        p = start(["burst", 64, 2000, scaled(1.5)], small_fs, HAKMEM_STATS=1, HAKMEM_TELEMETRY_MS=20)
        ring_path(small_fs, p.pid)
        fill(small_fs)
        out, err = p.communicate(timeout=scaled(60))
        assert p.returncode == 0, f"exit {p.returncode} (-7: SIGBUS)\n{err[-1000:]}"
        assert json.loads(out.splitlines()[-1])["mode"] == "burst"
        assert telemetry_line(err).startswith("on, "), err
        assert ring_files(small_fs) == []


# ---- 2. the directory -----------------------------------------------------------
def test_untrusted_directory_is_refused(tmp_path):
    """Before: the allocator followed a symbolic link named like the
    telemetry directory and created its file wherever it pointed, and took
    any directory (another user's, one anybody may write). After: the
    directory is opened with O_NOFOLLOW and accepted only when owned by root
    or the process's user and, if others may write it, sticky; otherwise no
    file, a counted failure and the reason in the stats."""
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    with Lease(real, "test"):
        rc, err, seen = run_stats(link, watch=real)
        assert rc == 0, err
        assert seen == [], "a file made through the link"
        line = telemetry_line(err)
        assert line.startswith("off: untrusted directory") and "symbolic link" in line, line
        assert re.search(r"\(\d+ failures\)", line), line
    if os.geteuid() != 0:
        return   # the rest gives a directory to another user
    other = tmp_path / "others"
    other.mkdir()
    os.chown(other, 65534, 65534)
    with Lease(other, "test"):
        rc, err, seen = run_stats(other)
        assert rc == 0 and seen == [], "a file made in another user's directory"
        assert "untrusted directory" in telemetry_line(err) and "owned by uid 65534" in telemetry_line(err), err
    open_ = tmp_path / "open"
    open_.mkdir()
    open_.chmod(0o777)
    with Lease(open_, "test"):
        rc, err, seen = run_stats(open_)
        assert rc == 0 and seen == [], "a file made in a directory anybody may write"
        assert "not sticky" in telemetry_line(err), err
        open_.chmod(0o1777)   # as /tmp: others may write, nobody can remove our file
        p = start(["burst", 64, 2000, scaled(1.0)], open_, HAKMEM_STATS=1)
        ring_path(open_, p.pid)
        _, err = p.communicate(timeout=scaled(60))
        assert p.returncode == 0 and telemetry_line(err).startswith("on, "), err


def test_exit_removes_only_its_own_file(tmp_path):
    """Before: at exit the allocator unlinked <dir>/<name> by path, whatever
    the path led to by then. After: it removes the name only when the
    directory is the one it made the file in and the name still leads to
    its file (device and inode of both); a directory renamed away and
    replaced keeps what was put in its place."""
    d = tmp_path / "shm"
    d.mkdir()
    with Lease(d, "test"):
        p = start(["burst", 64, 2000, scaled(1.0)], d)
        name = ring_path(d, p.pid).name
        os.rename(d, tmp_path / "moved")
        d.mkdir()
        (d / name).write_bytes(b"somebody else's")
        assert p.wait(timeout=scaled(60)) == 0
    assert (d / name).exists(), "exit removed the file put in the place of its own"
    assert (d / name).read_bytes() == b"somebody else's"


# ---- 3. the lease -------------------------------------------------------------------
def test_file_only_while_a_reader_holds_the_lease(tmp_path):
    """Before: a process made its file whenever the directory existed, read
    or not, so files of processes that died by _exit or a signal piled up in
    RAM. After: only while learnd.lock is a regular file of root or our user,
    write-locked by its holder (lease.py CONTRACT); without a lease nothing is
    made, which is not a failure; a process started before learnd is picked
    up at its next try (backoff 1 s doubling to 16 s); a FIFO as the lock file
    does not block."""
    d = tmp_path / "shm"
    d.mkdir()
    rc, err, seen = run_stats(d)
    assert rc == 0 and seen == [], f"a file made with no lease: {seen}"
    line = telemetry_line(err)
    assert line.startswith("off: no lease") and "failures" not in line, line
    # A service started before learnd: tries at 0.1 s, 1.1 s, 3.1 s.
    p = start(["burst", 64, 2000, scaled(3.0)], d, HAKMEM_STATS=1)
    # Past its first try (0.1 s after start), which nothing outside shows:
    # a wait of the allocator's own schedule, not a readiness guess.
    time.sleep(scaled(0.5))
    assert ring_files(d) == []
    with Lease(d, "test"):
        t0 = time.monotonic()
        ring_path(d, p.pid, timeout=5)
        late = time.monotonic() - t0
        _, err = p.communicate(timeout=scaled(60))
    assert p.returncode == 0 and telemetry_line(err).startswith("on, "), err
    assert late < scaled(3), f"picked up {late:.1f} s after the lease"
    # A FIFO in the lock file's place: no hang, no file.
    os.mkfifo(d / "learnd.lock")
    t0 = time.monotonic()
    rc, err, seen = run_stats(d)
    assert rc == 0 and time.monotonic() - t0 < scaled(10)
    assert seen == [] and telemetry_line(err).startswith("off: no lease"), err


def test_lease_of_another_user_is_not_believed(mallory, alice, public_bin, shared_shm):
    """Before: no lease was looked at. After: a lock file that another
    (unprivileged) user made and write-locks holds no lease for root's
    processes; root's lease holds one for every user's processes."""
    script = ("import fcntl, os, struct, sys, time\n"
              "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)\n"
              "fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack('hhqqi4x', fcntl.F_WRLCK, 0, 0, 0, 0))\n"
              "print('held', flush=True)\n"
              "time.sleep(60)\n")
    h = as_user(mallory, [PY, "-c", script, shared_shm / "learnd.lock"], stdout=subprocess.PIPE, text=True)
    try:
        assert h.stdout.readline().strip() == "held"
        rc, err, seen = run_stats(shared_shm)
        assert rc == 0, err
        assert seen == [], "a file made under another user's lease"
        line = telemetry_line(err)
        assert line.startswith("off: no lease") and f"owner uid {mallory[0]}" in line, line
    finally:
        h.kill()
        h.wait()
    os.unlink(shared_shm / "learnd.lock")
    with Lease(shared_shm, "test"):
        p = start_as(alice, public_bin, ["burst", 64, 2000, scaled(1.0)], shared_shm)
        path = ring_path(shared_shm, p.pid)
        assert path.stat().st_uid == alice[0]
        out, err = p.communicate(timeout=scaled(60))
        assert p.returncode == 0, err
    assert ring_files(shared_shm) == []


# ---- 4. fork ----------------------------------------------------------------------------
def test_short_lived_forked_children_leave_no_file(shm):
    """Before: a forked child made its file at its first slow path and left
    it behind when it ended with _exit (100 of 100 children did). After: the
    child waits an epoch like any process; children shorter than that make
    nothing (one that lives longer has its own file: test_ring
    test_forked_child_has_its_own_file)."""
    p = start(["forks", 100, 0], shm)
    out, err = p.communicate(timeout=scaled(120))
    assert p.returncode == 0, err
    fork_ms = json.loads(out.splitlines()[0])["fork_ms"]
    assert ring_files(shm) == [], f"{len(ring_files(shm))} files left by 100 children"
    print(f"100 forks with telemetry on: {fork_ms:.1f} ms")


# ---- 5. a squatted name ----------------------------------------------------------------
def test_squatted_name_is_counted_and_said(mallory, shared_shm):
    """Before: a file named <pid>-<starttime> made first by another user
    turned the victim's telemetry off without a word. After: it is counted
    (tel_failures) and the stats table says whose file took the name; the
    victim runs on and tries again later."""
    with Lease(shared_shm, "test"):
        p = start(["burst", 64, 2000, scaled(2.5)], shared_shm, HAKMEM_STATS=1, HAKMEM_TELEMETRY_MS=1000)
        name = f"{p.pid}-{proc_start_time(p.pid)}"
        t = as_user(mallory, ["touch", shared_shm / name])
        assert t.wait(timeout=scaled(10)) == 0
        out, err = p.communicate(timeout=scaled(60))
    assert p.returncode == 0, err
    line = telemetry_line(err)
    assert line.startswith("off: name taken") and f"owned by uid {mallory[0]}" in line, line
    m = re.search(r"\((\d+) failures\)", line)
    assert m and int(m.group(1)) >= 1, line
    assert (shared_shm / name).stat().st_uid == mallory[0]


# ---- 6. RLIMIT_FSIZE (issue 36) ----------------------------------------------------------
def fsize_limit(nbytes):
    """A preexec_fn: RLIMIT_FSIZE at nbytes, as `ulimit -f` sets it."""
    def set_limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    return set_limit


def run_limited(nbytes, shm_dir, seconds=0.6, stderr=subprocess.PIPE, **env):
    """run_stats under RLIMIT_FSIZE = nbytes: (exit status, stdout, stderr,
    the files seen in shm_dir while it ran)."""
    e = clean_env(LD_PRELOAD=str(LIB), HAKMEM_SHM_DIR=str(shm_dir), HAKMEM_STATS=1, **env)
    p = subprocess.Popen([str(WORKLOAD), "burst", "64", "2000", str(seconds)],
                         env=e, stdout=subprocess.PIPE, stderr=stderr, text=True, preexec_fn=fsize_limit(nbytes))
    seen = set()
    while p.poll() is None:
        seen.update(ring_files(shm_dir))
        time.sleep(0.01)        # the sampling interval
    out, err = p.communicate(timeout=scaled(60))
    return p.returncode, out, err, sorted(seen)


def test_file_size_limit_turns_telemetry_off_instead_of_killing(shm):
    """Before: under `ulimit -f 100` with a lease held, the telemetry file's
    fallocate raised SIGXFSZ: the program died (-25 here, 153 in a shell) and
    left a 0-byte file. After: the file's size is checked against the limit
    before it is made; over it, no file, a counted failure, and the reason
    in the stats."""
    rc, out, err, seen = run_limited(100 << 10, shm)
    assert rc == 0, f"exit {rc} (-25: SIGXFSZ)\n{err[-1000:]}"
    assert json.loads(out.splitlines()[-1])["mode"] == "burst"
    assert seen == [] and ring_files(shm) == []
    line = telemetry_line(err)
    assert line.startswith("off: RLIMIT_FSIZE") and "102400 bytes" in line, line
    assert re.search(r"\(\d+ failures\)", line), line


def test_file_size_limit_turns_the_trace_off_instead_of_killing(shm, tmp_path):
    """Before: HAKMEM_TRACE under `ulimit -f 0` died of SIGXFSZ on the
    trace's 8-byte magic, leaving an empty file. After: no room for the
    trace's header under the limit means no trace file at all, and the
    reason in the stats."""
    tr = tmp_path / "x.trace"
    rc, out, err, _ = run_limited(0, shm, seconds=0.2, HAKMEM_TRACE=tr)
    assert rc == 0, f"exit {rc} (-25: SIGXFSZ)\n{err[-1000:]}"
    assert json.loads(out.splitlines()[-1])["mode"] == "burst"
    assert not tr.exists(), f"{tr} left behind ({tr.stat().st_size} bytes)"
    m = re.search(r"^  trace: (.*)$", err, re.M)
    assert m and m.group(1).startswith("off: RLIMIT_FSIZE (0 bytes)"), err[-2000:]


@pytest.mark.parametrize("how", ["truncated", "appended"])
def test_stats_to_a_file_stop_at_the_file_size_limit(tmp_path, how):
    """Before: the exit-time table written to a stderr that is a regular
    file under `ulimit -f 1` wrote up to the limit, then wrote again and
    died of SIGXFSZ. After: only what fits under the limit is written."""
    path = tmp_path / "stderr"
    path.write_bytes(b"x" * 1000 if how == "appended" else b"")
    with open(path, "a" if how == "appended" else "w") as f:
        rc, out, _, _ = run_limited(1024, tmp_path, seconds=0.1, stderr=f, HAKMEM_TELEMETRY=0)
    assert rc == 0, f"exit {rc} (-25: SIGXFSZ)"
    assert json.loads(out.splitlines()[-1])["mode"] == "burst"
    data = path.read_bytes()
    assert len(data) == 1024, len(data)
    assert data[1000 if how == "appended" else 0:].startswith(b"hakmem: stats"), data[:100]


# ---- 7. secure execution (issue 36) --------------------------------------------------------
SETUID_PROG = r"""
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
#include "hakmem.h"
/* Allocates for argv[1] seconds (telemetry's first try is one epoch in),
 * then says who it runs as and the 64-byte class's cache capacity. */
int main(int argc, char** argv) {
  double secs = argc > 1 ? atof(argv[1]) : 0;
  struct timespec t0, t;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  do {
    for (int i = 0; i < 1000; i++) free(malloc(64 + i % 64));
    clock_gettime(CLOCK_MONOTONIC, &t);
  } while ((double)(t.tv_sec - t0.tv_sec) + (t.tv_nsec - t0.tv_nsec) * 1e-9 < secs);
  hk_policy_t p;
  hk_policy_get(&p);
  printf("{\"euid\": %u, \"tcache_cap\": %u}\n", (unsigned)geteuid(), p.tcache_cap[4]);
  return 0;
}
"""


@pytest.fixture
def setuid_dir():
    """A directory every user can reach, on a filesystem that honours the
    setuid bit (not mounted nosuid: /dev/shm and often /tmp are), removed at
    the end."""
    need_root("makes a setuid-root program")
    if not (shutil.which("cc") and shutil.which("findmnt")):
        pytest.skip("needs cc and findmnt (util-linux)")
    for base in (tempfile.gettempdir(), "/var/tmp", str(BUILD)):
        opts = subprocess.run(["findmnt", "-n", "-o", "OPTIONS", "-T", base], capture_output=True, text=True)
        if opts.returncode != 0 or "nosuid" in opts.stdout.split(","):
            continue
        p = pathlib.Path(base).resolve()
        if not all(os.stat(a).st_mode & 0o001 for a in (p, *p.parents)):
            continue   # some user cannot pass through
        d = pathlib.Path(tempfile.mkdtemp(prefix="hakmem-suid-", dir=p))
        d.chmod(0o755)
        try:
            yield d
        finally:
            shutil.rmtree(d, ignore_errors=True)
        return
    pytest.skip("no directory every user can reach on a filesystem without nosuid")


def test_setuid_programs_ignore_the_callers_hakmem_variables(mallory, setuid_dir, tmp_path):
    """Before: a setuid-root program linked with libhakmem.a, run by another
    user with HAKMEM_TRACE=<a path in root's 0700 directory>, created that
    file as root, and obeyed every other HAKMEM_* variable (the stats table,
    the knobs, the telemetry directory). After: under AT_SECURE the
    allocator reads no HAKMEM_* variable, as glibc reads no MALLOC_*: no
    trace, no table, default knobs, telemetry only in /dev/shm/hakmem. The
    same program without the setuid bit (the control) obeys them all."""
    src = tmp_path / "suid.c"
    src.write_text(SETUID_PROG)
    prog = setuid_dir / "hk-suid"
    # As the Makefile links its C tests (the builtins off, or cc drops free(malloc(n))).
    subprocess.run(["cc", "-O1", "-fno-builtin-malloc", "-fno-builtin-free", f"-I{ROOT / 'allocator' / 'include'}",
                    str(src), str(BUILD / "libhakmem.a"), "-lprotobuf-c", "-pthread", "-o", str(prog)],
                   check=True, capture_output=True)
    os.chown(prog, 0, 0)
    secret = tmp_path / "secret"            # root's, 0700, under root's 0700 tmp_path
    secret.mkdir(mode=0o700)
    trace = secret / "x.trace"
    mine = setuid_dir / "mallory-shm"       # a telemetry directory of mallory's
    mine.mkdir(mode=0o700)
    os.chown(mine, *mallory)
    env = clean_env(HAKMEM_TRACE=trace, HAKMEM_STATS=1, HAKMEM_SHM_DIR=mine, HAKMEM_TCACHE_CAP=1,
                    HAKMEM_TELEMETRY_MS=20)

    def run(mode):
        prog.chmod(mode)
        p = as_user(mallory, [prog, 0.6], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        seen = set()
        while p.poll() is None:
            seen.update(ring_files(mine))
            time.sleep(0.01)    # the sampling interval
        out, err = p.communicate(timeout=scaled(60))
        assert p.returncode == 0, err
        return json.loads(out.splitlines()[-1]), err, sorted(seen)

    with Lease(mine, "test"):
        did, err, seen = run(0o4755)
        if did["euid"] != 0:
            pytest.skip("the setuid bit is not honoured here (no_new_privs?)")
        assert not trace.exists(), "HAKMEM_TRACE obeyed: the trace was created as root"
        assert "hakmem" not in err, f"HAKMEM_STATS obeyed:\n{err[-1000:]}"
        assert did["tcache_cap"] != 1, "HAKMEM_TCACHE_CAP obeyed"
        assert seen == [], f"HAKMEM_SHM_DIR obeyed: {seen}"
        # The control: the same program, not setuid, obeys every variable.
        did, err, seen = run(0o755)
    assert did["euid"] == mallory[0] and did["tcache_cap"] == 1, did
    assert "hakmem: stats" in err and "HAKMEM_TCACHE_CAP=1" in err, err[-2000:]
    assert re.search(r"^  trace: off: cannot create .*x\.trace", err, re.M), err[-2000:]
    assert len(seen) == 1, f"no telemetry file in HAKMEM_SHM_DIR: {seen}\n{telemetry_line(err)}"
