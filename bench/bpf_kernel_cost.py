#!/usr/bin/env python3
"""The kernel-side cost per million allocations of one benchmark under
several warm-pool sizes, as hakmem-learnd sees it (issue 16's closing note).

For each HAKMEM_WARM_SLABS value: a fresh hakmem-learnd (static learner, no
exploration: the policy stays the one the program started with) with
hakmem-bpf, bench/learn_workload.c `phases` (the bench-learn workload whose
live set grows and shrinks, so emptied slabs either wait in the warm pool or
go back to the OS) preloaded, then learnd's own stored windows: those that
hakmem-bpf measured (k_bpf = 1; a process's first window is /proc's), their
rates times their lengths, summed, per million allocations the allocator
counted. The priced figure is what learnd's objective adds for the kernel:
faults at learnd's calibrated fault price (its log's "fault ... us") plus the
time measured inside mmap/munmap/madvise/mremap/brk.

    .venv/bin/python bench/bpf_kernel_cost.py [--warm 0,64] [--seconds 8] [--json]

Needs root, the kernel's BTF and `make tests` (BUILD=build-x: another dir)."""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / os.environ.get("BUILD", "build")
sys.path.insert(0, str(ROOT / "learner"))


def fail(msg):
    print(f"bpf_kernel_cost: error: {msg}", file=sys.stderr)
    sys.exit(1)


def wait(pred, timeout, what):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    fail(f"timed out waiting for {what}")


def measure(warm, seconds, tmp):
    from hakmem import layout as L
    tmp = Path(tmp) / f"warm{warm}"
    tmp.mkdir()
    log = open(tmp / "learnd.log", "w")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAKMEM_")}
    d = subprocess.Popen([sys.executable, "-m", "hakmem.daemon", "--foreground", "--db", str(tmp / "l.db"),
                          "--shm-dir", str(tmp / "shm"), "--run-dir", str(tmp / "run"), "--sample-period", "0.5",
                          "--learner", "static", "--no-explore"],
                         stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                         env=dict(env, HAKMEM_BPF=str(BUILD / "hakmem-bpf"), PYTHONPATH=str(ROOT / "learner")))
    text = lambda: (tmp / "learnd.log").read_text()    # noqa: E731
    try:
        wait(lambda: "ready:" in text() or d.poll() is not None, 60, "learnd ready")
        if d.poll() is not None:
            fail(f"learnd exited: {text()}")
        if "kernel-side cost from hakmem-bpf" not in text():
            fail(f"learnd is not using hakmem-bpf: {text()}")
        fault_s = float(re.search(r"fault ([0-9.]+) us", text()).group(1)) * 1e-6
        w = subprocess.run([str(BUILD / "bench" / "learn_workload"), "phases", str(seconds)],
                           env=dict(env, LD_PRELOAD=str(BUILD / "libhakmem.so"), HAKMEM_SHM_DIR=str(tmp / "shm"),
                                    HAKMEM_WARM_SLABS=str(warm)),
                           capture_output=True, text=True, timeout=seconds * 4 + 60)
        if w.returncode != 0:
            fail(f"learn_workload failed: {w.stderr.strip()}")
        wait(lambda: "process_exited" in text(), 30, "learnd to see the workload exit")
    finally:
        d.send_signal(signal.SIGTERM)
        d.wait(60)
        log.close()
    con = sqlite3.connect(tmp / "l.db")
    dt = "(t_end - t_start)"
    ks = list(L.KERNEL_COUNTERS)
    row = con.execute(f"SELECT count(*), sum(allocs * {dt}), " + ", ".join(f"sum({k} * {dt})" for k in ks)
                      + " FROM windows WHERE k_bpf = 1").fetchone()
    total = con.execute(f"SELECT count(*), sum(allocs * {dt}) FROM windows").fetchone()
    con.close()
    n, allocs, *vals = row
    if not n or not allocs:
        fail(f"no window measured by hakmem-bpf for warm {warm}")
    k = dict(zip(ks, vals))
    per_m = {name: v / allocs * 1e6 for name, v in k.items()}
    calls = sum(per_m[c] for c in ("k_mmap", "k_munmap", "k_madvise", "k_mremap", "k_brk"))
    # As learnd's objective prices it (objective.window_time_cost): faults by
    # their measured time where the kernel has kprobes, else count x price.
    faults_us = per_m["k_fault_ns"] / 1e3 if per_m["k_fault_ns"] > 0 else per_m["k_faults"] * fault_s * 1e6
    priced_us = faults_us + per_m["k_os_ns"] / 1e3
    return {"warm_slabs": warm, "windows_bpf": n, "windows_all": total[0], "allocs": allocs,
            "allocs_share_bpf": allocs / total[1] if total[1] else 0.0, "fault_price_us": fault_s * 1e6,
            "per_million_allocs": per_m, "os_calls_per_m": calls, "kernel_us_per_m": priced_us}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--warm", default="0,64", help="HAKMEM_WARM_SLABS values, comma-separated (default 0,64)")
    ap.add_argument("--seconds", type=float, default=8, help="workload seconds per value (default 8)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if os.geteuid() != 0:
        fail("needs root (hakmem-bpf loads BPF programs)")
    for f in (BUILD / "hakmem-bpf", BUILD / "libhakmem.so", BUILD / "bench" / "learn_workload"):
        if not f.exists():
            fail(f"{f} missing: run `make tests` (BUILD={BUILD.name})")
    try:
        warms = [int(x) for x in a.warm.split(",")]
    except ValueError:
        fail(f"--warm {a.warm!r}: comma-separated numbers")
    with tempfile.TemporaryDirectory() as tmp:
        res = []
        for w in warms:
            print(f"bpf_kernel_cost: warm_slabs {w}: learn_workload phases {a.seconds:g} s under learnd",
                  file=sys.stderr, flush=True)
            res.append(measure(w, a.seconds, tmp))
    if a.json:
        print(json.dumps(res, indent=1))
        return 0
    print("learn_workload phases, per million allocations, as hakmem-learnd stored it (hakmem-bpf windows):")
    print(f"{'warm_slabs':>10} {'faults':>10} {'mmap':>7} {'munmap':>7} {'madvise':>8} {'brk':>6} "
          f"{'OS calls':>9} {'in calls us':>12} {'kernel us':>10} {'windows':>8}")
    for r in res:
        p = r["per_million_allocs"]
        print(f"{r['warm_slabs']:>10} {p['k_faults']:>10.1f} {p['k_mmap']:>7.2f} {p['k_munmap']:>7.2f} "
              f"{p['k_madvise']:>8.2f} {p['k_brk']:>6.2f} {r['os_calls_per_m']:>9.2f} {p['k_os_ns'] / 1e3:>12.1f} "
              f"{r['kernel_us_per_m']:>10.1f} {r['windows_bpf']:>4}/{r['windows_all']}")
    timed = res[0]["per_million_allocs"]["k_fault_ns"] > 0
    print("kernel us = time in faults (measured) + time in the calls" if timed else
          f"kernel us = faults x {res[0]['fault_price_us']:.2f} us (learnd's calibrated price; no kprobes here "
          f"to time them) + time in the calls")
    return 0


if __name__ == "__main__":
    sys.exit(main())
