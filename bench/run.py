#!/usr/bin/env python3
"""Run hakmem's benchmark suite against glibc, mimalloc, jemalloc and tcmalloc.

Every benchmark is one binary under build/bench/ linked against glibc only;
the allocator under test is swapped with LD_PRELOAD, so all allocators run
the same code (LESSONS.md 4). Runs are interleaved (run 1 of every config
and allocator, then run 2, ...) with the allocator order rotated, so a slow
minute of a shared machine spreads over all of them instead of hitting one.
Each run's JSON line says which allocator it actually ran under; a mismatch
is an error of that run, never a number (LESSONS.md 3).

Outputs (in --out, default bench/results/): latest.json (everything, raw
runs included), latest.md (the tables), latest.png (ops/s normalized to the
best peer, when matplotlib is importable).

Exit status: 0 when every hakmem run succeeded (peers may fail: that is
shown, e.g. mimalloc's misaligned pointers), 1 when a hakmem run failed,
2 on a usage or setup error.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / os.environ.get("BUILD", "build")
BIN_DIR = BUILD / "bench"
HAKMEM_LIB = BUILD / "libhakmem.so"

PEERS = ("glibc", "mimalloc", "jemalloc", "tcmalloc")

# A progress bar on a terminal (hakmem.progress: tqdm, off when stderr is not
# one); without the package (python3 outside .venv) the log lines alone.
sys.path.insert(0, str(ROOT / "learner"))
try:
    from hakmem.progress import progress
except ImportError:
    progress = None
# peer -> (shared object preloaded, Debian package that installs it)
PEER_LIBS = {
    "mimalloc": ("libmimalloc.so.2", "libmimalloc-dev"),
    "jemalloc": ("libjemalloc.so.2", "libjemalloc-dev"),
    "tcmalloc": ("libtcmalloc_minimal.so.4", "libgoogle-perftools-dev"),
}
ALL_ALLOCATORS = ("hakmem", "hakmem-tel") + PEERS
DEFAULT_TEL_READER = ".venv/bin/hakmem ring watch {dir} --interval 0.1"

# What strace counts: the calls an allocator makes to get and return memory.
OS_CALLS = ("mmap", "munmap", "madvise", "mremap", "brk")

# Targets (README): hakmem at least as fast as the best peer on every
# config, peak RSS within 1.25x the peers' median, and in steady state at
# most one OS call per 10^8 operations.
TARGET_SPEED = 1.00
TARGET_RSS = 1.25
TARGET_STEADY_PER_1E8 = 1.0
# A row whose hakmem or best-peer runs spread wider than this ((max - min) /
# median) gets up to as many runs again, interleaved like the first ones, so
# its verdict does not rest on a noisy median.
SPREAD_WIDE = 0.10
# Rows whose instructions per operation are counted under callgrind: the
# single-threaded ones but startup (its work is in child processes).
CG_SKIP = ("startup",)


@dataclass
class Config:
    """One benchmark configuration. Full sizes take roughly 0.5-2 s per run
    under glibc on a 2-core machine; quick sizes 0.05-0.3 s."""

    name: str
    binary: str
    full: list[str]
    quick: list[str]
    threads: int = 1
    cg: list[str] | None = None   # arguments for the callgrind count (default: quick); single-threaded rows only


# Full sizes: every hakmem run lasts at least ~0.3 s (LESSONS.md: short runs
# measure warm-up); the slowest peers then take a few seconds.
CONFIGS = [
    Config("random_mixed", "random_mixed", ["50000000", "400", "42"], ["5000000", "400", "42"]),
    Config("tiny_hot", "tiny_hot", ["200000000"], ["20000000"]),
    Config("mid_large_mt_1t", "mid_large_mt", ["1", "30000000", "400", "42"], ["1", "1000000", "400", "42"]),
    Config("mid_large_mt_2t", "mid_large_mt", ["2", "30000000", "400", "42"], ["2", "1000000", "400", "42"], 2),
    Config("larson_1t", "larson", ["1", "1", "16", "1024", "1000", "10000", "42"],
           ["1", "0.2", "16", "1024", "1000", "10000", "42"]),
    Config("larson_2t", "larson", ["2", "1", "16", "1024", "1000", "10000", "42"],
           ["2", "0.2", "16", "1024", "1000", "10000", "42"], 2),
    Config("prodcons_2t", "prodcons", ["2", "4000000", "16", "1024", "42"], ["2", "400000", "16", "1024", "42"], 2),
    Config("realloc_grow", "realloc_grow", ["1600", "1048576", "42"], ["60", "1048576", "42"]),
    Config("aligned", "aligned", ["16000000", "42"], ["1000000", "42"]),
    Config("large_churn", "large_churn", ["300", "20", "5", "25", "42"], ["40", "20", "5", "25", "42"],
           cg=["10", "20", "5", "25", "42"]),
    Config("startup", "startup", ["1000", "3000"], ["100", "3000"]),
    # The field's standard patterns (mimalloc-bench's programs), written from
    # their descriptions: see each source's header.
    Config("xthread_mixed_8t", "xthread_mixed", ["8", "40", "100000", "4000", "42"],
           ["8", "4", "100000", "4000", "42"], 8),
    Config("burst_lifo_fifo_2t", "burst_foreign", ["2", "20000", "500", "0", "1000", "42"],
           ["2", "2000", "500", "0", "1000", "42"], 2),
    Config("burst_foreign_2t", "burst_foreign", ["2", "20000", "500", "25", "1000", "42"],
           ["2", "2000", "500", "25", "1000", "42"], 2),
    Config("shared_slots_2t", "shared_slots", ["2", "4000000", "5000", "42"], ["2", "400000", "5000", "42"], 2),
    Config("batch_handoff_2t", "batch_handoff", ["20000000", "4096", "64", "4"], ["2000000", "4096", "64", "4"], 2),
    Config("false_sharing_active_2t", "false_sharing", ["active", "2", "5000", "10000", "8"],
           ["active", "2", "500", "10000", "8"], 2),
    Config("false_sharing_passive_2t", "false_sharing", ["passive", "2", "5000", "10000", "8"],
           ["passive", "2", "500", "10000", "8"], 2),
    Config("object_replace", "object_replace", ["40000", "64", "4096", "1048576", "42"],
           ["4000", "64", "4096", "1048576", "42"], cg=["500", "64", "4096", "1048576", "42"]),
]
# The steady-state OS-call target: random_mixed at two lengths; the
# difference in calls is what the longer run needed once warm.
STEADY_ITERS = {"full": (20_000_000, 200_000_000), "quick": (2_000_000, 20_000_000)}
TEL_CONFIGS = ("random_mixed", "larson_2t")  # where telemetry overhead is reported
# Seconds the telemetry reader gets to start (a Python program importing
# numpy) before the benchmark does, so that its start-up is not counted as
# telemetry overhead on a 2-core machine.
TEL_SETTLE_S = 0.5


@dataclass
class Allocator:
    name: str
    expect: str  # the "allocator" value its runs must report
    lib: str | None  # preloaded library; None: glibc's own malloc
    telemetry: bool = False
    info: dict = field(default_factory=dict)


class SetupError(Exception):
    """A reason the suite cannot run at all; printed as one line, exit 2."""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- setup


def check_build(configs: list[Config], need_hakmem: bool) -> None:
    """Refuses to measure missing or stale binaries (LESSONS.md 3: weeks of
    results from stale builds)."""
    if need_hakmem:
        if not HAKMEM_LIB.exists():
            raise SetupError(f"{rel(HAKMEM_LIB)} missing: run `make lib` first")
        sources = sorted((ROOT / "allocator").glob("src/*.[ch]")) + sorted((ROOT / "allocator").glob("include/*.h"))
        newer = [s for s in sources if s.stat().st_mtime > HAKMEM_LIB.stat().st_mtime]
        if newer:
            raise SetupError(f"{rel(HAKMEM_LIB)} is older than {rel(newer[0])}: run `make lib` first")
    common = ROOT / "bench" / "common.h"
    for name in sorted({c.binary for c in configs} | ({"startup_child"} if any(c.binary == "startup" for c in configs) else set())):
        binary, source = BIN_DIR / name, ROOT / "bench" / f"{name}.c"
        if not binary.exists():
            raise SetupError(f"{rel(binary)} missing: run `make bench-build` first")
        if max(source.stat().st_mtime, common.stat().st_mtime) > binary.stat().st_mtime:
            raise SetupError(f"{rel(binary)} is older than its source: run `make bench-build` first")


def rel(p: Path) -> str:
    try:
        return str(p.relative_to(ROOT))
    except ValueError:
        return str(p)


def find_lib(soname: str) -> str | None:
    machine = platform.machine()
    for d in (f"/usr/lib/{machine}-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib"):
        p = Path(d) / soname
        if p.exists():
            return str(p)
    return None


def apt_install(packages: list[str], why: str) -> bool:
    """Installs Debian packages when we are root; False when we cannot."""
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return False
    log(f"installing {' '.join(packages)} with apt-get ({why})")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    quiet = {"stdout": subprocess.DEVNULL, "env": env}
    ok = subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages], **quiet).returncode == 0
    if not ok:  # the package lists may be missing or old
        subprocess.run(["apt-get", "update", "-qq"], **quiet)
        ok = subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages], **quiet).returncode == 0
    return ok


def package_of(path: str) -> str | None:
    """'package version' of the Debian package that installed path."""
    try:
        real = os.path.realpath(path)
        out = subprocess.run(["dpkg-query", "-S", real], capture_output=True, text=True).stdout
        pkg = out.split(":")[0].strip() if out else ""
        if not pkg:
            return None
        ver = subprocess.run(["dpkg-query", "-W", "-f=${Version}", pkg], capture_output=True, text=True).stdout
        return f"{pkg} {ver}".strip()
    except OSError:
        return None


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tel_reader_argv(template: str) -> list[str] | None:
    """The reader command with {dir} left in, its program resolved; None
    when the program is not there (yet)."""
    argv = shlex.split(template)
    if not argv:
        return None
    prog = argv[0]
    if "/" in prog:
        path = Path(prog) if os.path.isabs(prog) else ROOT / prog
        if not os.access(path, os.X_OK):
            return None
        argv[0] = str(path)
    elif not shutil.which(prog):
        return None
    return argv


def setup_allocators(names: list[str], tel_reader: str, base_lib: str | None = None) -> tuple[list[Allocator], dict[str, str]]:
    """The allocators that can run, and a reason for each one skipped."""
    allocs: list[Allocator] = []
    skipped: dict[str, str] = {}
    missing = [n for n in names if n in PEER_LIBS and not find_lib(PEER_LIBS[n][0])]
    if missing:
        apt_install([PEER_LIBS[n][1] for n in missing], "peer allocators to compare with")
    for n in names:
        if n in ("hakmem", "hakmem-tel"):
            info = {"lib": rel(HAKMEM_LIB), "sha256": sha256(HAKMEM_LIB)}
            if n == "hakmem-tel":
                if tel_reader_argv(tel_reader) is None:
                    skipped[n] = f"telemetry reader not found: `{tel_reader}`"
                    continue
                info["reader"] = tel_reader
            allocs.append(Allocator(n, "hakmem", str(HAKMEM_LIB), n == "hakmem-tel", info))
        elif n == "glibc":
            allocs.append(Allocator(n, "glibc", None, info={"lib": "(none: glibc's malloc)", "package": package_of(find_lib("libc.so.6") or "") or " ".join(platform.libc_ver())}))
        else:
            soname, pkg = PEER_LIBS[n]
            path = find_lib(soname)
            if not path:
                skipped[n] = f"{soname} not found (install {pkg}{'' if os.geteuid() == 0 else ' as root'})"
                continue
            allocs.append(Allocator(n, n, path, info={"lib": path, "soname": soname, "package": package_of(path), "sha256": sha256(Path(path))}))
    if base_lib:
        info = {"lib": base_lib, "sha256": sha256(Path(base_lib))}
        allocs.append(Allocator("hakmem-base", "hakmem", base_lib, False, info))
    for n, why in skipped.items():
        log(f"skipping {n}: {why}")
    return allocs, skipped


def find_strace() -> list[str] | None:
    """strace's command prefix, installing it when missing and root; None
    when there is none. --seccomp-bpf (strace >= 5.3) stops the tracee only
    on the traced calls, so the other syscalls run at full speed."""
    if not shutil.which("strace"):
        apt_install(["strace"], "OS call counts")
        if not shutil.which("strace"):
            return None
    base = ["strace", "-f", "-c", "-e", "trace=" + ",".join(OS_CALLS)]
    probe = subprocess.run(base + ["--seccomp-bpf", "-o", "/dev/null", "true"], capture_output=True)
    return base + ["--seccomp-bpf"] if probe.returncode == 0 else base


# ---------------------------------------------------------------- running


def alloc_env(alloc: Allocator, shm_dir: str | None = None) -> dict[str, str]:
    """The environment of a run. Telemetry is off for plain hakmem even if
    the machine has a telemetry directory (learnd running), and on, into a
    fresh directory, for hakmem-tel."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "HAKMEM_SHM_DIR", "HAKMEM_TELEMETRY")}
    if alloc.lib:
        env["LD_PRELOAD"] = alloc.lib
    if alloc.name == "hakmem":
        env["HAKMEM_TELEMETRY"] = "0"
    if alloc.telemetry:
        env["HAKMEM_SHM_DIR"] = shm_dir or ""
    return env


