"""hakmem-learnd's configuration (config.py): the defaults, a TOML file,
flags over the file, and a one-line error for every value that cannot be
used, naming the key (and the file, for what only a file can get wrong)."""
import os

import pytest

from conftest import ROOT
from hakmem import daemon
from hakmem.config import Config, ConfigError, ProgramConfig, default_db, default_run_dir, load
from hakmem.objective import Objective


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    for k in ("HAKMEM_DB", "HAKMEM_RUN_DIR", "XDG_STATE_HOME", "XDG_RUNTIME_DIR"):
        monkeypatch.delenv(k, raising=False)


def test_defaults(monkeypatch):
    c = load()
    assert c == Config()
    assert (c.shm_dir, c.sample_period, c.discover_period, c.learner, c.explore) == \
        ("/dev/shm/hakmem", 1.0, 0.1, "gp", True)
    assert c.objective == Objective(lam=0.125) and not c.objective_explicit
    assert (c.retain_every, c.raw_hours, c.keep_days, c.max_windows) == (600.0, 6.0, 30.0, 500_000)
    assert c.programs == {} and c.pool_users == ()
    if os.geteuid() == 0:
        assert (c.db, c.run_dir) == ("/var/lib/hakmem/learn.db", "/run/hakmem")
    else:
        assert c.db == os.path.expanduser("~/.local/state/hakmem/learn.db")
        assert c.run_dir == f"/tmp/hakmem-{os.geteuid()}"


def test_default_paths_follow_the_environment(monkeypatch):
    monkeypatch.setenv("HAKMEM_DB", "/srv/h/learn.db")
    monkeypatch.setenv("HAKMEM_RUN_DIR", "/srv/h/run")
    assert (default_db(), default_run_dir()) == ("/srv/h/learn.db", "/srv/h/run")
    assert (load().db, load().run_dir) == ("/srv/h/learn.db", "/srv/h/run")
    monkeypatch.delenv("HAKMEM_DB")
    monkeypatch.delenv("HAKMEM_RUN_DIR")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setenv("XDG_STATE_HOME", "/home/u/.state")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    assert (default_db(), default_run_dir()) == ("/home/u/.state/hakmem/learn.db", "/run/user/1000/hakmem")


def test_deploy_example_is_valid_and_all_defaults():
    assert load(str(ROOT / "deploy" / "learnd.toml")) == Config()


