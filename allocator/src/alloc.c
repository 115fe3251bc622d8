/* alloc.c — the public allocation API: fast paths and their slow paths.
 *
 * The fast paths touch only the calling thread's cache (TLS, initial-exec):
 * no locks, no atomics, no syscalls, no shared-memory writes. Everything
 * else — first use by a thread, empty or full caches, policy changes, huge
 * objects, misuse — falls through one unlikely branch into a noinline slow
 * path.
 */
#define _GNU_SOURCE
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>

#include "internal.h"
#include "prim.h"
#include "trace.h"

/* ---- fast paths ----------------------------------------------------------------
 * malloc of a small size runs 13 instructions (callgrind) with two tests:
 * the size table (indexed by the size, giving the bin's TLS offset), load
 * head, test, count down (sets the flags), test, load next, store head,
 * room+1. free runs 24: map byte (whose chunk number, shifted back, is the
 * segment), page's bin, block-start test (a multiply, with the class's
 * constants on the bin's own line), adjacent-double-free test, room-1
 * (sets the flags), test, push. A malloc+free pair is 47 with
 * bench/callgrind.sh's loop and PLT jumps (10). Class 0 (huge sizes, pages
 * without a slab) has an empty bin with block-start limit 0, so those
 * cases reach the slow paths through the same tests.
 */
/* ---- the thread cache through %fs ---------------------------------------------
 * On x86-64 the fast paths reach this thread's bins with %fs-relative
 * addresses (GCC's __seg_fs). malloc's size tables and a segment's
 * page_tls give the bin as its TLS offset (internal.h "reaching the thread
 * cache"): the bin is at %fs:(that), not one instruction to compute. Where
 * a fast path has the class instead (calloc, the aligned calls, malloc of
 * a size above 32 KiB or before init), tc_bin adds _hk_tc's offset from
 * the thread pointer to HK_BIN_OFF(cls): one add from the GOT
 * (initial-exec TLS). A plain pointer costs more: %fs:0 + offset + class.
 * A function that reaches the cache through a plain pointer too (the slow
 * paths) must not also use these: GCC takes the two address spaces for
 * disjoint. Off x86-64, and in the valgrind build (whose annotations want
 * the plain bin), TC_AS is empty and the bins plain pointers. */
#if HK_TC_FS
#define TC_AS __seg_fs
/* Both in %rdx: left to itself, GCC loaded free()'s bin over the register
 * that held the segment's address, and copied that first. */
HK_INLINE TC_AS hk_bin_t* tc_bin(uintptr_t off) {
  __asm__("addq _hk_tc@gottpoff(%%rip), %0" : "+d"(off) : : "cc");
  return (TC_AS hk_bin_t*)off;
}
HK_INLINE TC_AS hk_bin_t* tc_bin_tls(int32_t tls) {
  intptr_t a = tls;
  __asm__("" : "+d"(a));
  return (TC_AS hk_bin_t*)a;
}
/* For malloc: the block popped goes straight to %rax, where malloc returns
 * it (left to itself GCC loaded it elsewhere and moved it there at the
 * end). */
#define TC_POP_TO_RAX(p) __asm__("" : "+a"(p))
#else
#define TC_AS
HK_INLINE hk_bin_t* tc_bin(uintptr_t off) { return (hk_bin_t*)((char*)_hk_tc.bin + off); }
HK_INLINE hk_bin_t* tc_bin_tls(int32_t tls) { return (hk_bin_t*)((char*)_hk_tc.bin + tls); }
#define TC_POP_TO_RAX(p) ((void)0)
#endif

/* A block from this thread's bin, or NULL when the bin is empty or its
 * check-in is due (a countdown that reaches below zero counts nothing).
 * tc_bin_pop takes tc_bin's pointer (the fast paths), bin_pop a plain one. */
#define DEFINE_BIN_POP(name, AS, PIN)                                         \
  HK_INLINE void* name(AS hk_bin_t* bin) {                                    \
    void* p = bin->head;                                                      \
    PIN(p);                                                                   \
    if (HK_UNLIKELY(p == NULL || --bin->left < 0)) return NULL;               \
    bin->head = *(void**)p;                                                   \
    bin->room++;                                                              \
    HK_VG_ALLOC(p, _hk_class[bin - _hk_tc.bin].size);                         \
    return p;                                                                 \
  }
#define NO_PIN(p) ((void)0)
DEFINE_BIN_POP(bin_pop, , NO_PIN)
DEFINE_BIN_POP(tc_bin_pop, TC_AS, NO_PIN)
DEFINE_BIN_POP(tc_bin_pop_rax, TC_AS, TC_POP_TO_RAX)

HK_INLINE void* alloc_cls(unsigned cls, size_t n) {
  void* p = bin_pop(&_hk_tc.bin[cls]);
  return HK_LIKELY(p != NULL) ? p : _hk_malloc_slow(n, cls);
}

