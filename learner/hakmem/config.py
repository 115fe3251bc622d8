"""hakmem-learnd's configuration: defaults, a TOML file, command-line flags.

Read once at start. Precedence: flags over the file over the defaults.
Example (deploy/learnd.toml has a commented one):

    db = "/var/lib/hakmem/learn.db"
    shm_dir = "/dev/shm/hakmem"
    run_dir = "/run/hakmem"
    sample_period = 1.0          # seconds per window
    objective = "lambda=0.125"   # or "budget=512MiB"
    learner = "gp"
    explore = true

    [programs."/usr/sbin/nginx"]  # by executable path or base name
    objective = "budget=256MiB"
    explore = false
    learner = "missdriven"
"""
from __future__ import annotations

import dataclasses
import os
import tomllib

from .objective import DEFAULT_LAMBDA, Objective, ObjectiveError
from .ring import DEFAULT_DIR as DEFAULT_SHM_DIR


class ConfigError(Exception):
    """A configuration that cannot be used, with the reason in one line."""


def default_db() -> str:
    if os.environ.get("HAKMEM_DB"):
        return os.environ["HAKMEM_DB"]
    if os.geteuid() == 0:
        return "/var/lib/hakmem/learn.db"
    state = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return os.path.join(state, "hakmem", "learn.db")


def default_run_dir() -> str:
    if os.environ.get("HAKMEM_RUN_DIR"):
        return os.environ["HAKMEM_RUN_DIR"]
    if os.geteuid() == 0:
        return "/run/hakmem"
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return os.path.join(xdg, "hakmem") if xdg else f"/tmp/hakmem-{os.geteuid()}"


@dataclasses.dataclass(frozen=True)
class ProgramConfig:
    objective: Objective | None = None   # None: the global one (or the cgroup's limit)
    learner: str | None = None
    explore: bool | None = None


@dataclasses.dataclass(frozen=True)
class Config:
    db: str = dataclasses.field(default_factory=default_db)
    shm_dir: str = DEFAULT_SHM_DIR
    run_dir: str = dataclasses.field(default_factory=default_run_dir)
    sample_period: float = 1.0          # seconds per window
    discover_period: float = 0.1        # seconds between looks at the telemetry directory
    objective: Objective = Objective(lam=DEFAULT_LAMBDA)
    objective_explicit: bool = False    # False: a cgroup memory limit may override it per process
    learner: str = "gp"
    explore: bool = True
    programs: dict = dataclasses.field(default_factory=dict)   # exe path or base name -> ProgramConfig
    retain_every: float = 600.0         # seconds between retention passes
    raw_hours: float = 6.0              # windows kept as sampled before being merged per minute
    keep_days: float = 30.0
    max_windows: int = 500_000

    def for_program(self, exe: str) -> ProgramConfig:
        return self.programs.get(exe) or self.programs.get(os.path.basename(exe)) or ProgramConfig()


_KEYS = {"db": str, "shm_dir": str, "run_dir": str, "sample_period": float, "discover_period": float,
         "objective": str, "learner": str, "explore": bool, "retain_every": float, "raw_hours": float,
         "keep_days": float, "max_windows": int}


def _objective(text, where):
    try:
        return Objective.parse(text)
    except ObjectiveError as e:
        raise ConfigError(f"{where}: {e}") from None


def load(path: str | None = None, **flags) -> Config:
    """The file at path (if any), then flags that are not None."""
    values: dict = {}
    programs: dict = {}
    if path:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except OSError as e:
            raise ConfigError(f"cannot read {path}: {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from None
        for k, v in data.items():
            if k == "programs":
                if not isinstance(v, dict):
                    raise ConfigError(f"{path}: [programs] must be a table of tables")
                for exe, over in v.items():
                    if not isinstance(over, dict):
                        raise ConfigError(f"{path}: [programs.\"{exe}\"] must be a table")
                    unknown = set(over) - {"objective", "learner", "explore"}
                    if unknown:
                        raise ConfigError(f"{path}: [programs.\"{exe}\"]: unknown key {sorted(unknown)[0]!r}")
                    programs[exe] = ProgramConfig(
                        objective=_objective(over["objective"], f"{path}: {exe}") if "objective" in over else None,
                        learner=over.get("learner"), explore=over.get("explore"))
                continue
            if k not in _KEYS:
                raise ConfigError(f"{path}: unknown key {k!r} (known: {', '.join(sorted(_KEYS))}, programs)")
            want = _KEYS[k]
            if want is float and isinstance(v, int) and not isinstance(v, bool):
                v = float(v)
            if not isinstance(v, want) or (want is not bool and isinstance(v, bool)):
                raise ConfigError(f"{path}: {k} must be a {want.__name__}, got {v!r}")
            values[k] = v
    values.update({k: v for k, v in flags.items() if v is not None})
    explicit = "objective" in values
    if "objective" in values:
        values["objective"] = _objective(values["objective"], path or "--objective")
    values["objective_explicit"] = explicit
    for k in ("sample_period", "discover_period"):
        if k in values and not 0.01 <= values[k] <= 3600:
            raise ConfigError(f"{k} must be between 0.01 and 3600 seconds, got {values[k]}")
    for k in ("db", "shm_dir", "run_dir"):
        if k in values:
            values[k] = os.path.abspath(os.path.expanduser(values[k]))
    return Config(programs=programs, **values)
