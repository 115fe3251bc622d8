/* types.h — every shared type and constant of the allocator, in one place.
 *
 * Roster:
 *   hk_segment_t  a 4 MiB, 4 MiB-aligned region ("superslab") cut into 64 KiB
 *                 pages; page 0 holds this header, pages 1..63 hold slabs.
 *   hk_slab_t     a run of 1..16 pages of one segment serving one size class;
 *                 its descriptor lives in the segment header.
 *   hk_central_t  per size class: the lock, slabs no thread owns, the warm pool.
 *   hk_tcache_t   per thread: a bounded free list per size class (the fast path).
 *   hk_thread_rec_t  per thread, outside TLS: what other threads may read
 *                 about it (published counters), so a thread that died without
 *                 its exit hook never leaves a pointer into freed TLS behind.
 *   hk_huge_t     header in front of an object larger than the largest class,
 *                 which gets a mapping of its own.
 *   hk_lock_t     a small spin-then-yield lock (never allocates, fork-safe).
 *
 * Address arithmetic: for a pointer p inside a segment,
 *   segment = p & ~(HK_SEG_SIZE-1), page = (p >> HK_PAGE_SHIFT) & 63,
 * and hk_map[p >> HK_SEG_SHIFT] says whether that segment is ours at all.
 */
#ifndef HK_TYPES_H
#define HK_TYPES_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "hakmem.h"

/* ---- geometry ------------------------------------------------------------ */
#define HK_SEG_SHIFT       22                          /* 4 MiB segments */
#define HK_SEG_SIZE        ((uintptr_t)1 << HK_SEG_SHIFT)
#define HK_PAGE_SHIFT      16                          /* 64 KiB pages */
#define HK_PAGE_SIZE       ((uintptr_t)1 << HK_PAGE_SHIFT)
#define HK_SEG_PAGES       (HK_SEG_SIZE / HK_PAGE_SIZE) /* 64, page 0 = header */
#define HK_SLAB_MAX_PAGES  16
#define HK_OS_PAGE         4096u
#define HK_MIN_ALIGN       16u

#define HK_SMALL_MAX       1024u                       /* 16-byte table below */
#define HK_MEDIUM_MAX      32768u                      /* 128-byte table below */
#define HK_MAX_CLASS_SIZE  ((size_t)1 << 20)           /* 1 MiB: larger is huge */
#define HK_MAP_BITS        (47 - HK_SEG_SHIFT)         /* user space is 47 bits */
#define HK_MAP_ENTRIES     ((size_t)1 << HK_MAP_BITS)

/* hk_map values: what the 4 MiB chunk of address space holds. */
enum { HK_MAP_NONE = 0, HK_MAP_SEGMENT = 1, HK_MAP_HUGE = 2 };

/* Segments are reserved this many at a time (address space only) so that
 * getting 4 MiB alignment costs three syscalls per 16 segments, not per one. */
#define HK_RESERVE_SEGMENTS 16
/* Empty segments kept mapped before munmap: any 2, and up to 32 that still
 * hold dirty pages, which count against the dirty cap and decay as any
 * (segment.c "dirty pages"): unmapping one threw its pages away, and the
 * next segment faulted them in again (mstress: twice the faults once each
 * thread let go of the slabs it owned). */
#define HK_SEG_CACHE_MAX       2
#define HK_SEG_CACHE_DIRTY_MAX 32
/* Huge mappings kept for reuse after free: count and total bytes (huge.c
 * "cache_budget"); one that stays unused for a whole drain interval goes
 * back to the OS (_hk_huge_decay). */
#define HK_HUGE_CACHE_MAX       16
#define HK_HUGE_CACHE_BYTES     ((size_t)128 << 20)
/* Check mode keeps one bit per block; the largest block count of a slab is
 * a 64 KiB page of 16-byte blocks. */
#define HK_CHECK_BITMAP_WORDS (HK_PAGE_SIZE / HK_MIN_ALIGN / 64)

#define HK_SEG_MAGIC  0x686b6d656d736567ULL /* "hkmemseg" */
#define HK_HUGE_MAGIC 0x686b6d656d687567ULL /* "hkmemhug" */