HK_INLINE void free_fast(void* p) {
  /* _hk_map_kind, spelled out so that the chunk number it looks up gives
   * the segment too (a shift, where p & ~(HK_SEG_SIZE - 1) took a copy and
   * a mask). The two differ only for a p with bits above 47 set, which is
   * no user-space address (x86-64, 4-level paging): the map, which never
   * looked at those bits, answers for its 47-bit alias, and free() then
   * faults writing the link into p as it faulted reading a header at
   * p & ~mask. Only p and a real bin are ever written. */
  uintptr_t chunk = ((uintptr_t)p >> HK_SEG_SHIFT) & (HK_MAP_ENTRIES - 1);
  if (HK_UNLIKELY(_hk_map[chunk] != HK_MAP_SEGMENT)) { _hk_free_slow(p); return; }
  const hk_segment_t* seg = (const hk_segment_t*)(chunk << HK_SEG_SHIFT);
  /* _hk_is_block_start, spelled out so that the offset in the segment
   * gives the page and the offset in the slab alike. */
  uintptr_t in_seg = (uintptr_t)p & (HK_SEG_SIZE - 1);
  unsigned page = (unsigned)(in_seg >> HK_PAGE_SHIFT);
  uint64_t off = in_seg - seg->page_start[page];
  TC_AS hk_bin_t* bin = tc_bin_tls(seg->page_tls[page]);
  if (HK_UNLIKELY(off * bin->magic >= bin->limit || p == bin->head)) {
    _hk_free_slow(p);
    return;
  }
  if (HK_UNLIKELY(--bin->room < 0)) {   /* full: _hk_free_slow undoes this and drains */
    _hk_free_slow(p);
    return;
  }
  HK_VG_FREE(p);
  *(void**)p = bin->head;
  bin->head = p;
}

/* ---- slow paths ---------------------------------------------------------------- */
/* malloc_trim in any thread asks every thread to return its cached blocks;
 * each does so on its next slow path (no thread touches another's cache). */
static _Atomic uint64_t trim_epoch;

static hk_tcache_t* tcache_slow(void) {
  hk_tcache_t* tc = &_hk_tc;
  if (HK_UNLIKELY(tc->state == HK_TC_NEW)) {
    _hk_tcache_setup();
    tc->trim_epoch = hk_load_relaxed(&trim_epoch);
  } else if (tc->state == HK_TC_ACTIVE) {
    if (tc->policy_version != _hk_policy_current_version()) _hk_tcache_apply_policy(tc);
    uint64_t e = hk_load_relaxed(&trim_epoch);
    if (HK_UNLIKELY(tc->trim_epoch != e)) {
      tc->trim_epoch = e;
      _hk_flush_thread(tc);
    }
  }
  return tc;
}

/* ---- check-in -------------------------------------------------------------------
 * A thread whose cache serves every call would never reach a slow path: it
 * would write no telemetry, take up no policy, drain nothing and miss
 * malloc_trim. So each bin counts its allocations down (the decrement that
 * used to count them up, plus one branch) and, when the count runs out,
 * the next allocation of that class takes the slow path once: the thread
 * takes up the policy in force and any malloc_trim (tcache_slow), publishes
 * the bin's counters, runs the drain/decay checks and the telemetry tick
 * (maybe_gc), and draws the next countdown.
 *
 * The draw is in bytes, as tcmalloc's sampler: uniform in [B/2, 3B/2) for
 * a mean of B = CHECKIN_BYTES, turned into blocks of the class, at most
 * CHECKIN_MAX_BLOCKS, and for classes above 2 KiB (where B/2 is fewer
 * blocks) uniform in [CHECKIN_MIN_BLOCKS, 2 * CHECKIN_MIN_BLOCKS) instead.
 * Random, so a periodic program cannot fall into step with it; bounded
 * above, so a thread that allocates at all checks in within
 * CHECKIN_MAX_BLOCKS allocations of one class (well under a millisecond of
 * back-to-back small allocations); bounded below because a check-in costs
 * about 190 instructions whatever the block size: at 512 allocations or
 * more it adds under 0.4 of an instruction to each (bench/callgrind.sh;
 * a floor of 32 cost mid_large_mt 3.6% more instructions). Allocations
 * counted stay exact: see hk_bin_t.mark and _hk_bin_allocs. */
#define CHECKIN_BYTES      (1u << 20)
#define CHECKIN_MIN_BLOCKS 512u
#define CHECKIN_MAX_BLOCKS 32768u

