"""Allocation trace files (proto/trace.proto): the one Python reader and
writer, and the analysis `hakmem trace info` shows.

A trace is 8 bytes of magic ("HKTRACE1") and then length-delimited
TraceChunk messages: a header chunk, chunks of one thread's events as
columns, and at a clean end a footer chunk. Files come from libhakmem
(HAKMEM_TRACE, HAKMEM_TRACE_SAMPLE, `hakmem trace record`) and may be cut
short (the process died, the disk filled) or hostile (another user's file in
a shared directory), so the reader:

- opens with O_NOFOLLOW|O_NONBLOCK|O_CLOEXEC and reads only a regular file
  (a symlink, FIFO or device is refused without blocking on it);
- checks every declared length against what is left of the file (as it was
  when opened) and against MAX_CHUNK before reading a byte of it;
- checks every chunk: a well-formed message, columns of one length, known
  operations, the header first, the footer last, chunk numbers in order, the
  footer's counts equal to what the chunks hold, no event later than the
  footer's duration (a replay paces its idle gaps: a gap no capture could
  have recorded would hold it for as long as the trace says);
- on the first problem raises TraceError naming the file and the byte offset
  of the chunk at fault, or, asked to (partial=True), stops there and says
  how many bytes were valid and why it stopped.

Events come back as numpy columns (Events) so that millions of them cost
seconds, not minutes; rename_objects() turns reused addresses into unique
objects the way the proto's "OBJECT IDENTITY AND ORDER" section defines.
"""
import errno
import os
import stat

import numpy as np

from . import layout as L

MAGIC = b"HKTRACE1"
FORMAT = 1
MAX_CHUNK = 64 << 20          # no writer makes a chunk this big; a larger length is damage
MAX_VARINT = 10
DURATION_SLACK_NS = 1_000_000_000   # events may not come later than the footer's duration plus this

# Operations, as numbers (trace.proto's Op) and names.
MALLOC, CALLOC, REALLOC, FREE, ALIGNED, THREAD_EXIT = 1, 2, 3, 4, 5, 6
OP_NAMES = {MALLOC: "malloc", CALLOC: "calloc", REALLOC: "realloc", FREE: "free",
            ALIGNED: "aligned", THREAD_EXIT: "thread_exit"}
ALLOC_OPS = (MALLOC, CALLOC, REALLOC, ALIGNED)
MODE_NAMES = {0: "unspecified", 1: "full", 2: "sampled", 3: "live"}
MODES = {v: k for k, v in MODE_NAMES.items()}


def _pb():
    # Imported on first use: `hakmem --help` must not need protobuf.
    from ._pb import trace_pb2
    return trace_pb2


class TraceError(Exception):
    """A trace that cannot be read: `path`, the byte `offset` of the problem
    (the start of the chunk at fault, or where the file ends), and why.
    str() is one line: "PATH: WHY at byte OFFSET"."""

    def __init__(self, path, offset, why):
        super().__init__(f"{path}: {why} at byte {offset}")
        self.path, self.offset, self.why = str(path), int(offset), why


def default_class_sizes(n=L.NUM_CLASSES):
    """libhakmem's class table (classes.c: class_size_formula), class 0 =
    huge: what TraceWriter writes unless told another."""
    out = [0]
    for c in range(1, n):
        if c <= 8:
            out.append(c * 16)
        else:
            k = c - 9
            b = 7 + k // 4
            out.append((5 + k % 4) << (b - 2))
    return out


def size_classes(sizes, class_size):
    """The class of each size as libhakmem maps it (hk_size_class): the
    first class whose size is >= it (size 0 -> class 1); 0 (huge) above the
    largest class."""
    table = np.asarray(class_size[1:], dtype=np.uint64)
    s = np.asarray(sizes, dtype=np.uint64)
    cls = np.searchsorted(table, s, side="left").astype(np.int64) + 1
    cls[cls > len(table)] = 0
    return cls


# ---- opening ------------------------------------------------------------------

class Opened:
    """A trace already open: a descriptor of the reader's own (learnd's
    private copy of a screening trace, replay.sealed_copy), read again
    through /proc/self/fd (a description of its own, at offset 0), never by
    a name another user could rename over. `name` stands for it in messages."""

    def __init__(self, fd: int, name: str):
        self.fd, self.name = int(fd), name

    def __str__(self):
        return self.name