/* ---- lock ------------------------------------------------------------------ */
typedef struct hk_lock_s {
  atomic_int v; /* 0 free, 1 held */
} hk_lock_t;

/* ---- slab -------------------------------------------------------------------
 * Invariant (under the class lock, or by its owner):
 *   used + nfree + (end - bump) / block_size == capacity,
 *   nfree == cur_n + |chains|,  cur_n == |free|
 * where `used` counts blocks out of the slab: live in the program, in some
 * thread cache, or on their way back to the owner (slab.c "ownership").
 */
enum { HK_SLAB_UNUSED = 0, HK_SLAB_PARTIAL, HK_SLAB_FULL, HK_SLAB_WARM };

struct hk_thread_rec_s;

typedef struct hk_slab_s {
  /* Blocks returned to this slab, in chains of at most _hk_chain_len[cls]
   * (slab.c "chains"): `free` is the chain being built, of cur_n blocks;
   * `chains` the full ones, each headed as an inbox chain. */
  void*     free;
  void*     chains;
  uint8_t*  bump;        /* next never-handed-out block */
  uint8_t*  end;         /* start + capacity * block_size */
  uint8_t*  start;       /* first block, page aligned */
  struct hk_slab_s* next;/* owner's or central partial list, full list, warm pool */
  struct hk_slab_s* prev;
  /* The thread that takes blocks from this slab and gives them back
   * without a lock, or NULL: the class's (central, under its lock). Set
   * under the class lock; read without one by any thread freeing a block
   * of the slab, to pick where the block goes (slab.c "ownership"). */
  struct hk_thread_rec_s* _Atomic owner;
  uint32_t  used;        /* blocks out of the slab */
  uint32_t  capacity;    /* blocks that fit */
  uint32_t  nfree;       /* blocks on `free` and `chains` */
  uint32_t  cur_n;       /* blocks on `free` */
  uint32_t  last_tid;    /* the thread that last took blocks from it: a free
                            by any other counts as remote (remote_frees) */
  uint8_t   cls;
  uint8_t   cold;        /* carved from pages not resident: its never-used blocks fault in (fresh_pages) */
  uint8_t   pages;       /* span length, pages */
  uint8_t   state;       /* HK_SLAB_* */
} __attribute__((aligned(128))) hk_slab_t;
/* 128 bytes, so that finding a block's slab shifts the page's offset where
 * 88 took a multiply-add chain in every drained block (slab.c give_local). */
_Static_assert(sizeof(hk_slab_t) == 128, "a slab descriptor is 128 bytes");
_Static_assert(HK_NUM_CLASSES <= 256, "hk_slab_t.cls is a byte");

/* ---- segment ------------------------------------------------------------- */
typedef struct hk_segment_s {
  uint64_t  magic;                      /* HK_SEG_MAGIC */
  uint64_t  free_pages;                 /* bit i set: page i not in a slab */
  struct hk_segment_s* next;            /* list of segments with free pages */
  struct hk_segment_s* prev;
  uint32_t  in_list;
  uint32_t  _pad;
  /* Free pages still backed by memory (segment.c "dirty pages"): a subset
   * of free_pages, and of those the ones already dirty at the last decay
   * pass, which the next pass gives back. */
  uint64_t  dirty_pages;
  uint64_t  dirty_old;
  /* Per page: the class of the slab covering it (0 = none, so the fast free
   * path falls to the slow path through the class-0 sentinel bin), the
   * same as its bin's TLS offset, _hk_bin_tls(cls) (internal.h: what
   * free() reaches the bin by; _hk_bin_tls(0) when none, never 0 itself
   * where the bins are reached through %fs, so it is set in a new segment
   * before the map says "segment"), and the offset in the segment of that
   * slab's first page (a byte offset, not a page number: free() subtracts
   * it as is, straight from memory, which takes 64 bits). Read without
   * locks by free(): they change only when a slab is carved or released,
   * which a correct program cannot race with a free of a block in that
   * slab. */
  uint8_t   page_class[HK_SEG_PAGES];
  int32_t   page_tls[HK_SEG_PAGES];
  uint64_t  page_start[HK_SEG_PAGES];
  hk_slab_t slabs[HK_SEG_PAGES];        /* descriptor at the slab's first page */
  /* Check mode only (HAKMEM_CHECK=1): a bit per block handed out. Lives in
   * the header page, so it costs no memory unless touched. */
  uint64_t  check_bits[HK_SEG_PAGES][HK_CHECK_BITMAP_WORDS];
} hk_segment_t;

