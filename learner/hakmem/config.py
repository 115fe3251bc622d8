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
    pool_users = ["root", "postgres"]   # users whose processes share what is learned
    fleet = "postgresql://hakmem_host_web1@db.example/hakmem"   # share with other hosts (fleet.py)

    [programs."/usr/sbin/nginx"]  # by executable path or base name
    objective = "budget=256MiB"
    explore = false
    learner = "missdriven"
"""
from __future__ import annotations

import dataclasses
import os
import pwd
import re
import tomllib

from .objective import DEFAULT_LAMBDA, Objective, ObjectiveError
from .ring import DEFAULT_DIR as DEFAULT_SHM_DIR


class ConfigError(Exception):
    """A configuration that cannot be used, with the reason in one line."""


# ---- users: who a program is learned for ------------------------------------
# A program is learned per user: (executable, build id, users), users being the
# uid of its processes as a decimal string ("1000"). Users named in pool_users
# share one program whose users are their uids sorted, joined by commas
# ("0,101"). Evidence from one user never changes the policy another user's
# processes get, unless the configuration pools them (issue 10, finding 4).
UID_MAX = 2**32 - 2          # (uid_t)-1 means "no uid"


def parse_users(items, where: str) -> tuple[int, ...]:
    """uids named by user names or decimal numbers (an iterable, or one string
    of them separated by commas), sorted, each once. ConfigError when a name
    is not a user here or a number is not a uid."""
    if isinstance(items, str):
        items = [x for x in (t.strip() for t in items.split(",")) if x]
    out = set()
    for x in items:
        if isinstance(x, bool) or not isinstance(x, (int, str)):
            raise ConfigError(f"{where}: a user is a name or a uid, got {x!r}")
        if isinstance(x, str) and x.strip().isascii() and x.strip().isdigit():
            x = int(x)
        if isinstance(x, int):
            if not 0 <= x <= UID_MAX:
                raise ConfigError(f"{where}: {x} is not a uid")
            out.add(x)
            continue
        try:
            out.add(pwd.getpwnam(x.strip()).pw_uid)
        except KeyError:
            raise ConfigError(f"{where}: no user named {x!r} on this machine") from None
    return tuple(sorted(out))


def users_text(uids) -> str:
    """A program's users: the uids sorted, joined by commas ("0,101")."""
    return ",".join(str(u) for u in sorted(set(int(u) for u in uids)))


def users_names(users: str) -> str:
    """A program's users for a person: names joined by commas ("root,postgres"),
    the number where a uid has no name here; "" for no users."""
    out = []
    for u in users.split(",") if users else ():
        try:
            out.append(pwd.getpwuid(int(u)).pw_name)
        except (KeyError, ValueError, OverflowError):
            out.append(u)
    return ",".join(out)


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
    pool_users: tuple = ()              # uids, sorted: their processes share one program
    metrics: str | None = None          # Prometheus endpoint, HOST:PORT ("": 127.0.0.1:9711); None: off
    screen: bool = True                 # rank a cold program's candidates by replaying a trace of it (screen.py)
    screen_jobs: int = 24               # at most this many replays at once while screening; fewer where memory is short (screen.py jobs_for)
    fleet: str | None = None            # PostgreSQL URL of the fleet store (fleet.py); None: this host learns alone
    fleet_pull: float = 5.0             # seconds between pulls of the fleet's offers
    fleet_class: str | None = None      # the host's hardware class; None: from its CPUs and memory (fleet.hw_class)
    fleet_k: int = 3                    # `hakmem fleet migrate`: hosts that must agree before a policy is offered
    fleet_canary: float = 0.10          # `hakmem fleet migrate`: the share of a class's hosts that get it first

    def for_program(self, exe: str) -> ProgramConfig:
        return self.programs.get(exe) or self.programs.get(os.path.basename(exe)) or ProgramConfig()

    def users_key(self, uid: int) -> str:
        """The `users` of the program a process of uid belongs to: the pooled
        uids ("0,101") when uid is pooled, else the uid ("1000")."""
        uid = int(uid)
        return users_text(self.pool_users) if uid in self.pool_users else str(uid)