def spawn_and_wait(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int, str, str, bool]:
    """Runs cmd; returns (exit code, stdout, stderr, timed out)."""
    try:
        p = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return -9, (e.stdout or b"").decode(errors="replace"), (e.stderr or b"").decode(errors="replace"), True
    return p.returncode, p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace"), False


def last_line(text: str) -> str:
    lines = [l for l in text.splitlines() if l.strip()]
    return lines[-1].strip() if lines else ""


def parse_result(cfg: Config, alloc: Allocator, rc: int, out: str, err: str, timed_out: bool, timeout: float) -> tuple[dict | None, str | None]:
    """The run's JSON result, or why there is none."""
    if timed_out:
        return None, f"timed out after {timeout:.0f} s"
    if rc != 0:
        why = last_line(err) or last_line(out) or "no output"
        return None, f"{why} (exit {rc})" if rc > 0 else f"{why} (signal {-rc})"
    try:
        res = json.loads(last_line(out))
    except ValueError:
        return None, f"no JSON result line (last line: {last_line(out)[:80]!r})"
    if not isinstance(res, dict) or res.get("bench") != cfg.binary:
        return None, f"result is not from {cfg.binary}: {last_line(out)[:80]!r}"
    if res.get("allocator") != alloc.expect:
        return None, f"ran under {res.get('allocator')}, expected {alloc.expect}"
    if not res.get("ops_per_sec", 0) > 0:
        return None, "ops_per_sec is not positive"
    return res, None