/* ---- per size class central state ---------------------------------------- */
typedef struct hk_class_counters_s {
#define HK_X_ATOMIC(name, desc) _Atomic uint64_t name;
  HK_CLASS_COUNTERS(HK_X_ATOMIC)
} hk_class_counters_t;

typedef struct hk_central_s {
  hk_lock_t  lock;
  hk_slab_t* partial;     /* central slabs (no owner) with free or never-used blocks */
  hk_slab_t* warm;        /* empty slabs kept for reuse */
  uint32_t   warm_count;
  uint32_t   warm_low;    /* the least warm_count since the last decay pass */
  uint64_t   warm_seen;   /* slabs_from_warm at the last decay pass */
  hk_class_counters_t c;  /* cumulative counters (relaxed atomics) */
} __attribute__((aligned(64))) hk_central_t;

/* Static description of a class (filled once at init). */
typedef struct hk_class_info_s {
  uint32_t size;          /* block size */
  uint32_t slab_pages;    /* pages per slab */
  uint32_t slab_blocks;   /* blocks per slab */
  uint32_t chain_len;     /* most blocks in a chain of a slab's free blocks */
} hk_class_info_t;

/* ---- thread cache ----------------------------------------------------------
 * The whole fast path: pop/push on bin[cls].head. A bin holds what the
 * fast paths touch (32 bytes, two classes to a cache line); what only the
 * slow paths use is in hk_bin_cold_t, the thread cache's cold[cls]
 * (_hk_bin_cold). The list's length is not kept: free() counts down the
 * room left under the capacity instead (one decrement and its sign, where
 * count < cap took a load, a compare and an increment). Invariant, outside
 * free():
 *   cap - room == length of the list at head (_hk_bin_count), room >= 0.
 * Bin 0 is a sentinel: cap 0, head NULL, limit 0, so a free of a page
 * without a class (segment header, unused page) and a malloc of class 0 go
 * to the slow path.
 */
typedef struct hk_bin_s {
  void*    head;
  int32_t  room;          /* blocks free() may still push: cap - count */
  int32_t  left;          /* allocations before this bin checks in (alloc.c
                             "check-in"); 0 or below: due at the next one */
  /* The class's block-start test (_hk_div), copied here when the thread
   * cache is set up so that free() finds it beside the bin's head. limit 0
   * fails every block: free's trap (a new or dead thread, a capture:
   * alloc.c "capture traps") sends every free to the slow path, which
   * tests with _hk_div itself. */
  uint64_t magic;
  uint64_t limit;
} hk_bin_t;

_Static_assert(sizeof(hk_bin_t) == 32, "a bin is 32 bytes: two to a cache line");

typedef struct hk_bin_cold_s {
  uint64_t mark;          /* allocations counted once `left` reaches 0, so
                             blocks handed out = mark - max(left, 0) */
  uint32_t cap;
  uint16_t batch;         /* blocks per drain, and most per refill (<= 1024) */
  uint16_t fill;          /* blocks the next refill takes: starts small and
                             doubles up to batch, so a class used a few
                             times does not pull in a whole batch */
} hk_bin_cold_t;

/* Where bin cls lies in a thread cache's bins (internal.h: _hk_bin_tls,
 * what the fast paths' tables hold, so they need not scale the class). */
#define HK_BIN_OFF(cls) ((unsigned)(cls) * (unsigned)sizeof(hk_bin_t))

enum { HK_TC_NEW = 0, HK_TC_ACTIVE = 1, HK_TC_DEAD = 2 };

