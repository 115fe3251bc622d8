/* segment.c — segments ("superslabs") and the address map.
 *
 * SYNCHRONIZATION
 *  1. seg_lock guards the segment list, the reservation cursor, the empty
 *     segment cache, free_pages/page_class/page_tls/page_start of every segment, and
 *     writes to _hk_map.
 *  2. Lock order: a class lock (slab.c) may be held when seg_lock is taken,
 *     never the other way round.
 *  3. free() reads _hk_map and page_tls/page_start without a lock. They
 *     change only when a slab is carved (before any block of it exists) or
 *     released (after every block of it came back), so for a correct program
 *     no free can race with the change; the class locks order the writes
 *     before the blocks are handed to any thread.
 *  4. The decay pass takes the pages it gives back out of free_pages while
 *     it calls the OS without seg_lock (nobody can carve them meanwhile),
 *     then puts them back.
 *
 * DIRTY PAGES
 * A released slab's pages are not given back to the OS at once: they stay
 * committed ("dirty") and the next slab carved, of any class, takes a run
 * of dirty pages before clean ones, so memory freed at one size serves
 * another without a page fault per OS page (a program that replaces
 * 4 KiB-1 MiB objects at random faulted 6.8x as often as glibc when every
 * release went back to the OS). Pages that stay dirty for a whole drain
 * interval go back by the decay pass (_hk_segment_decay, from slab.c's
 * warm-pool decay); malloc_trim and an out-of-memory retry give back all
 * of them; and the dirty total is capped at a fraction of what the
 * process has committed, so it cannot double a small heap. The policy
 * scales that cap: one that keeps fewer empty slabs than the default keeps
 * fewer dirty pages in proportion (options.c: dirty_share_of).
 */
#include "internal.h"
#include "knobs.h"
#include "prim.h"

uint8_t _hk_map[HK_MAP_ENTRIES] HK_SPARSE_BSS;

static hk_lock_t seg_lock;
static hk_segment_t* seg_list;                 /* segments with free pages */
static hk_segment_t* seg_cache[HK_SEG_CACHE_DIRTY_MAX];
static unsigned seg_cache_count;
static uintptr_t reserve_next, reserve_end;    /* address space for new segments */
/* Dirty pages in all segments (written under seg_lock; read without it for
 * the cap, which is advice). */
static _Atomic uint64_t dirty_total;

/* At most this many dirty pages: 256 MiB (retain_mib, below), or an eighth
 * of what the process has committed when that is more. With 32 MiB, mimalloc-bench's mstress
 * (2 threads replacing objects of 8 B to 5 MiB) gave back and faulted in
 * again slabs of its 160 KiB-1 MiB classes 800-1,000 times a run: about
 * 45k of its 105k page faults. With 64 MiB, mimalloc's test-stress (32
 * threads whose live set swings by 100-200 MiB) made 31-33k madvise calls
 * and 870-916k page faults a run (mimalloc: 2.7-3.2k and 420-530k), and
 * with 128 MiB 9-10k and 240-270k; with 256 MiB 1.6k and 62-65k, at a
 * peak RSS of 229-241 MB (mimalloc 306-324, jemalloc 226). A process holds
 * no more dirty pages than it freed, and what is kept is kept for a drain
 * interval or two (_hk_segment_decay), not for good: jemalloc keeps its
 * dirty pages 10 s by default, with no cap. */
#define DIRTY_SHARE     8

#define ALL_SLAB_PAGES (~(uint64_t)1)          /* pages 1..63 */

void _hk_segment_lock(void) { _hk_lock(&seg_lock); }
void _hk_segment_unlock(void) { _hk_unlock(&seg_lock); }
void _hk_segment_reinit_lock(void) { _hk_lock_reinit(&seg_lock); }

static void list_push(hk_segment_t* s) {
  s->prev = NULL;
  s->next = seg_list;
  if (seg_list) seg_list->prev = s;
  seg_list = s;
  s->in_list = 1;
}

static void list_remove(hk_segment_t* s) {
  if (s->prev) s->prev->next = s->next; else seg_list = s->next;
  if (s->next) s->next->prev = s->prev;
  s->next = s->prev = NULL;
  s->in_list = 0;
}

/* Address space for new segments, HK_RESERVE_SEGMENTS at a time (one mmap
 * for many segments), or fewer when that much does not fit: a reservation
 * counts against RLIMIT_AS in full, MAP_NORESERVE or not, so under a
 * `ulimit -v` the last megabytes are reached one segment at a time. */