def test_a_file_sets_every_key_and_flags_win(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    f = tmp_path / "learnd.toml"
    f.write_text('db = "~/h/learn.db"\nshm_dir = "shm"\nrun_dir = "/run/h"\nsample_period = 2\n'
                 'discover_period = 0.5\nobjective = "budget=1GiB"\nlearner = "missdriven"\nexplore = false\n'
                 'retain_every = 60\nraw_hours = 1.5\nkeep_days = 7\nmax_windows = 1000\n'
                 'pool_users = ["root", 0]\n'
                 '[programs."/usr/sbin/nginx"]\nobjective = "lambda=1"\nexplore = true\n'
                 '[programs.batch]\nlearner = "static"\n')
    c = load(str(f))
    assert c.db == os.path.expanduser("~/h/learn.db") and c.shm_dir == str(tmp_path / "shm")
    assert c.run_dir == "/run/h"
    assert c.sample_period == 2.0 and isinstance(c.sample_period, float) and c.discover_period == 0.5
    assert c.objective == Objective(budget_bytes=1 << 30) and c.objective_explicit
    assert (c.learner, c.explore, c.retain_every, c.raw_hours, c.keep_days, c.max_windows) == \
        ("missdriven", False, 60.0, 1.5, 7.0, 1000)
    assert c.pool_users == (0,)
    assert c.programs == {"/usr/sbin/nginx": ProgramConfig(objective=Objective(lam=1.0), explore=True),
                          "batch": ProgramConfig(learner="static")}
    assert c.for_program("/usr/sbin/nginx").objective == Objective(lam=1.0)
    assert c.for_program("/opt/bin/batch").learner == "static"          # by base name
    assert c.for_program("/usr/bin/other") == ProgramConfig()
    # Flags over the file; a flag left out (None) keeps the file's value.
    c = load(str(f), sample_period=0.25, objective="lambda=3", learner=None, explore=True, pool_users="")
    assert (c.sample_period, c.objective, c.learner, c.explore, c.pool_users) == \
        (0.25, Objective(lam=3.0), "missdriven", True, ())


def test_an_objective_flag_alone_is_explicit():
    assert load(objective="lambda=0.125").objective_explicit
    assert not load(objective=None).objective_explicit


@pytest.mark.parametrize("text, why", [
    ("sample_period = 'fast'", "sample_period must be a float, got 'fast'"),
    ("sample_period = 0.001", None),
    ("discover_period = 7200", None),
    ("max_windows = 1.5", "max_windows must be a int, got 1.5"),
    ("max_windows = true", "max_windows must be a int, got True"),
    ("explore = 'no'", "explore must be a bool, got 'no'"),
    ("learner = 3", "learner must be a str, got 3"),
    ("objective = 'budget=lots'", "objective 'budget=lots': 'lots' is not a size (examples: 4096, 512MiB, 2GiB)"),
    ("sampel_period = 1", "unknown key 'sampel_period' (known: db, discover_period, explore, fleet, fleet_canary, "
                          "fleet_class, fleet_k, fleet_pull, keep_days, learner, max_windows, metrics, objective, "
                          "raw_hours, retain_every, run_dir, sample_period, screen, screen_jobs, shm_dir, "
                          "pool_users, programs)"),
    ("fleet = 'mysql://u:secret@h/db'", "fleet must be a PostgreSQL URL (postgresql://ROLE@HOST/DB)"),
    ("fleet_pull = 0", "fleet_pull must be between 0.1 and 3600 seconds, got 0.0"),
    ("fleet_k = 0", "fleet_k must be between 1 and 10000 hosts, got 0"),
    ("fleet_canary = 1.5", "fleet_canary must be a fraction between 0 and 1, got 1.5"),
    ("fleet_class = 3", "fleet_class must be a str, got 3"),
    ("screen_jobs = 0", "screen_jobs must be between 1 and 64, got 0"),
    ("screen = 1", "screen must be a bool, got 1"),
    ("metrics = 'somewhere:80'", "metrics address 'somewhere:80': 'somewhere' is not an IP address"),
    ("pool_users = 'root'", "pool_users must be a list of user names or uids, got 'root'"),
    ("pool_users = ['no-such-user-hk']", "pool_users: no user named 'no-such-user-hk' on this machine"),
    ("programs = 3", "[programs] must be a table of tables"),
    ("[programs]\nnginx = 3", "[programs.\"nginx\"] must be a table"),
    ("[programs.nginx]\nobjectiv = 'lambda=1'", "[programs.\"nginx\"]: unknown key 'objectiv'"),
    ("[programs.nginx]\nobjective = 'speed=1'", "nginx: objective 'speed=1': expected lambda=N or budget=SIZE"),
    ("sample_period = ", None),
])
def test_bad_values_are_one_line_errors_naming_the_file(tmp_path, text, why):
    f = tmp_path / "bad.toml"
    f.write_text(text + "\n")
    with pytest.raises(ConfigError) as e:
        load(str(f))
    msg = str(e.value)
    assert "\n" not in msg
    if text.startswith("sample_period = 0.001"):
        assert msg == "sample_period must be between 0.01 and 3600 seconds, got 0.001"
    elif text.startswith("discover_period"):
        assert msg == "discover_period must be between 0.01 and 3600 seconds, got 7200.0"
    elif why is None:
        assert msg.startswith(f"{f}: not valid TOML: "), msg
    else:
        assert msg == f"{f}: {why}"


def test_a_missing_file(tmp_path):
    with pytest.raises(ConfigError) as e:
        load(str(tmp_path / "absent.toml"))
    assert str(e.value) == f"cannot read {tmp_path / 'absent.toml'}: No such file or directory"


def test_flag_values_are_checked_too():
    with pytest.raises(ConfigError) as e:
        load(sample_period=0)
    assert str(e.value) == "sample_period must be between 0.01 and 3600 seconds, got 0"
    with pytest.raises(ConfigError) as e:
        load(objective="budget=-5")
    assert str(e.value) == "--objective: objective 'budget=-5': '-5' is not a size (examples: 4096, 512MiB, 2GiB)"
    with pytest.raises(ConfigError) as e:
        load(pool_users="root,no-such-user-hk")
    assert str(e.value) == "--pool-users: no user named 'no-such-user-hk' on this machine"


def test_learnd_says_a_bad_configuration_in_one_line_and_exits_1(tmp_path, capsys):
    f = tmp_path / "bad.toml"
    f.write_text("keep_days = 'forever'\n")
    assert daemon.main(["--config", str(f)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err == f"hakmem-learnd: error: {f}: keep_days must be a float, got 'forever'\n"
