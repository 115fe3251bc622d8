"""Reading a process's telemetry file and writing policy snapshots into it.

The file is <dir>/<pid>-<starttime> (schemas/shm_layout.json). A file is
believed only when its owner is the owner of the live process it names;
the program's identity comes from /proc/<pid>/exe, never from the file.

Every failure is a RingError whose message is one line meant for a person.
"""
import errno
import os
import re
import stat
import time

import numpy as np

from . import layout as L
from .knobs import PER_CLASS, PER_PROCESS, Bounds, Knobs, KnobsError
from .procfs import proc_start_time, proc_uids

DEFAULT_DIR = "/dev/shm/hakmem"
REJECT_REASONS = {0: "none", 1: "slot version mismatch", 2: "bad checksum", 3: "value out of bounds"}
_NAME = re.compile(r"^(\d+)-(\d+)$")


class RingError(Exception):
    """A telemetry file that cannot be used, with the reason in one line."""


def shm_dir(explicit=None):
    return explicit or os.environ.get("HAKMEM_SHM_DIR") or DEFAULT_DIR


def resolve(target, directory=None):
    """A path, or a pid whose file is looked up in the telemetry directory."""
    if isinstance(target, int) or (isinstance(target, str) and target.isdigit()):
        pid = int(target)
        d = shm_dir(directory)
        try:
            names = [n for n in os.listdir(d) if n.startswith(f"{pid}-") and _NAME.match(n)]
        except OSError as e:
            raise RingError(f"cannot list {d}: {e.strerror}") from None
        if not names:
            raise RingError(f"no telemetry file for pid {pid} in {d}")
        # The live process's own file: anyone can make files named after
        # another's pid with some other start time. A process that is gone
        # has only stale files left; the newest is the last image's.
        start = proc_start_time(pid)
        if start is not None:
            if f"{pid}-{start}" not in names:
                raise RingError(f"no telemetry file for the running process {pid} in {d} "
                                f"(only files of earlier processes with that pid)")
            return os.path.join(d, f"{pid}-{start}")
        names.sort(key=lambda n: int(n.split("-")[1]))
        return os.path.join(d, names[-1])
    return str(target)


def fnv1a64(data, h=0xCBF29CE484222325):
    # numpy has no FNV; ~750 bytes per slot keeps a plain loop cheap.
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def slot_checksum(slot_bytes):
    """FNV-1a 64 of the version (8 bytes) then the slot after the checksum."""
    version = slot_bytes[0:8]
    body = slot_bytes[L.offset_of("policy_slot", "checksum") + 8:L.POLICY_SLOT.itemsize]
    return fnv1a64(body, fnv1a64(version))


def encode_slot(pol, version, checksum=None):
    """The bytes of a policy slot carrying pol (Knobs, or its dict form) as
    `version`, with its checksum (or the one given: tests forge wrong ones)."""
    slot = np.zeros(1, dtype=L.POLICY_SLOT)
    slot["version"] = version
    for k, v in Knobs.of(pol).items():
        slot[k] = v
    b = bytearray(slot.tobytes())
    b[8:16] = (slot_checksum(bytes(b)) if checksum is None else checksum).to_bytes(8, "little")
    return bytes(b)


# Bounds on what a header may claim before we believe it: a hostile file
# must not make a reader allocate or read without limit.
MAX_SLOTS = 1 << 16
MAX_FILE = L.HEADER_SIZE + MAX_SLOTS * L.RECORD.itemsize + L.POLICY_AREA.itemsize + (1 << 16)