class TelemetryRun:
    """A fresh telemetry directory and the reader beside the benchmark. A
    thread watches the directory for the benchmark's ring file, so the
    result can say whether telemetry was really on. finish() always cleans
    up, whatever start() got to."""

    def __init__(self, reader_template: str):
        self.template = reader_template
        self.dir = tempfile.mkdtemp(prefix="hakmem-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        self.reader: subprocess.Popen | None = None
        self.err = tempfile.TemporaryFile()
        self.saw_ring = False
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._look, daemon=True)

    def start(self) -> None:
        argv = [a.replace("{dir}", self.dir) for a in tel_reader_argv(self.template) or []]
        self.reader = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self.err,
                                       cwd=ROOT, start_new_session=True)
        self._watch.start()
        time.sleep(TEL_SETTLE_S)

    def _look(self) -> None:
        while not self._stop.is_set() and not self.saw_ring:
            try:
                # learnd.lock is the reader's lease, not a ring file.
                self.saw_ring = any(n != "learnd.lock" for n in os.listdir(self.dir))
            except OSError:
                pass
            self._stop.wait(0.005)

    def finish(self) -> str | None:
        """Stops the reader and removes the directory; returns a problem
        (the reader was gone before the benchmark ended) or None."""
        self._stop.set()
        if self._watch.is_alive():
            self._watch.join()
        problem = None
        if self.reader is not None:
            rc = self.reader.poll()
            if rc is not None:
                self.err.seek(0)
                why = last_line(self.err.read().decode(errors="replace")) or "no message"
                problem = f"telemetry reader exited early (exit {rc}): {why}"
            else:
                self.reader.terminate()
                try:
                    self.reader.wait(5)
                except subprocess.TimeoutExpired:
                    self.reader.kill()
                    self.reader.wait()
        self.err.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        return problem


