/* slab.c — slabs: who owns them, refill, drain, the warm pool.
 *
 * OWNERSHIP
 * A slab belongs to one thread (its record, hk_thread_rec_t) or to its
 * class (owner NULL: central, under the class lock). A thread's refills
 * take blocks from the slabs it owns and its drains give blocks of those
 * slabs back, without a lock: no other thread touches an owned slab's
 * lists or counts. A block of a slab that another thread owns goes to that
 * thread's inbox for the class instead: a drain links such blocks into one
 * chain per owner and pushes each chain with one compare-and-swap, and the
 * owner takes its whole inbox with one exchange when a refill finds it
 * non-empty and hands each chain to its thread cache whole. So a free of
 * another thread's block never waits for a lock or another thread, and the
 * block goes back to the thread that allocates from its slab (mimalloc
 * shards free lists per page and lets other threads push onto a separate
 * atomic list; snmalloc sends batches of remote frees to their owner).
 * Blocks of central slabs go back under the class lock.
 *
 * A thread that needs a slab takes one from its class, under the lock: a
 * central slab with free blocks (one that a thread handed back when it
 * ended), then the warm pool, then fresh pages. An owner hands a slab back
 * when the slab empties (to the warm pool or the OS: give_local), and all
 * of its slabs when it ends (_hk_slabs_orphan, from thread.c).
 *
 * An inbox chain: word 0 of each block links the chain (NULL-terminated);
 * word 1 of its first block holds the next chain in the inbox and, in bits
 * 48-63, the chain's length (user addresses take 47 bits). Blocks in an
 * inbox or in the owner's stash of taken chains count as drained (stats.c
 * counts them neither live nor cached) and stay out of their slab until the
 * owner's thread cache takes them, or an idle pass, malloc_trim or the
 * owner's end gives them back to their slabs.
 *
 * SYNCHRONIZATION
 *  1. Each class has its own lock (_hk_central[cls].lock). It guards the
 *     class's central partial list and warm pool, every field of a central
 *     slab, and every change of a slab's owner. No lock is ever held across
 *     classes.
 *  2. An owned slab's fields are its owner's alone. Other threads read only
 *     `owner`, without a lock, to pick where a block goes. A slab changes
 *     owner with blocks out only when its owner ends; a block freed on a
 *     stale read then waits in the ended thread's inbox, which the record's
 *     next thread takes as its own or the decay pass sweeps
 *     (_hk_inbox_sweep_free_records): late, never lost.
 *  3. A central slab's blocks are given back under the lock, which reads
 *     the owner again: a thread may have taken the slab meanwhile.
 *  4. Slabs go back to the OS (segment.c, madvise) after the lock is
 *     dropped, so no thread waits on a syscall while holding it.
 *  5. A thread holds its record's `slabs` lock while its slow path touches
 *     its owned slabs and stash (refill, drain, a stash flush, its end).
 *     Uncontended but for the case below: one atomic pair per refill or
 *     drain, never on the fast path.
 *
 * IDLE OWNERS
 * Blocks that other threads free go to the owner's inbox and stay there
 * until the owner refills that class. An owner that stops allocating (a
 * server's main thread waiting for requests while a helper thread frees
 * what it built: redis's lazy free after FLUSHALL ASYNC) kept them, and
 * the slabs under them, for as long as it waited: 160 MiB of redis's
 * 2 KiB values, with no pass able to give them back. So the decay pass
 * looks at every live thread's inboxes and stashes; one found unchanged
 * and not empty since the last pass (a whole drain interval untaken) goes
 * back to its slabs by the pass, which takes the owner's `slabs` lock for
 * it (trylock: the pass never waits on a thread, and a thread that wakes
 * meanwhile waits for the lock at most one chain of blocks; the pass then
 * stops). Emptied slabs then go the usual way: warm pool, dirty pages,
 * decay.
 */
#include "internal.h"
#include "prim.h"

hk_central_t _hk_central[HK_NUM_CLASSES];

/* Warm pool limits of the policy in force (written by options.c). */
_Atomic uint32_t _hk_warm_limit[HK_NUM_CLASSES];

#define CHECK_FILL 0xdb
#define CHECK_SPAN 4096u   /* bytes of a freed block filled/verified */
#define CHAIN_SHIFT 48
#define CHAIN_MAX   ((1u << 16) - 1)
#define CHAIN_NEXT  (((uintptr_t)1 << CHAIN_SHIFT) - 1)

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