static bool reserve_more(void) {
  for (uintptr_t n = HK_RESERVE_SEGMENTS; n >= 1; n /= 2) {
    void* base;
    int err = _hk_os_map_aligned(n * HK_SEG_SIZE, HK_SEG_SIZE, true, &base);
    if (err == 0) {
      reserve_next = (uintptr_t)base;
      reserve_end = reserve_next + n * HK_SEG_SIZE;
      return true;
    }
    if (err != ENOMEM) return false;
  }
  return false;
}

static hk_segment_t* segment_new(void) {
  if (seg_cache_count > 0) {
    hk_segment_t* s = seg_cache[--seg_cache_count];
    HK_ASSERT(s->free_pages == ALL_SLAB_PAGES);
    return s;
  }
  if (reserve_next == reserve_end && !reserve_more()) return NULL;
  hk_segment_t* s = (hk_segment_t*)reserve_next;
  reserve_next += HK_SEG_SIZE;
  /* Fresh anonymous memory is zero: only the non-zero fields are set. */
  s->magic = HK_SEG_MAGIC;
  s->free_pages = ALL_SLAB_PAGES;
  for (unsigned i = 0; i < HK_SEG_PAGES; i++) s->page_tls[i] = _hk_bin_tls(0);   /* before the map */
  hk_add_relaxed(&_hk_proc.committed_bytes, HK_OS_PAGE * 2);
  /* Released after page_tls: free() of any pointer into the segment (a
   * stray one included) that sees the map byte sees the bins of class 0. */
  __atomic_store_n(&_hk_map[((uintptr_t)s >> HK_SEG_SHIFT) & (HK_MAP_ENTRIES - 1)], HK_MAP_SEGMENT,
                   __ATOMIC_RELEASE);
  return s;
}

/* The segment's dirty pages stop counting (it is being unmapped). */
static void forget_dirty(hk_segment_t* s) {
  unsigned n = (unsigned)__builtin_popcountll(s->dirty_pages);
  hk_sub_relaxed(&dirty_total, n);
  hk_sub_relaxed(&_hk_proc.committed_bytes, (uint64_t)n << HK_PAGE_SHIFT);
  s->dirty_pages = s->dirty_old = 0;
}

static void segment_unmap(hk_segment_t* s) {
  forget_dirty(s);
  _hk_map[((uintptr_t)s >> HK_SEG_SHIFT) & (HK_MAP_ENTRIES - 1)] = HK_MAP_NONE;
  hk_sub_relaxed(&_hk_proc.committed_bytes, HK_OS_PAGE * 2);
  _hk_os_unmap(s, HK_SEG_SIZE);
}

static void segment_free(hk_segment_t* s) {
  if (seg_cache_count < HK_SEG_CACHE_MAX ||
      (s->dirty_pages && seg_cache_count < HK_SEG_CACHE_DIRTY_MAX)) {
    seg_cache[seg_cache_count++] = s;
    return;
  }
  segment_unmap(s);
}

/* Lowest index of k consecutive set bits in m, or -1. */
static int find_run(uint64_t m, unsigned k) {
  uint64_t r = m;
  for (unsigned i = 1; i < k; i++) r &= m >> i;
  return r ? __builtin_ctzll(r) : -1;
}