def run_timed(cfg: Config, argv: list[str], alloc: Allocator, timeout: float, tel_reader: str) -> dict:
    """One measured run: {ok, ops_per_sec, ops, seconds, peak_rss_kb, result}
    or {ok: False, error}. Peak RSS is what the benchmark reports (VmHWM):
    wait4's ru_maxrss would include this runner's own high-water mark,
    which the kernel carries across the child's exec (bench/common.h)."""
    cmd = [str(BIN_DIR / cfg.binary), *argv]
    tel = TelemetryRun(tel_reader) if alloc.telemetry else None
    try:
        if tel:
            tel.start()
        rc, out, err, timed_out = spawn_and_wait(cmd, alloc_env(alloc, tel.dir if tel else None), timeout)
    finally:
        problem = tel.finish() if tel else None
    res, error = parse_result(cfg, alloc, rc, out, err, timed_out, timeout)
    if res and problem:
        res, error = None, problem
    run = {"ok": res is not None}
    if res:
        run.update(ops_per_sec=res["ops_per_sec"], ops=res["ops"], seconds=res["seconds"],
                   peak_rss_kb=res.get("peak_rss_kb"), result=res)
        if tel:
            run["ring_file_seen"] = tel.saw_ring
    else:
        run["error"] = error
    return run


def count_instructions(cfg: Config, alloc: Allocator, timeout: float) -> float | None:
    """Instructions per operation of one untimed run under callgrind (the
    benchmark's own work included: it is the same binary for every
    allocator). None when valgrind or the run fails."""
    vg = shutil.which("valgrind")
    if not vg:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [vg, "--tool=callgrind", f"--callgrind-out-file={tmp}/cg.out", str(BIN_DIR / cfg.binary),
               *(cfg.cg or cfg.quick)]
        rc, out, err, timed_out = spawn_and_wait(cmd, alloc_env(alloc), timeout)
    m = re.findall(r"Collected : (\d+)", err)
    if rc != 0 or timed_out or not m:
        return None
    try:
        ops = json.loads(out.strip().splitlines()[-1])["ops"]
    except (ValueError, KeyError, IndexError):
        return None
    return int(m[-1]) / ops if ops else None


def spread_wide(cfg_raw: dict[str, list[dict]], peers: list[str]) -> bool:
    """Whether hakmem's or the best peer's runs of a row spread over SPREAD_WIDE."""
    res = {x: summarize(rs) for x, rs in cfg_raw.items()}
    ok_peers = [p for p in peers if res.get(p, {}).get("median_ops_per_sec")]
    best = max(ok_peers, key=lambda p: res[p]["median_ops_per_sec"]) if ok_peers else None
    return any(res.get(x, {}).get("spread", 0.0) > SPREAD_WIDE for x in ("hakmem", best) if x)


def run_strace(strace: list[str], binary: str, argv: list[str], alloc: Allocator, timeout: float) -> dict:
    """One untimed run under strace -c: counts of OS_CALLS, and the ops the
    run reported. LD_PRELOAD goes to the tracee only (-E), not strace."""
    env = alloc_env(alloc)
    env.pop("LD_PRELOAD", None)
    with tempfile.NamedTemporaryFile("r", suffix=".strace") as summary:
        cmd = [*strace, "-o", summary.name, *(["-E", f"LD_PRELOAD={alloc.lib}"] if alloc.lib else []),
               str(BIN_DIR / binary), *argv]
        rc, out, err, timed_out = spawn_and_wait(cmd, env, timeout)
        if timed_out or rc != 0:
            return {"ok": False, "error": "timed out" if timed_out else f"{last_line(err)} (exit {rc})"}
        counts = dict.fromkeys(OS_CALLS, 0)
        # strace -c table rows: % time, seconds, usecs/call, calls, [errors,] syscall
        for line in summary.read().splitlines():
            f = line.split()
            if len(f) >= 5 and f[-1] in counts and f[3].isdigit():
                counts[f[-1]] = int(f[3])
    try:
        res = json.loads(last_line(out))
        ops = int(res["ops"])
        if res.get("allocator") != alloc.expect:
            return {"ok": False, "error": f"ran under {res.get('allocator')}, expected {alloc.expect}"}
    except (ValueError, KeyError, TypeError):
        return {"ok": False, "error": "no JSON result line"}
    total = sum(counts.values())
    return {"ok": True, "ops": ops, "calls": counts, "total": total, "per_mop": total / ops * 1e6 if ops else None}


# ---------------------------------------------------------------- summary


def summarize(runs: list[dict]) -> dict:
    ok = [r for r in runs if r["ok"]]
    s: dict = {"runs": len(runs), "failed": len(runs) - len(ok)}
    errors = [r["error"] for r in runs if not r["ok"]]
    if errors:
        s["error"] = errors[-1]
    if ok:
        v = [r["ops_per_sec"] for r in ok]
        med = statistics.median(v)
        s.update(median_ops_per_sec=med, min_ops_per_sec=min(v), max_ops_per_sec=max(v),
                 cv=statistics.stdev(v) / statistics.mean(v) if len(v) > 1 else 0.0,
                 spread=(max(v) - min(v)) / med if med else 0.0,
                 median_peak_rss_kb=statistics.median(r["peak_rss_kb"] or 0 for r in ok))
    return s