def _open(path):
    """A read-only file object on path (or an Opened trace), which must be a
    regular file: a symlink fails at open (O_NOFOLLOW), a FIFO opens without
    blocking (O_NONBLOCK) and is refused by fstat. Returns (file, size at open)."""
    where = f"/proc/self/fd/{path.fd}" if isinstance(path, Opened) else path
    try:
        fd = os.open(where, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC |
                     (0 if isinstance(path, Opened) else os.O_NOFOLLOW))
    except OSError as e:
        why = "a symbolic link; refusing to follow it" if e.errno == errno.ELOOP else (e.strerror or str(e))
        raise TraceError(path, 0, why) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TraceError(path, 0, "not a regular file; refusing it")
        return os.fdopen(fd, "rb", buffering=1 << 16), st.st_size
    except BaseException:
        os.close(fd)
        raise


class ChunkIter:
    """Iterates (offset, TraceChunk) over a trace's chunks after the magic,
    header chunk first. Without partial, the first bad or missing byte
    raises TraceError; with partial=True iteration ends there instead, and
    afterwards `valid_bytes` is the length of the good prefix and `stopped`
    the TraceError that ended it (None when the file ended cleanly with its
    footer). `header`, `footer` (None if none), `chunks` and `events` (the
    counts so far) are set as chunks go by."""

    def __init__(self, path, partial=False, check_layout=True):
        self.source = path                    # a path, or an Opened trace
        self.path, self.partial, self.check_layout = str(path), partial, check_layout
        self.header = self.footer = self.stopped = None
        self.valid_bytes = 0
        self.chunks = 0
        self.events = 0
        self.threads = set()
        self.file_size = 0
        self._gen = None
        self.last_ops = self.last_dt = None
        self.latest = None           # (time, chunk offset) of the latest event so far

    def __iter__(self):
        if self._gen is None:
            self._gen = self._run()
        return self._gen

    def _run(self):
        f, size = _open(self.source)
        self.file_size = size
        try:
            magic = f.read(len(MAGIC))
            if magic != MAGIC:
                if len(magic) < len(MAGIC) and MAGIC.startswith(magic):
                    raise TraceError(self.path, len(magic), "cut short inside the magic")
                raise TraceError(self.path, 0, f"not a hakmem trace (magic {magic[:8]!r}, expected {MAGIC!r})")
            pos = len(MAGIC)
            self.valid_bytes = pos
            while True:
                if pos == size:
                    if self.footer is None:
                        self._problem(pos, "cut short: no footer (the writer did not finish)"
                                      if self.header else "cut short: no header chunk")
                    return
                if self.footer is not None:
                    self._problem(pos, "data after the footer chunk")
                    return
                try:
                    length, nlen = self._varint(f, pos, size)
                    if length > MAX_CHUNK:
                        raise TraceError(self.path, pos, f"chunk length {length} is over the limit of {MAX_CHUNK} bytes")
                    if length > size - pos - nlen:
                        raise TraceError(self.path, pos, f"cut short: a chunk of {length} bytes, "
                                                         f"{size - pos - nlen} left in the file")
                    data = f.read(length)
                    if len(data) != length:
                        raise TraceError(self.path, pos, "cut short: the file shrank while being read")
                    chunk = self._parse(data, pos)
                except TraceError as e:
                    if not self.partial:
                        raise
                    self.stopped = e
                    return
                self.valid_bytes = pos + nlen + length
                yield pos, chunk
                pos += nlen + length
        finally:
            f.close()

    def _problem(self, pos, why):
        e = TraceError(self.path, pos, why)
        if not self.partial:
            raise e
        self.stopped = e

    def _varint(self, f, pos, size):
        v = shift = 0
        for i in range(MAX_VARINT):
            b = f.read(1)
            if not b:
                raise TraceError(self.path, pos, "cut short inside a chunk length")
            v |= (b[0] & 0x7F) << shift
            if not b[0] & 0x80:
                return v, i + 1
            shift += 7
        raise TraceError(self.path, pos, "bad chunk length (a varint over 10 bytes)")

    def _parse(self, data, pos):
        pb = _pb()
        from google.protobuf.message import DecodeError
        c = pb.TraceChunk()
        try:
            c.ParseFromString(data)
        except (DecodeError, ValueError, RuntimeError) as e:
            raise TraceError(self.path, pos, f"corrupt chunk ({e or 'not a TraceChunk'})") from None
        n = len(c.op)
        if c.seq != self.chunks:
            raise TraceError(self.path, pos, f"chunk {self.chunks} is numbered {c.seq}")
        if self.chunks == 0:
            if not c.HasField("header"):
                raise TraceError(self.path, pos, "the first chunk has no header")
            h = c.header
            if h.format != FORMAT:
                raise TraceError(self.path, pos, f"trace format {h.format}; this hakmem reads format {FORMAT}")
            if self.check_layout and h.layout_version != L.LAYOUT_VERSION:
                raise TraceError(self.path, pos, f"written by layout version {h.layout_version}; this hakmem "
                                                 f"(layout version {L.LAYOUT_VERSION}) refuses it")
            cs = list(h.class_size)
            if len(cs) < 2 or any(b <= a for a, b in zip(cs[1:], cs[2:])):
                raise TraceError(self.path, pos, "the header's class table is missing or not increasing")
            if n:
                raise TraceError(self.path, pos, "the header chunk holds events")
            self.header = h
        elif c.HasField("header"):
            raise TraceError(self.path, pos, "a second header chunk")
        if c.HasField("footer"):
            if n:
                raise TraceError(self.path, pos, "the footer chunk holds events")
            ft = c.footer
            if ft.chunks != self.chunks:
                raise TraceError(self.path, pos, f"the footer counts {ft.chunks} chunks before it, the file has {self.chunks}")
            if ft.events != self.events:
                raise TraceError(self.path, pos, f"the footer counts {ft.events} events, the chunks hold {self.events}")
            if self.latest is not None and self.latest[0] > ft.duration_ns + DURATION_SLACK_NS:
                t, at = self.latest
                raise TraceError(self.path, at, f"an event at {t / 1e9:.3f} s, past the trace's duration of "
                                                f"{ft.duration_ns / 1e9:.3f} s (its footer)")
            self.footer = ft
        for name in ("size", "align", "addr", "old_addr", "dt_ns"):
            if len(getattr(c, name)) != n:
                raise TraceError(self.path, pos, f"column {name} has {len(getattr(c, name))} entries, op has {n}")
        if n:
            ops = np.fromiter(c.op, dtype=np.int64, count=n)
            if ops.min() < MALLOC or ops.max() > THREAD_EXIT:
                bad = int(ops[(ops < MALLOC) | (ops > THREAD_EXIT)][0])
                raise TraceError(self.path, pos, f"unknown operation {bad}")
            if c.thread == 0:
                raise TraceError(self.path, pos, "events of thread 0 (threads are numbered from 1)")
            dt = np.fromiter(c.dt_ns, dtype=np.uint64, count=n)
            if float(dt.sum(dtype=np.float64)) >= 2.0 ** 63:
                raise TraceError(self.path, pos, "event times past 2^63 ns")
            self.last_ops, self.last_dt = ops, dt     # for events(): not converted twice
            t = int(dt.sum(dtype=np.uint64))           # the chunk's last event (times restart in each chunk)
            if self.latest is None or t > self.latest[0]:
                self.latest = (t, pos)
            self.threads.add(c.thread)
        self.chunks += 1
        self.events += n
        return c