hk_slab_t* _hk_slab_carve(unsigned cls) {
  const hk_class_info_t* ci = &_hk_class[cls];
  unsigned k = ci->slab_pages;
  _hk_lock(&seg_lock);
  hk_segment_t* s;
  int first = -1;
  /* A run of dirty pages costs no page faults: take one first. */
  for (s = seg_list; s; s = s->next) {
    first = find_run(s->dirty_pages, k);
    if (first >= 0) break;
  }
  if (!s)
    for (s = seg_list; s; s = s->next) {
      first = find_run(s->free_pages, k);
      if (first >= 0) break;
    }
  if (!s) {
    s = segment_new();
    if (!s) { _hk_unlock(&seg_lock); return NULL; }
    list_push(s);
    first = find_run(s->free_pages, k);
    HK_ASSERT(first == 1);
  }
  uint64_t mask = (k == 64 ? ~(uint64_t)0 : (((uint64_t)1 << k) - 1)) << first;
  s->free_pages &= ~mask;
  unsigned reused = (unsigned)__builtin_popcountll(s->dirty_pages & mask);
  s->dirty_pages &= ~mask;
  s->dirty_old &= ~mask;
  hk_sub_relaxed(&dirty_total, reused);
  for (unsigned i = (unsigned)first; i < (unsigned)first + k; i++) {
    s->page_start[i] = (uint64_t)first << HK_PAGE_SHIFT;
    s->page_class[i] = (uint8_t)cls;
    s->page_tls[i] = _hk_bin_tls(cls);
  }
  if (s->free_pages == 0) list_remove(s);
  hk_slab_t* slab = &s->slabs[first];
  uint8_t* start = (uint8_t*)s + ((uintptr_t)first << HK_PAGE_SHIFT);
  slab->free = NULL;
  slab->start = start;
  slab->bump = start;
  slab->end = start + (size_t)ci->slab_blocks * ci->size;
  slab->next = slab->prev = NULL;
  slab->used = 0;
  slab->capacity = ci->slab_blocks;
  slab->nfree = 0;
  slab->last_tid = 0;
  slab->cur_n = 0;
  slab->chains = NULL;
  hk_store_relaxed(&slab->owner, NULL);
  slab->cls = (uint8_t)cls;
  /* Pages kept dirty are resident up to where their last slab's blocks
   * reached; a slab with any page that is not (fresh, or given back) is
   * counted as cold throughout: the refills that first write its pages
   * take their faults (see fresh_pages in take_blocks). */
  slab->cold = reused < k;
  slab->pages = (uint8_t)k;
  slab->state = HK_SLAB_PARTIAL;
  /* For memcheck, nothing in a new slab is addressable until take_blocks
   * writes a block's link or the block is handed out. */
  HK_VG_NOACCESS(start, (size_t)k << HK_PAGE_SHIFT);
  if (_hk_check_mode)
    memset(s->check_bits[first], 0, sizeof s->check_bits[first]);
  hk_add_relaxed(&_hk_proc.committed_bytes, (uint64_t)(k - reused) << HK_PAGE_SHIFT);
  _hk_unlock(&seg_lock);
  return slab;
}

/* The policy's share of the cap (options.c: dirty_share_of), out of
 * HK_DIRTY_SHARE_ONE. */
static _Atomic uint32_t dirty_share = HK_DIRTY_SHARE_ONE;

void _hk_segment_dirty_share(uint32_t share) {
  hk_store_relaxed(&dirty_share, share < HK_DIRTY_SHARE_ONE ? share : HK_DIRTY_SHARE_ONE);
}

/* The policy's retain_mib (knobs.h): the cap's floor in MiB, and the share
 * of the heap it grows to above that, in proportion (an eighth at the
 * default). That default is the floor the comment above measured; a
 * program that reuses less of what it frees than mstress does (sqlite3's
 * shell: 250 MiB resident for 80 under glibc, most of it freed pages kept
 * through its whole run) is told to keep less, and 0 keeps nothing. */
#define RETAIN_DEFAULT_MIB HK_KNOB_RETAIN_MIB_DEFAULT(0, 0, NULL, 0)
static _Atomic uint32_t retain_mib = RETAIN_DEFAULT_MIB;

void _hk_segment_retain(uint32_t mib) { hk_store_relaxed(&retain_mib, mib); }

static uint64_t dirty_cap(void) {
  uint64_t r = hk_load_relaxed(&retain_mib);
  uint64_t floor = (r << 20) >> HK_PAGE_SHIFT;
  uint64_t cap = (hk_load_relaxed(&_hk_proc.committed_bytes) >> HK_PAGE_SHIFT) / DIRTY_SHARE
                 * r / RETAIN_DEFAULT_MIB;
  if (cap < floor) cap = floor;
  return cap * hk_load_relaxed(&dirty_share) / HK_DIRTY_SHARE_ONE;
}

/* Whether k more dirty pages fit under the cap. */
static bool dirty_room(unsigned k) {
  return hk_load_relaxed(&dirty_total) + k <= dirty_cap();
}

void _hk_slab_release(hk_slab_t* slab) {
  hk_segment_t* s = _hk_segment_of(slab);
  unsigned first = (unsigned)(slab - s->slabs);
  unsigned k = slab->pages;
  /* Kept dirty when there is room (see "dirty pages"); else given back
   * before the pages are published as free, outside the lock. */
  bool keep = dirty_room(k);
  if (!keep) _hk_os_decommit(slab->start, (size_t)k << HK_PAGE_SHIFT);
  _hk_lock(&seg_lock);
  for (unsigned i = first; i < first + k; i++) {
    s->page_class[i] = 0;
    s->page_tls[i] = _hk_bin_tls(0);
    s->page_start[i] = 0;
  }
  slab->state = HK_SLAB_UNUSED;
  slab->free = NULL;
  slab->nfree = 0;
  slab->cur_n = 0;
  slab->chains = NULL;
  slab->used = 0;
  uint64_t mask = (((uint64_t)1 << k) - 1) << first;
  s->free_pages |= mask;
  if (keep) {
    s->dirty_pages |= mask;
    hk_add_relaxed(&dirty_total, k);
  } else {
    hk_sub_relaxed(&_hk_proc.committed_bytes, (uint64_t)k << HK_PAGE_SHIFT);
  }
  if (!s->in_list) list_push(s);
  if (s->free_pages == ALL_SLAB_PAGES) {
    list_remove(s);
    segment_free(s);
  }
  _hk_unlock(&seg_lock);
}