HK_INLINE hk_slab_t* slab_of(const void* b) {
  hk_segment_t* seg = _hk_segment_of(b);
  return &seg->slabs[seg->page_start[_hk_page_of(b)] >> HK_PAGE_SHIFT];
}

/* A slab to take blocks from, for the caller to list (class lock held):
 * the warm pool first, then fresh pages. */
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

/* ---- chains -------------------------------------------------------------------
 * A slab keeps its free blocks in chains of at most chain_len (4 KiB of
 * blocks, 8 to 256), the last one open, so that a refill takes a whole
 * chain in one step without reading a block: taking part of one long list
 * reads every block taken, each a cache miss (sh8bench spent 76% of its
 * refills on that one load). Not in check mode, whose fill covers word 1. */
/* A chain's header, in word 1 of its first block h: the next chain and
 * this one's length (slab chains and inbox chains alike). */
HK_INLINE void chain_head_set(void* h, uintptr_t next, uint32_t n) {
  uintptr_t* w = (uintptr_t*)h + 1;
  HK_VG_DEFINED(w, sizeof *w);
  *w = (next & CHAIN_NEXT) | ((uintptr_t)n << CHAIN_SHIFT);
  HK_VG_NOACCESS(w, sizeof *w);
}

/* The next chain after h; *n gets h's length. */
HK_INLINE uintptr_t chain_head_get(const void* h, uint32_t* n) {
  const uintptr_t* w = (const uintptr_t*)h + 1;
  HK_VG_DEFINED(w, sizeof *w);
  uintptr_t v = *w;
  HK_VG_NOACCESS(w, sizeof *w);
  *n = (uint32_t)(v >> CHAIN_SHIFT);
  return v & CHAIN_NEXT;
}

/* The chain being built at s->free is full: onto s->chains. */
static HK_NOINLINE void chain_close(hk_slab_t* s, void* b, uint32_t n) {
  chain_head_set(b, (uintptr_t)s->chains, n);
  s->chains = b;
  s->free = NULL;
  s->cur_n = 0;
}

HK_INLINE void slab_put(hk_slab_t* s, void* b) {
  *(void**)b = s->free;
  s->free = b;
  s->nfree++;
  if (HK_UNLIKELY(++s->cur_n >= _hk_class[s->cls].chain_len) && !_hk_check_mode)
    chain_close(s, b, s->cur_n);
}

/* The first full chain of s; *n its length, *next the one after it. */
HK_INLINE void* chain_peek(const hk_slab_t* s, uint32_t* n, uintptr_t* next) {
  *next = chain_head_get(s->chains, n);
  return s->chains;
}

/* Takes blocks of slab s onto the chain at *head (its owner, or the class
 * lock held), up to n - *got of them, or one whole chain of at most `most`
 * when *head is empty; returns whether the caller should stop there (a
 * whole chain, or a fresh page). Free blocks first (hot in cache), then
 * never-used ones, linked in address order. */