def iter_chunks(path, partial=False, check_layout=True):
    """A ChunkIter: iterate it for (offset, chunk)."""
    return ChunkIter(path, partial, check_layout)


def read_header(path, check_layout=True):
    """(Header, info) of a trace, reading only its magic and first chunk.
    info: {"path", "file_size", "header_bytes"}. Raises TraceError."""
    it = iter_chunks(path, partial=False, check_layout=check_layout)
    gen = iter(it)
    try:
        for _pos, c in gen:
            return c.header, {"path": str(path), "file_size": it.file_size, "header_bytes": it.valid_bytes}
    finally:
        gen.close()
    raise TraceError(path, it.valid_bytes, "no header chunk")   # not reached: _run raises first


# ---- events -------------------------------------------------------------------

class Events:
    """A trace's events as numpy columns, in file order (each thread's chunks
    in its order): op (uint8), size (uint64), align (uint32), addr,
    old_addr (uint64), thread (uint32), time_ns (uint64, since capture
    start). Also header, footer (None if the file was cut), chunks,
    valid_bytes, file_size and stopped (the TraceError where a partial read
    ended, else None)."""

    COLUMNS = ("op", "size", "align", "addr", "old_addr", "thread", "time_ns")

    def __len__(self):
        return len(self.op)

    def order(self):
        """Indices of the events in time order; at equal times frees before
        reallocs before allocations (a block is freed before it is reused),
        then file order."""
        return np.lexsort((np.arange(len(self.op)), _SORT_KIND[self.op], self.time_ns))