/* Gives back the dirty pages that `pick` selects of each segment with free
 * pages (at most DECAY_BATCH segments a call; the rest wait for the next).
 * The pages leave free_pages while the OS is asked without seg_lock, so no
 * carve can take them half-returned, then come back clean. */
#define DECAY_BATCH 64
enum { DECAY_OLD, DECAY_ALL };

static bool give_back_dirty(int pick) {
  struct { hk_segment_t* s; uint64_t mask; } out[DECAY_BATCH];
  unsigned n = 0;
  _hk_lock(&seg_lock);
  /* Cached (wholly free) segments first: they leave the cache while their
   * pages are out, since segment_new takes only wholly free ones. */
  for (unsigned i = 0; i < seg_cache_count && n < DECAY_BATCH;) {
    hk_segment_t* s = seg_cache[i];
    uint64_t m = pick == DECAY_OLD ? s->dirty_pages & s->dirty_old : s->dirty_pages;
    s->dirty_old = s->dirty_pages & ~m;
    if (!m) { i++; continue; }
    seg_cache[i] = seg_cache[--seg_cache_count];
    s->dirty_pages &= ~m;
    s->free_pages &= ~m;
    out[n].s = s;
    out[n++].mask = m;
  }
  for (hk_segment_t* s = seg_list; s && n < DECAY_BATCH; s = s->next) {
    uint64_t m = pick == DECAY_OLD ? s->dirty_pages & s->dirty_old : s->dirty_pages;
    s->dirty_old = s->dirty_pages & ~m;
    if (!m) continue;
    s->dirty_pages &= ~m;
    s->free_pages &= ~m;
    out[n].s = s;
    out[n++].mask = m;
  }
  _hk_unlock(&seg_lock);
  for (unsigned i = 0; i < n; i++) {
    uint64_t m = out[i].mask;
    while (m) {   /* one call per run of consecutive pages */
      unsigned first = (unsigned)__builtin_ctzll(m);
      unsigned len = (unsigned)__builtin_ctzll(~(m >> first));
      if (first + len > 64) len = 64 - first;
      _hk_os_decommit((uint8_t*)out[i].s + ((uintptr_t)first << HK_PAGE_SHIFT),
                      (size_t)len << HK_PAGE_SHIFT);
      m &= len == 64 ? 0 : ~((((uint64_t)1 << len) - 1) << first);
    }
  }
  _hk_lock(&seg_lock);
  for (unsigned i = 0; i < n; i++) {
    hk_segment_t* s = out[i].s;
    unsigned pages = (unsigned)__builtin_popcountll(out[i].mask);
    hk_sub_relaxed(&dirty_total, pages);
    hk_sub_relaxed(&_hk_proc.committed_bytes, (uint64_t)pages << HK_PAGE_SHIFT);
    s->free_pages |= out[i].mask;
    if (s->free_pages == ALL_SLAB_PAGES) {
      if (s->in_list) list_remove(s);
      segment_free(s);
    }
  }
  _hk_unlock(&seg_lock);
  return n > 0;
}

void _hk_segment_decay(void) {
  if (hk_load_relaxed(&dirty_total) != 0) give_back_dirty(DECAY_OLD);
}

void _hk_segment_fit_dirty(void) {
  while (hk_load_relaxed(&dirty_total) > dirty_cap() && give_back_dirty(DECAY_ALL)) {}
}

bool _hk_segment_trim(void) {
  bool any = false;
  while (hk_load_relaxed(&dirty_total) != 0 && give_back_dirty(DECAY_ALL)) any = true;
  _hk_lock(&seg_lock);
  any |= seg_cache_count > 0;
  while (seg_cache_count > 0) segment_unmap(seg_cache[--seg_cache_count]);
  _hk_unlock(&seg_lock);
  return any;
}
