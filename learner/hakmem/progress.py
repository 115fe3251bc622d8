"""Progress bars for hakmem's long commands (benchmarks, replay sweeps, the demo).

One library (tqdm), one small API, silent when nobody is watching: a bar is
drawn on stderr only when stderr is a terminal, so logs, pipes, CI and
`--json` output never see a carriage return.

    from hakmem.progress import progress

    for case in progress(cases, desc="bench"):          # an iterable
        run(case)

    with progress(total=60, desc="learning", unit="s") as bar:   # by hand
        bar.update(1)
        bar.set_postfix_str("policy v3 accepted")
        bar.write("a line that does not break the bar")

HAKMEM_PROGRESS=0 turns bars off, HAKMEM_PROGRESS=1 forces them on (a
terminal that does not say it is one).
"""
from __future__ import annotations

import os
import sys


def enabled(stream=None) -> bool:
    """Whether a bar would be drawn on stream (default stderr)."""
    force = os.environ.get("HAKMEM_PROGRESS", "").strip()
    if force in ("0", "1"):
        return force == "1"
    stream = stream or sys.stderr
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class _Silent:
    """What progress() gives when no bar is drawn: the same calls, doing
    nothing but counting (n) and passing write() through to the stream."""

    def __init__(self, iterable=None, total=None, stream=None):
        self.iterable, self.total, self.n = iterable, total, 0
        self.stream = stream or sys.stderr

    def __iter__(self):
        for x in self.iterable if self.iterable is not None else ():
            self.n += 1
            yield x

    def __len__(self):
        return self.total if self.total is not None else len(self.iterable)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n=1):
        self.n += n

    def set_description(self, desc=None, refresh=True):
        pass

    def set_postfix_str(self, s="", refresh=True):
        pass

    def write(self, s):
        print(s, file=self.stream, flush=True)

    def close(self):
        pass


def progress(iterable=None, total=None, desc: str = "", unit: str = "it", stream=None, leave=True):
    """A tqdm bar over iterable (or a bar to update() by hand, of total
    steps), on stderr; a silent stand-in with the same methods (update,
    set_description, set_postfix_str, write, close, a context manager and
    an iterator) when stderr is not a terminal."""
    stream = stream or sys.stderr
    if total is None and iterable is not None and hasattr(iterable, "__len__"):
        total = len(iterable)
    if not enabled(stream):
        return _Silent(iterable, total, stream)
    from tqdm import tqdm
    return tqdm(iterable, total=total, desc=desc, unit=unit, file=stream, leave=leave, dynamic_ncols=True)


def write(msg: str, stream=None):
    """A line that does not break a bar being drawn (tqdm.write), or a plain line."""
    stream = stream or sys.stderr
    if enabled(stream):
        from tqdm import tqdm
        tqdm.write(msg, file=stream)
    else:
        print(msg, file=stream, flush=True)