_SORT_KIND = np.array([3, 2, 2, 1, 0, 2, 3, 3], dtype=np.int8)   # by op: FREE 0, REALLOC 1, allocs 2


def events(path, partial=False, check_layout=True, on_progress=None):
    """Every event of a trace as an Events. Raises TraceError (or with
    partial=True keeps the events before the first problem).
    on_progress(bytes_read, file_size) is called after each chunk."""
    it = iter_chunks(path, partial, check_layout)
    cols = {k: [] for k in Events.COLUMNS}
    for _pos, c in it:
        if on_progress is not None:
            on_progress(it.valid_bytes, it.file_size)
        n = len(c.op)
        if not n:
            continue
        cols["op"].append(it.last_ops.astype(np.uint8))
        cols["size"].append(np.fromiter(c.size, dtype=np.uint64, count=n))
        cols["align"].append(np.fromiter(c.align, dtype=np.uint32, count=n))
        cols["addr"].append(np.fromiter(c.addr, dtype=np.uint64, count=n))
        cols["old_addr"].append(np.fromiter(c.old_addr, dtype=np.uint64, count=n))
        cols["thread"].append(np.full(n, c.thread, dtype=np.uint32))
        cols["time_ns"].append(np.cumsum(it.last_dt, dtype=np.uint64))
    ev = Events()
    dtypes = {"op": np.uint8, "size": np.uint64, "align": np.uint32, "addr": np.uint64,
              "old_addr": np.uint64, "thread": np.uint32, "time_ns": np.uint64}
    for k in Events.COLUMNS:
        setattr(ev, k, np.concatenate(cols[k]) if cols[k] else np.zeros(0, dtype=dtypes[k]))
    ev.header, ev.footer, ev.chunks = it.header, it.footer, it.chunks
    ev.valid_bytes, ev.file_size, ev.stopped, ev.path = it.valid_bytes, it.file_size, it.stopped, str(path)
    if ev.header is None:     # partial, and not even the header was whole
        raise it.stopped or TraceError(path, it.valid_bytes, "no header chunk")
    return ev


class Objects:
    """Addresses renamed into objects (rename_objects). Per event: alloc_id,
    the object it makes (-1: none, or a failed allocation), free_id, the
    object it ends (-1: none, or an unmatched free). Per object (ids 0..n-1
    in time order of birth): event (its allocation), free_event (-1: never
    freed in the trace), size. unmatched_frees: frees of an address with no
    live allocation in the trace (allocated before capture began, or not
    sampled). order/rank: the events' time order and each event's place in it."""


def rename_objects(ev):
    """Unique object ids for reused addresses, using the events' time order
    (frees before allocations at equal times): allocation i of an address
    lives until the next free of that address after it."""
    n = len(ev.op)
    order = ev.order()
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n, dtype=np.int64)
    op = ev.op
    is_alloc = np.isin(op, ALLOC_OPS) & (ev.addr != 0)
    # realloc(p, n) that fails leaves p alone; realloc(NULL, n) is MALLOC.
    is_free = ((op == FREE) & (ev.addr != 0)) | ((op == REALLOC) & (ev.old_addr != 0) & (ev.addr != 0))
    fe = np.nonzero(is_free)[0]
    ae = np.nonzero(is_alloc)[0]
    faddr = np.where(op[fe] == FREE, ev.addr[fe], ev.old_addr[fe])
    rec_addr = np.concatenate([faddr, ev.addr[ae]])
    rec_event = np.concatenate([fe, ae])
    rec_side = np.concatenate([np.zeros(len(fe), np.int8), np.ones(len(ae), np.int8)])   # free 0, alloc 1
    s = np.lexsort((rec_side, rank[rec_event], rec_addr))
    A, E, S = rec_addr[s], rec_event[s], rec_side[s]
    same = np.zeros(len(s), dtype=bool)
    same[1:] = A[1:] == A[:-1]
    prev_alloc = np.zeros(len(s), dtype=bool)
    prev_alloc[1:] = S[:-1] == 1
    matched = (S == 0) & same & prev_alloc      # a free right after an allocation of its address
    o = Objects()
    # Object ids by birth order.
    births = ae[np.argsort(rank[ae], kind="stable")]
    o.alloc_id = np.full(n, -1, dtype=np.int64)
    o.alloc_id[births] = np.arange(len(births), dtype=np.int64)
    o.free_id = np.full(n, -1, dtype=np.int64)
    mj = np.nonzero(matched)[0]
    o.free_id[E[mj]] = o.alloc_id[E[mj - 1]]
    o.event = births
    o.size = ev.size[births]
    o.free_event = np.full(len(births), -1, dtype=np.int64)
    o.free_event[o.alloc_id[E[mj - 1]]] = E[mj]
    o.unmatched_frees = int(len(fe) - len(mj))
    o.order, o.rank = order, rank
    return o


