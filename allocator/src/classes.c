/* classes.c — the size classes: their sizes, slab geometry and lookup tables.
 *
 * Filled once at initialization (init.c:_hk_init) from a formula, before
 * any allocation is served, and read without locks ever after; the aligned
 * tables are built at the first aligned request instead (see below).
 * Sizes: 16..128 step 16, then four classes per doubling up to 1 MiB
 * (internal.h:_hk_class_of).
 */
#include "internal.h"

hk_class_info_t _hk_class[HK_NUM_CLASSES];
uint8_t _hk_small_class[HK_SMALL_MAX / 16 + 1];
uint8_t _hk_medium_class[HK_MEDIUM_MAX / 128 + 1];
intptr_t _hk_tc_fs;
int32_t _hk_small_tls[HK_SMALL_MAX + 1];
int32_t _hk_medium_tls[HK_MEDIUM_MAX / 128 + 1];
size_t _hk_small_end, _hk_medium_end;
hk_div_t _hk_div[HK_NUM_CLASSES] __attribute__((aligned(64)));
uint8_t _hk_align_class[HK_ALIGN_LEVELS][64];
uint8_t _hk_align_small[HK_ALIGN_LEVELS][HK_SMALL_MAX / 16 + 1] HK_SPARSE_BSS;
uint8_t _hk_align_medium[HK_ALIGN_LEVELS][HK_MEDIUM_MAX / 128 + 1] HK_SPARSE_BSS;

/* ---- size classes ----------------------------------------------------------- */
static uint32_t class_size_formula(unsigned cls) {
  if (cls <= 8) return cls * 16u;
  unsigned k = cls - 9;              /* 0.. */
  unsigned b = 7 + k / 4;            /* doubling above 2^b */
  return (uint32_t)((5u + k % 4) << (b - 2));
}

