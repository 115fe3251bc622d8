"""`hakmem trace record PID`: a bounded capture of a live process, without
restarting it (allocator/src/trace.c "LIVE", telemetry.c "live capture
requests").

The request travels through the process's telemetry file: we write the
bounds and then a new request number into its policy area (only the file's
owner or root can), and its allocator answers in the header at its next
telemetry tick. It makes the trace itself, O_EXCL|O_NOFOLLOW and mode 0600,
as <dir>/<pid>-<start>.trace-<request> in the telemetry directory: whoever
asks chooses only the bounds, never a path. We wait for its footer, copy the
trace to -o FILE (never overwriting one) and remove the original, since the
directory is usually /dev/shm, which is RAM.

A process publishes telemetry only while somebody holds the directory's
lease; when nobody does (no learnd), we hold it while we work, and then wait
for the process to make its file (it retries 1, 2, 4, 8, 16 s apart)."""
import errno
import json
import math
import os
import sys
import time

from ..capture import CaptureError as RecordError, _open_trace, _u32, _u64, check_trace, request
from ..lease import Lease, LeaseError, LeaseHeld
from ..ring import Ring, RingError, proc_start_time, resolve, shm_dir

MAX_SECONDS = 86400
MIN_BYTES, MAX_BYTES = 4096, 1 << 30
FILE_WAIT_S = 40.0     # the process's retries of its telemetry file reach 16 s apart
ACK_WAIT_S = 10.0      # a process that allocates ticks every telemetry epoch (100 ms)
GRACE_S = 10.0         # after --seconds: the bound is checked at the next allocation or tick


ERRORS = (RecordError, RingError)


def _progress(msg, end="\r"):
    if sys.stderr.isatty():
        print(f"\r{msg}\033[K", end=end, file=sys.stderr, flush=True)
    elif end == "\n":
        print(msg, file=sys.stderr, flush=True)


def _alive(pid, start):
    return proc_start_time(pid) == start


def _find_ring(pid, d, deadline):
    """The live process's telemetry file, waiting for it to be made."""
    start = proc_start_time(pid)
    if start is None:
        raise RecordError(f"no process {pid}")
    last = None
    while True:
        try:
            path = resolve(pid, d)
        except RingError as e:      # not made yet: it retries 1, 2, 4, ... s apart
            last = e
        else:
            # Only its owner (or root) may write the request: no use waiting.
            return Ring(path, writable=True)
        if not _alive(pid, start):
            raise RecordError(f"process {pid} ended before it made its telemetry file")
        if time.monotonic() >= deadline:
            raise RecordError(f"{last} (is it running with libhakmem preloaded, HAKMEM_SHM_DIR={d}?)")
        _progress(f"waiting for process {pid}'s telemetry file in {d}")
        time.sleep(0.1)


def cmd_trace_record(args):
    pid = args.pid
    if not 0 < args.seconds <= MAX_SECONDS or math.isnan(args.seconds):
        raise RecordError(f"--seconds must be in (0, {MAX_SECONDS}]")
    if not MIN_BYTES <= args.max_bytes <= MAX_BYTES:
        raise RecordError(f"--max-bytes must be between {MIN_BYTES} and {MAX_BYTES}")
    out = args.output
    if os.path.lexists(out):
        raise RecordError(f"{out}: exists; not overwritten")
    outdir = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(outdir):
        raise RecordError(f"{outdir}: no such directory")
    seconds = max(1, math.ceil(args.seconds))
    d = shm_dir(args.shm_dir)
    lease = None
    try:
        lease = Lease(d, "hakmem trace record").acquire()
    except LeaseHeld:
        lease = None           # learnd (or another reader) holds it: as good
    except LeaseError as e:
        raise RecordError(str(e)) from None
    try:
        return _record(args, pid, d, seconds, out)
    finally:
        if lease:
            lease.release()


def _record(args, pid, d, seconds, out):
    t0 = time.monotonic()
    ring = _find_ring(pid, d, t0 + FILE_WAIT_S)
    with ring:
        start = ring.start_time
        req = request(ring, seconds, args.max_bytes)
        name = f"{pid}-{start}.trace-{req}"
        # The answer: the process saw our request (seen == req), and then
        # recording, done or refused.
        deadline = time.monotonic() + ACK_WAIT_S
        while _u64(ring, "header", "trace_seen") != req:
            if not _alive(pid, start):
                raise RecordError(f"process {pid} ended before it took the request")
            if time.monotonic() >= deadline:
                raise RecordError(f"process {pid} did not take the request within {ACK_WAIT_S:g} s "
                                  f"(it takes it on an allocation; is it idle?)")
            time.sleep(0.02)
        state = _u32(ring, "header", "trace_state")
        if state == 3:
            err = _u32(ring, "header", "trace_error")
            why = "a capture is already on" if err == errno.EBUSY else os.strerror(err)
            raise RecordError(f"process {pid} refused the capture: {why}")
        t_start = time.monotonic()
        deadline = t_start + seconds + GRACE_S
        while True:
            state = _u32(ring, "header", "trace_state")
            if state == 2 or not _alive(pid, start):
                break
            now = time.monotonic()
            try:
                size = os.stat(os.path.join(d, name), follow_symlinks=False).st_size
            except OSError:
                size = 0
            _progress(f"recording process {pid}: {now - t_start:.1f} of {seconds} s, {size / 1048576:.1f} MiB")
            if now >= deadline:
                raise RecordError(f"the capture did not end within {seconds + GRACE_S:g} s (the process "
                                  f"ends it at its next allocation after {seconds} s; is it idle?); "
                                  f"what was written is in {d}/{name} (hakmem-learnd removes it a minute after the "
                                  f"capture ends)")
            time.sleep(0.05)
        uid = ring.file_uid
    dfd, fd, st = _open_trace(d, name, uid)
    try:
        with os.fdopen(fd, "rb") as f:
            data = f.read(MAX_BYTES + (1 << 20))
        footer = check_trace(data)
        try:
            ofd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise RecordError(f"{out}: {e.strerror}") from None
        with os.fdopen(ofd, "wb") as o:
            o.write(data)
        os.unlink(name, dir_fd=dfd)
    finally:
        os.close(dfd)
    _progress("", end="\r")
    res = {"pid": pid, "output": os.path.abspath(out), "bytes": len(data), **footer}
    if args.json:
        print(json.dumps(res))
    else:
        print(f"process {pid}: {footer['events']} events from {footer['threads']} threads in "
              f"{footer['duration_s']:.1f} s ({footer['end_reason']}"
              f"{', %d dropped' % footer['dropped'] if footer['dropped'] else ''}) -> {out} "
              f"({len(data) / 1048576:.1f} MiB)")
    return 0