static bool take_from(hk_slab_t* s, unsigned cls, uint32_t n, uint32_t most, void** head,
                      uint32_t* got) {
  const uint32_t size = _hk_class[cls].size;
  if (*head == NULL && !_hk_check_mode && s->nfree) {
    void* c = NULL;
    uint32_t k = 0;
    uintptr_t next;
    if (s->chains) {
      c = chain_peek(s, &k, &next);
      if (k <= most) s->chains = (void*)next;
      else c = NULL;
    } else if (s->cur_n <= most) {
      c = s->free;
      k = s->cur_n;
      s->free = NULL;
      s->cur_n = 0;
    }
    if (c) {
      *head = c;
      *got = k;
      s->used += k;
      s->nfree -= k;
      return true;
    }
  }
  while (*got < n) {
    if (!s->free) {
      if (!s->chains) break;
      uintptr_t next;
      s->free = chain_peek(s, &s->cur_n, &next);   /* opened: the chain being built */
      s->chains = (void*)next;
    }
    void* b = s->free;
    s->free = *(void**)b;
    s->cur_n--;
    s->nfree--;
    if (HK_UNLIKELY(_hk_check_mode)) {
      check_verify_fill(s, b);
      check_bit_flip(s, b, true);
    }
    *(void**)b = *head;
    *head = b;
    (*got)++;
    s->used++;
  }
  if (*got >= n || s->bump >= s->end) return false;
  /* Never-used blocks: only those starting in the OS page that holds the
   * bump pointer (at least one). Linking a block writes into it, so a
   * larger take would fault in pages ahead of use, and a short run leaves
   * them untouched by the program (up to 7 pages per class at the end of
   * the slow start); refills from fresh memory pay a page fault each
   * anyway, which dwarfs one more trip here. */
  uint32_t m = (uint32_t)((size_t)(s->end - s->bump) / size);
  uintptr_t page_end = ((uintptr_t)s->bump | (HK_OS_PAGE - 1)) + 1;
  uint32_t in_page = (uint32_t)((page_end - (uintptr_t)s->bump + size - 1) / size);
  if (m > in_page) m = in_page;
  if (m > n - *got) m = n - *got;
  uint8_t* b = s->bump;
  for (uint32_t i = 0; i < m; i++) HK_VG_DEFINED(b + (size_t)i * size, sizeof(void*));
  /* The first block to start in this OS page of a cold slab: linking it
   * is the page's first write, and its fault is the kernel's time, which
   * learnd prices from the process's fault count: timed as kernel time
   * and left out of slow_ns (_hk_kernel_ticks), or it would be priced
   * twice (bench-learn's spikes: keeping nothing looked 5% dearer). */
  if (s->cold && (b == s->start || (uintptr_t)(b - size) < (page_end - HK_OS_PAGE))) {
    hk_add_relaxed(&_hk_central[cls].c.fresh_pages, 1);
    uint64_t f0 = _hk_os_ticks();
    *(void* volatile*)b = NULL;
    _hk_kernel_ticks += _hk_os_ticks_since(f0);
  }
  for (uint32_t i = 0; i + 1 < m; i++) *(void**)(b + (size_t)i * size) = b + (size_t)(i + 1) * size;
  *(void**)(b + (size_t)(m - 1) * size) = *head;
  if (HK_UNLIKELY(_hk_check_mode))
    for (uint32_t i = 0; i < m; i++) check_bit_flip(s, b + (size_t)i * size, true);
  *head = b;
  s->bump += (size_t)m * size;
  *got += m;
  s->used += m;
  return true;   /* at most one fresh page per refill (see above) */
}

/* Takes up to n blocks of class cls from central slabs into a chain (class
 * lock held); returns how many. */
static uint32_t take_central(hk_central_t* c, unsigned cls, uint32_t n, uint32_t most,
                             void** head_out, uint32_t tid) {
  void* head = NULL;
  uint32_t got = 0;
  while (got < n) {
    hk_slab_t* s = c->partial;
    if (!s) {
      if (!(s = slab_get(c, cls))) break;
      slab_push(&c->partial, s);
    }
    s->last_tid = tid;
    bool stop = take_from(s, cls, n, most, &head, &got);
    if (s->used == s->capacity) {
      slab_unlink(&c->partial, s);
      s->state = HK_SLAB_FULL;
    }
    if (stop) break;
  }
  HK_ASSERT(got <= n);
  *head_out = head;
  return got;
}

/* A slab for `me` to own, listed as its partial slab: a central one with
 * free blocks, else one from the warm pool or fresh pages; NULL when there
 * is no memory. */
static hk_slab_t* adopt(hk_thread_rec_t* me, uint32_t tid, hk_central_t* c, unsigned cls) {
  _hk_lock(&c->lock);
  hk_slab_t* s = c->partial;
  if (s) slab_unlink(&c->partial, s);
  else s = slab_get(c, cls);
  if (s) {
    hk_store_relaxed(&s->owner, me);
    s->last_tid = tid;
    s->state = HK_SLAB_PARTIAL;
    slab_push(&me->own[cls], s);
  }
  _hk_unlock(&c->lock);
  return s;
}

/* Takes up to n blocks of class cls from the slabs `me` owns, adopting one
 * when they run out; returns how many. */
