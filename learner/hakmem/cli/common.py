"""What every `hakmem` command shares: failing with one line, and the plain
output helpers (tables, times, JSON). Light: imported before any command
runs."""
import json
import sys
import time


def _fail(msg, code=1):
    print(f"hakmem: error: {msg}", file=sys.stderr)
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