HK_INLINE void checkin_arm(hk_tcache_t* tc, hk_bin_t* bin, unsigned cls) {
  hk_add_relaxed(&_hk_central[cls].c.checkins, 1);
  uint64_t x = tc->rng;   /* xorshift64 (Marsaglia 2003) */
  x ^= x << 13;
  x ^= x >> 7;
  x ^= x << 17;
  tc->rng = x;
  uint32_t bytes = CHECKIN_BYTES / 2 + (uint32_t)((x >> 32) & (CHECKIN_BYTES - 1));
  uint32_t blocks = bytes / _hk_class[cls].size;
  if (blocks < CHECKIN_MIN_BLOCKS) blocks = CHECKIN_MIN_BLOCKS + (uint32_t)(x & (CHECKIN_MIN_BLOCKS - 1));
  if (blocks > CHECKIN_MAX_BLOCKS) blocks = CHECKIN_MAX_BLOCKS;
  uint64_t done = _hk_bin_allocs(bin);
  bin->left = (int32_t)blocks;
  _hk_bin_cold(bin)->mark = done + blocks;
}

/* Idle classes give their cached blocks back every drain interval, and idle
 * warm pools shrink; telemetry records and policy snapshots are looked at.
 * Checked on the slow path only, with the cheapest clock. */
static void maybe_gc(hk_tcache_t* tc) {
  uint64_t now = _hk_os_now_coarse_ns();
  if (_hk_tel_on) _hk_tel_tick(now);
  uint32_t ms = _hk_drain_ms();
  if (ms == 0) return;
  uint64_t interval = (uint64_t)ms * 1000000u;
  if (now - tc->last_gc_ns < interval) return;
  tc->last_gc_ns = now;
  _hk_warm_decay(now, interval);
  for (unsigned cls = 1; cls < HK_NUM_CLASSES; cls++) {
    hk_bin_t* bin = &tc->bin[cls];
    uint64_t allocs = _hk_bin_allocs(bin);
    if (allocs == tc->gc_allocs[cls]) {
      if (_hk_bin_count(bin)) {
        _hk_drain(tc, cls, _hk_bin_count(bin));
        tc->cold[cls].fill = 0;   /* back to a slow start */
      }
      _hk_stash_flush(tc, cls);
    }
    tc->gc_allocs[cls] = allocs;
  }
  _hk_background_maybe_start(now);   /* last: this thread's cache is consistent */
}

/* ---- capture traps (trace.h) -----------------------------------------------------
 * While a capture is on, a thread's bins keep a block-start limit of 0
 * (every free fails the test and takes the slow path) and, outside
 * SAMPLED, a countdown far below zero (every allocation does): the fast
 * paths stay as they are, not one instruction more. The real limit comes
 * back from _hk_div, the real countdown waits in _hk_trace_tls; both are
 * put back around the real work, so the policy in force still governs. A
 * trapped countdown keeps the blocks counted exact: mark loses what `left`
 * still had to count, and gets it back. */
#define TRAP_LEFT (INT32_MIN / 2)

static void trap_bin(hk_bin_t* bin, unsigned cls, unsigned how) {
  hk_trace_tls_t* t = &_hk_trace_tls;
  bin->limit = 0;
  if (how == HK_TRAP_ALL) {
    t->left[cls] = bin->left;
    if (bin->left > 0) _hk_bin_cold(bin)->mark -= (uint64_t)bin->left;
    bin->left = TRAP_LEFT;
  }
}

static void untrap_bin(hk_bin_t* bin, unsigned cls, unsigned how) {
  hk_trace_tls_t* t = &_hk_trace_tls;
  bin->limit = _hk_div[cls].limit;
  if (how == HK_TRAP_ALL) {
    bin->left = t->left[cls];
    if (bin->left > 0) _hk_bin_cold(bin)->mark += (uint64_t)bin->left;
  }
}

/* After tcache_slow: trap or untrap the whole cache as the capture wants
 * (a new policy writes capacities, which no trap touches). Returns how the
 * bins are trapped now. */
static unsigned trace_sync(hk_tcache_t* tc) {
  hk_trace_tls_t* t = &_hk_trace_tls;
  unsigned want = _hk_trace_trap_wanted(tc->state == HK_TC_ACTIVE);
  if (HK_LIKELY(t->trapped == want)) return want;
  if (t->trapped)
    for (unsigned cls = 1; cls < HK_NUM_CLASSES; cls++) untrap_bin(&tc->bin[cls], cls, t->trapped);
  if (want)
    for (unsigned cls = 1; cls < HK_NUM_CLASSES; cls++) trap_bin(&tc->bin[cls], cls, want);
  t->trapped = (uint8_t)want;
  return want;
}

