"""Everything hakmem-learnd and the CLI read from /proc: a process's counters
and resident memory, its uids and start time, its cgroup's memory limit, and
its program identity.

Every reader takes a pid and returns None when the process is gone or cannot
be read, never raising for that: a process may exit between any two reads.

A program's identity is its executable and build, read from /proc/<pid>/exe,
never from the telemetry file (its writer could claim anything). The build is
the ELF GNU build id when the executable has one; otherwise its size and
modification time, which change whenever the file is replaced.
"""
from __future__ import annotations

import os
import struct

PAGE = os.sysconf("SC_PAGE_SIZE")


# ---- a process's figures ---------------------------------------------------------
def proc_stat(pid: int) -> dict | None:
    """ppid, minflt, majflt, utime/stime and the waited-for children's
    cutime/cstime (seconds), cpu_ticks (utime + stime in clock ticks, for
    differences: cpu_seconds_between), threads, start_time; None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        rest = data[data.rindex(b")") + 2:].split()   # from the 3rd field on, whatever the name holds
        hz = os.sysconf("SC_CLK_TCK")
        return {"ppid": int(rest[1]), "minflt": int(rest[7]), "majflt": int(rest[9]),
                "utime": int(rest[11]) / hz, "stime": int(rest[12]) / hz,
                "cutime": int(rest[13]) / hz, "cstime": int(rest[14]) / hz,
                "cpu_ticks": int(rest[11]) + int(rest[12]), "hz": hz,
                "threads": int(rest[17]), "start_time": int(rest[19])}
    except (OSError, ValueError, IndexError):
        return None


def cpu_seconds_between(prev: dict, cur: dict) -> float:
    """The CPU seconds (user + system) a process spent between two
    proc_stat readings: 0.0 exactly when its tick count did not move. In
    seconds each, (0.31 + 0.05) - (0.30 + 0.06) came out 6.9e-17, not 0: a
    block of windows with "some" CPU that a ratio of CPU per allocation
    then put at 10^14 times another's (learnd logged "+72347243275562256%"
    and rolled a trial back on it)."""
    return max(cur["cpu_ticks"] - prev["cpu_ticks"], 0) / cur["hz"]


def proc_children(pid: int) -> list[int]:
    """The live processes whose parent is pid (a server's backends)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = proc_stat(int(d))
            if st is not None and st["ppid"] == pid:
                out.append(int(d))
    return out


def proc_descendants(pid: int) -> list[int]:
    """pid and its live descendants, through /proc/PID/task/TID/children
    (a process tree's own links: no walk of all of /proc per call)."""
    out, pending = [], [pid]
    while pending:
        p = pending.pop()
        out.append(p)
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    pending.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return out


def proc_start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (clock ticks since boot), or None when the
    process is gone: with the pid, what names one process for its whole life."""
    st = proc_stat(pid)
    return st["start_time"] if st else None


def proc_uids(pid: int) -> tuple[int, int, int, int] | None:
    """(real, effective, saved, filesystem) uids of a process, or None if gone.
    Not the owner of /proc/<pid>: that is root for a non-dumpable process."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    r, e, s, fs = (int(x) for x in line.split()[1:5])
                    return r, e, s, fs
    except (OSError, ValueError):
        return None
    return None


def proc_rss(pid: int) -> int | None:
    """Resident bytes (/proc/<pid>/statm), or None if the process is gone."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return None


def cgroup_memory_limit(pid: int, root: str = "/sys/fs/cgroup") -> int | None:
    """The tightest memory.max (cgroup v2) above the process, or None."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    path = next((ln.split(":", 2)[2] for ln in lines if ln.startswith("0::")), None)
    if path is None:
        return None
    best = None
    parts = [p for p in path.split("/") if p]
    for i in range(len(parts), 0, -1):
        try:
            with open(os.path.join(root, *parts[:i], "memory.max")) as f:
                v = f.read().strip()
        except OSError:
            continue
        if v != "max":
            best = int(v) if best is None else min(best, int(v))
    return best


# ---- program identity -----------------------------------------------------------
NT_GNU_BUILD_ID = 3
PT_NOTE = 4


def elf_build_id(path: str) -> str | None:
    """The GNU build id of an ELF file as hex, or None."""
    try:
        with open(path, "rb") as f:
            ident = f.read(64)
            if len(ident) < 64 or ident[:4] != b"\x7fELF":
                return None
            is64, little = ident[4] == 2, ident[5] == 1
            e = "<" if little else ">"
            if is64:
                phoff, = struct.unpack_from(e + "Q", ident, 32)
                phentsize, phnum = struct.unpack_from(e + "HH", ident, 54)
            else:
                phoff, = struct.unpack_from(e + "I", ident, 28)
                phentsize, phnum = struct.unpack_from(e + "HH", ident, 42)
            if phnum > 256 or phentsize < (56 if is64 else 32):
                return None
            f.seek(phoff)
            table = f.read(phentsize * phnum)
            for i in range(phnum):
                ph = table[i * phentsize:(i + 1) * phentsize]
                if len(ph) < phentsize:
                    return None
                if struct.unpack_from(e + "I", ph, 0)[0] != PT_NOTE:
                    continue
                if is64:
                    off, = struct.unpack_from(e + "Q", ph, 8)
                    size, = struct.unpack_from(e + "Q", ph, 32)
                else:
                    off, = struct.unpack_from(e + "I", ph, 4)
                    size, = struct.unpack_from(e + "I", ph, 16)
                if size > 1 << 16:
                    continue
                f.seek(off)
                notes = f.read(size)
                pos = 0
                while pos + 12 <= len(notes):
                    namesz, descsz, ntype = struct.unpack_from(e + "III", notes, pos)
                    pos += 12
                    name = notes[pos:pos + namesz]
                    pos += (namesz + 3) & ~3
                    desc = notes[pos:pos + descsz]
                    pos += (descsz + 3) & ~3
                    if ntype == NT_GNU_BUILD_ID and name.rstrip(b"\0") == b"GNU" and desc:
                        return desc.hex()
    except (OSError, struct.error):
        return None
    return None


# File systems whose reads another user's process can stall at will (a FUSE
# server is an ordinary program); learnd never opens an executable on one.
STALLABLE = ("fuse", "fuseblk", "fuse.")


def mount_fstype(pid: int, path: str) -> str | None:
    """The file system type of the mount that holds path, as process pid
    sees its mounts (/proc/<pid>/mountinfo: reading it touches no file
    system of the process's choosing)."""
    best, fstype = -1, None
    try:
        with open(f"/proc/{pid}/mountinfo", "rb") as f:
            for line in f:
                left, _, right = line.partition(b" - ")
                fields = left.split()
                if len(fields) < 5 or not right:
                    continue
                mnt = fields[4].decode("utf-8", "replace").replace("\\040", " ")
                inside = path == mnt or path.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) > best:
                    best, fstype = len(mnt), right.split()[0].decode("utf-8", "replace")
    except OSError:
        return None
    return fstype


def program_identity(pid: int) -> tuple[str, str] | None:
    """(executable path, build identity) of a live process, or None if gone
    or not readable (another user's process when we are not root).

    readlink of /proc/<pid>/exe touches no file system; stat and open of it
    reach the executable's, which for a program run from a FUSE mount is
    another program that can stall them for ever. Such an executable is
    identified by its path alone ("unverified")."""
    link = f"/proc/{pid}/exe"
    try:
        exe = os.readlink(link)
    except OSError:
        return None
    exe = exe.removesuffix(" (deleted)")
    fstype = mount_fstype(pid, exe)
    if fstype is None or fstype.startswith(STALLABLE):
        return exe, f"unverified:{fstype or 'unknown'}"
    try:
        st = os.stat(link)
    except OSError:
        return None
    bid = elf_build_id(link)
    return exe, bid if bid else f"stat:{st.st_size}:{int(st.st_mtime)}"
