"""`hakmem trace info`: what a trace file holds (hakmem/trace.py reads it)."""
import sys

from ..trace import TraceError, events, rename_objects, summarize
from .common import _out_json, _table



class OutputError(Exception):
    """The chart could not be written."""


ERRORS = (TraceError, OutputError)      # what main() reports as one line

_SPARK = "▁▂▃▄▅▆▇█"


def _bytes(n):
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} B"


def _ms(ns):
    return f"{ns / 1e6:.3f} ms" if ns < 1e9 else f"{ns / 1e9:.3f} s"


def _num(x, fmt="{:.3g}"):
    return "-" if x is None else fmt.format(x)


def _sparkline(values, width=60):
    if not values:
        return ""
    step = max(1, len(values) // width)
    vals = [max(values[i:i + step]) for i in range(0, len(values), step)]
    top = max(vals) or 1
    return "".join(_SPARK[min(len(_SPARK) - 1, int(v * len(_SPARK) / (top + 1)))] for v in vals)


def _print(s):
    h = s["header"]
    mode = h["mode"]
    if mode == "sampled":
        mode += f" (one pick per {_bytes(h['sample_bytes'])} allocated on average)"
    elif mode == "live":
        lim = [f"{h['limit_seconds']} s" if h["limit_seconds"] else "", _bytes(h["limit_bytes"]) if h["limit_bytes"] else ""]
        mode += f" (bounded by {' and '.join(x for x in lim if x) or 'nothing'})"
    print(f"{s['file']}: {s['file_size']:,} bytes, {s['chunks']} chunks, trace format {h['format']}, "
          f"layout {h['layout_version']}")
    print(f"program: {h['exe'] or '?'}{' (' + h['argv0'] + ')' if h['argv0'] else ''}  pid {h['pid']}  "
          f"hakmem {h['hakmem_version'] or '?'}{'  build id ' + h['build_id'] if h['build_id'] else ''}")
    print(f"mode: {mode}")
    ft, cut = s["footer"], s["cut"]
    if ft is not None:
        print(f"end: {ft['end_reason'] or '?'}; {ft['events']:,} events written, {ft['dropped']:,} dropped")
    if cut is not None:
        why = cut["why"][len("cut short: "):] if cut["why"].startswith("cut short: ") else cut["why"]
        print(f"cut short at byte {cut['at_byte']:,}: {why}; read the {cut['valid_bytes']:,} valid bytes")
    print(f"events: {s['events']:,} from {s['threads']} threads over {_ms(s['duration_ns'])}")
    print("  " + ", ".join(f"{k} {v:,}" for k, v in s["ops"].items()))
    print(f"allocated: {_bytes(s['bytes_allocated'])} in {s['objects']:,} objects ({s['failed_allocs']} failed); "
          f"{s['objects_freed']:,} freed, {s['objects_live_at_end']:,} live at the end; "
          f"{s['unmatched_frees']:,} frees of blocks allocated outside the trace")
    lb = s["live_bytes"]
    print(f"live bytes: peak {_bytes(lb['peak'])} at {_ms(lb['peak_time_ns'])}, {_bytes(lb['at_end'])} at the end")
    if lb["series"]:
        print(f"  {_sparkline([v for _t, v in lb['series']])}")
    if s["classes"]:
        print("size classes (allocations by the size asked for; lifetimes of the objects freed in the trace):")
        rows = [(c["class"], "huge" if c["class"] == 0 else c["size"], f"{c['allocs']:,}", _bytes(c["bytes"]),
                 f"{c['live_at_end']:,}", _num(c["lifetime_ms"]["median"]), _num(c["lifetime_ms"]["p90"]),
                 _num(c["lifetime_ops"]["median"], "{:.0f}"), _num(c["lifetime_ops"]["p90"], "{:.0f}"))
                for c in s["classes"]]
        _table(("class", "size", "allocs", "bytes", "live@end", "life ms p50", "p90", "life ops p50", "p90"), rows)


def _png(s, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(9, 7))
    ser = s["live_bytes"]["series"]
    a1.plot([t / 1e9 for t, _ in ser], [v / 2**20 for _, v in ser], drawstyle="steps-post")
    a1.set_xlabel("seconds since capture start")
    a1.set_ylabel("live MiB")
    a1.set_title(f"{s['header']['exe'] or s['file']}: live bytes")
    cl = s["classes"]
    a2.bar(range(len(cl)), [c["allocs"] for c in cl])
    a2.set_xticks(range(len(cl)))
    a2.set_xticklabels(["huge" if c["class"] == 0 else str(c["size"]) for c in cl], rotation=90, fontsize=7)
    a2.set_xlabel("size class (bytes)")
    a2.set_ylabel("allocations")
    fig.tight_layout()
    try:
        fig.savefig(out, format="png")
    except OSError as e:
        raise OutputError(f"{out}: {e.strerror or e}") from None
    finally:
        plt.close(fig)


def cmd_trace_info(args):
    from ..progress import progress
    # A bar (on a terminal only) for big files: reading costs about a
    # second per 2 million events.
    with progress(total=None, desc="reading", unit="B", leave=False) as bar:
        def seen(done, total):
            if bar.total is None:
                bar.total = total
            bar.update(done - bar.n)
        ev = events(args.file, partial=args.partial, on_progress=seen)
    if ev.stopped is not None and not args.json:
        print(f"hakmem: warning: {ev.stopped}; showing the {ev.valid_bytes:,} bytes before it", file=sys.stderr)
    s = summarize(ev)
    if args.png:
        _png(s, args.png)
    if args.json:
        _out_json(s)
    else:
        _print(s)
        if args.png:
            print(f"chart: {args.png}")
    return 0
