"""procfs.py: what learnd and the CLI read from /proc, each reader against a
real process (a child python that reports its own figures), and a
program's identity: its executable and its GNU build id, read from
/proc/<pid>/exe (README "hakmem-learnd": a program is the executable and
its build id, and the user). The build id must be the one the linker
wrote, as readelf reports it, not another note's bytes."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import LIB, WORKLOAD
from hakmem import procfs
from hakmem.procfs import elf_build_id, program_identity

CHILD = """
import json, os, resource, sys, threading, time
buf = bytearray(64 << 20)                     # 64 MiB touched: resident
for i in range(0, len(buf), 4096):
    buf[i] = 1
ev = threading.Event()
ts = [threading.Thread(target=ev.wait) for _ in range(3)]
for t in ts:
    t.start()
t0 = time.process_time()
while time.process_time() - t0 < 0.2:         # some CPU time
    pass
ru = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"minflt": ru.ru_minflt, "cpu": time.process_time(), "uids": os.getresuid()}), flush=True)
sys.stdin.readline()
ev.set()
"""


@pytest.fixture
def child():
    """A child python holding 64 MiB and 4 threads: (Popen, what it says of itself)."""
    p = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        yield p, json.loads(p.stdout.readline())
    finally:
        p.stdin.close()
        p.wait(30)


def test_proc_stat_of_a_live_process(child):
    p, said = child
    st = procfs.proc_stat(p.pid)
    assert st["threads"] == 4
    assert st["minflt"] >= said["minflt"] >= (64 << 20) // procfs.PAGE      # every touched page faulted once
    assert st["utime"] + st["stime"] >= said["cpu"] - 0.02                   # ticks: 10 ms each
    assert st["start_time"] == procfs.proc_start_time(p.pid)
    with open(f"/proc/{p.pid}/stat") as f:                                   # field 22, after the command name
        assert st["start_time"] == int(f.read().rsplit(")", 1)[1].split()[19])


def test_cpu_between_two_readings_is_whole_ticks_and_zero_when_none_passed(child):
    """learnd's window CPU: a process whose ticks did not move spent 0.0,
    not the 7e-17 that subtracting sums of seconds leaves (31 + 5 ticks
    then 30 + 6: same total, user and system split differently)."""
    p, said = child
    st = procfs.proc_stat(p.pid)
    assert st["cpu_ticks"] == round((st["utime"] + st["stime"]) * st["hz"]) > 0
    hz = st["hz"]
    for (u0, s0), (u1, s1) in (((30, 6), (31, 5)), ((130, 8), (131, 7)), ((7, 1), (7, 1))):
        a = {"utime": u0 / hz, "stime": s0 / hz, "cpu_ticks": u0 + s0, "hz": hz}
        b = {"utime": u1 / hz, "stime": s1 / hz, "cpu_ticks": u1 + s1, "hz": hz}
        assert procfs.cpu_seconds_between(a, b) == 0.0
    assert procfs.cpu_seconds_between({"cpu_ticks": 10, "hz": hz}, {"cpu_ticks": 13, "hz": hz}) == 3 / hz
    assert procfs.cpu_seconds_between({"cpu_ticks": 13, "hz": hz}, {"cpu_ticks": 10, "hz": hz}) == 0.0   # a recycled pid
    assert procfs.cpu_seconds_between(st, procfs.proc_stat(p.pid)) >= 0


def test_children_and_the_time_of_those_reaped(child):
    """A server's CPU (bench/services.py): its live children are found by
    their parent, and a child's time counts for its parent once waited for."""
    p, said = child
    assert p.pid in procfs.proc_children(os.getpid())
    assert procfs.proc_stat(p.pid)["ppid"] == os.getpid()
    before = procfs.proc_stat(os.getpid())
    p.stdin.close()
    p.wait(30)
    after = procfs.proc_stat(os.getpid())
    assert p.pid not in procfs.proc_children(os.getpid())
    reaped = (after["cutime"] + after["cstime"]) - (before["cutime"] + before["cstime"])
    assert reaped >= said["cpu"] - 0.05, (reaped, said)


def test_proc_rss_and_uids_of_a_live_process(child):
    p, said = child
    assert (64 << 20) <= procfs.proc_rss(p.pid) <= (64 << 20) + (200 << 20)
    assert procfs.proc_uids(p.pid) == (*said["uids"], os.geteuid())        # real, effective, saved, fs


def test_start_time_names_one_process():
    a, b = (subprocess.Popen(["sleep", "5"]) for _ in range(2))
    try:
        assert procfs.proc_start_time(os.getpid()) <= procfs.proc_start_time(a.pid) <= procfs.proc_start_time(b.pid)
    finally:
        for x in (a, b):
            x.kill()
            x.wait()


def test_every_reader_says_none_for_a_process_that_is_gone():
    p = subprocess.Popen(["true"])
    p.wait()
    for read in (procfs.proc_stat, procfs.proc_start_time, procfs.proc_uids, procfs.proc_rss,
                 procfs.cgroup_memory_limit, procfs.program_identity):
        assert read(p.pid) is None, read.__name__


def test_mount_of_an_executable():
    fstype = procfs.mount_fstype(os.getpid(), os.path.realpath(sys.executable))
    with open("/proc/self/mountinfo") as f:
        assert fstype in {ln.split(" - ")[1].split()[0] for ln in f}


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


def test_descendants_follow_the_tree_and_only_it():
    import subprocess
    import time
    from hakmem.procfs import proc_descendants
    import os
    import signal
    p = subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30 & wait"], start_new_session=True)
    other = subprocess.Popen(["sleep", "30"])
    try:
        for _ in range(200):
            d = proc_descendants(p.pid)
            if len(d) == 3:
                break
            time.sleep(0.01)
        assert d[0] == p.pid and len(d) == 3, d
        assert other.pid not in d
        assert proc_descendants(2 ** 22 + 1) == [2 ** 22 + 1]   # a pid that is not there: itself, nothing under it
    finally:
        os.killpg(p.pid, signal.SIGKILL)    # the shell and its two sleeps
        other.kill()
        for q in (p, other):
            q.wait()
