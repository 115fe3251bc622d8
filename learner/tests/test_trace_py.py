"""Trace files (proto/trace.proto) on the Python side: hakmem/trace.py's
writer and reader, the object renaming, and `hakmem trace info` run as a
real process (.venv/bin/hakmem) on synthetic traces: exact figures on a
trace whose answer is worked out by hand below, and every kind of bad file
(cut short, corrupt, hostile: symlink, FIFO, huge lengths, another layout)
giving one line with the byte offset and exit 1, never a hang."""
import json
import os
import subprocess
import time

import numpy as np
import pytest

from conftest import ROOT, scaled
from hakmem import layout as L
from hakmem import trace as T
from hakmem._pb import trace_pb2

HAKMEM_BIN = ROOT / ".venv" / "bin" / "hakmem"
A, B, C, D, E, F, DEAD = 0x1000, 0x2000, 0x3000, 0x4000, 0x5000, 0x7f0000000000, 0xdead0

# The hand-worked trace. Thread 1 and thread 2 (in two chunks, the first
# written before thread 1's); at t=400 thread 1 frees A while thread 2
# allocates a new object at A: the free sorts first (file order would put
# the allocation first), so these are two objects, both freed.
T1 = [(T.MALLOC, 24, 0, A, 0, 100), (T.CALLOC, 100, 0, B, 0, 200), (T.REALLOC, 200, 0, C, B, 300),
      (T.FREE, 0, 0, A, 0, 400), (T.ALIGNED, 64, 64, D, 0, 500), (T.FREE, 0, 0, 0, 0, 600)]
T2a = [(T.MALLOC, 5000, 0, E, 0, 150), (T.MALLOC, 24, 0, A, 0, 400), (T.FREE, 0, 0, C, 0, 450)]
T2b = [(T.FREE, 0, 0, DEAD, 0, 460), (T.MALLOC, 2 << 20, 0, F, 0, 470), (T.FREE, 0, 0, A, 0, 700),
       (T.THREAD_EXIT, 0, 0, 0, 0, 800)]


def write_sample(path, **kw):
    with T.TraceWriter(path, pid=4242, exe="/usr/bin/sample", argv0="sample", hakmem_version="9.9",
                       **kw) as w:
        w.chunk(2, T2a).chunk(1, T1).chunk(2, T2b)
    return path


def hakmem(*args, timeout=60):
    return subprocess.run([str(HAKMEM_BIN), *map(str, args)], capture_output=True, text=True,
                          timeout=scaled(timeout), cwd=ROOT)


def chunk_offsets(path):
    return [pos for pos, _ in T.iter_chunks(path)]


def one_error_line(r):
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("hakmem: error: "), r.stderr
    assert r.stdout == ""
    return lines[0]


# ---- writer and reader --------------------------------------------------------

def test_round_trip(tmp_path):
    p = write_sample(tmp_path / "t.trace", mode="sampled", sample_bytes=4096)
    h, info = T.read_header(p)
    assert (h.pid, h.exe, h.argv0, h.hakmem_version) == (4242, "/usr/bin/sample", "sample", "9.9")
    assert h.mode == trace_pb2.SAMPLED and h.sample_bytes == 4096
    assert h.format == T.FORMAT and h.layout_version == L.LAYOUT_VERSION
    assert list(h.class_size) == T.default_class_sizes() and len(h.class_size) == L.NUM_CLASSES
    assert info["file_size"] == os.path.getsize(p) and 8 < info["header_bytes"] < info["file_size"]
    ev = T.events(p)
    want = T2a + T1 + T2b
    assert len(ev) == 13 and ev.chunks == 5 and ev.stopped is None   # header, 3, footer
    for k, col in enumerate(("op", "size", "align", "addr", "old_addr", "time_ns")):
        assert getattr(ev, col).tolist() == [e[k] for e in want], col
    assert ev.thread.tolist() == [2] * 3 + [1] * 6 + [2] * 4
    assert ev.op.dtype == np.uint8 and ev.time_ns.dtype == np.uint64
    assert (ev.footer.events, ev.footer.chunks, ev.footer.threads, ev.footer.duration_ns) == (13, 4, 2, 800)
    assert ev.footer.end_reason == "exit"
    # Offsets: after the magic, each the previous plus its length prefix and body.
    offs = chunk_offsets(p)
    assert offs[0] == 8 and offs == sorted(offs) and len(offs) == 5