/* A block of class cls for this thread, by the policy in force. */
HK_INLINE void* alloc_small(hk_tcache_t* tc, unsigned cls) {
  hk_bin_t* bin = &tc->bin[cls];
  void* p;
  if (HK_UNLIKELY(tc->state != HK_TC_ACTIVE || tc->cold[cls].cap == 0)) {
    p = _hk_alloc_direct(cls);
    if (_hk_tel_on) _hk_tel_tick(_hk_os_now_coarse_ns());   /* check mode, capacity 0 */
  } else {
    if (bin->left <= 0) checkin_arm(tc, bin, cls);
    if ((p = bin_pop(bin)) != NULL) {   /* the countdown ran out: check in */
      _hk_publish(tc, cls);
      maybe_gc(tc);
      return p;
    }
    p = _hk_refill(tc, cls);   /* publishes */
    maybe_gc(tc);
  }
  if (HK_LIKELY(p)) HK_VG_ALLOC(p, _hk_class[cls].size);
  return p;
}

/* _hk_malloc_slow while a capture is on, or after it for a trapped thread. */
static HK_NOINLINE void* malloc_traced(unsigned cls) {
  hk_tcache_t* tc = tcache_slow();
  unsigned how = trace_sync(tc);
  hk_bin_t* bin = &tc->bin[cls];
  if (how) untrap_bin(bin, cls, how);
  bool cached = tc->state == HK_TC_ACTIVE && tc->cold[cls].cap != 0;
  bool due = bin->left <= 0 && cached;
  /* What the fast path would have done, when it would have: the
   * countdown still runs, so check-ins (and telemetry) keep their pace. */
  void* p = cached ? bin_pop(bin) : NULL;
  if (!p) p = alloc_small(tc, cls);
  if (HK_UNLIKELY(!cached && _hk_trace_sample_bytes)) {
    /* No countdown without a cache: the same mean, counted in bytes here. */
    hk_trace_tls_t* t = &_hk_trace_tls;
    t->direct_left -= _hk_class[cls].size;
    if (t->direct_left <= 0) {
      uint64_t x = tc->rng, b = _hk_trace_sample_bytes;
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      tc->rng = x;
      t->direct_left = (int64_t)(b / 2 + (x >> 32) % b);
      t->picked = 1;
    }
  } else if (HK_UNLIKELY(due && _hk_trace_sample_bytes)) {
    /* SAMPLED (trace.c): the allocation the countdown stopped at is picked,
     * and the next countdown has the capture's mean and no floor. Blocks
     * counted stay exact: mark moves with left. */
    _hk_trace_tls.picked = 1;
    uint64_t x = tc->rng, b = _hk_trace_sample_bytes;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    tc->rng = x;
    uint64_t blocks = (b / 2 + (x >> 32) % b) / _hk_class[cls].size;
    if (blocks > CHECKIN_MAX_BLOCKS) blocks = CHECKIN_MAX_BLOCKS;
    if (bin->left > 0) {
      tc->cold[cls].mark = tc->cold[cls].mark - (uint64_t)bin->left + blocks;
      bin->left = (int32_t)blocks;
    }
  }
  /* maybe_gc may have started or ended a capture: the next call syncs. */
  if (how) trap_bin(&tc->bin[cls], cls, how);
  if (HK_UNLIKELY(!p)) errno = ENOMEM;
  return p;
}

HK_NOINLINE void* _hk_malloc_slow(size_t n, unsigned cls) {
  if (cls == 0) {
    /* Before initialization the small-size table reads all zero. */
    if (!_hk_initialized) {
      _hk_init();
      /* Only malloc comes here uninitialized (calloc and the aligned calls
       * initialize first): a capture _hk_init just started records it. */
      if (_hk_trace_on) {
        void* p = _hk_malloc_slow(n, _hk_class_of(n));
        _hk_trace_alloc(HK_OP_MALLOC, n, 0, p);
        return p;
      }
      cls = _hk_class_of(n);
    }
    if (cls == 0) {
      if (n > PTRDIFF_MAX) { errno = ENOMEM; return NULL; }
      return _hk_huge_alloc(n, 0, false);
    }
  }
  if (HK_UNLIKELY(_hk_trace_on || _hk_trace_tls.trapped)) return malloc_traced(cls);
  void* p = alloc_small(tcache_slow(), cls);
  if (HK_UNLIKELY(!p)) errno = ENOMEM;
  return p;
}

/* Resolves p to (segment, page, class) or reports why it is not ours. */
static unsigned owner_or_die(void* p, hk_segment_t** seg_out, unsigned* page_out) {
  hk_segment_t* seg = _hk_segment_of(p);
  unsigned page = _hk_page_of(p);
  unsigned cls = _hk_page_class(seg, page);
  HK_ASSERT(seg->page_tls[page] == _hk_bin_tls(cls));   /* what free_fast went by */
  if (cls == 0) _hk_invalid_free(p, "not inside an allocated slab");
  if (!_hk_is_block_start(seg, page, cls, p)) _hk_invalid_free(p, "not the start of a block");
  *seg_out = seg;
  *page_out = page;
  return cls;
}

