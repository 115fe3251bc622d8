"""The layout contract: the generated files are current, and the C structs
and the numpy dtypes agree on every field's offset and size."""
import subprocess
import sys

import numpy as np

from conftest import ROOT
from hakmem import layout as L

PROBE = r'''
#include <stdio.h>
#include <stddef.h>
#include "hakmem.h"
#include "shm_layout.h"
#define FIELD(T, f) printf("field %s %s %zu %zu\n", #T, #f, offsetof(T, f), sizeof(((T*)0)->f));
#define SIZE(T) printf("size %s %zu\n", #T, sizeof(T));
#define CLS(n, d) printf("class_counter %s\n", #n);
#define PROC(n, d) printf("proc_counter %s\n", #n);
#define STATS_CLS(n, d) printf("stats_class %s %zu\n", #n, offsetof(hk_class_stats_t, n));
int main(void) {
  HK_SHM_FIELDS(FIELD)
  SIZE(hk_shm_header_t) SIZE(hk_shm_record_t) SIZE(hk_shm_policy_slot_t)
  SIZE(hk_shm_policy_area_t) SIZE(hk_shm_proc_t) SIZE(hk_shm_class_t)
  HK_CLASS_COUNTERS(CLS)
  HK_PROC_COUNTERS(PROC)
  HK_CLASS_COUNTERS(STATS_CLS)
  printf("const magic %llu\n", (unsigned long long)HK_SHM_MAGIC);
  printf("const layout_version %u\n", HK_SHM_LAYOUT_VERSION);
  printf("const num_classes %u\n", HK_SHM_NUM_CLASSES);
  printf("const hk_num_classes %u\n", HK_NUM_CLASSES);
  printf("const ring_slots %u\n", HK_SHM_RING_SLOTS);
  printf("const header_size %u\n", HK_SHM_HEADER_SIZE);
  return 0;
}
'''

CTYPE = {"hk_shm_header_t": "header", "hk_shm_record_t": "record", "hk_shm_policy_slot_t": "policy_slot",
         "hk_shm_policy_area_t": "policy_area", "hk_shm_proc_t": "proc_counters",
         "hk_shm_class_t": "class_counters"}


def probe(tmp_path):
    src = tmp_path / "probe.c"
    src.write_text(PROBE)
    exe = tmp_path / "probe"
    subprocess.run(["cc", "-std=gnu11", "-Wall", "-Werror", f"-I{ROOT}/allocator/include",
                    f"-I{ROOT}/allocator/src", str(src), "-o", str(exe)], check=True)
    return subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.splitlines()


def test_generated_files_are_current():
    r = subprocess.run([sys.executable, str(ROOT / "tools/gen_layout.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_c_and_numpy_agree(tmp_path):
    lines = probe(tmp_path)
    fields = [l.split()[1:] for l in lines if l.startswith("field ")]
    seen = {}
    for ctype, name, off, size in fields:
        struct = CTYPE[ctype]
        dt = L.dtype(struct)
        assert name in dt.fields, f"{struct}.{name} is in C but not in numpy"
        fdt, foff = dt.fields[name][:2]
        assert foff == int(off), f"{struct}.{name}: C offset {off}, numpy {foff}"
        assert fdt.itemsize == int(size), f"{struct}.{name}: C size {size}, numpy {fdt.itemsize}"
        seen.setdefault(struct, set()).add(name)
    for struct, names in seen.items():
        assert names == set(L.dtype(struct).names), f"{struct}: numpy has fields C lacks"
    sizes = {CTYPE[l.split()[1]]: int(l.split()[2]) for l in lines if l.startswith("size ")}
    for struct, size in sizes.items():
        assert L.dtype(struct).itemsize == size, struct
    assert set(sizes) == set(CTYPE.values())


def test_counter_lists_agree(tmp_path):
    lines = probe(tmp_path)
    c_class = [l.split()[1] for l in lines if l.startswith("class_counter ")]
    c_proc = [l.split()[1] for l in lines if l.startswith("proc_counter ")]
    assert tuple(c_class) == L.CLASS_COUNTERS
    assert tuple(c_proc) == L.PROC_COUNTERS
    assert list(L.dtype("class_counters").names) == c_class
    assert list(L.dtype("proc_counters").names) == c_proc
    # hk_stats_t (the public API) is generated from the same list.
    assert [l.split()[1] for l in lines if l.startswith("stats_class ")] == c_class


def test_constants_agree(tmp_path):
    consts = {l.split()[1]: int(l.split()[2]) for l in probe(tmp_path) if l.startswith("const ")}
    assert consts["magic"] == L.MAGIC_U64 == int.from_bytes(L.MAGIC, "little")
    assert consts["layout_version"] == L.LAYOUT_VERSION
    assert consts["num_classes"] == consts["hk_num_classes"] == L.NUM_CLASSES
    assert consts["ring_slots"] == L.RING_SLOTS
    assert consts["header_size"] == L.HEADER_SIZE == L.HEADER.itemsize


def test_the_telemetry_file_stays_small():
    """Every preloaded process maps its telemetry file while learnd runs,
    and writes a record each epoch until the whole ring is resident: it is
    in that process's PSS. At 128 records it was 1.18 MB, 0.8% of a perl's
    PSS in learn_real (and 118 MB over a hundred PostgreSQL backends);
    learnd reads the newest record and counters are cumulative, so a short
    ring loses nothing but history."""
    size = L.HEADER_SIZE + L.RING_SLOTS * L.RECORD.itemsize + L.POLICY_AREA.itemsize
    assert size <= 256 << 10, f"a telemetry file of {size} bytes"
    # `hakmem ring --window 1` (the default) needs a second of records at
    # the default epoch (100 ms).
    assert L.RING_SLOTS * 100 >= 1000 + 100


def test_no_field_overlaps():
    for struct in ("header", "record", "policy_slot", "policy_area"):
        dt = L.dtype(struct)
        spans = sorted((off, off + fdt.itemsize, name) for name, (fdt, off, *_) in dt.fields.items())
        for (a0, a1, an), (b0, b1, bn) in zip(spans, spans[1:]):
            assert a1 <= b0, f"{struct}: {an} overlaps {bn}"
        assert spans[-1][1] <= dt.itemsize
        assert np.dtype(dt).itemsize == dt.itemsize


def test_the_bounds_import_and_pin_check_are_the_allocators(shm):
    """import and `pin --set` check knobs without a live process
    (knobs.Bounds.for_class_sizes: each knob's "max" rule and the slab
    geometry of classes.c); a live process publishes the bounds it applies
    in its header. They must be the same for every class, and the class
    table the same as trace.default_class_sizes."""
    from conftest import ring_path, scaled, start
    from hakmem.knobs import Bounds
    from hakmem.ring import Ring
    from hakmem.trace import default_class_sizes
    w = start(["burst", 64, 100, scaled(1)], shm)
    try:
        with Ring(ring_path(shm, w.pid)) as r:
            h = r.header()
    finally:
        w.communicate(timeout=scaled(30))
    sizes = [int(x) for x in h["class_size"]]
    assert sizes[1:] == default_class_sizes()[1:]
    assert Bounds.for_class_sizes(sizes) == Bounds.from_header(h)
