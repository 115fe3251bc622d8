"""The objective learnd minimises (objective.py) and how each program gets
its own: `--objective` / the config file, per-program overrides, and a
cgroup's memory.max when nothing is configured.

    cost = time + lambda * rss / GiB                      (priced, lambda 0.125)
    cost = time + OVER_BUDGET * max(0, rss / budget - 1)  (budget=SIZE)

The cgroup tests read a real /proc/<pid>/cgroup where they can (a process
moved into a child of the cgroup v2 hierarchy, as root) and a cgroup tree
made in a temporary directory (cgroup_memory_limit's root parameter); the
end-to-end test runs learnd with a configuration file."""
import builtins
import functools
import json
import os
import pathlib
import subprocess
import sys

import pytest

from conftest import ROOT, clean_env, ring_path, scaled, start
from hakmem import objective as O
from hakmem import procfs as P
from hakmem.config import ConfigError, load
from hakmem.daemon import Daemon, Log, Program
from hakmem.objective import GIB, OVER_BUDGET, Objective, ObjectiveError, parse_size

MIB = 1 << 20


# ---- sizes and parsing -----------------------------------------------------------------
@pytest.mark.parametrize("text, want", [
    ("4096", 4096), (4096, 4096), ("512MiB", 512 * MIB), ("512M", 512 * MIB), ("512mb", 512 * MIB),
    ("2G", 2 << 30), ("2GiB", 2 << 30), ("1.5 GiB", 3 << 29), (" 64 KiB ", 64 << 10), ("1k", 1024),
    ("1T", 1 << 40), (".5G", 1 << 29)])
def test_parse_size(text, want):
    assert parse_size(text) == want


@pytest.mark.parametrize("text", ["lots", "", "12 parsecs", "-1G", "1.2.3", "G"])
def test_parse_size_refuses_what_is_not_a_size(text):
    with pytest.raises(ObjectiveError) as e:
        parse_size(text)
    assert str(e.value) == f"{text!r} is not a size (examples: 4096, 512MiB, 2GiB)"


@pytest.mark.parametrize("text, lam, budget", [
    ("lambda=0.125", 0.125, None), ("0.5", 0.5, None), ("lam=2", 2.0, None), ("price = 0", 0.0, None),
    ("budget=512MiB", 0.125, 512 * MIB), ("BUDGET=2G", 0.125, 2 << 30), ("budget=4096", 0.125, 4096)])
def test_objective_parse(text, lam, budget):
    o = Objective.parse(text)
    assert (o.lam, o.budget_bytes) == (lam, budget)


@pytest.mark.parametrize("text, why", [
    ("budget=lots", "objective 'budget=lots': 'lots' is not a size (examples: 4096, 512MiB, 2GiB)"),
    ("budget=0", "objective 'budget=0': a memory budget must be positive, got 0"),
    ("lambda=-1", "objective 'lambda=-1': lambda must be >= 0, got -1.0"),
    ("lambda=nan", "objective 'lambda=nan': lambda must be >= 0, got nan"),
    ("lambda=cheap", "objective 'lambda=cheap': could not convert string to float: 'cheap'"),
    ("speed=1", "objective 'speed=1': expected lambda=N or budget=SIZE")])
def test_objective_parse_errors_are_one_line(text, why):
    with pytest.raises(ObjectiveError) as e:
        Objective.parse(text)
    assert str(e.value) == why


# ---- what it costs -----------------------------------------------------------------------
def test_priced_cost_is_time_plus_lambda_per_gib():
    o = Objective()
    assert o.lam == 0.125 and o.budget_bytes is None
    assert o.cost(0.02, 0) == 0.02
    assert o.cost(0.02, 2 * GIB) == 0.02 + 0.25
    assert Objective(lam=1.0).mem_cost(512 * MIB) == 0.5
    assert o.describe() == "time + 0.125/GiB"