/* Lives in allocator metadata (never unmapped), listed in the registry.
 * The owning thread publishes its bins' counters here on its slow paths;
 * stats read only these, never another thread's TLS. */
typedef struct hk_thread_rec_s {
  _Atomic uint64_t allocs[HK_NUM_CLASSES];  /* blocks handed out, as last published */
  _Atomic uint32_t cached[HK_NUM_CLASSES];  /* bin.count as last published */
  uint32_t tid;                             /* kernel thread id */
  /* The thread's cache, for the one write another thread makes to it: the
   * free trap that brings a new policy or a malloc_trim to it at its next
   * free (thread.c "reaching every thread"). Set and cleared under the
   * registry lock; NULL once the thread has run its exit hook. */
  struct hk_tcache_s* tc;
  /* Held by the thread while its slow path touches own, own_full and
   * stash, and by the decay pass while it gives back the inbox of a thread
   * that has not taken it for a whole interval (slab.c "idle owners"). */
  hk_lock_t slabs;
  struct hk_thread_rec_s* next;             /* registry, or free list */
  struct hk_thread_rec_s* prev;
  /* Slabs this thread owns, per class (slab.c "ownership"): touched by the
   * thread alone while it lives, and when it is gone by whoever hands
   * them back to the class (thread.c), which is why they are here and
   * not in TLS. */
  hk_slab_t* own[HK_NUM_CLASSES];           /* with free or never-used blocks */
  hk_slab_t* own_full[HK_NUM_CLASSES];      /* every block out */
  void*      stash[HK_NUM_CLASSES];         /* chains taken from inbox, not yet used */
  /* What the last decay pass found in inbox and stash (slab.c "idle owners"). */
  void*      seen_inbox[HK_NUM_CLASSES];
  void*      seen_stash[HK_NUM_CLASSES];
  /* Blocks of this thread's slabs that other threads freed: chains pushed
   * with one compare-and-swap each, taken by this thread in one exchange. */
  _Atomic(void*) inbox[HK_NUM_CLASSES] __attribute__((aligned(64)));
} hk_thread_rec_t;

typedef struct hk_tcache_s {
  hk_bin_t  bin[HK_NUM_CLASSES] __attribute__((aligned(64)));
  hk_bin_cold_t cold[HK_NUM_CLASSES];
  uint64_t  policy_version;     /* version of the policy its caps came from */
  uint64_t  trim_epoch;         /* malloc_trim calls seen (alloc.c) */
  uint64_t  last_gc_ns;         /* last idle-drain pass */
  uint64_t  gc_allocs[HK_NUM_CLASSES]; /* blocks handed out at the last pass */
  uint64_t  rng;                /* xorshift state for check-in draws */
  uint32_t  tid;
  int       state;              /* HK_TC_* */
  hk_thread_rec_t* rec;         /* this thread's published record */
} hk_tcache_t;

/* ---- huge objects ---------------------------------------------------------- */
enum { HK_HUGE_LIVE = 1, HK_HUGE_CACHED = 2 };

/* Sits in the 64 bytes before the user pointer, inside the same mapping. */
typedef struct hk_huge_s {
  uint64_t magic;          /* HK_HUGE_MAGIC ^ (uintptr_t)user */
  void*    base;           /* mapping start (4 MiB aligned) */
  size_t   map_len;        /* mapping length, a multiple of HK_SEG_SIZE */
  size_t   size;           /* bytes requested (usable = map end - user) */
  size_t   dirty;          /* bytes from user that may have been touched */
  uint32_t state;          /* HK_HUGE_* */
  uint32_t several;        /* 1: the mapping may be several kernel mappings
                              (joined from pieces, huge.c), met at chunk
                              boundaries */
  struct hk_huge_s* next_cached;
  uint32_t aged;           /* cached: a decay pass has seen it there */
  uint32_t _pad2;
} hk_huge_t;

_Static_assert(sizeof(hk_huge_t) == 64, "huge header is 64 bytes");
_Static_assert(sizeof(hk_segment_t) <= HK_PAGE_SIZE, "segment header fits page 0");

#endif /* HK_TYPES_H */