def test_columns_writer_matches_tuples(tmp_path):
    a = tmp_path / "a.trace"
    with T.TraceWriter(a) as w:
        w.columns(3, [T.MALLOC, T.FREE], [48, 0], [0, 0], [A, A], [0, 0], [1000, 1500])
    ev = T.events(a)
    assert ev.op.tolist() == [T.MALLOC, T.FREE] and ev.time_ns.tolist() == [1000, 1500]
    assert ev.thread.tolist() == [3, 3] and ev.size.tolist() == [48, 0]


def test_size_classes_follow_the_allocator():
    cs = T.default_class_sizes()
    assert cs[:10] == [0, 16, 32, 48, 64, 80, 96, 112, 128, 160] and cs[-1] == 1 << 20
    got = T.size_classes([0, 1, 16, 17, 128, 129, 160, 161, 5000, 1 << 20, (1 << 20) + 1], cs).tolist()
    assert got == [1, 1, 1, 2, 8, 9, 9, 10, cs.index(5120), len(cs) - 1, 0]


def test_rename_objects(tmp_path):
    ev = T.events(write_sample(tmp_path / "t.trace"))
    o = T.rename_objects(ev)
    # Births in time order: A(100) E(150) B(200) C(300) A'(400) F(470) D(500).
    assert ev.addr[o.event].tolist() == [A, E, B, C, A, F, D]
    assert ev.time_ns[o.free_event[o.free_event >= 0]].tolist() == [400, 300, 450, 700]
    assert (o.free_event < 0).tolist() == [False, True, False, False, False, True, True]
    assert o.unmatched_frees == 1                   # DEAD; free(NULL) is no free of anything
    # The realloc ends B and makes C.
    r = int(np.nonzero(ev.op == T.REALLOC)[0][0])
    assert o.free_id[r] == 2 and o.alloc_id[r] == 3


def test_million_events_in_seconds(tmp_path):
    n = 1_000_000
    p = tmp_path / "big.trace"
    rng = np.random.default_rng(7)
    with T.TraceWriter(p) as w:
        for th in (1, 2):
            half = n // 4
            addr = (np.arange(half, dtype=np.uint64) * 64 + th * (1 << 32))
            op = np.r_[np.full(half, T.MALLOC), np.full(half, T.FREE)]
            size = np.r_[rng.integers(1, 4096, half), np.zeros(half, int)]
            t = np.arange(2 * half, dtype=np.uint64) * 10 + th
            for s in range(0, 2 * half, 50_000):
                sl = slice(s, s + 50_000)
                w.columns(th, op[sl], size[sl], np.zeros(len(op[sl]), int), np.r_[addr, addr][sl],
                          np.zeros(len(op[sl]), int), t[sl])
    t0 = time.monotonic()
    ev = T.events(p)
    s = T.summarize(ev)
    took = time.monotonic() - t0
    assert len(ev) == n and s["objects"] == n // 2 and s["objects_freed"] == n // 2
    assert s["unmatched_frees"] == 0 and s["live_bytes"]["at_end"] == 0
    assert took < scaled(15), f"{took:.1f} s for a million events"


# ---- trace info: exact figures ------------------------------------------------