/* Frees p into this thread's cache by the policy in force. */
HK_INLINE void free_small(hk_tcache_t* tc, void* p, hk_segment_t* seg, unsigned page, unsigned cls) {
  hk_bin_t* bin = &tc->bin[cls];
  if (p == bin->head) _hk_invalid_free(p, "double free");
  HK_VG_FREE(p);
  if (tc->state != HK_TC_ACTIVE || tc->cold[cls].cap == 0) {
    _hk_free_direct(p, seg, page, cls);
    if (_hk_tel_on) _hk_tel_tick(_hk_os_now_coarse_ns());
    return;
  }
  if (bin->room <= 0) {
    uint32_t n = tc->cold[cls].batch;
    if (n < (uint32_t)(1 - bin->room)) n = (uint32_t)(1 - bin->room);
    _hk_drain(tc, cls, n);
  }
  *(void**)p = bin->head;
  bin->head = p;
  bin->room--;
  maybe_gc(tc);
}

static HK_NOINLINE void free_traced(void* p, hk_segment_t* seg, unsigned page, unsigned cls) {
  hk_tcache_t* tc = tcache_slow();
  unsigned how = trace_sync(tc);
  hk_bin_t* bin = &tc->bin[cls];
  if (how) untrap_bin(bin, cls, how);
  if (tc->state == HK_TC_ACTIVE && bin->room > 0 && p != bin->head) {
    HK_VG_FREE(p);   /* what the fast path would have done */
    *(void**)p = bin->head;
    bin->head = p;
    bin->room--;
  } else {
    free_small(tc, p, seg, page, cls);
  }
  if (how) trap_bin(bin, cls, how);
}

HK_NOINLINE void _hk_free_slow(void* p) {
  if (p == NULL) return;
  /* Stamped before the block can be reused (proto "time-stamping rule"). */
  if (HK_UNLIKELY(_hk_trace_on)) _hk_trace_free(p);
  unsigned kind = _hk_map_kind(p);
  if (kind == HK_MAP_HUGE) { _hk_huge_free(p); return; }
  if (kind != HK_MAP_SEGMENT) _hk_invalid_free(p, "not allocated by hakmem");
  hk_segment_t* seg;
  unsigned page;
  unsigned cls = owner_or_die(p, &seg, &page);
  /* free_fast counts the room down before it knows the bin is full (one
   * instruction fewer than testing first): when it ran out, that is the
   * one decrement to undo, and the room is >= 0 again for everyone else. */
  hk_bin_t* bin = &_hk_tc.bin[cls];
  if (bin->room < 0) bin->room++;
  HK_ASSERT(bin->room >= 0);
  /* Trapped by a new policy or a malloc_trim (thread.c "reaching every
   * thread"): the limits back, and tcache_slow takes up what came. */
  if (HK_UNLIKELY(__atomic_load_n(&bin->limit, __ATOMIC_RELAXED) == 0)) _hk_untrap_if_trapped(&_hk_tc);
  if (HK_UNLIKELY(_hk_trace_on || _hk_trace_tls.trapped)) { free_traced(p, seg, page, cls); return; }
  free_small(tcache_slow(), p, seg, page, cls);
}

/* ---- aligned ------------------------------------------------------------------- */
/* A class whose blocks all satisfy `align`: slabs start 64 KiB-aligned, so a
 * block size that is a multiple of align (<= 64 KiB) keeps every block
 * aligned; classes.c tabulates the first such class at or above each class.
 * Returns 0 when the request must go to a huge mapping. */
static unsigned aligned_class(size_t n, size_t align) {
  if (align > HK_PAGE_SIZE) return 0;
  unsigned cls = _hk_class_of(n < align ? align : n);
  if (cls == 0) return 0;
  return _hk_align_class[__builtin_ctzll(align) - HK_ALIGN_SHIFT0][cls];
}

/* The aligned fast path: a block from the thread cache of a class whose
 * blocks satisfy align, or NULL (and nothing touched, errno included) when
 * that takes the slow path. Before initialization every table reads 0, and
 * bin 0 is always empty. */
HK_INLINE void* aligned_fast(size_t align, size_t n) {
  unsigned cls;
  if (align <= HK_MIN_ALIGN) {
    cls = _hk_class_of(n);
  } else {
    if (align > HK_PAGE_SIZE) return NULL;
    size_t m = n < align ? align : n;
    unsigned k = (unsigned)__builtin_ctzll(align) - HK_ALIGN_SHIFT0;
    if (HK_LIKELY(m <= HK_SMALL_MAX)) cls = _hk_align_small[k][(m + 15) >> 4];
    else if (HK_LIKELY(m <= HK_MEDIUM_MAX)) cls = _hk_align_medium[k][(m + 127) >> 7];
    else cls = _hk_align_class[k][_hk_class_of(m)];
  }
  return tc_bin_pop(tc_bin(HK_BIN_OFF(cls)));
}

