"""`make install` into a temporary DESTDIR, as a packager runs it (issue 17):
the versioned library with its soname links, the header, hakmem.pc, the
Python package in a virtual environment under the prefix with its console
scripts, the systemd files; then a C program built with
`pkg-config --cflags --libs hakmem` runs on the installed library and
reports hakmem as its allocator; the unit passes `systemd-analyze verify`
and scores well in `systemd-analyze security`; tmpfiles.d makes the
directories with the modes the trust model needs; `make uninstall` removes
everything but the administrator's learnd.toml.

The Python dependencies come from this environment's site-packages
(HK_PY_DEPS_FROM, a .pth line; pip runs with --no-index): no download."""
import os
import pathlib
import re
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile

import pytest

from conftest import BUILD, ROOT, clean_env, scaled

PREFIX = "/usr/local"
VERSION = re.search(r'"hakmem_version":\s*"([^"]+)"', (ROOT / "schemas" / "shm_layout.json").read_text()).group(1)
MAJOR = VERSION.split(".")[0]

PROGRAM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <hakmem.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(void) {
  static void *p[4096];
  for (int i = 0; i < 4096; i++) {
    p[i] = malloc((size_t)(i % 512) * 16 + 1);
    if (!p[i]) return 2;
    memset(p[i], i, (size_t)(i % 512) * 16 + 1);
  }
  for (int i = 0; i < 4096; i++) free(p[i]);
  hk_stats_t st;
  memset(&st, 0, sizeof st);
  if (hk_stats_get(&st) != 0) return 3;
  unsigned long long allocs = 0;
  for (unsigned c = 0; c < st.num_classes; c++) allocs += st.cls[c].allocs;
  Dl_info info;
  if (!dladdr((void *)malloc, &info) || !info.dli_fname) return 4;
  printf("malloc from %s\nhakmem counted %llu allocations in %u classes, class of 100 B: %zu B\n",
         info.dli_fname, allocs, st.num_classes, hk_class_size(hk_size_class(100)));
  return 0;
}
"""


def run(cmd, env=None, cwd=ROOT, timeout=300, check=True):
    r = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env or clean_env(), capture_output=True, text=True,
                       timeout=scaled(timeout))
    if check:
        assert r.returncode == 0, f"{' '.join(map(str, cmd))}: exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r


@pytest.fixture(scope="module")
def dest():
    if (shutil.which("systemd-analyze") is None or shutil.which("strace") is None) and os.geteuid() == 0:
        run([ROOT / "tools" / "install-deps.sh", "ops"], timeout=900)     # Debian's systemd: a container may lack it
    for tool in ("pkg-config", "systemd-analyze", "systemd-tmpfiles", "strace"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} missing (tools/install-deps.sh base ops installs it)")
    d = pathlib.Path(tempfile.mkdtemp(prefix="hk-destdir-"))
    site = sysconfig.get_paths()["purelib"]
    try:
        run(["make", f"BUILD={BUILD}", "install", f"DESTDIR={d}", f"PREFIX={PREFIX}", f"HK_PY_DEPS_FROM={site}"])
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_the_library_installs_with_its_soname_and_pkg_config_builds_against_it(dest, tmp_path):
    lib = dest / PREFIX.lstrip("/") / "lib"
    real = lib / f"libhakmem.so.{VERSION}"
    assert real.is_file() and not real.is_symlink()
    assert os.readlink(lib / f"libhakmem.so.{MAJOR}") == real.name
    assert os.readlink(lib / "libhakmem.so") == f"libhakmem.so.{MAJOR}"
    dyn = run(["readelf", "-d", real]).stdout
    assert f"Library soname: [libhakmem.so.{MAJOR}]" in dyn, dyn

    env = clean_env(PKG_CONFIG_PATH=str(lib / "pkgconfig"), PKG_CONFIG_SYSROOT_DIR=str(dest))
    env.pop("PKG_CONFIG_LIBDIR", None)
    assert run(["pkg-config", "--modversion", "hakmem"], env=env).stdout.strip() == VERSION
    flags = run(["pkg-config", "--cflags", "--libs", "hakmem"], env=env).stdout.split()
    assert f"-I{dest}{PREFIX}/include" in flags and f"-L{dest}{PREFIX}/lib" in flags and "-lhakmem" in flags, flags
    src = tmp_path / "uses_hakmem.c"
    src.write_text(PROGRAM)
    exe = tmp_path / "uses_hakmem"
    run(["cc", "-O1", "-o", exe, src, *flags, "-ldl"], env=env)
    needed = run(["readelf", "-d", exe]).stdout
    assert f"Shared library: [libhakmem.so.{MAJOR}]" in needed, needed   # the soname, not the dev link
    r = run([exe], env=clean_env(LD_LIBRARY_PATH=str(lib)), cwd=tmp_path)
    m = re.match(r"malloc from (\S+)\nhakmem counted (\d+) allocations in (\d+) classes, class of 100 B: (\d+) B",
                 r.stdout)
    assert m, r.stdout
    assert os.path.realpath(m.group(1)) == str(real), r.stdout       # malloc is hakmem's, from the installed file
    assert int(m.group(2)) >= 4096 and int(m.group(3)) > 1 and int(m.group(4)) >= 100, r.stdout


def test_the_python_package_and_systemd_files_install(dest, tmp_path):
    root = dest / PREFIX.lstrip("/")
    venv = root / "lib" / "hakmem" / "venv"
    for cmd in ("hakmem", "hakmem-learnd"):
        assert os.readlink(root / "bin" / cmd) == f"{PREFIX}/lib/hakmem/venv/bin/{cmd}"
        # Written for where it will run, not for DESTDIR.
        assert (venv / "bin" / cmd).read_text().splitlines()[0] == f"#!{PREFIX}/lib/hakmem/venv/bin/python"
    r = run([venv / "bin" / "python", "-m", "hakmem.daemon", "--help"], cwd=tmp_path)
    assert r.stdout.startswith("usage: hakmem-learnd") and "--metrics" in r.stdout
    r = run([venv / "bin" / "python", "-c", "import hakmem, prometheus_client, tqdm; print(hakmem.__file__)"],
            cwd=tmp_path)
    assert r.stdout.strip().startswith(str(venv)), r.stdout
    for h in ("hakmem.h", "hakmem_counters.h", "hakmem_knobs.h"):
        assert (root / "include" / h).is_file()

    unit = dest / "etc" / "systemd" / "system" / "hakmem-learnd.service"
    text = unit.read_text()
    assert f"ExecStart={PREFIX}/lib/hakmem/venv/bin/hakmem-learnd --config /etc/hakmem/learnd.toml" in text
    assert not re.search(r"@[A-Z_]+@", text), "a placeholder left in the unit"
    # verify checks that ExecStart is there: the copy names it under DESTDIR.
    check = tmp_path / "hakmem-learnd.service"
    check.write_text(text.replace(f"ExecStart={PREFIX}", f"ExecStart={dest}{PREFIX}"))
    r = run(["systemd-analyze", "verify", check], check=False)
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr
    r = run(["systemd-analyze", "security", "--offline=yes", check], check=False)
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", r.stdout)
    assert m and float(m.group(1)) <= 3.0, r.stdout[-3000:]   # "OK"; learnd needs root and the host's /dev/shm

    drop = (root / "share" / "hakmem" / "preload.conf").read_text()
    assert f"Environment=LD_PRELOAD={PREFIX}/lib/libhakmem.so.{MAJOR}" in drop
    assert (dest / "etc" / "hakmem" / "learnd.toml").read_text() == (ROOT / "deploy" / "learnd.toml").read_text()
    # tmpfiles.d: the telemetry directory every user publishes in is root's,
    # world-writable and sticky; learnd's own are root's alone.
    tmproot = tmp_path / "root"
    run(["systemd-tmpfiles", "--create", f"--root={tmproot}", dest / "etc" / "tmpfiles.d" / "hakmem.conf"])
    modes = {p: stat.S_IMODE((tmproot / p).stat().st_mode) for p in ("dev/shm/hakmem", "run/hakmem", "var/lib/hakmem")}
    assert modes == {"dev/shm/hakmem": 0o1777, "run/hakmem": 0o700, "var/lib/hakmem": 0o700}, modes
    assert all((tmproot / p).stat().st_uid == 0 for p in modes)


def unit_allows(unit_text):
    """The system calls the unit's SystemCallFilter= lines allow, merged as
    systemd merges them (the first line an allow list, each ~ line after it
    taking calls out), the groups expanded by systemd-analyze."""
    groups, cur = {}, None
    for ln in run(["systemd-analyze", "syscall-filter", "--no-pager"]).stdout.splitlines():
        if ln.startswith("@"):
            cur = groups.setdefault(ln.split()[0], [])
        elif ln.startswith("#") or not ln.strip():
            cur = None
        elif cur is not None and not ln.strip().startswith("#"):
            cur.append(ln.split()[0])

    def expand(names):
        return set().union(*[expand(groups[n]) if n.startswith("@") else {n} for n in names])
    lines = [ln.split("=", 1)[1] for ln in unit_text.splitlines() if ln.startswith("SystemCallFilter=")]
    assert lines and not lines[0].startswith("~") and all(ln.startswith("~") for ln in lines[1:]), lines
    allowed = expand(lines[0].split())
    for ln in lines[1:]:
        allowed -= expand(ln[1:].split())
    return allowed


@pytest.mark.skipif(os.geteuid() != 0, reason="learnd runs a replay as the traced program's user only as root")
def test_the_unit_lets_a_screening_replay_run_as_the_programs_user_niced(dest, tmp_path):
    """A screening's replay as learnd runs it under the unit, traced: as the
    traced program's user (the fork's setgroups, setregid, setreuid), niced
    and on chosen CPUs (hakmem-replay's setpriority, sched_setaffinity).
    Every call its processes make is one the unit's filter allows, and the
    unit keeps CAP_SETUID and CAP_SETGID. The unit denied @resources and
    @setuid whole, and lacked both: under it every replay failed at its
    first call and learnd searched blind."""
    sys.path.insert(0, str(ROOT / "learner" / "tests"))
    from test_replayer import gap_trace
    text = (dest / "etc" / "systemd" / "system" / "hakmem-learnd.service").read_text()
    caps = next(ln for ln in text.splitlines() if ln.startswith("CapabilityBoundingSet=")).split("=", 1)[1].split()
    assert {"CAP_SETUID", "CAP_SETGID"} <= set(caps), caps
    tr = tmp_path / "gap.trace"
    gap_trace(tr)
    log = tmp_path / "strace.txt"
    # The trace by descriptor, a sealed copy, as learnd hands it over.
    code = ("import sys; from hakmem.replay import run_replayer, sealed_copy; "
            "fd = sealed_copy('trace', open(sys.argv[1], 'rb').read()); "
            "r = run_replayer(fd, {'drain_ms': 100}, user=65534, nice=19, cpus={0}, nice_group=True, replayer=sys.argv[2]); "
            "print(r['group_nice'], r['runs'][0]['ops'])")
    r = run(["strace", "-f", "-qq", "-o", log, sys.executable, "-c", code, tr, BUILD / "hakmem-replay"], cwd=tmp_path)
    assert r.stdout.split()[-1] == "200", r.stdout
    lines = log.read_text().splitlines()
    main = lines[0].split()[0]
    # The replay's processes: the fork that drops to the user, the replayer, its run.
    used = {m.group(2) for m in (re.match(r"(\d+)\s+(?:<\.\.\. )?([a-z_0-9]+)[( ]", ln) for ln in lines)
            if m and m.group(1) != main}
    assert {"setreuid", "setpriority", "sched_setaffinity", "execve"} <= used, sorted(used)
    denied = used - unit_allows(text)
    assert not denied, f"the unit denies what a replay calls: {sorted(denied)}"


def test_uninstall_leaves_only_the_admins_configuration(dest):
    run(["make", f"BUILD={BUILD}", "uninstall", f"DESTDIR={dest}", f"PREFIX={PREFIX}"])
    files = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if not p.is_dir())
    assert files == ["etc/hakmem/learnd.toml"], files


def test_library_needs_only_libc_and_exports_only_its_api():
    """protobuf-c is linked in from its archive with its symbols hidden: a
    preloaded process loads one library more, not two, and a program with
    its own protobuf-c keeps it."""
    lib = BUILD / "libhakmem.so"
    dyn = subprocess.run(["readelf", "-dW", str(lib)], capture_output=True, text=True, check=True).stdout
    needed = sorted(re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dyn))
    assert needed == ["libc.so.6"], needed
    syms = subprocess.run(["readelf", "--dyn-syms", "-W", str(lib)], capture_output=True, text=True,
                          check=True).stdout
    defined = [ln.split()[-1].split("@")[0] for ln in syms.splitlines()
               if re.search(r"\b(FUNC|OBJECT)\s+(GLOBAL|WEAK)\s+DEFAULT\s+\d+\s", ln)]
    assert defined and not [s for s in defined if "protobuf" in s], defined
    assert {"malloc", "free", "hk_stats_get"} <= set(defined)


def test_install_deps_says_everything_on_stderr(tmp_path):
    """tools/install-deps.sh runs on the way to a document on stdout
    (bench/learn_real.py --json installs redis or MariaDB when they are
    missing): what it and apt print is progress, on stderr. On a machine
    without redis, learn_real's JSON began with "install-deps: installing
    redis-server redis-tools" and its test failed to parse it. Here dpkg-query
    says nothing is installed, and apt-get and sudo (the path a user other
    than root takes) are stand-ins that print on both."""
    fake = tmp_path / "bin"
    fake.mkdir()
    for name, body in (("dpkg-query", "exit 1"),
                       ("apt-get", 'echo "apt-get $* (stdout)"; echo "apt-get (stderr)" >&2'),
                       ("sudo", 'echo "sudo (stdout)"; exec "$@"')):
        (fake / name).write_text(f"#!/bin/sh\n{body}\n")
        (fake / name).chmod(0o755)
    env = dict(clean_env(), PATH=f"{fake}:{os.environ['PATH']}")
    r = subprocess.run([str(ROOT / "tools" / "install-deps.sh"), "redis"], capture_output=True, text=True,
                       env=env, timeout=scaled(30))
    assert r.returncode == 0, r.stderr
    assert r.stdout == "", r.stdout
    assert "install-deps: installing redis-server redis-tools" in r.stderr and "(stdout)" in r.stderr, r.stderr