def ratios(cfg_res: dict, peers: list[str]) -> dict:
    """hakmem vs the peers on one config; None where a side has no number."""
    med = {a: s.get("median_ops_per_sec") for a, s in cfg_res.items()}
    rss = {a: s.get("median_peak_rss_kb") for a, s in cfg_res.items()}
    ok_peers = [p for p in peers if med.get(p)]
    r: dict = {"best_peer": max(ok_peers, key=lambda p: med[p]) if ok_peers else None}
    h = med.get("hakmem")
    r["vs_best"] = h / med[r["best_peer"]] if h and r["best_peer"] else None
    # The ratio's spread: hakmem's and the best peer's relative spreads
    # ((max - min) / median) combined, as for the ratio of two measurements.
    if r["vs_best"] is not None:
        sh, sp = cfg_res["hakmem"].get("spread", 0.0), cfg_res[r["best_peer"]].get("spread", 0.0)
        r["vs_best_spread"] = (sh ** 2 + sp ** 2) ** 0.5
    else:
        r["vs_best_spread"] = None
    r["vs_peer"] = {p: h / med[p] for p in ok_peers} if h else {}
    peer_rss = [rss[p] for p in ok_peers if rss.get(p)]
    r["peer_median_rss_kb"] = statistics.median(peer_rss) if peer_rss else None
    r["rss_vs_peers"] = rss["hakmem"] / r["peer_median_rss_kb"] if rss.get("hakmem") and peer_rss else None
    t = med.get("hakmem-tel")
    r["tel_vs_hakmem"] = t / h if t and h else None
    return r


def machine_info() -> dict:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_kb = None
    try:
        mem_kb = int(Path("/proc/meminfo").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        pass

    def git(*args: str) -> str:
        r = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else ""

    commit = git("rev-parse", "HEAD")
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "mem_kb": mem_kb,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": commit or None,
        "git_dirty": dirty,
        "loadavg_start": os.getloadavg(),
        "hakmem_env": {k: v for k, v in os.environ.items() if k.startswith("HAKMEM_")},
    }


def fmt_rate(v: float | None) -> str:
    if v is None:
        return "–"
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if v >= div:
            return f"{v / div:.3g}{unit}"
    return f"{v:.3g}"


def fmt_ratio(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}×"


def fmt_measured(v: float, target: float) -> str:
    """A ratio beside its target's verdict: three decimals where two would
    print the target itself (0.996 reads "1.00×" beside FAIL), rounded away
    from the target where three would too (0.9997 as 0.999×)."""
    if v == target or f"{v:.2f}" != f"{target:.2f}":
        return fmt_ratio(v)
    if f"{v:.3f}" == f"{target:.3f}":
        v = (math.floor if v < target else math.ceil)(v * 1000) / 1000
    return f"{v:.3f}×"


def cell(s: dict | None) -> str:
    """A table cell for one (config, allocator): the median, marked when
    some runs failed; 'failed: why' when none succeeded."""
    if s is None:
        return "–"
    if "median_ops_per_sec" not in s:
        return "failed: " + s.get("error", "?").replace("|", "\\|")
    v = fmt_rate(s["median_ops_per_sec"])
    return f"{v} ({s['failed']}/{s['runs']} failed)" if s["failed"] else v