static void* alloc_aligned_real(size_t align, size_t n) {
  if (!_hk_initialized) _hk_init();
  _hk_align_tables_build();
  if (align <= HK_MIN_ALIGN) return alloc_cls(_hk_class_of(n), n);
  if (n > PTRDIFF_MAX - align) { errno = ENOMEM; return NULL; }
  unsigned cls = aligned_class(n, align);
  if (cls) return alloc_cls(cls, n);
  return _hk_huge_alloc(n, align, false);
}

static HK_NOINLINE void* alloc_aligned_slow(size_t align, size_t n) {
  void* p = alloc_aligned_real(align, n);
  if (HK_UNLIKELY(_hk_trace_on)) _hk_trace_alloc(HK_OP_ALIGNED, n, align, p);
  return p;
}

HK_INLINE void* alloc_aligned(size_t align, size_t n) {
  void* p = aligned_fast(align, n);
  return HK_LIKELY(p != NULL) ? p : alloc_aligned_slow(align, n);
}

static size_t usable_size(void* p) {
  unsigned kind = _hk_map_kind(p);
  if (kind == HK_MAP_HUGE) return _hk_huge_usable(p);
  if (kind != HK_MAP_SEGMENT) _hk_invalid_free(p, "not allocated by hakmem");
  hk_segment_t* seg;
  unsigned page;
  return _hk_class[owner_or_die(p, &seg, &page)].size;
}

/* ---- the API ------------------------------------------------------------------- */
/* malloc's slow path finds the class again itself, so the fast path need
 * not keep it alive across the pop (one instruction fewer). */
static HK_NOINLINE void* alloc_recorded(unsigned op, size_t n, unsigned cls) {
  void* p = _hk_malloc_slow(n, cls);
  _hk_trace_alloc(op, n, 0, p);
  return p;
}

static HK_NOINLINE void* malloc_slow(size_t n) {
  if (HK_UNLIKELY(_hk_trace_on)) return alloc_recorded(HK_OP_MALLOC, n, _hk_class_of(n));
  return _hk_malloc_slow(n, _hk_class_of(n));
}

static HK_NOINLINE void* calloc_slow(size_t n, unsigned cls) {
  if (HK_UNLIKELY(_hk_trace_on)) return alloc_recorded(HK_OP_CALLOC, n, cls);
  return _hk_malloc_slow(n, cls);
}

static void* realloc_traced(void* p, size_t n);

/* malloc's bin for size n: from the size tables once init filled them
 * (internal.h), else by class. */
HK_INLINE TC_AS hk_bin_t* malloc_bin(size_t n) {
  if (HK_LIKELY(n < _hk_small_end)) return tc_bin_tls(_hk_small_tls[n]);
  if (HK_LIKELY(n < _hk_medium_end)) return tc_bin_tls(_hk_medium_tls[(n + 127) >> 7]);
  return tc_bin(HK_BIN_OFF(_hk_class_of(n)));   /* above 32 KiB, or before init: class 0 */
}

HK_EXPORT void* malloc(size_t n) {
  void* p = tc_bin_pop_rax(malloc_bin(n));
  return HK_LIKELY(p != NULL) ? p : malloc_slow(n);
}

HK_EXPORT void free(void* p) { free_fast(p); }

HK_EXPORT void free_sized(void* p, size_t n) { free_fast(p); }

HK_EXPORT void free_aligned_sized(void* p, size_t align, size_t n) { free_fast(p); }

HK_EXPORT void cfree(void* p) { free_fast(p); }

HK_EXPORT void* calloc(size_t count, size_t size) {
  size_t n;
  if (HK_UNLIKELY(__builtin_mul_overflow(count, size, &n))) { errno = ENOMEM; return NULL; }
  unsigned cls = _hk_class_of(n);
  if (HK_UNLIKELY(cls == 0) && !_hk_initialized) { _hk_init(); cls = _hk_class_of(n); }
  if (HK_UNLIKELY(cls == 0)) {
    if (n > PTRDIFF_MAX) { errno = ENOMEM; return NULL; }
    void* h = _hk_huge_alloc(n, 0, true);   /* fresh mappings are already zero */
    if (HK_UNLIKELY(_hk_trace_on)) _hk_trace_alloc(HK_OP_CALLOC, n, 0, h);
    return h;
  }
  void* p = tc_bin_pop(tc_bin(HK_BIN_OFF(cls)));
  if (HK_UNLIKELY(p == NULL)) p = calloc_slow(n, cls);
  if (HK_LIKELY(p)) memset(p, 0, n);
  return p;
}

