#!/usr/bin/env python3
"""What hakmem-bpf's tracing costs a program: the bench runner's random_mixed,
larson_2t and large_churn (their arguments from bench/run.py; large_churn
spends most of its time in page faults, the others barely fault), preloaded
with hakmem,
with hakmem-bpf counting the benchmark's pid vs without hakmem-bpf loaded at
all, runs interleaved (off, on, on, off, ...) so a slow minute of a shared
machine falls on both. Prints each config's median ops/s and median CPU time
(user + system of the benchmark) per operation, and their differences (the
target: at most 1%).

    .venv/bin/python bench/bpf_overhead.py [--runs 7] [--only random_mixed] [--json]

Needs root (loads BPF), the kernel's BTF, `make tests` (build/hakmem-bpf,
build/bench/*, build/libhakmem.so); BUILD=build-x picks another build dir."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / os.environ.get("BUILD", "build")
sys.path.insert(0, str(ROOT / "learner"))
sys.path.insert(0, str(ROOT / "bench"))

CONFIGS = ("random_mixed", "larson_2t", "large_churn")


def fail(msg):
    print(f"bpf_overhead: error: {msg}", file=sys.stderr)
    sys.exit(1)


def configs():
    import run as R        # bench/run.py: the runner's own arguments
    return {c.name: (c.binary, c.full) for c in R.CONFIGS if c.name in CONFIGS}


class Loader:
    def __init__(self, tmp):
        import zmq
        from hakmem._pb import hakmem_pb2 as pb
        self.pb = pb
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.bind(f"ipc://{tmp}/k.sock")
        self.proc = subprocess.Popen([str(BUILD / "hakmem-bpf"), "--connect", f"ipc://{tmp}/k.sock",
                                      "--interval-ms", "250"], stdin=subprocess.PIPE, text=True)
        self.recv(10)

    def recv(self, timeout=5):
        if not self.sock.poll(int(timeout * 1000)):
            fail("no sample from hakmem-bpf")
        m = self.pb.KernelSample()
        m.ParseFromString(self.sock.recv())
        return m

    def add(self, pid):
        self.proc.stdin.write(f"pids {pid}\n")
        self.proc.stdin.flush()
        while pid not in [p.pid for p in self.recv().procs]:
            pass

    def close(self):
        self.proc.terminate()
        self.proc.wait(10)
        self.sock.close(0)
        self.ctx.term()


def bpf_run_ns():
    """Nanoseconds hakmem-bpf's programs have run (kernel.bpf_stats_enabled),
    all of them: they run for every process's calls and faults and filter
    by pid inside, so this is everything tracing costs, not only what the
    benchmark's own calls cost."""
    r = subprocess.run(["bpftool", "-j", "prog", "show"], capture_output=True, text=True)
    if r.returncode != 0:
        return None
    return sum(p.get("run_time_ns", 0) for p in json.loads(r.stdout or "[]") if p.get("name", "").startswith("hk_"))


def one(binary, args, tmp, traced):
    """ops/s of one run; traced: hakmem-bpf counts it from its first instruction."""
    ld = Loader(tmp) if traced else None
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("HAKMEM_")}
        env.update(LD_PRELOAD=str(BUILD / "libhakmem.so"), HAKMEM_TELEMETRY="0")
        # sh waits for a line, then execs the benchmark: its pid is known
        # (and in the set) before it starts.
        p = subprocess.Popen(["sh", "-c", 'read _ && exec "$0" "$@"', str(BUILD / "bench" / binary), *args],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        if ld is not None:
            ld.add(p.pid)
        p.stdin.write("go\n")
        p.stdin.close()
        out = p.stdout.read()
        _, status, ru = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        if p.returncode != 0:
            fail(f"{binary} failed ({p.returncode})")
        r = json.loads(out.strip().splitlines()[-1])
        # CPU time per operation: what tracing adds runs in the traced
        # process's own context (the handlers), and unlike throughput it
        # barely moves when other work shares the machine.
        cpu_ns = (ru.ru_utime + ru.ru_stime) * 1e9 / r["ops"]
        bpf_share = None
        if ld is not None:
            ns = bpf_run_ns()
            if ns is not None:
                bpf_share = ns / ((ru.ru_utime + ru.ru_stime) * 1e9)
            got = {q.pid: list(q.values) for q in ld.recv().procs}
            if p.pid not in got:
                fail("hakmem-bpf lost the benchmark's pid")
        return r["ops_per_sec"], cpu_ns, bpf_share
    finally:
        if ld is not None:
            ld.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=7, help="runs per config and mode (default 7)")
    ap.add_argument("--only", help="one of " + ", ".join(CONFIGS))
    ap.add_argument("--json", action="store_true", help="the figures as JSON")
    a = ap.parse_args()
    if os.geteuid() != 0:
        fail("needs root (hakmem-bpf loads BPF programs)")
    for f in (BUILD / "hakmem-bpf", BUILD / "libhakmem.so"):
        if not f.exists():
            fail(f"{f} missing: run `make tests` (BUILD={BUILD.name})")
    from hakmem.kernel import mount_tracefs
    why = mount_tracefs()
    if why:
        fail(why)
    cfgs = configs()
    names = [a.only] if a.only else list(CONFIGS)
    # The programs' own run time, counted by the kernel: a measure of the
    # tracing's cost that the machine's noise does not move.
    stats = Path("/proc/sys/kernel/bpf_stats_enabled")
    stats_before = stats.read_text().strip() if stats.exists() else None
    if stats_before is not None:
        stats.write_text("1")
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            if name not in cfgs:
                fail(f"unknown config {name} (known: {', '.join(cfgs)})")
            binary, args = cfgs[name]
            runs = {False: [], True: []}
            for i in range(a.runs):
                for traced in ((False, True) if i % 2 == 0 else (True, False)):
                    runs[traced].append(one(binary, args, tmp, traced))
                print(f"bpf_overhead: {name} run {i + 1}/{a.runs}", file=sys.stderr, flush=True)
            off, on = (statistics.median(x[0] for x in runs[t]) for t in (False, True))
            coff, con = (statistics.median(x[1] for x in runs[t]) for t in (False, True))
            shares = [x[2] for x in runs[True] if x[2] is not None]
            res[name] = {"bpf_cpu_share_pct": statistics.median(shares) * 100 if shares else None,
                         "off_ops_per_s": off, "on_ops_per_s": on, "diff_pct": (on - off) / off * 100,
                         "off_cpu_ns_per_op": coff, "on_cpu_ns_per_op": con,
                         "cpu_diff_pct": (con - coff) / coff * 100,
                         "runs": a.runs, "off": runs[False], "on": runs[True]}
    if stats_before is not None:
        stats.write_text(stats_before)
    if a.json:
        print(json.dumps(res, indent=1))
    else:
        print(f"{'config':<14} {'untraced ops/s':>16} {'traced ops/s':>14} {'difference':>11}"
              f" {'untraced CPU ns/op':>19} {'traced CPU ns/op':>17} {'difference':>11} {'BPF run time / CPU':>19}")
        for name, r in res.items():
            print(f"{name:<14} {r['off_ops_per_s']:>16.4g} {r['on_ops_per_s']:>14.4g} "
                  f"{r['diff_pct']:>+10.2f}% {r['off_cpu_ns_per_op']:>19.4g} {r['on_cpu_ns_per_op']:>17.4g} "
                  f"{r['cpu_diff_pct']:>+10.2f}% "
                  + (f"{r['bpf_cpu_share_pct']:>18.4f}%" if r['bpf_cpu_share_pct'] is not None else f"{'–':>19}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
