/* slab.c — the central per-class state: refill, drain, warm pool.
 *
 * SYNCHRONIZATION
 *  1. Each class has its own lock (_hk_central[cls].lock). It guards the
 *     class's partial list, warm pool and every field of its slabs except the
 *     page tables (segment.c). No lock is ever held across classes.
 *  2. A thread takes a class lock only on its slow path, once per batch of
 *     blocks moved (refill or drain), so frees from any thread stay lock-free
 *     on the fast path: they land in the freeing thread's cache and travel
 *     back to their slab in batches.
 *  3. Slabs are released to the OS (segment.c, madvise) after the class lock
 *     is dropped, so no thread waits on a syscall while holding it.
 *
 * TRANSFER
 * A drain of at most a batch parks the chain as it is in the class's
 * transfer cache (a few slots, HK_XFER_BYTES at most), and the next refill
 * of any thread takes a parked chain whole: both are O(1) under the lock,
 * where returning blocks to their slabs one by one and taking them back
 * costs a slab lookup and list update per block while every other thread of
 * the class waits for the lock. That is what a producer/consumer pair does
 * all day (one thread's drains feed the other's refills). Parked blocks are
 * still "out" of their slabs, so a slab they belong to cannot be emptied;
 * every decay pass and malloc_trim return them to their slabs (give_block,
 * which also checks each one as any drain does).
 */
#include "internal.h"
#include "prim.h"

hk_central_t _hk_central[HK_NUM_CLASSES];

/* Warm pool limits of the policy in force (written by options.c). */
_Atomic uint32_t _hk_warm_limit[HK_NUM_CLASSES];

#define CHECK_FILL 0xdb
#define NO_TID     UINT32_MAX   /* give_block: counted as remote or not already */
#define CHECK_SPAN 4096u   /* bytes of a freed block filled/verified */

/* ---- list helpers ---------------------------------------------------------- */
static void slab_push(hk_slab_t** list, hk_slab_t* s) {
  s->prev = NULL;
  s->next = *list;
  if (*list) (*list)->prev = s;
  *list = s;
}

static void slab_unlink(hk_slab_t** list, hk_slab_t* s) {
  if (s->prev) s->prev->next = s->next; else *list = s->next;
  if (s->next) s->next->prev = s->prev;
  s->next = s->prev = NULL;
}

/* A slab to take blocks from: the warm pool first, then fresh pages. */
static hk_slab_t* slab_get(hk_central_t* c, unsigned cls) {
  hk_slab_t* s = c->warm;
  if (s) {
    slab_unlink(&c->warm, s);
    if (--c->warm_count < c->warm_low) c->warm_low = c->warm_count;
    hk_add_relaxed(&c->c.slabs_from_warm, 1);
  } else {
    s = _hk_slab_carve(cls);
    if (!s) return NULL;
    hk_add_relaxed(&c->c.slabs_from_os, 1);
  }
  s->state = HK_SLAB_PARTIAL;
  slab_push(&c->partial, s);
  return s;
}

static bool check_bit_flip(hk_slab_t* s, const void* b, bool set) {
  hk_segment_t* seg = _hk_segment_of(s);
  unsigned first = (unsigned)(s - seg->slabs);
  size_t idx = (size_t)((const uint8_t*)b - s->start) / _hk_class[s->cls].size;
  uint64_t* w = &seg->check_bits[first][idx / 64];
  uint64_t bit = (uint64_t)1 << (idx % 64);
  if (idx >= HK_CHECK_BITMAP_WORDS * 64) return true; /* not tracked */
  bool was = (*w & bit) != 0;
  if (was == set) return false;
  if (set) *w |= bit; else *w &= ~bit;
  return true;
}

static void check_verify_fill(const hk_slab_t* s, const uint8_t* b) {
  size_t n = _hk_class[s->cls].size;
  if (n > CHECK_SPAN) n = CHECK_SPAN;
  HK_VG_DEFINED(b, n);
  for (size_t i = sizeof(void*); i < n; i++)
    if (b[i] != CHECK_FILL) _hk_fatal("heap corruption: freed block written after free", b + i);
}

/* Takes up to n blocks of class cls into a chain; returns how many. Free
 * blocks first (hot in cache), then never-used ones, linked in address order. */