void _hk_classes_init(void) {
#if HK_TC_FS
  /* _hk_tc's offset from the thread pointer, as the fast paths' asm takes
   * it (alloc.c tc_bin); the TLS offsets must fit the tables' 32 bits. */
  uintptr_t tp_off;
  __asm__("movq _hk_tc@gottpoff(%%rip), %0" : "=r"(tp_off));
  _hk_tc_fs = (intptr_t)tp_off;
  if (_hk_tc_fs < INT32_MIN || _hk_tc_fs + (intptr_t)sizeof _hk_tc.bin > INT32_MAX)
    _hk_fatal("static TLS too large for 32-bit bin offsets", NULL);
#endif
  for (unsigned cls = 1; cls < HK_NUM_CLASSES; cls++) {
    hk_class_info_t* ci = &_hk_class[cls];
    uint32_t size = class_size_formula(cls);
    ci->size = size;
    /* Pages per slab: at least 8 blocks up to 64 KiB (4 up to 128 KiB, then
     * one), so medium slabs do not empty and refill at every swing of a
     * working set; at most 1/8 of a slab wasted at its end. */
    unsigned want = size <= 65536 ? 8 : size <= 131072 ? 4 : 1;
    unsigned best = 0;
    for (unsigned k = 1; k <= HK_SLAB_MAX_PAGES; k++) {
      uint64_t bytes = (uint64_t)k << HK_PAGE_SHIFT;
      if (bytes / size < want) continue;
      if ((bytes % size) * 8 <= bytes) { best = k; break; }
    }
    if (!best) best = (unsigned)((size + HK_PAGE_SIZE - 1) >> HK_PAGE_SHIFT);
    ci->slab_pages = best;
    ci->slab_blocks = (uint32_t)(((uint64_t)best << HK_PAGE_SHIFT) / size);
    /* 4 KiB of blocks, 8 to 256 of them (slab.c "chains"). */
    uint32_t chain = 4096u / size;
    ci->chain_len = chain < 8 ? 8 : chain > 256 ? 256 : chain;
    uint64_t c = UINT64_MAX / size + 1;
    uint64_t e = c * size;                    /* d*c mod 2^64, < size */
    _hk_div[cls].magic = c;
    _hk_div[cls].limit = e ? (uint64_t)ci->slab_blocks * e : c;
  }
#if HK_DEBUG
  /* The block-start test against plain division, for every block start,
   * the slack after the last block, and offsets just off a boundary. */
  for (unsigned cls = 1; cls < HK_NUM_CLASSES; cls++) {
    uint64_t size = _hk_class[cls].size, blocks = _hk_class[cls].slab_blocks;
    uint64_t span = (uint64_t)_hk_class[cls].slab_pages << HK_PAGE_SHIFT;
    for (uint64_t q = 0; q <= blocks; q++)
      for (uint64_t d = 0; d < 64 && q * size + d < span; d += 16) {
        uint64_t off = q * size + d;
        bool want = off % size == 0 && off / size < blocks;
        HK_ASSERT((off * _hk_div[cls].magic < _hk_div[cls].limit) == want);
      }
  }
#endif
  /* From the top down, so each alignment is one pass over the classes. */
  for (unsigned k = 0; k < HK_ALIGN_LEVELS; k++) {
    unsigned next = 0;   /* the nearest class above with aligned blocks */
    for (unsigned c = HK_NUM_CLASSES - 1; c >= 1; c--) {
      if ((_hk_class[c].size & ((1u << (k + HK_ALIGN_SHIFT0)) - 1)) == 0) next = c;
      _hk_align_class[k][c] = (uint8_t)next;
    }
  }
  /* Sizes grow with i, so each table is one merge-like pass: the class
   * search resumes where the last entry's ended (restarting it at class 1
   * for each of the 257 medium entries cost ~45k instructions, a third of
   * what preloading hakmem adds to a process that never allocates). */
  unsigned cls = 1;
  for (unsigned i = 0; i <= HK_SMALL_MAX / 16; i++) {
    size_t n = i ? (size_t)i * 16 : 1;
    while (_hk_class[cls].size < n) cls++;
    _hk_small_class[i] = (uint8_t)cls;
  }
  cls = 1;
  for (unsigned i = 0; i <= HK_MEDIUM_MAX / 128; i++) {
    size_t n = i ? (size_t)i * 128 : 1;
    while (_hk_class[cls].size < n) cls++;
    _hk_medium_class[i] = (uint8_t)cls;
  }
  /* malloc's tables (internal.h), from _hk_class_of. Every class size up
   * to 1 KiB is a multiple of 16, so the sizes in (16(i-1), 16i] share a
   * class, that of the group's smallest: 16 entries at a time (vector
   * stores; one at a time cost ~4k instructions at every start). */
  _hk_small_tls[0] = _hk_bin_tls(_hk_class_of(0));
  for (unsigned i = 1; i <= HK_SMALL_MAX / 16; i++) {
    int32_t tls = _hk_bin_tls(_hk_class_of(i * 16 - 15));
    for (unsigned j = 0; j < 16; j++) _hk_small_tls[i * 16 - 15 + j] = tls;
  }
  for (unsigned i = 0; i <= HK_MEDIUM_MAX / 128; i++) _hk_medium_tls[i] = _hk_bin_tls(_hk_medium_class[i]);
#if HK_DEBUG
  for (size_t n = 0; n <= HK_MEDIUM_MAX; n++) {   /* the smallest class that holds n */
    unsigned c = _hk_class_of(n);
    HK_ASSERT(c >= 1 && _hk_class[c].size >= n && (c == 1 || _hk_class[c - 1].size < n));
    HK_ASSERT((n <= HK_SMALL_MAX ? _hk_small_tls[n] : _hk_medium_tls[(n + 127) >> 7]) == _hk_bin_tls(c));
  }
#endif
  /* Last: a malloc that sees an end sees the table it guards. */
  __atomic_store_n(&_hk_small_end, (size_t)HK_SMALL_MAX + 1, __ATOMIC_RELEASE);
  __atomic_store_n(&_hk_medium_end, (size_t)HK_MEDIUM_MAX + 1, __ATOMIC_RELEASE);
}

/* Built at the first aligned request's slow path rather than at start: 4 KiB
 * of tables that most processes never read. Until then they read 0, which
 * sends aligned requests to the slow path (bin 0 is always empty). */
void _hk_align_tables_build(void) {
  static _Atomic int state;   /* 0 none, 1 building, 2 built */
  int expect = 0;
  if (hk_load_relaxed(&state) != 0 || !atomic_compare_exchange_strong(&state, &expect, 1)) return;
  for (unsigned k = 0; k < HK_ALIGN_LEVELS; k++) {
    for (unsigned i = 0; i <= HK_SMALL_MAX / 16; i++)
      _hk_align_small[k][i] = _hk_align_class[k][_hk_small_class[i]];
    for (unsigned i = 0; i <= HK_MEDIUM_MAX / 128; i++)
      _hk_align_medium[k][i] = _hk_align_class[k][_hk_medium_class[i]];
  }
  atomic_store(&state, 2);
}
