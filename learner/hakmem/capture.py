"""Live capture's protocol (allocator/src/trace.c "LIVE", telemetry.c "live
capture requests"), shared by `hakmem trace record` (cli/trace_record.py)
and learnd's screening (screen.py).

The request travels through the process's telemetry file: the bounds, then a
new request number, into its policy area (only the file's owner or root can
write it); the allocator answers in the header (trace_seen, trace_state,
trace_error) at its next telemetry tick, and makes the trace itself,
O_EXCL|O_NOFOLLOW and mode 0600, as <dir>/<pid>-<start>.trace-<request>:
whoever asks chooses only the bounds, never a path; the request number is
random, so nobody else can make that name first (request). learnd removes
the traces nobody takes (daemon.py sweep_captures)."""
import os
import secrets
import stat

from . import layout as L

STATE = {0: "none", 1: "recording", 2: "done", 3: "refused"}
RECORDING, DONE, REFUSED = 1, 2, 3
MAX_BYTES = 1 << 30


class CaptureError(Exception):
    """One line for `hakmem: error:` or learnd's log."""


def _u32(ring, struct, field):
    base = 0 if struct == "header" else ring.policy_offset
    return int.from_bytes(ring.read(base + L.offset_of(struct, field), 4), "little")


def _u64(ring, struct, field):
    base = 0 if struct == "header" else ring.policy_offset
    return int.from_bytes(ring.read(base + L.offset_of(struct, field), 8), "little")


def request(ring, seconds, max_bytes):
    """Writes a capture request into ring's policy area; returns its number.
    The bounds first, the number last: the allocator reads the number with
    acquire and the bounds after it.

    The number is random (63 bits): the process names the trace after it,
    in a directory every user can write, and a name that can be guessed can
    be taken first (any user could make <pid>-<start>.trace-1..N and every
    capture of that process would fail with EEXIST). Only the file's owner
    and root can read the number before the trace exists."""
    po = ring.policy_offset
    taken = {_u64(ring, "header", "trace_seen"), _u64(ring, "policy_area", "trace_request"), 0}
    req = 0
    while req in taken:
        req = secrets.randbits(63)
    ring.write(po + L.offset_of("policy_area", "trace_max_bytes"), int(max_bytes).to_bytes(8, "little"))
    ring.write(po + L.offset_of("policy_area", "trace_seconds"), int(seconds).to_bytes(4, "little"))
    ring.write(po + L.offset_of("policy_area", "trace_request"), req.to_bytes(8, "little"))
    return req


def withdraw(ring, req) -> bool:
    """Takes back request req if the process has not seen it: the request
    number goes back to the one it saw last, which it reads as no request.
    Returns whether it was in time. A process that took req meanwhile keeps
    it (its number is put back: were the old one left there, the process
    would take that as yet another request, refused while req records), and
    its trace is nobody's: learnd sweeps it (daemon.py sweep_captures)."""
    seen = _u64(ring, "header", "trace_seen")
    if seen == req:
        return False
    at = ring.policy_offset + L.offset_of("policy_area", "trace_request")
    ring.write(at, seen.to_bytes(8, "little"))
    if _u64(ring, "header", "trace_seen") == req:
        ring.write(at, req.to_bytes(8, "little"))
        return False
    return True


def _varint(b, i):
    n = shift = 0
    while True:
        if i >= len(b):
            raise CaptureError("truncated varint")
        c = b[i]
        i += 1
        n |= (c & 0x7F) << shift
        shift += 7
        if c < 0x80:
            return n, i


def check_trace(data):
    """The footer of a complete trace (dict), or raises CaptureError naming the
    byte offset where it is cut or damaged."""
    from ._pb import trace_pb2
    if data[:8] != b"HKTRACE1":
        raise CaptureError("not a hakmem trace (bad magic)")
    i, last, seq = 8, None, 0
    while i < len(data):
        at = i
        try:
            n, i = _varint(data, i)
        except CaptureError:
            raise CaptureError(f"trace cut short at byte {at}") from None
        if i + n > len(data):
            raise CaptureError(f"trace cut short at byte {at} (a {n}-byte chunk, {len(data) - i} left)")
        c = trace_pb2.TraceChunk()
        try:
            c.ParseFromString(data[i:i + n])
        except Exception:
            raise CaptureError(f"damaged chunk at byte {at}") from None
        if c.seq != seq:
            raise CaptureError(f"chunk {seq} at byte {at} says it is chunk {c.seq}")
        seq += 1
        i += n
        last = c
    if last is None or not last.HasField("footer"):
        raise CaptureError(f"trace has no footer: cut short at byte {len(data)}")
    f = last.footer
    return {"events": f.events, "dropped": f.dropped, "chunks": f.chunks, "threads": f.threads,
            "duration_s": f.duration_ns / 1e9, "end_reason": f.end_reason}


def trace_name(ring, req) -> str:
    """The name the process gives the trace of request req."""
    return f"{ring.pid}-{ring.start_time}.trace-{req}"


def answer(ring, req):
    """(state, errno) of request req once the process has seen it, else None."""
    if _u64(ring, "header", "trace_seen") != req:
        return None
    return _u32(ring, "header", "trace_state"), _u32(ring, "header", "trace_error")


def _open_trace(d, name, uid):
    """Opens the process's trace file: a regular file of its owner with one
    name, not followed if it is a link."""
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except OSError as e:
        os.close(dfd)
        raise CaptureError(f"{d}/{name}: {e.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != uid or st.st_nlink != 1:
        os.close(fd)
        os.close(dfd)
        raise CaptureError(f"{d}/{name}: not a trace file of the recorded process's user")
    return dfd, fd, st