static uint32_t take_blocks(hk_central_t* c, unsigned cls, uint32_t n,
                            void** head_out, uint32_t tid) {
  const uint32_t size = _hk_class[cls].size;
  void* head = NULL;
  uint32_t got = 0;
  bool fresh = false;
  while (got < n) {
    hk_slab_t* s = c->partial;
    if (!s && !(s = slab_get(c, cls))) break;
    s->owner = tid;
    while (got < n && s->free) {
      void* b = s->free;
      s->free = *(void**)b;
      if (HK_UNLIKELY(_hk_check_mode)) {
        check_verify_fill(s, b);
        check_bit_flip(s, b, true);
      }
      *(void**)b = head;
      head = b;
      got++;
      s->used++;
    }
    if (got < n && s->bump < s->end) {
      /* Never-used blocks: only those starting in the OS page that holds
       * the bump pointer (at least one). Linking a block writes into it,
       * so a larger take would fault in pages ahead of use, and a short
       * run leaves them untouched by the program (up to 7 pages per class
       * at the end of the slow start); refills from fresh memory pay a
       * page fault each anyway, which dwarfs one more trip here. */
      uint32_t m = (uint32_t)((size_t)(s->end - s->bump) / size);
      uintptr_t page_end = ((uintptr_t)s->bump | (HK_OS_PAGE - 1)) + 1;
      uint32_t in_page = (uint32_t)((page_end - (uintptr_t)s->bump + size - 1) / size);
      if (m > in_page) m = in_page;
      if (m > n - got) m = n - got;
      uint8_t* b = s->bump;
      for (uint32_t i = 0; i < m; i++) HK_VG_DEFINED(b + (size_t)i * size, sizeof(void*));
      /* The first block to start in this OS page of a cold slab: linking it
       * is the page's first write, and its fault is the kernel's time, which
       * learnd prices from the process's fault count: timed as kernel time
       * and left out of slow_ns (_hk_kernel_ticks), or it would be priced
       * twice (bench-learn's spikes: keeping nothing looked 5% dearer). */
      if (s->cold && (b == s->start || (uintptr_t)(b - size) < (page_end - HK_OS_PAGE))) {
        hk_add_relaxed(&c->c.fresh_pages, 1);
        uint64_t f0 = _hk_os_ticks();
        *(void* volatile*)b = NULL;
        _hk_kernel_ticks += _hk_os_ticks() - f0;
      }
      for (uint32_t i = 0; i + 1 < m; i++) *(void**)(b + (size_t)i * size) = b + (size_t)(i + 1) * size;
      *(void**)(b + (size_t)(m - 1) * size) = head;
      if (HK_UNLIKELY(_hk_check_mode))
        for (uint32_t i = 0; i < m; i++) check_bit_flip(s, b + (size_t)i * size, true);
      head = b;
      s->bump += (size_t)m * size;
      got += m;
      s->used += m;
      fresh = true;
    }
    if (s->used == s->capacity) {
      slab_unlink(&c->partial, s);
      s->state = HK_SLAB_FULL;
    }
    if (fresh) break;   /* at most one fresh page per refill (see above) */
  }
  HK_ASSERT(got <= n);
  *head_out = head;
  return got;
}

/* Returns one block to its slab (class lock held). A slab that becomes
 * empty is appended to *release when it must go back to the OS. */
static void give_block(hk_central_t* c, unsigned cls, void* b, uint32_t tid,
                       hk_slab_t** release) {
  hk_segment_t* seg = _hk_segment_of(b);
  unsigned page = _hk_page_of(b);
  if (HK_UNLIKELY(_hk_page_class(seg, page) != cls))
    _hk_invalid_free(b, "block of another size class");
  hk_slab_t* s = &seg->slabs[seg->page_start[page] >> HK_PAGE_SHIFT];
  if (HK_UNLIKELY(s->used == 0 || (uint8_t*)b >= s->bump))
    _hk_invalid_free(b, "double free or never allocated");
  if (HK_UNLIKELY(_hk_check_mode)) {
    if (!check_bit_flip(s, b, false)) _hk_invalid_free(b, "double free");
    size_t n = _hk_class[cls].size;
    n = n > CHECK_SPAN ? CHECK_SPAN : n;
    HK_VG_DEFINED((uint8_t*)b + sizeof(void*), n - sizeof(void*));
    memset((uint8_t*)b + sizeof(void*), CHECK_FILL, n - sizeof(void*));
    HK_VG_NOACCESS((uint8_t*)b + sizeof(void*), n - sizeof(void*));
  }
  *(void**)b = s->free;
  s->free = b;
  s->used--;
  if (tid != NO_TID && s->owner != tid) hk_add_relaxed(&c->c.remote_frees, 1);
  if (s->state == HK_SLAB_FULL) {
    s->state = HK_SLAB_PARTIAL;
    slab_push(&c->partial, s);
  }
  if (s->used == 0) {
    /* Keep the class's only partial slab: retiring it would make the very
     * next refill take it (or a new one) straight back. */
    if (c->partial == s && s->next == NULL) return;
    slab_unlink(&c->partial, s);
    if (c->warm_count < hk_load_relaxed(&_hk_warm_limit[cls])) {
      s->state = HK_SLAB_WARM;
      slab_push(&c->warm, s);
      c->warm_count++;
      hk_add_relaxed(&c->c.slabs_to_warm, 1);
    } else {
      s->state = HK_SLAB_UNUSED;
      s->next = *release;
      *release = s;
      hk_add_relaxed(&c->c.slabs_to_os, 1);
    }
  }
}