def test_budget_cost_is_time_alone_under_the_budget_and_steep_past_it():
    o = Objective.parse("budget=512MiB")
    b = 512 * MIB
    assert o.describe() == "time under 512 MiB"
    for rss in (0, b // 2, b - 1, b):
        assert o.cost(0.03, rss) == 0.03, rss          # under (or at) the budget: time alone, lambda ignored
    assert o.mem_cost(1.5 * b) == OVER_BUDGET * 0.5 == 5.0
    assert o.mem_cost(2 * b) == OVER_BUDGET
    # Past the budget memory dominates: 1% over costs more than any plausible
    # allocator time (a tenth of a core).
    assert o.cost(0.0, 1.01 * b) > 0.1
    # A budget beats any time saving bought with memory past it.
    assert o.cost(0.001, 1.1 * b) > o.cost(0.5, b)
    assert Objective(lam=99, budget_bytes=b).cost(0.03, b) == 0.03


# ---- the cgroup's memory.max --------------------------------------------------------------
def fake_proc(monkeypatch, tmp_path, pid, cgroup_text):
    """/proc/<pid>/cgroup says cgroup_text, as procfs.py reads it."""
    f = tmp_path / f"proc-{pid}-cgroup"
    f.write_text(cgroup_text)
    real = builtins.open

    def fake_open(path, *a, **kw):
        if str(path) == f"/proc/{pid}/cgroup":
            path = f
        return real(path, *a, **kw)
    monkeypatch.setattr(P, "open", fake_open, raising=False)


def cgroup_tree(root, limits):
    """A cgroup v2 tree under root: {"a/b": "max" or bytes or None (no file)}."""
    for path, v in limits.items():
        d = pathlib.Path(root, path)
        d.mkdir(parents=True, exist_ok=True)
        if v is not None:
            (d / "memory.max").write_text(f"{v}\n")
    return str(root)


V1_AND_V2 = "12:memory:/v1/ignored\n4:cpu:/x\n0::/system.slice/db.service\n"


def test_cgroup_limit_is_the_tightest_memory_max_above_the_process(tmp_path, monkeypatch):
    fake_proc(monkeypatch, tmp_path, 4242, V1_AND_V2)
    root = cgroup_tree(tmp_path / "cg", {"system.slice": 3 << 30, "system.slice/db.service": "max"})
    assert P.cgroup_memory_limit(4242, root=root) == 3 << 30          # the parent's limit holds
    (tmp_path / "cg/system.slice/db.service/memory.max").write_text(f"{1 << 30}\n")
    assert P.cgroup_memory_limit(4242, root=root) == 1 << 30          # the tighter one
    (tmp_path / "cg/system.slice/memory.max").write_text(f"{512 * MIB}\n")
    assert P.cgroup_memory_limit(4242, root=root) == 512 * MIB
    (tmp_path / "cg/system.slice/memory.max").write_text("max\n")
    (tmp_path / "cg/system.slice/db.service/memory.max").write_text("max\n")
    assert P.cgroup_memory_limit(4242, root=root) is None             # "max" everywhere: no limit
    # No memory.max files at all (the controller is not enabled): no limit.
    assert P.cgroup_memory_limit(4242, root=cgroup_tree(tmp_path / "empty", {"system.slice/db.service": None})) \
        is None


@pytest.mark.parametrize("text", ["0::/\n", "4:memory:/v1/only\n1:cpu:/x\n", ""])
def test_no_cgroup_limit_at_the_root_or_without_cgroup_v2(tmp_path, monkeypatch, text):
    fake_proc(monkeypatch, tmp_path, 4243, text)
    root = cgroup_tree(tmp_path / "cg", {".": 1 << 30, "v1/only": 1 << 30})
    assert P.cgroup_memory_limit(4243, root=root) is None


def test_no_cgroup_limit_for_a_process_that_is_gone(tmp_path):
    p = subprocess.Popen(["true"])
    p.wait()
    assert P.cgroup_memory_limit(p.pid, root=str(tmp_path)) is None


def test_default_objective_is_time_under_80_percent_of_the_limit(tmp_path, monkeypatch):
    fallback = Objective(lam=0.25)
    fake_proc(monkeypatch, tmp_path, 4244, "0::/svc\n")
    root = cgroup_tree(tmp_path / "cg", {"svc": 1 << 30})
    monkeypatch.setattr(P, "cgroup_memory_limit", functools.partial(P.cgroup_memory_limit, root=root))
    o = O.default_objective(4244, fallback)
    assert o == Objective(budget_bytes=int(0.8 * (1 << 30))) and o.budget_bytes == 858993459
    assert o.describe() == "time under 819.2 MiB"
    assert O.default_objective(4244, fallback, budget_share=0.5).budget_bytes == 512 * MIB
    (tmp_path / "cg/svc/memory.max").write_text("max\n")
    assert O.default_objective(4244, fallback) is fallback


def cgroup2_mount():
    """Where the cgroup v2 hierarchy is mounted, or None."""
    with open("/proc/self/mountinfo") as f:
        for ln in f:
            parts = ln.split()
            sep = parts.index("-")
            if parts[sep + 1] == "cgroup2":
                return parts[4]
    return None


@pytest.fixture
def child_cgroup(tmp_path):
    """A sleeping process in a child cgroup of its own in the real cgroup v2
    hierarchy: (pid, its cgroup path, the hierarchy's mount point)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: makes a cgroup and moves a process into it")
    mnt = cgroup2_mount()
    if mnt is None:
        pytest.skip("needs a cgroup v2 hierarchy (none is mounted)")
    name = f"hakmem-test-{os.getpid()}"
    cg = pathlib.Path(mnt, name)
    cg.mkdir()
    p = subprocess.Popen(["sleep", "60"])
    try:
        (cg / "cgroup.procs").write_text(f"{p.pid}\n")
        yield p.pid, f"/{name}", mnt
    finally:
        p.kill()
        p.wait()
        cg.rmdir()


def test_cgroup_limit_of_a_real_process_in_a_child_cgroup(child_cgroup, tmp_path):
    """The kernel's /proc/<pid>/cgroup, read as learnd reads it. The limit
    is the real memory.max where the hierarchy has the memory controller,
    else a tree mirroring the hierarchy in a temporary directory."""
    pid, path, mnt = child_cgroup
    line = next(ln for ln in open(f"/proc/{pid}/cgroup").read().splitlines() if ln.startswith("0::"))
    assert line == f"0::{path}"
    real = pathlib.Path(mnt, path.lstrip("/"), "memory.max")
    if real.exists():
        real.write_text(f"{256 * MIB}\n")
        assert P.cgroup_memory_limit(pid, root=mnt) == 256 * MIB
        real.write_text("max\n")
        assert P.cgroup_memory_limit(pid, root=mnt) is None
    else:
        assert P.cgroup_memory_limit(pid, root=mnt) is None      # no memory controller here: no limit
    root = cgroup_tree(tmp_path / "cg", {path.lstrip("/"): 256 * MIB})
    assert P.cgroup_memory_limit(pid, root=root) == 256 * MIB


# ---- which objective a program gets --------------------------------------------------------
def daemon(tmp_path, monkeypatch, cgroup_limit, *config_lines, **flags):
    """A Daemon (no loop, no store) with a configuration file, and every
    process in a cgroup limited to cgroup_limit bytes (None: no limit)."""
    cfg_file = tmp_path / "learnd.toml"
    cfg_file.write_text("\n".join(config_lines) + "\n")
    fake_proc(monkeypatch, tmp_path, 4245, "0::/svc\n")
    root = cgroup_tree(tmp_path / "cg", {"svc": "max" if cgroup_limit is None else cgroup_limit})
    monkeypatch.setattr(P, "cgroup_memory_limit", functools.partial(P.cgroup_memory_limit, root=root))
    cfg = load(str(cfg_file), db=str(tmp_path / "x.db"), shm_dir=str(tmp_path / "shm"),
               run_dir=str(tmp_path / "run"), **flags)
    return Daemon(cfg, Log(True), store=None)


def objective_of(d, exe):
    return d._objective_for(Program(key=exe, exe=exe, build_id="b", users="0", header={}), 4245).describe()


def test_which_objective_each_program_gets(tmp_path, monkeypatch):
    overrides = ['[programs."/usr/sbin/nginx"]', 'objective = "budget=256MiB"',
                 '[programs.batch-import]', 'objective = "lambda=2"', 'explore = false']
    # Nothing configured: the cgroup's limit (80% of it), else lambda=0.125.
    d = daemon(tmp_path, monkeypatch, 1 << 30, *overrides)
    assert objective_of(d, "/usr/bin/python3") == "time under 819.2 MiB"
    assert objective_of(d, "/usr/sbin/nginx") == "time under 256 MiB"          # by path: the override
    assert objective_of(d, "/opt/x/batch-import") == "time + 2/GiB"            # by base name
    d = daemon(tmp_path, monkeypatch, None, *overrides)
    assert objective_of(d, "/usr/bin/python3") == "time + 0.125/GiB"
    assert objective_of(d, "/usr/sbin/nginx") == "time under 256 MiB"
    # An objective configured for all (file or flag) wins over the cgroup, not over a program's own.
    d = daemon(tmp_path, monkeypatch, 1 << 30, 'objective = "lambda=0.5"', *overrides)
    assert objective_of(d, "/usr/bin/python3") == "time + 0.5/GiB"
    assert objective_of(d, "/usr/sbin/nginx") == "time under 256 MiB"
    d = daemon(tmp_path, monkeypatch, 1 << 30, 'objective = "lambda=0.5"', *overrides, objective="budget=1G")
    assert objective_of(d, "/usr/bin/python3") == "time under 1 GiB"
    assert objective_of(d, "/opt/x/batch-import") == "time + 2/GiB"
    with pytest.raises(ConfigError) as e:
        daemon(tmp_path, monkeypatch, None, '[programs.bad]', 'objective = "budget=lots"')
    assert str(e.value) == (f"{tmp_path / 'learnd.toml'}: bad: objective 'budget=lots': 'lots' is not a size "
                            "(examples: 4096, 512MiB, 2GiB)")


def test_learnd_tunes_a_program_for_its_own_objective(tmp_path):
    """End to end: learnd with a configuration file giving the workload a
    budget of its own and every other program a price; `hakmem status` and
    the stored evaluations name the workload's budget."""
    from test_learnd import Learnd, db_rows, finish
    cfg = tmp_path / "learnd.toml"
    cfg.write_text('objective = "lambda=0.5"\n[programs.workload]\nobjective = "budget=256MiB"\n')
    d = Learnd(tmp_path, "--learner", "gp", "--config", str(cfg))
    try:
        assert "objective time + 0.5/GiB, " in d.text()            # explicit: no cgroup fallback
        w = start(["burst", 64, 4000, scaled(6)], d.shm)
        ring_path(d.shm, w.pid)
        d.wait_log(f"process_started workload[{w.pid}]")
        r = subprocess.run([sys.executable, "-m", "hakmem", "status", "--json", "--run-dir", str(d.run)],
                           cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=scaled(30))
        st = json.loads(r.stdout)
        assert st["status"]["objective"] == "time + 0.5/GiB"
        assert [p["objective"] for p in st["programs"]] == ["time under 256 MiB"], st["programs"]
        finish(w)
        d.wait_log(f"process_exited workload[{w.pid}]")
    finally:
        assert d.stop() == 0, d.text()
    objectives = {o for (o,) in db_rows(d.db, "SELECT objective FROM evaluations")}
    assert objectives == {"time under 256 MiB"}, objectives