class Ring:
    """One telemetry file, read with pread and written with pwrite.

    Never mapped: the file's owner can truncate it at any moment, and a
    mapping of a truncated file kills its reader with SIGBUS. A short read
    is a RingError instead. The file is opened without following links and
    without blocking (a FIFO under the name would hang a plain open), and
    only a regular file is read."""

    def __init__(self, path, writable=False, trust=True):
        self.path = path
        self.fd = -1
        flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(path, flags)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise RingError(f"{path}: is a symbolic link, not a telemetry file") from None
            raise RingError(f"{path}: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise RingError(f"{path}: not a regular file")
            self.file_uid = st.st_uid
            self.size = st.st_size
            if self.size < L.HEADER_SIZE:
                raise RingError(f"{path}: truncated: {self.size} bytes, smaller than the {L.HEADER_SIZE}-byte header")
            if self.size > MAX_FILE:
                raise RingError(f"{path}: {self.size} bytes is larger than any telemetry file")
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.writable = writable
        try:
            self._validate()
            self.alive = proc_start_time(self.pid) == self.start_time
            if trust and self.alive:
                uids = proc_uids(self.pid)
                if uids is not None and self.file_uid != uids[1]:
                    raise RingError(f"{path}: owned by uid {self.file_uid} but process {self.pid} runs as "
                                    f"uid {uids[1]}: not trusted")
                if proc_start_time(self.pid) != self.start_time:   # the pid was reused while we looked
                    self.alive = False
        except BaseException:
            self.close()
            raise

    # ---- raw access ------------------------------------------------------------
    def read(self, offset, n) -> bytes:
        """n bytes at offset; a file cut shorter than that is a RingError."""
        try:
            b = os.pread(self.fd, n, offset)
        except OSError as e:
            raise RingError(f"{self.path}: {e.strerror}") from None
        if len(b) != n:
            raise RingError(f"{self.path}: truncated while being read ({offset + len(b)} of {offset + n} bytes)")
        return b

    def write(self, offset, data):
        """Writes data at offset (policy slots; tests forge bytes with it)."""
        if not self.writable:
            raise RingError(f"{self.path}: opened read-only")
        try:
            n = os.pwrite(self.fd, data, offset)
        except OSError as e:
            raise RingError(f"{self.path}: {e.strerror}") from None
        if n != len(data):
            raise RingError(f"{self.path}: short write ({n} of {len(data)} bytes)")

    def _read_u64(self, offset):
        return int.from_bytes(self.read(offset, 8), "little")

    def _validate(self):
        raw = self.read(0, L.HEADER_SIZE)
        h = np.frombuffer(raw, dtype=L.HEADER, count=1)[0]
        if raw[0:8] != L.MAGIC:
            raise RingError(f"{self.path}: not a hakmem telemetry file (bad magic)")
        v = int(h["layout_version"])
        if v > L.LAYOUT_VERSION:
            raise RingError(f"{self.path}: layout version {v} is newer than this reader's "
                            f"({L.LAYOUT_VERSION}); use the hakmem that matches the allocator")
        if v < L.LAYOUT_VERSION:
            raise RingError(f"{self.path}: layout version {v} is older than this reader's ({L.LAYOUT_VERSION})")
        expect = {"header_size": L.HEADER_SIZE, "record_size": L.RECORD.itemsize,
                  "policy_size": L.POLICY_AREA.itemsize, "num_classes": L.NUM_CLASSES,
                  "ring_offset": L.HEADER_SIZE}
        for field, want in expect.items():
            if int(h[field]) != want:
                raise RingError(f"{self.path}: header says {field}={int(h[field])}, layout says {want}")
        slots = int(h["ring_slots"])
        need = L.HEADER_SIZE + slots * L.RECORD.itemsize + L.POLICY_AREA.itemsize
        if not 0 < slots <= MAX_SLOTS or int(h["policy_offset"]) != L.HEADER_SIZE + slots * L.RECORD.itemsize:
            raise RingError(f"{self.path}: inconsistent ring geometry ({slots} slots, policy at "
                            f"{int(h['policy_offset'])})")
        if int(h["file_size"]) != self.size or self.size < need:
            raise RingError(f"{self.path}: truncated: {self.size} bytes, header says {int(h['file_size'])}")
        self.pid = int(h["pid"])
        self.start_time = int(h["start_time"])
        self.slots = slots
        self.ring_offset = L.HEADER_SIZE
        self.policy_offset = int(h["policy_offset"])
        m = _NAME.match(os.path.basename(self.path))
        if m and (int(m.group(1)), int(m.group(2))) != (self.pid, self.start_time):
            raise RingError(f"{self.path}: name does not match the header (pid {self.pid}, "
                            f"start time {self.start_time})")

    def close(self):
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- header ---------------------------------------------------------------
    def header(self):
        h = np.frombuffer(self.read(0, L.HEADER_SIZE), dtype=L.HEADER, count=1)[0]
        out = {}
        for name in L.HEADER.names:
            if name.startswith("_"):
                continue
            v = h[name]
            if isinstance(v, bytes):
                out[name] = v.split(b"\0", 1)[0].decode("utf-8", "replace")
            elif np.ndim(v):
                out[name] = [int(x) for x in v]
            else:
                out[name] = int(v)
        return out

    def ring_head(self):
        return self._read_u64(L.offset_of("header", "ring_head"))

    def exited(self):
        o = L.offset_of("header", "state")
        return int.from_bytes(self.read(o, 4), "little") == 1

    # ---- records --------------------------------------------------------------
    def _stable(self, slot, head):
        """Slot's record if it is stable and belongs to the ring as of head,
        else None. Seqlock read: sequence, record, sequence, each its own
        pread, so the kernel entry between them orders the loads."""
        size = L.RECORD.itemsize
        off = self.ring_offset + slot * size
        seq = self._read_u64(off)
        if seq % 2 or seq == 0:
            return None
        rec = np.frombuffer(self.read(off, size), dtype=L.RECORD)[0].copy()
        if self._read_u64(off) != seq or int(rec["seq"]) != seq:
            return None
        idx = int(rec["index"])
        if not (idx < head and idx + self.slots >= head and idx % self.slots == slot):
            return None
        return rec

    def records(self):
        """Every stable record still in the ring, oldest first (numpy array)."""
        head = self.ring_head()
        got = [r for r in (self._stable(s, head) for s in range(min(head, self.slots))) if r is not None]
        if not got:
            return np.zeros(0, dtype=L.RECORD)
        out = np.array(got, dtype=L.RECORD)
        return out[np.argsort(out["index"], kind="stable")]

    def latest(self):
        """The newest stable record, or None. Reads one slot (8 KiB), not the
        whole ring: this is what a sampler calls every window. A slot being
        written is passed over for the one before it; a writer that keeps
        every slot unstable (nobody honest does, records come an epoch
        apart) gets None after a few reads, not a walk of the ring."""
        for _ in range(3):
            head = self.ring_head()
            if head == 0:
                return None
            for back in (1, 2):
                if back <= min(head, self.slots):
                    rec = self._stable((head - back) % self.slots, head)
                    if rec is not None:
                        return rec
        return None

    # ---- policy ---------------------------------------------------------------
    def _slot_bytes(self, which):
        base = self.policy_offset
        if which == "in_force":
            off = base + L.offset_of("policy_area", "in_force")
        else:
            off = base + L.offset_of("policy_area", "slot") + which * L.POLICY_SLOT.itemsize
        return off, self.read(off, L.POLICY_SLOT.itemsize)

    @staticmethod
    def slot_to_policy(b):
        s = np.frombuffer(b, dtype=L.POLICY_SLOT, count=1)[0]
        return {"version": int(s["version"]), **Knobs({k: s[k] for k in (*PER_PROCESS, *PER_CLASS)}).to_dict()}

    def policy_in_force(self, timeout=0.1):
        """The policy the allocator has in force. The allocator rewrites it
        under its policy lock, checksum last, so a mismatch is retried; for
        at most `timeout` seconds (learnd passes 0: a file that never reads
        consistently must not cost it more than a few reads per turn)."""
        end = time.monotonic() + timeout
        for attempt in range(1000):
            _, b = self._slot_bytes("in_force")
            chk = int.from_bytes(b[8:16], "little")
            if chk and chk == slot_checksum(b):
                return self.slot_to_policy(b)
            if attempt >= 2 and time.monotonic() >= end:
                break
            time.sleep(0.001 if attempt >= 2 else 0)
        raise RingError(f"{self.path}: the policy in force could not be read consistently (bad checksum)")

    def published_version(self):
        return self._read_u64(self.policy_offset + L.offset_of("policy_area", "version"))

    def status(self):
        # seen_version first, on its own: the allocator stores it after the
        # outcome (applied_version or the rejection), so an outcome read
        # after it is at least as new. Read in one copy of the header, the
        # outcome (offset 88) came before seen_version (96), and a copy the
        # allocator overtook between the two said "seen, not applied" of a
        # policy it applied: bench-learn's burst best-static run failed so
        # (seen_version 1, applied_version 0, nothing rejected).
        seen = self._read_u64(L.offset_of("header", "seen_version"))
        h = self.header()
        out = {k: h[k] for k in ("applied_version", "rejected", "reject_reason")}
        out["seen_version"] = seen
        return out

    def check_policy(self, pol):
        """Raises RingError naming the first value out of the bounds this
        process publishes (Knobs.check: the allocator's own rule)."""
        h = self.header()
        try:
            Knobs.of(pol).check(Bounds.from_header(h), h["class_size"])
        except KnobsError as e:
            raise RingError(str(e)) from None

    def write_policy(self, pol, check=True, version=None):
        """Publishes pol (a dict like policy_in_force's) as a new snapshot.
        Returns the version written; see wait_applied."""
        if not self.writable:
            raise RingError(f"{self.path}: opened read-only")
        if not self.alive:
            raise RingError(f"{self.path}: process {self.pid} is not running")
        if check:
            self.check_policy(pol)
        if version is None:
            h = self.header()
            version = max(self.published_version(), h["applied_version"], h["seen_version"]) + 1
        b = encode_slot(pol, version)
        off, _ = self._slot_bytes(version % 2)
        self.write(off, b)
        self.publish(version)
        return version

    def publish(self, version):
        """Stores the version word after the slot: two pwrites, in this order.
        On x86 the kernel's copies keep program order (release enough for the
        allocator's acquire load); an 8-byte aligned word read torn would
        name a slot whose version differs, which the allocator rejects and
        examines again when the word settles."""
        wp = self.policy_offset + L.offset_of("policy_area", "writer_pid")
        self.write(wp, os.getpid().to_bytes(4, "little"))
        word = self.policy_offset + L.offset_of("policy_area", "version")
        self.write(word, int(version).to_bytes(8, "little"))

    def wait_applied(self, version, timeout=1.0):
        """Waits until the allocator examined `version`; returns (applied, status)."""
        end = time.monotonic() + timeout
        while True:
            s = self.status()
            if s["seen_version"] >= version or s["applied_version"] >= version:
                return s["applied_version"] == version, s
            if time.monotonic() >= end:
                return False, s
            time.sleep(0.002)


def parse_assignment(pol, text, header):
    """Applies one `key=value` to pol. Keys: drain_ms, retain_mib; tcache_cap, tcache_batch,
    warm_slabs for every class; knob[N] for class N; knob@SIZE for the class
    serving SIZE bytes. Returns (knob, the classes it set)."""
    if "=" not in text:
        raise RingError(f"expected key=value, got {text!r}")
    key, val = text.split("=", 1)
    try:
        value = int(val, 0)
    except ValueError:
        raise RingError(f"{key}: {val!r} is not a whole number") from None
    m = re.fullmatch(r"(\w+)(?:\[(\d+)\]|@(\d+))?", key.strip())
    if not m:
        raise RingError(f"cannot read the key {key!r}")
    name, cls, size = m.group(1), m.group(2), m.group(3)
    if name in PER_PROCESS:
        if cls or size:
            raise RingError(f"{name} is per process, not per class")
        pol[name] = value
        return name, []
    if name not in PER_CLASS:
        raise RingError(f"unknown knob {name!r} (knobs: {', '.join((*PER_PROCESS, *PER_CLASS))})")
    sizes = header["class_size"]
    if cls is not None:
        classes = [int(cls)]
        if not 1 <= classes[0] < L.NUM_CLASSES:
            raise RingError(f"class {classes[0]} does not exist (1..{L.NUM_CLASSES - 1})")
    elif size is not None:
        fits = [c for c in range(1, L.NUM_CLASSES) if sizes[c] >= int(size)]
        if not fits:
            raise RingError(f"{size} bytes is above the largest class ({sizes[-1]} B)")
        classes = [fits[0]]
    else:
        classes = range(1, L.NUM_CLASSES)
    for c in classes:
        pol[name][c] = value
    return name, list(classes)


def fit_batches(pol, before, named, header) -> list[tuple[int, int, int]]:
    """After `set-policy` changed some classes' tcache_cap without naming
    their tcache_batch: each such batch goes with its new capacity, as the
    allocator's own start-up path (HAKMEM_TCACHE_CAP alone) fits it: a batch
    that followed the default rule (half the capacity) follows it still, and
    one that no longer fits (larger than the capacity) is cut to it. Without
    this, `tcache_cap@64=77` was refused whole for a batch the user never
    named. Returns (class, old batch, new batch) for each one changed."""
    from .knobs import default_batch
    bmax = int(header["batch_max"])
    out = []
    for c in sorted(set(named.get("tcache_cap", ())) - set(named.get("tcache_batch", ()))):
        cap, old = int(pol["tcache_cap"][c]), int(pol["tcache_batch"][c])
        if old == default_batch(int(before["tcache_cap"][c]), bmax):
            new = default_batch(cap, bmax)
        elif old > max(cap, 1):
            new = max(cap, 1)
        else:
            continue
        if new != old:
            pol["tcache_batch"][c] = new
            out.append((c, old, new))
    return out


def batches_note(fitted, pol, class_size) -> str:
    """One line saying what fit_batches changed."""
    if len(fitted) == 1:
        c, a, b = fitted[0]
        return (f"note: tcache_batch[{c}] ({int(class_size[c])} B) {a} -> {b}, to go with its new capacity "
                f"{pol['tcache_cap'][c]} (name tcache_batch to set it yourself)")
    return (f"note: tcache_batch changed in {len(fitted)} classes to go with their new capacities (half of "
            f"each, or at most it; name tcache_batch to set it yourself)")


# ---- windows and rates -------------------------------------------------------
def window(a, b, seconds=None, clamp=False):
    """Per-second rates between two records (b newer): cumulative counters as
    rates, gauges as the values at b. Returns a dict of numpy arrays.
    seconds: divide by this instead of the time between the records (a
    sampler's window); clamp: a delta below zero counts as zero."""
    dt = (int(b["time_ns"]) - int(a["time_ns"])) / 1e9 if seconds is None else max(float(seconds), 1e-3)
    if dt <= 0:
        raise ValueError("records are not in time order")
    lo = 0 if clamp else None
    out = {"seconds": dt, "proc": {}, "cls": {}}
    for name in L.PROC_COUNTERS:
        va, vb = int(a["proc"][name]), int(b["proc"][name])
        out["proc"][name] = vb if name in L.GAUGES else (vb - va if lo is None else max(vb - va, lo)) / dt
    for name in L.CLASS_COUNTERS:
        va = a["cls"][name].astype(np.int64)
        vb = b["cls"][name].astype(np.int64)
        out["cls"][name] = vb if name in L.GAUGES else (vb - va if lo is None else np.maximum(vb - va, lo)) / dt
    return out


def list_files(directory=None):
    d = shm_dir(directory)
    try:
        return sorted(os.path.join(d, n) for n in os.listdir(d) if _NAME.match(n))
    except FileNotFoundError:
        raise RingError(f"{d} does not exist (no process publishes telemetry there)") from None
    except OSError as e:
        raise RingError(f"cannot list {d}: {e.strerror}") from None