/* Warm slabs beyond the limit (it may have been lowered) go to *release. */
static void warm_shrink(hk_central_t* c, unsigned cls, uint32_t limit, hk_slab_t** release) {
  while (c->warm_count > limit) {
    hk_slab_t* s = c->warm;
    slab_unlink(&c->warm, s);
    c->warm_count--;
    s->state = HK_SLAB_UNUSED;
    s->next = *release;
    *release = s;
    hk_add_relaxed(&c->c.slabs_to_os, 1);
  }
  if (c->warm_count < c->warm_low) c->warm_low = c->warm_count;
}

static void release_all(hk_slab_t* s) {
  while (s) {
    hk_slab_t* next = s->next;
    _hk_slab_release(s);
    s = next;
  }
}

/* Out of memory: the slabs every class keeps warm and the huge mappings
 * kept for reuse go back to the OS (their pages and address space are then
 * free for this class's new slab), and take_blocks gets one more try. The
 * segment cache is left: a new slab takes a cached segment before it maps
 * anything, so it was empty when the slab could not be had. Runs with no
 * lock held: trimming takes each class lock in turn. */
static HK_NOINLINE uint32_t take_after_trim(hk_central_t* c, unsigned cls, uint32_t n,
                                            void** head, uint32_t tid) {
  bool any = _hk_trim_warm();
  any |= _hk_huge_trim();
  if (!any) return 0;
  _hk_lock(&c->lock);
  uint32_t got = take_blocks(c, cls, n, head, tid);
  _hk_unlock(&c->lock);
  return got;
}

/* Parked chains back to their slabs (class lock held). */
static void xfer_flush(hk_central_t* c, unsigned cls, hk_slab_t** release) {
  while (c->xfer_count > 0) {
    hk_xfer_t* x = &c->xfer[--c->xfer_count];
    void* b = x->head;
    for (uint32_t i = 0; i < x->n; i++) {
      void* next = *(void**)b;
      give_block(c, cls, b, NO_TID, release);
      b = next;
    }
    c->xfer_blocks -= x->n;
    x->head = NULL;
    x->n = 0;
  }
}

/* A parked chain of at most `most` blocks, or 0 (class lock held). */
static uint32_t xfer_take(hk_central_t* c, uint32_t most, void** head) {
  if (c->xfer_count == 0) return 0;
  hk_xfer_t* x = &c->xfer[c->xfer_count - 1];
  if (x->n > most) return 0;
  uint32_t n = x->n;
  *head = x->head;
  x->head = NULL;
  x->n = 0;
  c->xfer_count--;
  c->xfer_blocks -= n;
  return n;
}

