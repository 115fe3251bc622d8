/* internal.h — cross-file prototypes and tiny inline helpers.
 *
 * Names: hk_ public (hakmem.h), _hk_ internal across files, static within a
 * file. Every atomic names its memory order here, so each ordering choice
 * can be found with grep.
 */
#ifndef HK_INTERNAL_H
#define HK_INTERNAL_H

#include <errno.h>
#include <stdatomic.h>
#include <string.h>

#include "types.h"

#define HK_LIKELY(x)   __builtin_expect(!!(x), 1)
#define HK_UNLIKELY(x) __builtin_expect(!!(x), 0)
#define HK_NOINLINE    __attribute__((noinline))
#define HK_INLINE      static inline __attribute__((always_inline))
#define HK_EXPORT      __attribute__((visibility("default")))
#define HK_COLD        __attribute__((cold, noinline))

/* Debug-build invariant (compiled out in release). For data read from
 * shared memory or that a buggy program may corrupt, use the always-on
 * checks in the code instead: they report and abort without allocating. */
#if HK_DEBUG
#define HK_ASSERT(c) \
  do { if (HK_UNLIKELY(!(c))) _hk_assert_fail(#c, __FILE__, __LINE__); } while (0)
#else
#define HK_ASSERT(c) ((void)0)
#endif

/* ---- valgrind ---------------------------------------------------------------
 * With HK_VALGRIND (the debug build, when valgrind's headers are installed)
 * memcheck learns where blocks begin and end: a block handed out is
 * "malloc-like" (usable size, contents undefined), a freed one "free-like"
 * (no access) except its first word, which holds the free-list link that
 * hakmem itself reads and writes. Memcheck then reports use after free,
 * overflows past the usable size and reads of uninitialized heap memory in
 * the program, and any touch of a freed block by hakmem beyond its link.
 * Outside valgrind each annotation is a few no-op instructions.
 */
#if HK_VALGRIND
#include <valgrind/memcheck.h>
#define HK_VG_ALLOC(p, n)     VALGRIND_MALLOCLIKE_BLOCK((p), (n), 0, 0)
#define HK_VG_ALLOC_ZERO(p, n, z) VALGRIND_MALLOCLIKE_BLOCK((p), (n), 0, (z))
#define HK_VG_FREE(p)         do { VALGRIND_FREELIKE_BLOCK((p), 0); \
                                   VALGRIND_MAKE_MEM_DEFINED((p), sizeof(void*)); } while (0)
#define HK_VG_RESIZE(p, o, n) VALGRIND_RESIZEINPLACE_BLOCK((p), (o), (n), 0)
#define HK_VG_DEFINED(p, n)   VALGRIND_MAKE_MEM_DEFINED((p), (n))
#define HK_VG_NOACCESS(p, n)  VALGRIND_MAKE_MEM_NOACCESS((p), (n))
#else
#define HK_VG_ALLOC(p, n)     ((void)0)
#define HK_VG_ALLOC_ZERO(p, n, z) ((void)0)
#define HK_VG_FREE(p)         ((void)0)
#define HK_VG_RESIZE(p, o, n) ((void)0)
#define HK_VG_DEFINED(p, n)   ((void)0)
#define HK_VG_NOACCESS(p, n)  ((void)0)
#endif

/* ---- atomics ----------------------------------------------------------------- */
#define hk_load_relaxed(p)        atomic_load_explicit((p), memory_order_relaxed)
#define hk_load_acquire(p)        atomic_load_explicit((p), memory_order_acquire)
#define hk_store_relaxed(p, v)    atomic_store_explicit((p), (v), memory_order_relaxed)
#define hk_store_release(p, v)    atomic_store_explicit((p), (v), memory_order_release)
#define hk_add_relaxed(p, v)      atomic_fetch_add_explicit((p), (v), memory_order_relaxed)
#define hk_sub_relaxed(p, v)      atomic_fetch_sub_explicit((p), (v), memory_order_relaxed)

/* ---- data layout ------------------------------------------------------------
 * Large zero-initialized data that a process touches sparsely or never (the
 * address map, the stats snapshot buffers) goes to .lbss, which the linker
 * places after all of .bss. Left in .bss, they sat between the small hot
 * globals and spread those over several more pages, each one a page fault in
 * every process (the dynamic loader already zeroes the page after .data).
 */
#define HK_SPARSE_BSS __attribute__((section(".lbss")))

/* ---- globals (defined in thread.c / classes.c / segment.c / slab.c / options.c / init.c) */
extern __thread hk_tcache_t _hk_tc __attribute__((tls_model("initial-exec")));
/* Ticks in the kernel for the allocator, this thread (prim.c). */
extern __thread uint64_t _hk_kernel_ticks __attribute__((tls_model("initial-exec")));
/* One byte per 4 MiB of the 47-bit address space (32 MiB of .bss: pages of
 * it that are never written are never committed). */
extern uint8_t _hk_map[HK_MAP_ENTRIES];
extern hk_central_t _hk_central[HK_NUM_CLASSES];
extern hk_class_info_t _hk_class[HK_NUM_CLASSES];
extern uint8_t _hk_small_class[HK_SMALL_MAX / 16 + 1];
extern uint8_t _hk_medium_class[HK_MEDIUM_MAX / 128 + 1];
/* ---- reaching the thread cache ---------------------------------------------
 * On x86-64 the fast paths address this thread's bins relative to %fs (GCC's
 * __seg_fs; alloc.c "the thread cache through %fs"), and the tables they
 * read give a bin as its TLS offset: _hk_tc_fs + HK_BIN_OFF(cls), where
 * _hk_tc_fs is _hk_tc's offset from the thread pointer, the same in every
 * thread of the process (initial-exec TLS) and never 0 (_hk_tc lies below
 * the thread pointer). Elsewhere (other targets, the valgrind build, whose
 * annotations want plain bins) _hk_tc_fs is 0 and a TLS offset is the
 * bin's offset in _hk_tc. Slow paths use classes, never TLS offsets. */
#if defined(__x86_64__) && defined(__SEG_FS) && !HK_VALGRIND
#define HK_TC_FS 1
#else
#define HK_TC_FS 0
#endif
#define HK_HIDDEN __attribute__((visibility("hidden")))
extern HK_HIDDEN intptr_t _hk_tc_fs;   /* set first thing at init (classes.c) */
HK_INLINE int32_t _hk_bin_tls(unsigned cls) { return (int32_t)(_hk_tc_fs + (intptr_t)HK_BIN_OFF(cls)); }
/* malloc's size tables, in TLS offsets: [n] for n < _hk_small_end, and
 * [(n + 127) >> 7] for n < _hk_medium_end. The ends stay 0 until the tables
 * are filled at init (a TLS offset of 0 would be the thread's control
 * block, not a bin): before, every size takes the plain way. Hidden, so
 * that malloc compares with an end straight from memory. */
extern HK_HIDDEN int32_t _hk_small_tls[HK_SMALL_MAX + 1];
extern HK_HIDDEN int32_t _hk_medium_tls[HK_MEDIUM_MAX / 128 + 1];
extern HK_HIDDEN size_t _hk_small_end, _hk_medium_end;
/* Per class, for the block-start test (0 for class 0): ceil(2^64 / size),
 * and the bound the product must stay under (see _hk_is_block_start).
 * Each thread's bins carry a copy for free()'s fast path (types.h). */
typedef struct hk_div_s {
  uint64_t magic, limit;
} hk_div_t;
extern hk_div_t _hk_div[HK_NUM_CLASSES];
extern _Atomic uint32_t _hk_warm_limit[HK_NUM_CLASSES]; /* policy, slab.c */
/* [k][cls]: the first class >= cls whose size is a multiple of 2^(k+5)
 * (alignments 32 B .. 64 KiB), or 0 when none is. */
#define HK_ALIGN_SHIFT0 5
#define HK_ALIGN_LEVELS (HK_PAGE_SHIFT - HK_ALIGN_SHIFT0 + 1)
extern uint8_t _hk_align_class[HK_ALIGN_LEVELS][64];   /* rows of 64: index by shift */
/* The same composed with the size tables, so the aligned fast path does one
 * lookup, not two in a row: [k][(n + 15) >> 4] and [k][(n + 127) >> 7]. */
extern uint8_t _hk_align_small[HK_ALIGN_LEVELS][HK_SMALL_MAX / 16 + 1];
extern uint8_t _hk_align_medium[HK_ALIGN_LEVELS][HK_MEDIUM_MAX / 128 + 1];
void _hk_align_tables_build(void);   /* classes.c: once, from the aligned slow path */
extern bool _hk_check_mode;                     /* HAKMEM_CHECK=1 */
extern int  _hk_initialized;

typedef struct hk_proc_counters_s {
#define HK_X_PATOMIC(name, desc) _Atomic uint64_t name;
  HK_PROC_COUNTERS(HK_X_PATOMIC)
#undef HK_X_PATOMIC
} hk_proc_counters_t;
extern hk_proc_counters_t _hk_proc;

/* ---- size classes ------------------------------------------------------------
 * Sizes 16..128 step 16, then four classes per doubling up to 1 MiB:
 * (5,6,7,8) << (b-2) for 2^b < size <= 2^(b+1). Waste per class <= 25%.
 */
HK_INLINE unsigned _hk_class_of(size_t n) {
  if (HK_LIKELY(n <= HK_SMALL_MAX)) return _hk_small_class[(n + 15) >> 4];
  /* Class sizes above 1 KiB are multiples of 256, so 128-byte steps map
   * every size to its class exactly. */
  if (HK_LIKELY(n <= HK_MEDIUM_MAX)) return _hk_medium_class[(n + 127) >> 7];
  if (HK_UNLIKELY(n > HK_MAX_CLASS_SIZE)) return 0;
  size_t m = n - 1;
  unsigned b = 63u - (unsigned)__builtin_clzll(m);   /* 2^b <= m < 2^(b+1) */
  return 9u + (b - 7u) * 4u + (unsigned)(m >> (b - 2)) - 4u;
}

/* ---- thread-cache bins ---------------------------------------------------------- */
/* The slow paths' half of one of this thread's bins (types.h). */
HK_INLINE hk_bin_cold_t* _hk_bin_cold(const hk_bin_t* bin) {
  return &_hk_tc.cold[bin - _hk_tc.bin];
}
/* Blocks in the bin's list (types.h: the room left is what is kept). */
HK_INLINE uint32_t _hk_bin_count(const hk_bin_t* bin) {
  return (uint32_t)((int64_t)_hk_bin_cold(bin)->cap - bin->room);
}
/* Blocks this bin has handed out, exact at any moment (alloc.c "check-in"). */
HK_INLINE uint64_t _hk_bin_allocs(const hk_bin_t* bin) {
  return _hk_bin_cold(bin)->mark - (uint64_t)(bin->left > 0 ? bin->left : 0);
}

/* ---- lock ------------------------------------------------------------------- */
void _hk_lock_slow(hk_lock_t* l);   /* prim.c: spin, then yield the CPU */
HK_INLINE void _hk_lock(hk_lock_t* l) {
  int expect = 0;
  if (HK_LIKELY(atomic_compare_exchange_weak_explicit(&l->v, &expect, 1,
        memory_order_acquire, memory_order_relaxed))) return;
  _hk_lock_slow(l);
}
HK_INLINE bool _hk_trylock(hk_lock_t* l) {
  int expect = 0;
  return atomic_compare_exchange_strong_explicit(&l->v, &expect, 1, memory_order_acquire,
                                                 memory_order_relaxed);
}
HK_INLINE void _hk_unlock(hk_lock_t* l) { hk_store_release(&l->v, 0); }
HK_INLINE void _hk_lock_reinit(hk_lock_t* l) { hk_store_relaxed(&l->v, 0); }

/* ---- pointer -> owner ------------------------------------------------------- */
HK_INLINE unsigned _hk_map_kind(const void* p) {
  return _hk_map[((uintptr_t)p >> HK_SEG_SHIFT) & (HK_MAP_ENTRIES - 1)];
}
HK_INLINE hk_segment_t* _hk_segment_of(const void* p) {
  return (hk_segment_t*)((uintptr_t)p & ~(HK_SEG_SIZE - 1));
}
HK_INLINE unsigned _hk_page_of(const void* p) {
  return (unsigned)(((uintptr_t)p >> HK_PAGE_SHIFT) & (HK_SEG_PAGES - 1));
}
/* The class of the slab covering a page (0: none). */
HK_INLINE unsigned _hk_page_class(const hk_segment_t* seg, unsigned page) {
  return seg->page_class[page];
}
/* Is p the start of one of its slab's blocks? With c = ceil(2^64/d) and
 * off < 2^32, off % d == 0 <=> off*c mod 2^64 < c (Lemire, Kaser, Kurz
 * 2019). For off = q*d the product is q*e with e = d*c - 2^64 < d, so
 * comparing with blocks*e instead of c also rejects q >= blocks: the slack
 * at the end of a slab, where a block would overrun the slab. (e == 0 for
 * powers of two, whose slabs have no slack; their bound stays c.) */
HK_INLINE bool _hk_is_block_start(const hk_segment_t* seg, unsigned page,
                                  unsigned cls, const void* p) {
  uintptr_t start = (uintptr_t)seg + seg->page_start[page];
  uint64_t off = (uint64_t)((uintptr_t)p - start);
  return off * _hk_div[cls].magic < _hk_div[cls].limit;
}

/* ---- slow paths and helpers (one file each) --------------------------------- */
/* alloc.c */
void* _hk_malloc_slow(size_t n, unsigned cls);
void  _hk_free_slow(void* p);
/* slab.c: slabs, their owners and the classes' central state */
void* _hk_refill(hk_tcache_t* tc, unsigned cls);       /* returns one block */
void  _hk_drain(hk_tcache_t* tc, unsigned cls, uint32_t n);
void  _hk_flush_thread(hk_tcache_t* tc);
void  _hk_stash_flush(hk_tcache_t* tc, unsigned cls);  /* other threads' frees of this one's blocks, to their slabs */
void  _hk_slabs_orphan(hk_thread_rec_t* rec);          /* an ended thread's slabs to their classes */
void  _hk_inbox_sweep(hk_thread_rec_t* rec);           /* a record without a thread: its inboxes to the slabs */
void  _hk_inbox_sweep_free_records(void);            /* thread.c: every such record */
void  _hk_inbox_idle(hk_thread_rec_t* rec);           /* a live record's untaken inboxes to the slabs */
void  _hk_inbox_sweep_idle(void);                    /* thread.c: every live record's */
void* _hk_alloc_direct(unsigned cls);                  /* no thread cache */
void  _hk_free_direct(void* p, hk_segment_t* seg, unsigned page, unsigned cls);
bool  _hk_trim_warm(void);
bool  _hk_warm_decay(uint64_t now_ns, uint64_t interval_ns);   /* whether this call ran the pass */
void  _hk_central_lock_all(void);
void  _hk_central_unlock_all(void);
void  _hk_central_reinit_locks(void);
/* segment.c: segments and the address map */
hk_slab_t* _hk_slab_carve(unsigned cls);               /* NULL on OOM */
void       _hk_slab_release(hk_slab_t* slab);          /* pages back to OS */
bool       _hk_segment_trim(void);                   /* dirty pages and cached segments back */
void       _hk_segment_decay(void);                  /* dirty pages idle for an interval back */
#define HK_DIRTY_SHARE_ONE 1024u
void       _hk_segment_dirty_share(uint32_t share);   /* dirty cap × share/HK_DIRTY_SHARE_ONE (the policy's) */
void       _hk_segment_retain(uint32_t mib);          /* the policy's retain_mib: the dirty cap's floor (segment.c) */
void       _hk_segment_fit_dirty(void);              /* dirty pages over the cap back now */
void       _hk_segment_lock(void);
void       _hk_segment_unlock(void);
void       _hk_segment_reinit_lock(void);
/* huge.c */
void*  _hk_huge_alloc(size_t n, size_t align, bool zero);
void   _hk_huge_free(void* p);
size_t _hk_huge_usable(const void* p);
void*  _hk_huge_realloc(void* p, size_t n);            /* NULL: could not in place */
bool   _hk_huge_trim(void);
void   _hk_huge_decay(void);                        /* cached mappings idle for an interval back */
void   _hk_huge_retain(uint32_t mib);               /* the policy's retain_mib: the cache's budget, at most HK_HUGE_CACHE_BYTES */
void   _hk_huge_fit(void);                          /* cached mappings over the budget back */
void   _hk_huge_lock(void);
void   _hk_huge_unlock(void);
void   _hk_huge_reinit_lock(void);
/* options.c: options table and the live policy (knows nothing of telemetry) */
void     _hk_options_init(void);
bool     _hk_options_env_missing(void);
void     _hk_policy_default(hk_policy_t* p);
uint64_t _hk_policy_current_version(void);
void     _hk_tcache_apply_policy(hk_tcache_t* tc);
bool     _hk_stats_at_exit(void);
void     _hk_policy_lock(void);
void     _hk_policy_unlock(void);
void     _hk_policy_reinit_lock(void);
uint32_t _hk_drain_ms(void);
void     _hk_options_print(int fd);
const char* _hk_env_get(const char* name);             /* no allocation */
bool     _hk_tel_enabled(void);
uint32_t _hk_tel_epoch_ms(void);
/* Called under the policy lock with each policy installed, and at once with
 * the one in force when registered (telemetry.c mirrors it); NULL: none. */
typedef void (*hk_policy_observer_t)(const hk_policy_t* p);
void     _hk_policy_observe(hk_policy_observer_t fn);
/* telemetry.c: the shared-memory file (slow path only; uses options.c) */
extern bool _hk_tel_on;
void _hk_tel_start(void);
void _hk_tel_tick(uint64_t now_coarse_ns);
void _hk_tel_exit(const hk_stats_t* st);
bool _hk_tel_exit_unmapped(void);
void _hk_tel_after_fork_child(void);
/* The stats table's line: "telemetry: on, PATH" or "telemetry: off: why". */
size_t _hk_tel_describe(char* buf, size_t cap, uint64_t failures);

/* ---- the background thread (background.c) --------------------------------------- */
bool _hk_background_allowed(void);          /* HAKMEM_BACKGROUND (options.c) */
void _hk_background_born(void);             /* at initialization */
void _hk_background_start_now(void);        /* the replayer: a live capture's process was past its first second */
void _hk_background_maybe_start(uint64_t now_ns);
void _hk_background_after_fork_child(void);
size_t _hk_background_describe(char* buf, size_t cap);
/* init.c: start-up, fork, exit */
void        _hk_init(void);
/* classes.c: size-class tables */
void        _hk_classes_init(void);
/* thread.c: the thread registry and thread caches */
void        _hk_thread_init(void);
void        _hk_thread_after_fork_child(void);
hk_tcache_t* _hk_tcache_setup(void);                   /* first slow path */
void        _hk_registry_lock(void);
void        _hk_registry_unlock(void);
void        _hk_registry_sum(uint64_t* allocs, uint64_t* cached_blocks);
void        _hk_publish(hk_tcache_t* tc, unsigned cls);   /* bin counters -> record */
void        _hk_publish_all(hk_tcache_t* tc);
void        _hk_threads_trap(void);      /* every live thread's next free takes the slow path */
void        _hk_untrap_if_trapped(hk_tcache_t* tc);   /* that slow path: the limits back */
/* stats.c */
void _hk_stats_collect(hk_stats_t* out);
void _hk_stats_print_snapshot(int fd, const hk_stats_t* st);
void _hk_stats_clock_start(void);
/* error.c: report and abort, never allocating */
HK_COLD __attribute__((noreturn)) void _hk_invalid_free(const void* p, const char* why);
HK_COLD __attribute__((noreturn)) void _hk_fatal(const char* msg, const void* p);
HK_COLD __attribute__((noreturn)) void _hk_assert_fail(const char* c, const char* f, int l);
HK_COLD void _hk_warn(const char* msg, const char* detail);
/* Formats into a caller buffer without allocating; returns length. */
size_t _hk_fmt(char* buf, size_t cap, const char* fmt, ...);

#endif /* HK_INTERNAL_H */