def _pct(a, q):
    return float(np.percentile(a, q)) if len(a) else None


def summarize(ev, objs=None, series_points=200):
    """What `hakmem trace info` shows, as plain data (JSON-ready)."""
    h, ft = ev.header, ev.footer
    objs = objs if objs is not None else rename_objects(ev)
    cs = list(h.class_size)
    op = ev.op
    ops = {OP_NAMES[k]: int(np.count_nonzero(op == k)) for k in OP_NAMES}
    alloc_ev = np.isin(op, ALLOC_OPS)
    ok = alloc_ev & (ev.addr != 0)
    end_ns = int(ev.time_ns.max()) if len(op) else 0
    duration = int(ft.duration_ns) if ft is not None else end_ns
    # Size classes of every allocation asked for (failed ones too).
    cls_all = size_classes(ev.size[alloc_ev], cs)
    counts = np.bincount(cls_all, minlength=len(cs))
    byts = np.bincount(cls_all, weights=ev.size[alloc_ev].astype(np.float64), minlength=len(cs))
    # Lifetimes of the objects freed in the trace.
    freed = objs.free_event >= 0
    ocls = size_classes(objs.size, cs)
    life_ns = (ev.time_ns[objs.free_event[freed]].astype(np.int64) - ev.time_ns[objs.event[freed]].astype(np.int64))
    life_ops = objs.rank[objs.free_event[freed]] - objs.rank[objs.event[freed]]
    fcls = ocls[freed]
    classes = []
    for k in range(len(cs)):
        if not counts[k]:
            continue
        m = fcls == k
        ln, lo = life_ns[m], life_ops[m]
        classes.append({
            "class": k, "size": cs[k], "allocs": int(counts[k]), "bytes": int(byts[k]),
            "freed": int(m.sum()), "live_at_end": int(np.count_nonzero((ocls == k) & ~freed)),
            "lifetime_ms": {"median": None if not len(ln) else _pct(ln, 50) / 1e6,
                            "p90": None if not len(ln) else _pct(ln, 90) / 1e6},
            "lifetime_ops": {"median": _pct(lo, 50), "p90": _pct(lo, 90)},
        })
    # Live bytes after each event, in time order.
    delta = np.zeros(len(op), dtype=np.int64)
    delta[objs.event] += objs.size.astype(np.int64)
    fr = objs.free_event[freed]
    np.subtract.at(delta, fr, objs.size[freed].astype(np.int64))
    live = np.cumsum(delta[objs.order])
    t_sorted = ev.time_ns[objs.order]
    series = []
    if len(live):
        pk = int(np.argmax(live))
        peak, peak_t = int(live[pk]), int(t_sorted[pk])
        pts = np.linspace(0, max(duration, end_ns), series_points)
        idx = np.searchsorted(t_sorted, pts.astype(np.uint64), side="right") - 1
        series = [[int(t), int(live[i]) if i >= 0 else 0] for t, i in zip(pts, idx)]
    else:
        peak = peak_t = 0
    out = {
        "file": ev.path, "file_size": ev.file_size,
        "header": {"format": h.format, "layout_version": h.layout_version, "hakmem_version": h.hakmem_version,
                   "exe": h.exe, "argv0": h.argv0, "build_id": h.build_id, "pid": h.pid,
                   "start_unix": h.start_unix, "mode": MODE_NAMES.get(h.mode, str(h.mode)),
                   "sample_bytes": h.sample_bytes, "limit_seconds": h.limit_seconds,
                   "limit_bytes": h.limit_bytes, "classes": len(cs)},
        "events": int(len(op)), "chunks": ev.chunks, "ops": ops,
        "threads": int(len(np.unique(ev.thread))), "duration_ns": duration,
        "bytes_allocated": int(ev.size[ok].sum(dtype=np.uint64)),
        "failed_allocs": int(np.count_nonzero(alloc_ev & (ev.addr == 0))),
        "objects": int(len(objs.event)), "objects_freed": int(freed.sum()),
        "objects_live_at_end": int((~freed).sum()), "unmatched_frees": objs.unmatched_frees,
        "classes": classes,
        "live_bytes": {"peak": peak, "peak_time_ns": peak_t, "at_end": int(live[-1]) if len(live) else 0,
                       "series": series},
        "footer": None if ft is None else {"events": ft.events, "dropped": ft.dropped, "chunks": ft.chunks,
                                           "threads": ft.threads, "duration_ns": ft.duration_ns,
                                           "end_reason": ft.end_reason},
        "cut": None if ev.stopped is None else {"at_byte": ev.stopped.offset, "why": ev.stopped.why,
                                                "valid_bytes": ev.valid_bytes},
    }
    return out