void* _hk_refill(hk_tcache_t* tc, unsigned cls) {
  hk_bin_t* bin = &tc->bin[cls];
  hk_central_t* c = &_hk_central[cls];
  uint64_t t0 = _hk_os_ticks(), k0 = _hk_kernel_ticks;
  void* head;
  hk_bin_cold_t* cold = &tc->cold[cls];
  uint32_t want = cold->fill;
  if (want == 0 || want > cold->batch) want = cold->batch < 4 ? cold->batch : 4;
  if (want == 0) want = 1;
  cold->fill = want * 2 < cold->batch ? want * 2 : cold->batch;
  _hk_lock(&c->lock);
  uint32_t got = xfer_take(c, cold->batch, &head);
  if (got == 0) got = take_blocks(c, cls, want, &head, tc->tid);
  _hk_unlock(&c->lock);
  if (HK_UNLIKELY(got == 0)) got = take_after_trim(c, cls, want, &head, tc->tid);
  hk_add_relaxed(&c->c.refills, 1);
  hk_add_relaxed(&c->c.refill_blocks, got);
  /* ticks, stats.c converts; the kernel's time is priced apart (prim.c) */
  hk_add_relaxed(&c->c.slow_ns, _hk_os_ticks() - t0 - (_hk_kernel_ticks - k0));
  if (HK_UNLIKELY(got == 0)) return NULL;
  void* p = head;
  bin->head = *(void**)p;
  bin->room -= (int32_t)(got - 1);   /* the bin was empty */
  bin->left--;   /* counts this block (the caller armed a due countdown) */
  _hk_publish(tc, cls);
  return p;
}

void _hk_drain(hk_tcache_t* tc, unsigned cls, uint32_t n) {
  hk_bin_t* bin = &tc->bin[cls];
  hk_central_t* c = &_hk_central[cls];
  if (n > _hk_bin_count(bin)) n = _hk_bin_count(bin);
  if (n == 0) return;
  uint64_t t0 = _hk_os_ticks(), k0 = _hk_kernel_ticks;
  hk_slab_t* release = NULL;
  void* b = bin->head;
  if (n > 1 && n <= tc->cold[cls].batch && (uint64_t)n * _hk_class[cls].size <= HK_XFER_BYTES) {
    /* Cut the chain outside the lock, then park it if a slot and the byte
     * bound allow (see "transfer"). */
    void* last = b;
    uint32_t remote = 0;
    for (uint32_t i = 0;; i++) {
      /* Counted here, as give_block would: frees of blocks from slabs that
       * another thread last refilled from (a racy read: a statistic). */
      const hk_segment_t* seg = _hk_segment_of(last);
      const hk_slab_t* sl = &seg->slabs[seg->page_start[_hk_page_of(last)] >> HK_PAGE_SHIFT];
      remote += sl->owner != tc->tid;
      if (i + 1 == n) break;
      last = *(void**)last;
    }
    void* rest = *(void**)last;
    *(void**)last = NULL;
    _hk_lock(&c->lock);
    if (c->xfer_count < HK_XFER_SLOTS &&
        (c->xfer_blocks + n) * _hk_class[cls].size <= HK_XFER_BYTES) {
      c->xfer[c->xfer_count].head = b;
      c->xfer[c->xfer_count++].n = n;
      c->xfer_blocks += n;
      if (remote) hk_add_relaxed(&c->c.remote_frees, remote);
      b = rest;
    } else {
      for (uint32_t i = 0; i < n; i++) {
        void* next = *(void**)b;
        give_block(c, cls, b, tc->tid, &release);
        b = next;
      }
      b = rest;
      warm_shrink(c, cls, hk_load_relaxed(&_hk_warm_limit[cls]), &release);
    }
    _hk_unlock(&c->lock);
  } else {
    _hk_lock(&c->lock);
    for (uint32_t i = 0; i < n; i++) {
      void* next = *(void**)b;
      give_block(c, cls, b, tc->tid, &release);
      b = next;
    }
    warm_shrink(c, cls, hk_load_relaxed(&_hk_warm_limit[cls]), &release);
    _hk_unlock(&c->lock);
  }
  bin->head = b;
  bin->room += (int32_t)n;
  _hk_publish(tc, cls);
  hk_add_relaxed(&c->c.drains, 1);
  hk_add_relaxed(&c->c.drain_blocks, n);
  release_all(release);
  hk_add_relaxed(&c->c.slow_ns, _hk_os_ticks() - t0 - (_hk_kernel_ticks - k0));   /* as in _hk_refill */
}

void _hk_flush_thread(hk_tcache_t* tc) {
  for (unsigned cls = 1; cls < HK_NUM_CLASSES; cls++)
    if (_hk_bin_count(&tc->bin[cls])) _hk_drain(tc, cls, _hk_bin_count(&tc->bin[cls]));
}

/* One block without a thread cache: check mode, a cache capacity of 0, or a
 * thread whose cache was already torn down at exit. */