HK_EXPORT void* realloc(void* p, size_t n) {
  if (HK_UNLIKELY(_hk_trace_on)) return realloc_traced(p, n);
  if (p == NULL) return malloc(n);
  if (n == 0) { free(p); return NULL; }   /* glibc: realloc(p, 0) frees */
  size_t old;
  unsigned kind = _hk_map_kind(p);
  if (kind == HK_MAP_HUGE) {
    if (n > HK_MAX_CLASS_SIZE) {
      if (_hk_huge_realloc(p, n)) return p;
    }
    old = _hk_huge_usable(p);
  } else {
    old = usable_size(p);     /* reports a pointer that is not ours */
    /* Fits, and not so much smaller that keeping the block wastes memory. */
    if (n <= old && (n > old / 2 || old <= 32)) return p;
  }
  if (n > PTRDIFF_MAX) { errno = ENOMEM; return NULL; }
  /* Growing: take at least a quarter more than the old block (tcmalloc
   * does the same), so a buffer grown by small appends moves about three
   * times per doubling instead of once per size class. */
  size_t want = n > old && n - old < old / 4 ? old + old / 4 : n;
  void* q = malloc(want);
  if (!q && want != n) q = malloc(n);
  if (!q) return NULL;
  memcpy(q, p, n < old ? n : old);
  free(p);
  return q;
}

/* realloc while a capture is on: one REALLOC event, stamped after the new
 * block is had and before the old one is given back; the malloc and free
 * inside are not events (quiet). */
static HK_NOINLINE void* realloc_traced(void* p, size_t n) {
  if (p == NULL || n == 0) {   /* proto: realloc(NULL, n) is MALLOC, realloc(p, 0) is FREE */
    if (p == NULL) return malloc(n);
    free(p);
    return NULL;
  }
  hk_trace_tls_t* t = &_hk_trace_tls;
  bool want = _hk_trace_realloc_wanted(p);
  size_t old;
  void* q = NULL;
  t->quiet = 1;
  unsigned kind = _hk_map_kind(p);
  if (kind == HK_MAP_HUGE) {
    if (n > HK_MAX_CLASS_SIZE && _hk_huge_realloc(p, n)) q = p;
    old = _hk_huge_usable(p);
  } else {
    old = usable_size(p);
    if (n <= old && (n > old / 2 || old <= 32)) q = p;
  }
  if (!q) {
    if (n > PTRDIFF_MAX) { t->quiet = 0; errno = ENOMEM; return NULL; }
    size_t want_n = n > old && n - old < old / 4 ? old + old / 4 : n;
    q = malloc(want_n);
    if (!q && want_n != n) q = malloc(n);
    if (!q) { t->quiet = 0; return NULL; }
    memcpy(q, p, n < old ? n : old);
  }
  t->quiet = 0;
  t->picked = 0;
  if (want) _hk_trace_realloc(p, q, n);
  if (q != p) {
    t->quiet = 1;
    free(p);
    t->quiet = 0;
  }
  return q;
}

HK_EXPORT void* reallocarray(void* p, size_t count, size_t size) {
  size_t n;
  if (__builtin_mul_overflow(count, size, &n)) { errno = ENOMEM; return NULL; }
  return realloc(p, n);
}

static HK_NOINLINE int posix_memalign_slow(void** out, size_t align, size_t n) {
  int saved = errno;   /* posix_memalign reports failure by its result only */
  void* p = alloc_aligned_slow(align, n);
  if (!p) { errno = saved; return ENOMEM; }
  *out = p;
  return 0;
}

HK_EXPORT int posix_memalign(void** out, size_t align, size_t n) {
  if (align < sizeof(void*) || (align & (align - 1)) != 0) return EINVAL;
  void* p = aligned_fast(align, n);
  if (HK_UNLIKELY(p == NULL)) return posix_memalign_slow(out, align, n);
  *out = p;
  return 0;
}

/* glibc rounds a non-power-of-two alignment up; so do we. */
static size_t fix_align(size_t align) {
  if (align <= HK_MIN_ALIGN) return HK_MIN_ALIGN;
  if ((align & (align - 1)) == 0) return align;
  if (align > ((size_t)1 << 62)) return 0;
  return (size_t)1 << (64 - __builtin_clzll(align));
}

HK_EXPORT void* memalign(size_t align, size_t n) {
  align = fix_align(align);
  if (!align) { errno = EINVAL; return NULL; }
  return alloc_aligned(align, n);
}

HK_EXPORT void* aligned_alloc(size_t align, size_t n) { return memalign(align, n); }

HK_EXPORT void* valloc(size_t n) { return alloc_aligned(HK_OS_PAGE, n); }