def markdown(result: dict) -> str:
    m, st = result["machine"], result["settings"]
    names = list(result["allocators"])
    peers = [p for p in PEERS if p in names]
    mode = "--quick (small sizes: a smoke check, not for claims)" if st["quick"] else "full sizes"
    commit = (m["git_commit"] or "?")[:10] + ("+dirty" if m["git_dirty"] else "")
    lines = [
        f"Measured {m['date'][:16].replace('T', ' ')} UTC on {m['cpu']}, {m['nproc']} CPUs, Linux {m['kernel']}; "
        f"hakmem {commit}; {mode}, median of {st['runs']} interleaved runs.",
        "",
    ]
    head = ["config"] + [a for a in ("hakmem",) if a in names] + peers + ["best peer", "hakmem ÷ best (spread)", "RSS ÷ peers", "OS calls/Mop"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" + "---:|" * (len(head) - 1)]
    for name, c in result["configs"].items():
        res, r = c["results"], c["ratios"]
        row = [name] + [cell(res.get(a)) for a in ("hakmem",) if a in names] + [cell(res.get(p)) for p in peers]
        os_calls = c.get("os_calls", {}).get("hakmem", {})
        ratio = fmt_ratio(r["vs_best"])
        if r.get("vs_best_spread") is not None:
            ratio += f" ±{r['vs_best_spread'] * 50:.0f}%"
        row += [r["best_peer"] or "–", ratio, fmt_ratio(r["rss_vs_peers"]),
                f"{os_calls['per_mop']:.3g}" if os_calls.get("ok") else "–"]
        lines.append("| " + " | ".join(row) + " |")
    os_note = ("+".join(OS_CALLS) + " per 10⁶ ops in one extra run under strace (startup: per 10⁶ processes)"
               if st["strace"] else "not counted (--no-strace, or no strace)")
    lines += ["", f"ops/s: median (more runs where the first ones spread over {SPREAD_WIDE:.0%}). hakmem ÷ best: "
              f"± half the combined spread ((max − min) ÷ median) of hakmem's and the best peer's runs. "
              f"RSS: hakmem's median peak RSS (VmHWM) ÷ the median of the peers'. OS calls: {os_note}."]
    libs = "; ".join(f"{a}: {i.get('lib')}" + (f" ({i['package']})" if i.get("package") else "")
                     + (f" (sha256 {i['sha256'][:12]})" if a == "hakmem" else "")
                     for a, i in result["allocators"].items() if a != "hakmem-tel")
    lines += [f"Libraries: {libs}."]
    if result["skipped"]:
        lines += ["Skipped: " + "; ".join(f"{a} ({why})" for a, why in result["skipped"].items()) + "."]
    cg_rows = {n: c["instructions"] for n, c in result["configs"].items() if c.get("instructions")}
    if cg_rows:
        cg_allocs = [a for a in ("hakmem",) + PEERS if any(a in v for v in cg_rows.values())]
        lines += ["", "Instructions per operation (callgrind, smaller arguments; the same binary for every allocator, "
                  "so the differences are the allocators'): a second column for the single-threaded rows, free of the "
                  "machine's timing noise.", "",
                  "| config | " + " | ".join(cg_allocs) + " | hakmem ÷ fewest peer |", "|---|" + "---:|" * (len(cg_allocs) + 1)]
        for n, v in cg_rows.items():
            peer_v = [v[a] for a in PEERS if v.get(a)]
            best = min(peer_v) if peer_v else None
            rat = f"{v['hakmem'] / best:.2f}×" if best and v.get("hakmem") else "–"
            lines.append(f"| {n} | " + " | ".join(f"{v[a]:.1f}" if v.get(a) else "–" for a in cg_allocs) + f" | {rat} |")

    lines += ["", "| target | config | measured | pass |", "|---|---|---:|---|"]
    for name, c in result["configs"].items():
        r = c["ratios"]
        if r["vs_best"] is not None:
            lines.append(f"| ops/s ≥ {TARGET_SPEED:.2f}× best peer | {name} | {fmt_measured(r['vs_best'], TARGET_SPEED)} | "
                         f"{'pass' if r['vs_best'] >= TARGET_SPEED else 'FAIL'} |")
    for name, c in result["configs"].items():
        r = c["ratios"]
        if r["rss_vs_peers"] is not None:
            lines.append(f"| peak RSS ≤ {TARGET_RSS:.2f}× peer median | {name} | {fmt_measured(r['rss_vs_peers'], TARGET_RSS)} | "
                         f"{'pass' if r['rss_vs_peers'] <= TARGET_RSS else 'FAIL'} |")
    ss = result.get("steady_state")
    if ss and ss["allocators"].get("hakmem", {}).get("per_1e8") is not None:
        h = ss["allocators"]["hakmem"]
        v = h["per_1e8"]
        others = ", ".join(f"{a} {s['per_1e8']:.3g}" for a, s in ss["allocators"].items()
                           if a != "hakmem" and s.get("per_1e8") is not None)
        lines.append(f"| steady-state OS calls ≤ {TARGET_STEADY_PER_1E8:g} per 10⁸ ops | random_mixed "
                     f"{ss['iters'][0] // 10**6}M→{ss['iters'][1] // 10**6}M | {v:.3g} ({h['calls'][0]}→{h['calls'][1]} calls; peers: {others}) | "
                     f"{'pass' if v <= TARGET_STEADY_PER_1E8 else 'FAIL'} |")

    if "hakmem-base" in names:
        base = result["allocators"]["hakmem-base"]["lib"]
        lines += ["", f"| A/B: this build against `{base}` | hakmem | hakmem-base | hakmem ÷ base |", "|---|---:|---:|---:|"]
        for name, c in result["configs"].items():
            new, old = (c["results"].get(a) for a in ("hakmem", "hakmem-base"))
            ratio = (new["median_ops_per_sec"] / old["median_ops_per_sec"]
                     if new and old and new.get("median_ops_per_sec") and old.get("median_ops_per_sec") else None)
            lines.append(f"| {name} | {cell(new)} | {cell(old)} | {fmt_ratio(ratio)} |")

    if "hakmem-tel" in names:
        lines += ["", "| telemetry on (hakmem-tel) | hakmem | hakmem-tel | tel ÷ off |", "|---|---:|---:|---:|"]
        for name in TEL_CONFIGS:
            c = result["configs"].get(name)
            if c:
                lines.append(f"| {name} | {cell(c['results'].get('hakmem'))} | {cell(c['results'].get('hakmem-tel'))} | "
                             f"{fmt_ratio(c['ratios']['tel_vs_hakmem'])} |")
        # startup's processes live less than a telemetry epoch, and hakmem
        # makes the file only after one: no file there is the expected case.
        tel_runs = [r for name, c in result["configs"].items() if name != "startup"
                    for r in c["raw"].get("hakmem-tel", []) if r["ok"]]
        unseen = [name for name, c in result["configs"].items() if name != "startup"
                  for r in c["raw"].get("hakmem-tel", []) if r["ok"] and not r["ring_file_seen"]]
        if unseen:
            where = ", ".join(f"{n} {unseen.count(n)}" for n in dict.fromkeys(unseen))
            lines += ["", f"hakmem-tel: no ring file appeared in the telemetry directory in {len(unseen)} of "
                      f"{len(tel_runs)} runs ({where}): hakmem makes the file at its first check-in one telemetry "
                      "epoch (100 ms) after start, so runs shorter than that (--quick) have none."]
    return "\n".join(lines) + "\n"


def chart(result: dict, path: Path) -> str | None:
    """Grouped bars of ops/s ÷ best peer per config; returns why it was
    skipped, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not importable"
    names = list(result["allocators"])
    configs = list(result["configs"])
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(configs)), 4.5))
    width = 0.8 / max(1, len(names))
    top = 1.0
    for i, a in enumerate(names):
        xs, ys = [], []
        for j, cname in enumerate(configs):
            c = result["configs"][cname]
            best = c["ratios"]["best_peer"]
            s = c["results"].get(a, {})
            x = j + (i - (len(names) - 1) / 2) * width
            if best and s.get("median_ops_per_sec"):
                xs.append(x)
                ys.append(s["median_ops_per_sec"] / c["results"][best]["median_ops_per_sec"])
            elif s.get("failed"):
                ax.text(x, 0.02, "failed", rotation=90, ha="center", va="bottom", fontsize=7)
        ax.bar(xs, ys, width, label=a)
        top = max([top, *ys])
    ax.set_ylim(0, top * 1.2)  # room for the legend
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(configs)), configs, rotation=30, ha="right")
    ax.set_ylabel("ops/s ÷ best peer")
    ax.set_title(f"hakmem vs peers ({'quick' if result['settings']['quick'] else 'full'}, {result['machine']['date'][:10]})")
    ax.legend(fontsize="small", ncol=min(len(names), 6))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def readme_markers(section: str) -> tuple[str, str]:
    return f"<!-- {section}:begin -->", f"<!-- {section}:end -->"


def update_readme(path: Path, md: str, section: str = "bench") -> None:
    """Replaces the lines between README's `<!-- SECTION:begin -->` and
    `<!-- SECTION:end -->` lines with md (bench/services.py's table too)."""
    begin, end = readme_markers(section)
    lines = path.read_text().splitlines(keepends=True)
    starts = [i for i, l in enumerate(lines) if l.strip() == begin]
    ends = [i for i, l in enumerate(lines) if l.strip() == end]
    if len(starts) != 1 or len(ends) != 1 or ends[0] < starts[0]:
        raise SetupError(f"{path} needs exactly one line `{begin}` followed by one line `{end}`")
    path.write_text("".join(lines[: starts[0] + 1]) + md + "".join(lines[ends[0]:]))


# ---------------------------------------------------------------- main


def select_configs(only: str | None) -> list[Config]:
    if not only:
        return list(CONFIGS)
    chosen = set()
    for pat in (p.strip() for p in only.split(",") if p.strip()):
        exact = [c.name for c in CONFIGS if c.name == pat]
        try:
            chosen.update(exact or [c.name for c in CONFIGS if re.search(pat, c.name)])
        except re.error as e:
            raise SetupError(f"--only: bad pattern {pat!r}: {e}")
    if not chosen:
        raise SetupError(f"--only {only!r} matches no config; configs: {', '.join(c.name for c in CONFIGS)}")
    return [c for c in CONFIGS if c.name in chosen]


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="bench/run.py", description=__doc__.split("\n\n")[0],
        epilog="configs: " + ", ".join(c.name for c in CONFIGS) + ". allocators: " + ", ".join(ALL_ALLOCATORS)
        + ". Build first with `make bench-build` (or just `make bench`).")
    ap.add_argument("--quick", action="store_true", help="small sizes and 3 runs: a check that everything runs")
    ap.add_argument("--runs", type=int, help="runs per (config, allocator) (default 5, --quick 3)")
    ap.add_argument("--base", metavar="LIB", help="another libhakmem.so (say, built from the commit before a change) "
                    "run beside the others as hakmem-base, interleaved, with an A/B table")
    ap.add_argument("--only", metavar="PATTERN", help="config names, comma-separated, or regular expressions")
    ap.add_argument("--allocators", metavar="LIST", help="comma-separated (default: all available)")
    ap.add_argument("--no-strace", action="store_true", help="skip the OS call counts")
    ap.add_argument("--no-callgrind", action="store_true",
                    help="skip the instructions-per-operation column (callgrind) of the single-threaded rows")
    ap.add_argument("--json", action="store_true", help="print the result JSON on stdout instead of the table")
    ap.add_argument("--out", metavar="DIR", type=Path, default=ROOT / "bench" / "results", help="where latest.{json,md,png} go")
    ap.add_argument("--tel-reader", metavar="CMD", default=DEFAULT_TEL_READER,
                    help="reader started beside each hakmem-tel run; {dir} is its telemetry directory (default: %(default)s)")
    ap.add_argument("--update-readme", metavar="PATH", type=Path,
                    help="replace the text between <!-- bench:begin --> and <!-- bench:end --> in PATH with the tables")
    a = ap.parse_args(argv)
    if a.runs is not None and a.runs < 1:
        ap.error("--runs must be at least 1")
    return a


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    mode = "quick" if a.quick else "full"
    runs = a.runs or (3 if a.quick else 5)
    timeout = 120.0 if a.quick else 600.0
    configs = select_configs(a.only)
    names = [n.strip() for n in a.allocators.split(",")] if a.allocators else list(ALL_ALLOCATORS)
    unknown = [n for n in names if n not in ALL_ALLOCATORS]
    if unknown or not names:
        raise SetupError(f"--allocators: unknown {', '.join(unknown) or '(empty)'}; known: {', '.join(ALL_ALLOCATORS)}")
    check_build(configs, any(n.startswith("hakmem") for n in names))
    if a.update_readme and not a.update_readme.is_file():
        raise SetupError(f"--update-readme: {a.update_readme} not found")
    if a.base and not os.access(a.base, os.R_OK):
        raise SetupError(f"--base: {a.base} cannot be read")
    allocs, skipped = setup_allocators(names, a.tel_reader, str(Path(a.base).resolve()) if a.base else None)
    if not allocs:
        raise SetupError("no allocator left to run")
    strace = None
    if not a.no_strace:
        strace = find_strace()
        if strace is None:
            log("skipping OS call counts: strace missing and cannot be installed (not root)")
    a.out.mkdir(parents=True, exist_ok=True)

    peers = [x.name for x in allocs if x.name in PEERS]
    raw: dict[str, dict[str, list[dict]]] = {c.name: {x.name: [] for x in allocs} for c in configs}
    total, done = runs * len(configs) * len(allocs), 0
    started = time.monotonic()
    bar = progress(total=total, desc="bench", unit="run") if progress else None
    for run in range(runs):
        for ci, cfg in enumerate(configs):
            argv_ = cfg.quick if a.quick else cfg.full
            k = (run + ci) % len(allocs)
            for alloc in allocs[k:] + allocs[:k]:
                done += 1
                r = run_timed(cfg, argv_, alloc, timeout, a.tel_reader)
                raw[cfg.name][alloc.name].append(r)
                what = f"{fmt_rate(r['ops_per_sec'])} ops/s" if r["ok"] else "failed: " + r["error"]
                (bar.write if bar else log)(f"[{done}/{total}] {cfg.name} {alloc.name} run {run + 1}/{runs}: {what}")
                if bar:
                    bar.update(1)
    if bar:
        bar.close()
    # Rows whose runs spread wide get more, up to as many again (full sizes).
    for extra in range(0 if a.quick else runs):
        wide = [cfg for cfg in configs if spread_wide(raw[cfg.name], peers)]
        if not wide:
            break
        log(f"[extra {extra + 1}/{runs}] spread over {SPREAD_WIDE:.0%}: one more run of " + ", ".join(c.name for c in wide))
        for ci, cfg in enumerate(wide):
            k = (runs + extra + ci) % len(allocs)
            for alloc in allocs[k:] + allocs[:k]:
                raw[cfg.name][alloc.name].append(run_timed(cfg, cfg.full, alloc, timeout, a.tel_reader))

    result: dict = {
        "machine": machine_info(),
        "settings": {"quick": a.quick, "runs": runs, "only": a.only, "strace": strace is not None,
                     "tel_reader": a.tel_reader, "timeout_s": timeout},
        "allocators": {x.name: x.info for x in allocs},
        "skipped": skipped,
        "configs": {},
    }
    for cfg in configs:
        res = {x: summarize(rs) for x, rs in raw[cfg.name].items()}
        result["configs"][cfg.name] = {"binary": cfg.binary, "argv": cfg.quick if a.quick else cfg.full,
                                       "threads": cfg.threads, "results": res, "ratios": ratios(res, peers),
                                       "raw": raw[cfg.name]}

    if not a.no_callgrind:
        cg_cfgs = [c for c in configs if c.threads == 1 and c.name not in CG_SKIP]
        counted = [x for x in allocs if not x.telemetry and x.name != "hakmem-base"]
        for i, (cfg, alloc) in enumerate(((c, x) for c in cg_cfgs for x in counted), 1):
            v = count_instructions(cfg, alloc, timeout * 20)
            result["configs"][cfg.name].setdefault("instructions", {})[alloc.name] = v
            log(f"[callgrind {i}/{len(cg_cfgs) * len(counted)}] {cfg.name} {alloc.name}: "
                + (f"{v:.1f} instructions/op" if v else "failed"))

    if strace:
        counted = [x for x in allocs if not x.telemetry]  # telemetry adds no allocator OS calls worth a column
        n = len(configs) * len(counted)
        for i, (cfg, alloc) in enumerate(((c, x) for c in configs for x in counted), 1):
            s = run_strace(strace, cfg.binary, cfg.quick if a.quick else cfg.full, alloc, timeout)
            result["configs"][cfg.name].setdefault("os_calls", {})[alloc.name] = s
            what = f"{s['total']} calls, {s['per_mop']:.3g}/Mop" if s["ok"] else "failed: " + s["error"]
            log(f"[strace {i}/{n}] {cfg.name} {alloc.name}: {what}")
        short, long_ = STEADY_ITERS[mode]
        ss: dict = {"iters": [short, long_], "allocators": {}}
        for alloc in counted:
            pair = [run_strace(strace, "random_mixed", [str(it), "400", "42"], alloc, timeout) for it in (short, long_)]
            entry = {"calls": [p.get("total") for p in pair]}
            if all(p["ok"] for p in pair):
                entry["per_1e8"] = (pair[1]["total"] - pair[0]["total"]) / (long_ - short) * 1e8
                log(f"[steady] {alloc.name}: {pair[0]['total']} calls at {short:,}, {pair[1]['total']} at {long_:,}: "
                    f"{entry['per_1e8']:.3g} per 10^8 ops")
            else:
                entry["error"] = next(p["error"] for p in pair if not p["ok"])
                log(f"[steady] {alloc.name}: failed: {entry['error']}")
            ss["allocators"][alloc.name] = entry
        result["steady_state"] = ss

    result["machine"]["loadavg_end"] = os.getloadavg()
    result["machine"]["elapsed_s"] = round(time.monotonic() - started, 1)
    md = markdown(result)
    (a.out / "latest.json").write_text(json.dumps(result, indent=1) + "\n")
    (a.out / "latest.md").write_text("# hakmem benchmarks\n\n" + md)
    why = chart(result, a.out / "latest.png")
    if why:
        log(f"chart skipped: {why}")
        (a.out / "latest.png").unlink(missing_ok=True)  # never leave an older run's chart beside new tables
    if a.update_readme:
        update_readme(a.update_readme, md)
        log(f"updated {a.update_readme}")
    log(f"wrote {rel(a.out / 'latest.json')}, {rel(a.out / 'latest.md')}" + ("" if why else f", {rel(a.out / 'latest.png')}"))
    print(json.dumps(result, indent=1) if a.json else md)
    hakmem_failed = any(s.get("failed") for c in result["configs"].values()
                        for x, s in c["results"].items() if x.startswith("hakmem"))
    return 1 if hakmem_failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except SetupError as e:
        print(f"bench/run.py: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("bench/run.py: interrupted", file=sys.stderr)
        sys.exit(130)
