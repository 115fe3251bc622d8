"""numpy dtypes for the telemetry file, built from the generated layout.

The offsets come from tools/gen_layout.py (the same numbers the C header
checks with _Static_assert); learner/tests/test_layout.py compiles a probe
against that header and compares field by field.
"""
import numpy as np

from ._layout import KERNEL_COUNTERS as _KERNEL, KNOBS, LAYOUT

MAGIC = LAYOUT["magic"].encode("ascii")
MAGIC_U64 = LAYOUT["magic_u64"]
LAYOUT_VERSION = LAYOUT["layout_version"]
NUM_CLASSES = LAYOUT["num_classes"]
RING_SLOTS = LAYOUT["ring_slots"]
HEADER_SIZE = LAYOUT["header_size"]
CLASS_COUNTERS = tuple(LAYOUT["class_counters"])
PROC_COUNTERS = tuple(LAYOUT["proc_counters"])
GAUGES = frozenset(LAYOUT["gauges"])
KERNEL_COUNTERS = tuple(n for n, _d in _KERNEL)   # hakmem-bpf's, in its order (kernel.py)
KNOBS_PER_CLASS = tuple(k["name"] for k in KNOBS if k["per_class"])   # knobs.py: the Knobs type

_PRIM = {"u32": "<u4", "u64": "<u8"}
_cache = {}


def dtype(struct):
    """The numpy dtype of one struct of the layout (header, record, ...)."""
    if struct in _cache:
        return _cache[struct]
    spec = LAYOUT["structs"][struct]
    names, formats, offsets = [], [], []
    for name, ftype, count, offset in spec["fields"]:
        if ftype == "char":
            fmt = np.dtype(f"S{count}")
        else:
            base = np.dtype(_PRIM[ftype]) if ftype in _PRIM else dtype(ftype)
            fmt = base if count == 1 else np.dtype((base, (count,)))
        names.append(name)
        formats.append(fmt)
        offsets.append(offset)
    dt = np.dtype({"names": names, "formats": formats, "offsets": offsets,
                   "itemsize": spec["size"]})
    _cache[struct] = dt
    return dt


def offset_of(struct, field):
    for name, _t, _c, offset in LAYOUT["structs"][struct]["fields"]:
        if name == field:
            return offset
    raise KeyError(f"{struct}.{field}")


HEADER = dtype("header")
RECORD = dtype("record")
POLICY_SLOT = dtype("policy_slot")
POLICY_AREA = dtype("policy_area")