def test_info_json_exact(tmp_path):
    p = write_sample(tmp_path / "t.trace")
    r = hakmem("trace", "info", p, "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["ops"] == {"malloc": 4, "calloc": 1, "realloc": 1, "free": 5, "aligned": 1, "thread_exit": 1}
    assert s["events"] == 13 and s["threads"] == 2 and s["duration_ns"] == 800 and s["chunks"] == 5
    assert s["bytes_allocated"] == 24 + 100 + 200 + 64 + 5000 + 24 + (2 << 20)
    assert (s["objects"], s["objects_freed"], s["objects_live_at_end"], s["unmatched_frees"]) == (7, 4, 3, 1)
    assert s["header"]["mode"] == "full" and s["header"]["pid"] == 4242
    assert s["footer"]["dropped"] == 0 and s["footer"]["end_reason"] == "exit" and s["cut"] is None
    cs = T.default_class_sizes()
    by = {c["class"]: c for c in s["classes"]}
    assert {k: c["allocs"] for k, c in by.items()} == {
        0: 1, cs.index(32): 2, cs.index(64): 1, cs.index(112): 1, cs.index(224): 1, cs.index(5120): 1}
    c32 = by[cs.index(32)]
    assert c32["bytes"] == 48 and c32["freed"] == 2 and c32["live_at_end"] == 0
    assert c32["lifetime_ms"]["median"] == pytest.approx(300e-6)
    # Ranks in time order: A 0 ... free A 4, new A 5 ... free A' 11: lifetimes 4 and 6 operations.
    assert c32["lifetime_ops"]["median"] == pytest.approx(5.0) and c32["lifetime_ops"]["p90"] == pytest.approx(5.8)
    assert by[cs.index(112)]["lifetime_ms"]["median"] == pytest.approx(100e-6)   # B: calloc 200 -> realloc 300
    assert by[cs.index(112)]["lifetime_ops"]["median"] == 1
    assert by[cs.index(224)]["lifetime_ms"]["p90"] == pytest.approx(150e-6)      # C: 300 -> freed by thread 2 at 450
    assert by[cs.index(224)]["lifetime_ops"]["median"] == 3
    for k in (0, cs.index(64), cs.index(5120)):
        assert by[k]["live_at_end"] == 1 and by[k]["freed"] == 0 and by[k]["lifetime_ms"]["median"] is None
    lb = s["live_bytes"]
    assert lb["peak"] == 64 + 5000 + 24 + (2 << 20) and lb["peak_time_ns"] == 500     # C freed at 450
    assert lb["at_end"] == 64 + 5000 + (2 << 20)
    assert lb["series"][-1] == [800, lb["at_end"]] and lb["series"][0] == [0, 0]


def test_info_text(tmp_path):
    p = write_sample(tmp_path / "t.trace", mode="live", limit_seconds=5)
    r = hakmem("trace", "info", p)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    out = r.stdout
    assert "events: 13 from 2 threads" in out
    assert "malloc 4, calloc 1, realloc 1, free 5, aligned 1, thread_exit 1" in out
    assert "mode: live (bounded by 5 s)" in out and "end: exit; 13 events written, 0 dropped" in out
    assert "1 frees of blocks allocated outside the trace" in out
    assert "cut short" not in out
    rows = [ln.split() for ln in out.splitlines() if ln.startswith("     ") and ln.split()[0].isdigit()]
    assert [(x[0], x[2]) for x in rows] == [("0", "1"), ("2", "2"), ("4", "1"), ("7", "1"), ("11", "1"),
                                            (str(T.default_class_sizes().index(5120)), "1")]


def test_info_png(tmp_path):
    p = write_sample(tmp_path / "t.trace")
    out = tmp_path / "chart.png"
    r = hakmem("trace", "info", p, "--png", out)
    assert r.returncode == 0, r.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    r = hakmem("trace", "info", p, "--png", tmp_path / "no" / "such" / "dir.png")
    assert "dir.png" in one_error_line(r)


def test_help():
    r = hakmem("trace", "--help")
    assert r.returncode == 0 and "info" in r.stdout and "record" in r.stdout
    r = hakmem("trace", "info", "--help")
    assert r.returncode == 0 and "--partial" in r.stdout and "byte offset" in r.stdout
    r = hakmem("trace", "record", "--help")
    assert r.returncode == 0 and "--seconds" in r.stdout and "--max-bytes" in r.stdout


# ---- bad files ----------------------------------------------------------------

def test_truncated_inside_a_chunk(tmp_path):
    p = write_sample(tmp_path / "t.trace")
    offs = chunk_offsets(p)
    cut = offs[3] + 5                              # inside thread 2's second chunk (the third)
    data = p.read_bytes()
    p.write_bytes(data[:cut])
    line = one_error_line(hakmem("trace", "info", p))
    assert line.startswith(f"hakmem: error: {p}: cut short") and line.endswith(f"at byte {offs[3]}")
    with pytest.raises(T.TraceError) as ei:
        T.events(p)
    assert ei.value.offset == offs[3] and ei.value.path == str(p)
    # --partial: the three whole chunks (header, thread 2's first, thread 1's).
    r = hakmem("trace", "info", p, "--partial", "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["events"] == len(T1) + len(T2a) and s["footer"] is None
    assert s["cut"]["at_byte"] == offs[3] and s["cut"]["valid_bytes"] == offs[3]
    r = hakmem("trace", "info", p, "--partial")
    assert r.returncode == 0 and f"cut short at byte {offs[3]:,}" in r.stdout
    assert r.stderr.startswith("hakmem: warning: ")


def test_no_footer(tmp_path):
    p = tmp_path / "t.trace"
    w = T.TraceWriter(p)
    w.chunk(1, T1)
    w.close(footer=False)                          # the process died
    size = p.stat().st_size
    line = one_error_line(hakmem("trace", "info", p))
    assert "no footer" in line and line.endswith(f"at byte {size}")
    s = json.loads(hakmem("trace", "info", p, "--partial", "--json").stdout)
    assert s["events"] == len(T1) and s["cut"]["at_byte"] == size and s["duration_ns"] == 600


@pytest.mark.parametrize("cut", range(0, 8))
def test_cut_in_magic_or_empty(tmp_path, cut):
    p = write_sample(tmp_path / "t.trace")
    p.write_bytes(p.read_bytes()[:cut])
    line = one_error_line(hakmem("trace", "info", p, "--partial"))
    assert line.endswith(f"at byte {cut}") and "cut short" in line


def test_bad_magic(tmp_path):
    p = tmp_path / "t.trace"
    p.write_bytes(b"HKRING01" + b"\0" * 100)
    line = one_error_line(hakmem("trace", "info", p))
    assert "not a hakmem trace" in line and line.endswith("at byte 0")


def test_symlink_refused(tmp_path):
    real = write_sample(tmp_path / "t.trace")
    link = tmp_path / "link.trace"
    link.symlink_to(real)
    line = one_error_line(hakmem("trace", "info", link))
    assert "symbolic link" in line
    with pytest.raises(T.TraceError, match="symbolic link"):
        T.read_header(link)


def test_fifo_refused_without_hanging(tmp_path):
    fifo = tmp_path / "fifo.trace"
    os.mkfifo(fifo)
    t0 = time.monotonic()
    line = one_error_line(hakmem("trace", "info", fifo, timeout=20))   # a blocking open would hang here
    assert "not a regular file" in line and time.monotonic() - t0 < scaled(20)


def test_directory_refused(tmp_path):
    assert "not a regular file" in one_error_line(hakmem("trace", "info", tmp_path))


def _with_header(tmp_path, body):
    """A valid magic and header chunk, then body."""
    p = tmp_path / "t.trace"
    w = T.TraceWriter(p)
    w.raw(body)
    w.close(footer=False)
    return p, chunk_offsets_prefix(p)


def chunk_offsets_prefix(p):
    it = T.iter_chunks(p, partial=True)
    return [pos for pos, _ in it] + [it.valid_bytes]


@pytest.mark.parametrize("length", [1 << 40, (64 << 20) + 1, (64 << 20) - 1, 2 ** 63])
def test_huge_declared_length(tmp_path, length):
    p, offs = _with_header(tmp_path, T._varint(length) + b"\x18\x01" * 10)
    t0 = time.monotonic()
    line = one_error_line(hakmem("trace", "info", p))
    assert line.endswith(f"at byte {offs[-1]}")
    assert ("over the limit" in line) if length > T.MAX_CHUNK else ("cut short: a chunk of" in line)
    assert time.monotonic() - t0 < scaled(20)


def test_endless_varint(tmp_path):
    p, offs = _with_header(tmp_path, b"\xff" * 20)
    line = one_error_line(hakmem("trace", "info", p))
    assert "varint" in line and line.endswith(f"at byte {offs[-1]}")


def _chunk(**kw):
    """One framed chunk: its length, then the message."""
    data = trace_pb2.TraceChunk(**kw).SerializeToString()
    return T._varint(len(data)) + data


@pytest.mark.parametrize("body,why", [
    (b"\x03\x0a\xff\xff", "corrupt chunk"),                                         # a cut submessage
    (_chunk(seq=1, thread=1, op=[1, 1], size=[8], align=[0, 0], addr=[1, 2], old_addr=[0, 0], dt_ns=[1, 1]),
     "column size has 1 entries, op has 2"),
    (_chunk(seq=1, thread=1, op=[1, 9], size=[8, 8], align=[0, 0], addr=[1, 2], old_addr=[0, 0], dt_ns=[1, 1]),
     "unknown operation 9"),
    (_chunk(seq=1, thread=1, op=[0], size=[8], align=[0], addr=[1], old_addr=[0], dt_ns=[1]), "unknown operation 0"),
    (_chunk(seq=5, thread=1, op=[1], size=[8], align=[0], addr=[1], old_addr=[0], dt_ns=[1]), "numbered 5"),
    (_chunk(seq=1, thread=0, op=[1], size=[8], align=[0], addr=[1], old_addr=[0], dt_ns=[1]), "thread 0"),
    (_chunk(seq=1, header=trace_pb2.Header(format=1)), "a second header"),
    (_chunk(seq=1, footer=trace_pb2.Footer(events=3, chunks=1)), "the footer counts 3 events"),
    (_chunk(seq=1, footer=trace_pb2.Footer(events=0, chunks=1)) + b"\x00", "data after the footer"),
    (_chunk(seq=1, thread=1, op=[1, 1], size=[8, 8], align=[0, 0], addr=[1, 2], old_addr=[0, 0],
            dt_ns=[1, 2 ** 63]), "past 2^63"),
])
def test_corrupt_chunks(tmp_path, body, why):
    p, offs = _with_header(tmp_path, body)
    line = one_error_line(hakmem("trace", "info", p))
    assert why in line, line
    assert line.endswith(f"at byte {offs[-1]}"), (line, offs)     # the first byte not valid
    r = hakmem("trace", "info", p, "--partial", "--json")
    assert r.returncode == 0, r.stderr
    assert why in json.loads(r.stdout)["cut"]["why"]


def test_header_problems(tmp_path):
    p = tmp_path / "t.trace"
    p.write_bytes(T.MAGIC + _chunk(seq=0, thread=1, op=[1], size=[8], align=[0], addr=[1], old_addr=[0], dt_ns=[1]))
    assert "the first chunk has no header" in one_error_line(hakmem("trace", "info", p))
    with T.TraceWriter(p, format=2):
        pass
    assert "trace format 2; this hakmem reads format 1" in one_error_line(hakmem("trace", "info", p))
    with T.TraceWriter(p, class_size=[0, 32, 16]):
        pass
    assert "class table" in one_error_line(hakmem("trace", "info", p))


def test_other_layout_version_refused(tmp_path):
    other = L.LAYOUT_VERSION + 7
    p = write_sample(tmp_path / "t.trace", layout_version=other)
    line = one_error_line(hakmem("trace", "info", p))
    assert f"layout version {other}" in line and f"layout version {L.LAYOUT_VERSION}" in line
    assert line.endswith("at byte 8")
    one_error_line(hakmem("trace", "info", p, "--partial"))       # --partial does not bend the version
    h, _ = T.read_header(p, check_layout=False)
    assert h.layout_version == other