HK_EXPORT void* pvalloc(size_t n) {
  if (n > PTRDIFF_MAX) { errno = ENOMEM; return NULL; }
  n = n ? (n + HK_OS_PAGE - 1) & ~(size_t)(HK_OS_PAGE - 1) : HK_OS_PAGE;
  return alloc_aligned(HK_OS_PAGE, n);
}

HK_EXPORT size_t malloc_usable_size(void* p) {
  if (p == NULL) return 0;
  return usable_size(p);
}

/* ---- glibc extras -------------------------------------------------------------- */
/* Accepted and ignored: glibc's knobs (arenas, mmap threshold, ...) have no
 * meaning here, and programs that set them expect success. */
HK_EXPORT int mallopt(int param, int value) { return 1; }

HK_EXPORT int malloc_trim(size_t pad) {
  if (!_hk_initialized) return 0;
  hk_add_relaxed(&trim_epoch, 1);
  _hk_threads_trap();   /* the other threads flush at their next free */
  hk_thread_flush();
  _hk_tc.trim_epoch = hk_load_relaxed(&trim_epoch);
  bool any = _hk_trim_warm();
  any |= _hk_segment_trim();
  any |= _hk_huge_trim();
  return any ? 1 : 0;
}

HK_EXPORT void hk_thread_flush(void) {
  hk_tcache_t* tc = &_hk_tc;
  if (tc->state == HK_TC_ACTIVE) _hk_flush_thread(tc);
}

HK_EXPORT struct mallinfo2 mallinfo2(void) {
  struct mallinfo2 mi;
  memset(&mi, 0, sizeof mi);
  hk_stats_t st;
  if (hk_stats_get(&st) != 0) return mi;
  uint64_t live = 0, cached = 0;
  for (unsigned c = 0; c < HK_NUM_CLASSES; c++) {
    live += st.cls[c].live_bytes;
    cached += st.cls[c].cached_bytes;
  }
  mi.arena = st.committed_bytes;
  mi.uordblks = live;
  mi.fordblks = st.committed_bytes > live ? st.committed_bytes - live : 0;
  mi.hblks = st.cls[0].allocs - st.cls[0].frees;
  mi.hblkhd = st.cls[0].live_bytes;
  mi.fsmblks = cached;
  return mi;
}

HK_EXPORT struct mallinfo mallinfo(void) {
  struct mallinfo2 m2 = mallinfo2();
  struct mallinfo mi;
  memset(&mi, 0, sizeof mi);
  mi.arena = (int)m2.arena;
  mi.uordblks = (int)m2.uordblks;
  mi.fordblks = (int)m2.fordblks;
  mi.hblks = (int)m2.hblks;
  mi.hblkhd = (int)m2.hblkhd;
  mi.fsmblks = (int)m2.fsmblks;
  return mi;
}

HK_EXPORT void malloc_stats(void) { hk_stats_print(2); }

HK_EXPORT int malloc_info(int options, FILE* fp) {
  if (options != 0 || fp == NULL) { errno = EINVAL; return -1; }
  hk_stats_t st;
  hk_stats_get(&st);
  char buf[512];
  size_t n = _hk_fmt(buf, sizeof buf,
      "<malloc version=\"hakmem-1\">\n"
      "<total type=\"committed\" size=\"%lu\"/>\n"
      "<total type=\"huge\" count=\"%lu\" size=\"%lu\"/>\n"
      "<system type=\"mmap\" count=\"%lu\"/>\n<system type=\"munmap\" count=\"%lu\"/>\n"
      "<system type=\"madvise\" count=\"%lu\"/>\n<threads count=\"%lu\"/>\n",
      st.committed_bytes, st.cls[0].allocs - st.cls[0].frees, st.cls[0].live_bytes,
      st.mmap_calls, st.munmap_calls, st.madvise_calls, st.threads);
  if (fwrite(buf, 1, n, fp) != n) return -1;
  for (unsigned c = 1; c < HK_NUM_CLASSES; c++) {
    if (st.cls[c].allocs == 0) continue;
    n = _hk_fmt(buf, sizeof buf,
        "<size class=\"%u\" size=\"%lu\" allocs=\"%lu\" frees=\"%lu\" live=\"%lu\" cached=\"%lu\"/>\n",
        c, st.cls[c].size, st.cls[c].allocs, st.cls[c].frees, st.cls[c].live_bytes,
        st.cls[c].cached_bytes);
    if (fwrite(buf, 1, n, fp) != n) return -1;
  }
  if (fputs("</malloc>\n", fp) < 0) return -1;
  return 0;
}

HK_EXPORT size_t hk_class_size(unsigned cls) {
  if (!_hk_initialized) _hk_init();
  return (cls > 0 && cls < HK_NUM_CLASSES) ? _hk_class[cls].size : 0;
}

HK_EXPORT unsigned hk_size_class(size_t size) {
  if (!_hk_initialized) _hk_init();
  return _hk_class_of(size);
}