_KEYS = {"db": str, "shm_dir": str, "run_dir": str, "sample_period": float, "discover_period": float,
         "objective": str, "learner": str, "explore": bool, "retain_every": float, "raw_hours": float,
         "keep_days": float, "max_windows": int, "metrics": str, "screen": bool, "screen_jobs": int,
         "fleet": str, "fleet_pull": float, "fleet_class": str, "fleet_k": int, "fleet_canary": float}


def _objective(text, where):
    try:
        return Objective.parse(text)
    except ObjectiveError as e:
        raise ConfigError(f"{where}: {e}") from None


def load(path: str | None = None, **flags) -> Config:
    """The file at path (if any), then flags that are not None. pool_users:
    names or uids separated by commas ("root,postgres"; "" pools nobody)."""
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
            if k == "pool_users":
                if not isinstance(v, list):
                    raise ConfigError(f"{path}: pool_users must be a list of user names or uids, got {v!r}")
                values[k] = parse_users(v, f"{path}: pool_users")
                continue
            if k not in _KEYS:
                raise ConfigError(f"{path}: unknown key {k!r} (known: {', '.join(sorted(_KEYS))}, "
                                  f"pool_users, programs)")
            want = _KEYS[k]
            if want is float and isinstance(v, int) and not isinstance(v, bool):
                v = float(v)
            if not isinstance(v, want) or (want is not bool and isinstance(v, bool)):
                raise ConfigError(f"{path}: {k} must be a {want.__name__}, got {v!r}")
            values[k] = v
    values.update({k: v for k, v in flags.items() if v is not None})
    if flags.get("pool_users") is not None:
        values["pool_users"] = parse_users(flags["pool_users"], "--pool-users")
    explicit = "objective" in values
    if "objective" in values:
        values["objective"] = _objective(values["objective"], path or "--objective")
    values["objective_explicit"] = explicit
    for k in ("sample_period", "discover_period"):
        if k in values and not 0.01 <= values[k] <= 3600:
            raise ConfigError(f"{k} must be between 0.01 and 3600 seconds, got {values[k]}")
    if "screen_jobs" in values and not 1 <= values["screen_jobs"] <= 64:
        raise ConfigError(f"{path}: screen_jobs must be between 1 and 64, got {values['screen_jobs']}")
    at = f"{path}: " if path else ""
    if "fleet_pull" in values and not 0.1 <= values["fleet_pull"] <= 3600:
        raise ConfigError(f"{at}fleet_pull must be between 0.1 and 3600 seconds, got {values['fleet_pull']}")
    if "fleet_k" in values and not 1 <= values["fleet_k"] <= 10_000:
        raise ConfigError(f"{at}fleet_k must be between 1 and 10000 hosts, got {values['fleet_k']}")
    if "fleet_canary" in values and not 0.0 <= values["fleet_canary"] <= 1.0:
        raise ConfigError(f"{at}fleet_canary must be a fraction between 0 and 1, got {values['fleet_canary']}")
    if values.get("fleet") is not None and not re.match(r"^postgres(ql)?://", values["fleet"]):
        # Not the text itself: a URL may hold a password.
        raise ConfigError(f"{at}fleet must be a PostgreSQL URL (postgresql://ROLE@HOST/DB)")
    if values.get("metrics") is not None:
        from .metrics import MetricsError, parse_addr
        try:
            parse_addr(values["metrics"])
        except MetricsError as e:
            raise ConfigError(str(e) if flags.get("metrics") is not None else f"{path}: {e}") from None
    for k in ("db", "shm_dir", "run_dir"):
        if k in values:
            values[k] = os.path.abspath(os.path.expanduser(values[k]))
    return Config(programs=programs, **values)