static uint32_t take_owned(hk_thread_rec_t* me, uint32_t tid, hk_central_t* c, unsigned cls,
                           uint32_t n, uint32_t most, void** head_out) {
  void* head = NULL;
  uint32_t got = 0;
  while (got < n) {
    hk_slab_t* s = me->own[cls];
    if (!s && !(s = adopt(me, tid, c, cls))) break;
    bool stop = take_from(s, cls, n, most, &head, &got);
    if (s->used == s->capacity) {
      slab_unlink(&me->own[cls], s);
      slab_push(&me->own_full[cls], s);
      s->state = HK_SLAB_FULL;
    }
    if (stop) break;
  }
  *head_out = head;
  return got;
}

/* The checks every block given back to its slab passes, and check mode's
 * fill. */
static void give_checks(hk_slab_t* s, unsigned cls, void* b) {
  hk_segment_t* seg = _hk_segment_of(b);
  if (HK_UNLIKELY(_hk_page_class(seg, _hk_page_of(b)) != cls))
    _hk_invalid_free(b, "block of another size class");
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
}

/* An empty slab leaves its class's lists for the warm pool or, over the
 * limit, for *release (class lock held). */
static void retire(hk_central_t* c, unsigned cls, hk_slab_t* s, hk_slab_t** release) {
  hk_store_relaxed(&s->owner, NULL);
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

/* Returns one block to its central slab (class lock held). A slab that
 * becomes empty goes to the warm pool or *release. */
static void give_central(hk_central_t* c, unsigned cls, hk_slab_t* s, void* b,
                         hk_slab_t** release) {
  give_checks(s, cls, b);
  slab_put(s, b);
  s->used--;
  if (s->state == HK_SLAB_FULL) {
    s->state = HK_SLAB_PARTIAL;
    slab_push(&c->partial, s);
  }
  if (s->used == 0) {
    /* Keep the class's only partial slab: retiring it would make the very
     * next refill take it (or a new one) straight back. */
    if (c->partial == s && s->next == NULL) return;
    slab_unlink(&c->partial, s);
    retire(c, cls, s, release);
  }
}

/* ---- routing blocks back ------------------------------------------------------
 * A drain, a direct free, an idle pass over a stash: each block goes to its
 * slab if the caller owns it, to its owner's inbox, or to its central slab
 * under the class lock, in three batches that route_end settles. */
typedef struct route_s {
  hk_thread_rec_t* me;       /* the caller's record, or NULL */
  uint32_t tid;              /* the caller's thread */
  hk_central_t* c;
  unsigned cls;
  uint32_t chain_len;        /* the class's */
  uint32_t remote;           /* blocks of slabs another thread took them from */
  hk_thread_rec_t* to;       /* the chain being built, for `to` */
  void* chain;
  uint32_t chain_n;
  void* central;             /* blocks of central slabs */
  hk_slab_t* empty;          /* own slabs emptied, to hand to the class */
} route_t;

static void push_chain(hk_thread_rec_t* to, unsigned cls, void* head, uint32_t n) {
  _Atomic(void*)* inbox = &to->inbox[cls];
  void* old = hk_load_relaxed(inbox);
  do {
    chain_head_set(head, (uintptr_t)old, n);
  } while (!atomic_compare_exchange_weak_explicit(inbox, &old, head, memory_order_release,
                                                  memory_order_relaxed));
}

static void route_flush_chain(route_t* r) {
  if (r->chain_n == 0) return;
  push_chain(r->to, r->cls, r->chain, r->chain_n);
  r->remote += r->chain_n;
  r->chain = NULL;
  r->chain_n = 0;
}

/* What give_local does after the block is back when the slab was full or
 * is now empty: it moves between its owner's lists, or leaves them. */
static HK_NOINLINE void give_local_moved(route_t* r, hk_slab_t* s) {
  hk_thread_rec_t* me = r->me;
  if (s->state == HK_SLAB_FULL) {
    slab_unlink(&me->own_full[r->cls], s);
    slab_push(&me->own[r->cls], s);
    s->state = HK_SLAB_PARTIAL;
  }
  if (s->used == 0) {
    /* As in give_central: the only partial slab stays. */
    if (me->own[r->cls] == s && s->next == NULL) return;
    slab_unlink(&me->own[r->cls], s);
    s->next = r->empty;
    r->empty = s;
  }
}

static HK_NOINLINE void give_local_checked(route_t* r, hk_slab_t* s, void* b) {
  give_checks(s, r->cls, b);
  slab_put(s, b);
  s->used--;
  give_local_moved(r, s);
}

/* A block of a slab `me` owns back to it, without a lock: the checks
 * give_checks makes, inline where they pass, and slab_put, with the fields
 * read once (a drain runs this once a block: called, it cost 58
 * instructions a block on sh8bench, callgrind). Owned slabs are never
 * check mode's (its threads cache nothing, so own nothing). */
HK_INLINE void give_local(route_t* r, const hk_segment_t* seg, unsigned page, hk_slab_t* s,
                          void* b) {
  uint32_t used = s->used;
  void* head = s->free;
  uint32_t n = s->cur_n + 1;
  if (HK_UNLIKELY(_hk_page_class(seg, page) != r->cls || used == 0 || (uint8_t*)b >= s->bump)) {
    give_local_checked(r, s, b);
    return;
  }
  *(void**)b = head;
  s->used = used - 1;
  s->nfree++;
  if (HK_LIKELY(n < r->chain_len)) {
    s->free = b;
    s->cur_n = n;
  } else {
    chain_close(s, b, n);
  }
  if (HK_UNLIKELY(used == 1 || s->state == HK_SLAB_FULL)) give_local_moved(r, s);
}

HK_INLINE void route_remote(route_t* r, hk_thread_rec_t* o, void* b) {
  if (o != r->to || r->chain_n == CHAIN_MAX) {
    route_flush_chain(r);
    r->to = o;
  }
  *(void**)b = r->chain;
  r->chain = b;
  r->chain_n++;
}

HK_INLINE void route_block(route_t* r, void* b) {
  hk_segment_t* seg = _hk_segment_of(b);
  unsigned page = _hk_page_of(b);
  hk_slab_t* s = &seg->slabs[seg->page_start[page] >> HK_PAGE_SHIFT];
  hk_thread_rec_t* o = hk_load_relaxed(&s->owner);
  if (HK_LIKELY(o == r->me && o != NULL)) {
    give_local(r, seg, page, s, b);
  } else if (o == NULL) {
    *(void**)b = r->central;
    r->central = b;
  } else {
    if (HK_UNLIKELY(_hk_page_class(seg, page) != r->cls))
      _hk_invalid_free(b, "block of another size class");
    route_remote(r, o, b);
  }
}

/* Settles what route_block set aside: chains to their owners, central
 * blocks and emptied slabs under the class lock, freed slabs to the OS. */
static void route_end(route_t* r) {
  route_flush_chain(r);
  if (r->central || r->empty) {
    hk_central_t* c = r->c;
    hk_slab_t* release = NULL;
    _hk_lock(&c->lock);
    for (void* b = r->central, *next; b; b = next) {
      next = *(void**)b;
      hk_slab_t* s = slab_of(b);
      hk_thread_rec_t* o = hk_load_relaxed(&s->owner);   /* taken over meanwhile? */
      if (o == NULL) {
        r->remote += s->last_tid != r->tid;
        give_central(c, r->cls, s, b, &release);
      }
      else if (o == r->me) give_local_checked(r, s, b);
      else route_remote(r, o, b);
    }
    r->central = NULL;
    for (hk_slab_t* s = r->empty, *next; s; s = next) {
      next = s->next;
      retire(c, r->cls, s, &release);
    }
    r->empty = NULL;
    warm_shrink(c, r->cls, hk_load_relaxed(&_hk_warm_limit[r->cls]), &release);
    _hk_unlock(&c->lock);
    route_flush_chain(r);
    release_all(release);
  }
}

HK_INLINE void route_begin(route_t* r, hk_thread_rec_t* me, uint32_t tid, unsigned cls) {
  memset(r, 0, sizeof *r);
  r->me = me;
  r->tid = tid;
  r->c = &_hk_central[cls];
  r->cls = cls;
  r->chain_len = _hk_class[cls].chain_len;
}

static void route_chains(route_t* r, void* h) {
  while (h) {
    uint32_t n;
    void* next = (void*)chain_head_get(h, &n);
    for (void* b = h, *nb; b; b = nb) {
      nb = *(void**)b;
      route_block(r, b);
    }
    h = next;
  }
}

/* Every chain in the stash and the inbox of class cls back to the slabs,
 * by `me` (their owner) or, for an ended thread's record, NULL. */
static void stash_flush(hk_thread_rec_t* rec, hk_thread_rec_t* me, unsigned cls) {
  void* stash = rec->stash[cls];
  rec->stash[cls] = NULL;
  void* inbox = NULL;
  if (hk_load_relaxed(&rec->inbox[cls]))
    inbox = atomic_exchange_explicit(&rec->inbox[cls], NULL, memory_order_acquire);
  if (!stash && !inbox) return;
  route_t r;
  route_begin(&r, me, 0, cls);   /* counts nothing: these were counted when sent */
  route_chains(&r, stash);
  route_chains(&r, inbox);
  route_end(&r);
}

/* A chain of at most `most` blocks from the stash, taking the inbox into
 * it when it is empty; returns its length (0: none). */
static uint32_t take_stash(hk_thread_rec_t* me, unsigned cls, uint32_t most, void** head) {
  void* h = me->stash[cls];
  if (!h) {
    if (!hk_load_relaxed(&me->inbox[cls])) return 0;
    h = atomic_exchange_explicit(&me->inbox[cls], NULL, memory_order_acquire);
    if (!h) return 0;
  }
  uint32_t n;
  uintptr_t next = chain_head_get(h, &n);
  if (n > most) {   /* a chain longer than the cache holds: cut it */
    void* t = h;
    for (uint32_t i = 1; i < most; i++) t = *(void**)t;
    void* rest = *(void**)t;
    *(void**)t = NULL;
    chain_head_set(rest, next, n - most);
    next = (uintptr_t)rest;
    n = most;
  }
  me->stash[cls] = (void*)next;
  *head = h;
  return n;
}

/* Up to n blocks for this thread: from its stash or inbox, its own slabs,
 * or, without a record, central slabs. */
static uint32_t take_any(hk_tcache_t* tc, hk_central_t* c, unsigned cls, uint32_t n,
                         uint32_t most, void** head) {
  hk_thread_rec_t* me = tc->rec;
  if (me && tc->state == HK_TC_ACTIVE) {
    uint32_t got = take_stash(me, cls, most, head);
    if (got) return got;
    return take_owned(me, tc->tid, c, cls, n, most, head);
  }
  _hk_lock(&c->lock);
  uint32_t got = take_central(c, cls, n, most, head, tc->tid);
  _hk_unlock(&c->lock);
  return got;
}

/* Out of memory: the slabs every class keeps warm and the huge mappings
 * kept for reuse go back to the OS (their pages and address space are then
 * free for this class's new slab), and the take gets one more try. The
 * segment cache is left: a new slab takes a cached segment before it maps
 * anything, so it was empty when the slab could not be had. Runs with no
 * lock held: trimming takes each class lock in turn. */
static HK_NOINLINE uint32_t take_after_trim(hk_tcache_t* tc, hk_central_t* c, unsigned cls,
                                            uint32_t n, uint32_t most, void** head) {
  bool any = _hk_trim_warm();
  any |= _hk_huge_trim();
  if (!any) return 0;
  return take_any(tc, c, cls, n, most, head);
}

/* A slow path's ticks since t0, less its time in the kernel since k0
 * (prim.c: priced apart), at most the replayer's bound (prim.h). */
static inline uint64_t slow_since(uint64_t t0, uint64_t k0) {
  uint64_t d = _hk_os_ticks() - t0 - (_hk_kernel_ticks - k0);
  if ((int64_t)d < 0) return 0;   /* a migration between CPUs whose counters disagree */
  return HK_UNLIKELY(_hk_slow_bound_ticks) && d > _hk_slow_bound_ticks ? _hk_slow_bound_ticks : d;
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
  /* The bin is empty: it holds cap blocks, and one goes to the caller. */
  uint32_t most = cold->cap + 1;
  hk_thread_rec_t* me = tc->rec;
  if (me) _hk_lock(&me->slabs);
  uint32_t got = take_any(tc, c, cls, want, most, &head);
  if (HK_UNLIKELY(got == 0)) got = take_after_trim(tc, c, cls, want, most, &head);
  if (me) _hk_unlock(&me->slabs);
  hk_add_relaxed(&c->c.refills, 1);
  hk_add_relaxed(&c->c.refill_blocks, got);
  /* ticks, stats.c converts; the kernel's time is priced apart (prim.c) */
  hk_add_relaxed(&c->c.slow_ns, slow_since(t0, k0));
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
  route_t r;
  route_begin(&r, tc->state == HK_TC_ACTIVE ? tc->rec : NULL, tc->tid, cls);
  if (r.me) _hk_lock(&r.me->slabs);
  void* b = bin->head;
  for (uint32_t i = 0; i < n; i++) {
    void* next = *(void**)b;
    route_block(&r, b);
    b = next;
  }
  bin->head = b;
  bin->room += (int32_t)n;
  route_end(&r);
  if (r.me) _hk_unlock(&r.me->slabs);
  _hk_publish(tc, cls);
  hk_add_relaxed(&c->c.drains, 1);
  hk_add_relaxed(&c->c.drain_blocks, n);
  if (r.remote) hk_add_relaxed(&c->c.remote_frees, r.remote);
  hk_add_relaxed(&c->c.slow_ns, slow_since(t0, k0));   /* as in _hk_refill */
}

void _hk_stash_flush(hk_tcache_t* tc, unsigned cls) {
  hk_thread_rec_t* me = tc->rec;
  if (!me || tc->state != HK_TC_ACTIVE) return;
  _hk_lock(&me->slabs);
  stash_flush(me, me, cls);
  _hk_unlock(&me->slabs);
}

void _hk_flush_thread(hk_tcache_t* tc) {
  for (unsigned cls = 1; cls < HK_NUM_CLASSES; cls++) {
    if (_hk_bin_count(&tc->bin[cls])) _hk_drain(tc, cls, _hk_bin_count(&tc->bin[cls]));
    _hk_stash_flush(tc, cls);
  }
}

/* The slabs of a thread that ended (or, in a fork's child, does not exist)
 * go to their classes: those with blocks out to the central lists, empty
 * ones to the warm pool or the OS. Its bins must be flushed or lost
 * already; its stash and inbox go back to their slabs first. Run by the
 * thread itself at its end, or with the registry lock held for a record
 * nobody else uses. */
void _hk_slabs_orphan(hk_thread_rec_t* rec) {
  for (unsigned cls = 1; cls < HK_NUM_CLASSES; cls++) {
    stash_flush(rec, rec, cls);
    if (!rec->own[cls] && !rec->own_full[cls]) continue;
    hk_central_t* c = &_hk_central[cls];
    hk_slab_t* release = NULL;
    _hk_lock(&c->lock);
    while (rec->own[cls]) {
      hk_slab_t* s = rec->own[cls];
      slab_unlink(&rec->own[cls], s);
      if (s->used == 0) {
        retire(c, cls, s, &release);
      } else {
        hk_store_relaxed(&s->owner, NULL);
        slab_push(&c->partial, s);
      }
    }
    while (rec->own_full[cls]) {
      hk_slab_t* s = rec->own_full[cls];
      slab_unlink(&rec->own_full[cls], s);
      hk_store_relaxed(&s->owner, NULL);   /* FULL, on no list, as a central slab */
    }
    _hk_unlock(&c->lock);
    release_all(release);
  }
}

/* The inboxes of records no thread has (thread.c, registry lock held):
 * blocks freed there after their owner ended go to their slabs now. */
void _hk_inbox_sweep(hk_thread_rec_t* rec) {
  for (unsigned cls = 1; cls < HK_NUM_CLASSES; cls++) stash_flush(rec, NULL, cls);
}

/* Class cls's inbox and stash of rec back to their slabs, one chain (one
 * drain's worth: a thread cache's capacity at most) per hold of rec's
 * lock, which the caller holds: a thread that wakes meanwhile waits for
 * one chain, not for all of them. False when the owner took the lock
 * between two chains: the rest stays in its stash, which the owner uses
 * or the next pass gives back; the lock is then not held. */
static bool idle_give_back(hk_thread_rec_t* rec, unsigned cls) {
  void* in = atomic_exchange_explicit(&rec->inbox[cls], NULL, memory_order_acquire);
  if (in) {   /* the inbox goes in front of the stash */
    uint32_t n;
    void* t = in;
    for (void* nx; (nx = (void*)chain_head_get(t, &n)) != NULL;) t = nx;
    chain_head_set(t, (uintptr_t)rec->stash[cls], n);
    rec->stash[cls] = in;
  }
  while (rec->stash[cls]) {
    uint32_t n;
    void* h = rec->stash[cls];
    rec->stash[cls] = (void*)chain_head_get(h, &n);
    chain_head_set(h, 0, n);   /* this chain alone */
    route_t r;
    route_begin(&r, rec, 0, cls);   /* counts nothing: these were counted when sent */
    route_chains(&r, h);
    route_end(&r);
    _hk_unlock(&rec->slabs);
    if (!_hk_trylock(&rec->slabs)) return false;
  }
  return true;
}

/* A live thread's inboxes and stashes that no refill took since the last
 * pass go back to their slabs, by the pass on the owner's behalf ("idle
 * owners"; thread.c, registry lock held). */
void _hk_inbox_idle(hk_thread_rec_t* rec) {
  if (!_hk_trylock(&rec->slabs)) return;   /* the owner is in its slow path: not idle */
  for (unsigned cls = 1; cls < HK_NUM_CLASSES; cls++) {
    void* in = hk_load_relaxed(&rec->inbox[cls]);
    void* st = rec->stash[cls];
    if ((in || st) && in == rec->seen_inbox[cls] && st == rec->seen_stash[cls]) {
      if (!idle_give_back(rec, cls)) return;   /* the owner woke: it has its lock */
      in = st = NULL;
    }
    rec->seen_inbox[cls] = in;
    rec->seen_stash[cls] = st;
  }
  _hk_unlock(&rec->slabs);
}

/* One block without a thread cache: check mode, a cache capacity of 0, or a
 * thread whose cache was already torn down at exit. */
void* _hk_alloc_direct(unsigned cls) {
  hk_central_t* c = &_hk_central[cls];
  void* b;
  _hk_lock(&c->lock);
  uint32_t got = take_central(c, cls, 1, 1, &b, _hk_tc.tid);
  _hk_unlock(&c->lock);
  if (HK_UNLIKELY(got == 0) && (_hk_trim_warm() | _hk_huge_trim())) {
    _hk_lock(&c->lock);
    got = take_central(c, cls, 1, 1, &b, _hk_tc.tid);
    _hk_unlock(&c->lock);
  }
  if (!got) return NULL;
  hk_add_relaxed(&c->c.refills, 1);
  hk_add_relaxed(&c->c.refill_blocks, 1);
  hk_add_relaxed(&c->c.allocs, 1);
  return b;
}

void _hk_free_direct(void* p, hk_segment_t* seg, unsigned page, unsigned cls) {
  hk_central_t* c = &_hk_central[cls];
  hk_tcache_t* tc = &_hk_tc;
  route_t r;
  route_begin(&r, tc->state == HK_TC_ACTIVE ? tc->rec : NULL, tc->tid, cls);
  if (r.me) _hk_lock(&r.me->slabs);
  route_block(&r, p);
  route_end(&r);
  if (r.me) _hk_unlock(&r.me->slabs);
  hk_add_relaxed(&c->c.drains, 1);
  hk_add_relaxed(&c->c.drain_blocks, 1);
  if (r.remote) hk_add_relaxed(&c->c.remote_frees, r.remote);
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
bool _hk_warm_decay(uint64_t now_ns, uint64_t interval_ns) {
  static _Atomic uint64_t last_ns;
  uint64_t last = hk_load_relaxed(&last_ns);
  if (now_ns - last < interval_ns) return false;
  if (!atomic_compare_exchange_strong_explicit(&last_ns, &last, now_ns,
        memory_order_relaxed, memory_order_relaxed)) return false;
  for (unsigned cls = 1; cls < HK_NUM_CLASSES; cls++) {
    hk_central_t* c = &_hk_central[cls];
    if (c->warm_count == 0) {   /* racy peek: a miss waits for the next pass */
      c->warm_seen = hk_load_relaxed(&c->c.slabs_from_warm);
      continue;
    }
    hk_slab_t* release = NULL;
    _hk_lock(&c->lock);
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
  _hk_inbox_sweep_free_records();
  _hk_inbox_sweep_idle();   /* before the segment decay: what empties counts as dirty from now */
  _hk_segment_decay();
  _hk_huge_decay();
  return true;
}

bool _hk_trim_warm(void) {
  bool any = false;
  for (unsigned cls = 1; cls < HK_NUM_CLASSES; cls++) {
    hk_central_t* c = &_hk_central[cls];
    hk_slab_t* release = NULL;
    _hk_lock(&c->lock);
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
