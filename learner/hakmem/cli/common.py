"""What every `hakmem` command shares: failing with one line, and the plain
output helpers (tables, times, JSON). Light: imported before any command
runs."""
import json
import re
import sys
import time

# C0 but tab and newline, DEL, C1: what a terminal takes as a command.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """text with control characters written out (\\x1b, \\r, ...): what a
    policy file's note, a program's name (any user names their executables)
    or a telemetry file says reaches a terminal as text, never as an escape
    sequence that moves the cursor, rewrites earlier lines or sets the title."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


class Printable:
    """A text stream whose writes pass through printable(): every command's
    stdout (main). Binary output (policy export) goes through .buffer, as is."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        return self._stream.write(printable(text))

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _fail(msg, code=1):
    print(f"hakmem: error: {printable(str(msg))}", file=sys.stderr)
    return code


class _Usage(Exception):
    """A command line argparse cannot catch on its own (exit 2)."""


def _out_json(data):
    json.dump(data, sys.stdout)
    print()


def _when(t):
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def _span(s):
    s = max(0, int(s))
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    if d:
        return f"{d}d{h:02d}h"
    if h:
        return f"{h}h{m:02d}m"
    return f"{m}m{s:02d}s" if m else f"{s}s"


def _table(head, rows, indent="  "):
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    for row in (head, *rows):
        print((indent + "  ".join(str(x).rjust(w) for x, w in zip(row, widths))).rstrip())