void* _hk_alloc_direct(unsigned cls) {
  hk_central_t* c = &_hk_central[cls];
  void* b;
  _hk_lock(&c->lock);
  uint32_t got = take_blocks(c, cls, 1, &b, _hk_tc.tid);
  _hk_unlock(&c->lock);
  if (HK_UNLIKELY(got == 0)) got = take_after_trim(c, cls, 1, &b, _hk_tc.tid);
  if (!got) return NULL;
  hk_add_relaxed(&c->c.refills, 1);
  hk_add_relaxed(&c->c.refill_blocks, 1);
  hk_add_relaxed(&c->c.allocs, 1);
  return b;
}

void _hk_free_direct(void* p, hk_segment_t* seg, unsigned page, unsigned cls) {
  hk_central_t* c = &_hk_central[cls];
  hk_slab_t* release = NULL;
  _hk_lock(&c->lock);
  give_block(c, cls, p, _hk_tc.tid, &release);
  _hk_unlock(&c->lock);
  hk_add_relaxed(&c->c.drains, 1);
  hk_add_relaxed(&c->c.drain_blocks, 1);
  release_all(release);
}

/* Once per drain interval, process-wide: a warm pool that no refill drew
 * from since the last pass gives half its slabs (rounded up) back to the
 * OS, so memory kept for a burst that is over flows back within a few
 * intervals. A pool that was drawn from gives back half (rounded up) of
 * the slabs it never went below since the last pass: those served nothing
 * in a whole interval. Without that, a pool drawn from every interval kept
 * whatever it once held: bench-learn's phases under cap=4 warm=max held
 * 10 slabs (4-5 MiB) more in its 20-32 KiB classes after 17 s of the
 * default's deeper caches and 9 s of a trial than from the start, to the
 * run's end (134.5 MiB against 129.9 side by side). Run by whichever
 * thread's slow path notices the interval. */
void _hk_warm_decay(uint64_t now_ns, uint64_t interval_ns) {
  static _Atomic uint64_t last_ns;
  uint64_t last = hk_load_relaxed(&last_ns);
  if (now_ns - last < interval_ns) return;
  if (!atomic_compare_exchange_strong_explicit(&last_ns, &last, now_ns,
        memory_order_relaxed, memory_order_relaxed)) return;
  for (unsigned cls = 1; cls < HK_NUM_CLASSES; cls++) {
    hk_central_t* c = &_hk_central[cls];
    if (c->warm_count == 0 && c->xfer_count == 0) {   /* racy peek: a miss waits for the next pass */
      c->warm_seen = hk_load_relaxed(&c->c.slabs_from_warm);
      continue;
    }
    hk_slab_t* release = NULL;
    _hk_lock(&c->lock);
    xfer_flush(c, cls, &release);
    uint64_t taken = hk_load_relaxed(&c->c.slabs_from_warm);
    uint32_t keep = taken == c->warm_seen ? c->warm_count / 2
                                          : c->warm_count - (c->warm_low + 1) / 2;
    uint32_t limit = hk_load_relaxed(&_hk_warm_limit[cls]);
    warm_shrink(c, cls, keep < limit ? keep : limit, &release);
    c->warm_seen = taken;
    c->warm_low = c->warm_count;
    _hk_unlock(&c->lock);
    release_all(release);
  }
  _hk_segment_decay();
  _hk_huge_decay();
}

bool _hk_trim_warm(void) {
  bool any = false;
  for (unsigned cls = 1; cls < HK_NUM_CLASSES; cls++) {
    hk_central_t* c = &_hk_central[cls];
    hk_slab_t* release = NULL;
    _hk_lock(&c->lock);
    xfer_flush(c, cls, &release);
    warm_shrink(c, cls, 0, &release);
    _hk_unlock(&c->lock);
    any |= release != NULL;
    release_all(release);
  }
  return any;
}

void _hk_central_lock_all(void) {
  for (unsigned cls = 0; cls < HK_NUM_CLASSES; cls++) _hk_lock(&_hk_central[cls].lock);
}
void _hk_central_unlock_all(void) {
  for (unsigned cls = 0; cls < HK_NUM_CLASSES; cls++) _hk_unlock(&_hk_central[cls].lock);
}
void _hk_central_reinit_locks(void) {
  for (unsigned cls = 0; cls < HK_NUM_CLASSES; cls++) _hk_lock_reinit(&_hk_central[cls].lock);
}