# ---- writing ------------------------------------------------------------------

def _varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


class TraceWriter:
    """Writes a valid trace (tests, and traces made by hand):

        with TraceWriter(path, pid=42, exe="/usr/bin/x") as w:
            w.chunk(1, [(MALLOC, 32, 0, 0x1000, 0, 10), (FREE, 0, 0, 0x1000, 0, 20)])
        # the footer is written at the end of the with block (not after an exception)

    Events are (op, size, align, addr, old_addr, time_ns) with time_ns
    absolute (since capture start); the writer stores the deltas. Header
    fields are keyword arguments (trace.proto's Header; mode may be a name).
    close(footer=False) leaves the file cut short as a dying process would;
    raw(bytes) appends anything (damage, for tests)."""

    def __init__(self, path, *, class_size=None, layout_version=None, format=FORMAT, mode="full", **header):
        pb = _pb()
        self._pb = pb
        self.path = str(path)
        self.f = open(path, "wb")
        self.f.write(MAGIC)
        self.seq = 0
        self.events = 0
        self.threads = set()
        self.max_t = 0
        h = pb.Header(format=format, layout_version=L.LAYOUT_VERSION if layout_version is None else layout_version,
                      mode=MODES[mode] if isinstance(mode, str) else mode,
                      class_size=default_class_sizes() if class_size is None else class_size, **header)
        self._write(pb.TraceChunk(header=h, seq=0))

    def _write(self, chunk):
        data = chunk.SerializeToString()
        self.f.write(_varint(len(data)) + data)
        self.seq += 1

    def chunk(self, thread, evs):
        """One chunk of thread's events (a list of 6-tuples), in its order."""
        c = self._pb.TraceChunk(thread=thread, seq=self.seq)
        prev = None
        for op, size, align, addr, old_addr, t in evs:
            c.op.append(op)
            c.size.append(size)
            c.align.append(align)
            c.addr.append(addr)
            c.old_addr.append(old_addr)
            c.dt_ns.append(t if prev is None else t - prev)
            prev = t
            self.max_t = max(self.max_t, t)
        self._write(c)
        self.events += len(evs)
        if evs:
            self.threads.add(thread)
        return self

    def columns(self, thread, op, size, align, addr, old_addr, time_ns):
        """One chunk from numpy columns (big synthetic traces)."""
        t = np.asarray(time_ns, dtype=np.uint64)
        dt = np.diff(t, prepend=np.uint64(0)) if len(t) else t
        if len(t):
            dt[0] = t[0]
            self.max_t = max(self.max_t, int(t.max()))
        c = self._pb.TraceChunk(thread=thread, seq=self.seq)
        c.op.extend(np.asarray(op).tolist())
        c.size.extend(np.asarray(size).tolist())
        c.align.extend(np.asarray(align).tolist())
        c.addr.extend(np.asarray(addr).tolist())
        c.old_addr.extend(np.asarray(old_addr).tolist())
        c.dt_ns.extend(dt.tolist())
        self._write(c)
        self.events += len(t)
        if len(t):
            self.threads.add(thread)
        return self

    def raw(self, data):
        self.f.write(data)

    def close(self, footer=True, dropped=0, end_reason="exit", duration_ns=None):
        if self.f is None:
            return
        if footer:
            ft = self._pb.Footer(events=self.events, dropped=dropped, chunks=self.seq, threads=len(self.threads),
                                 duration_ns=self.max_t if duration_ns is None else duration_ns,
                                 end_reason=end_reason)
            self._write(self._pb.TraceChunk(footer=ft, seq=self.seq))
        self.f.close()
        self.f = None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        self.close(footer=exc_type is None)
