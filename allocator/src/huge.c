/* huge.c — objects above the largest size class, each in its own mapping.
 *
 * Layout: the mapping starts 4 MiB-aligned and spans whole 4 MiB chunks, so
 * no other mapping shares a chunk with it and _hk_map can mark the chunk of
 * the user pointer as HK_MAP_HUGE. The 64-byte header sits right before the
 * user pointer, inside the mapping.
 *
 * Freed mappings go to a small cache (count and bytes bounded) so programs
 * that replace big buffers do not pay mmap + page faults every time.
 *
 * SYNCHRONIZATION
 *  1. huge_lock guards the cache list and the map entries of huge chunks.
 *  2. A live object's header is only touched by the thread that frees or
 *     reallocates it (the program owns it until then).
 */
#include "internal.h"
#include "prim.h"

static hk_lock_t huge_lock;
static hk_huge_t* cache;          /* cached mappings, most recent first */
static unsigned cache_count;
static size_t cache_bytes;

void _hk_huge_lock(void) { _hk_lock(&huge_lock); }
void _hk_huge_unlock(void) { _hk_unlock(&huge_lock); }
void _hk_huge_reinit_lock(void) { _hk_lock_reinit(&huge_lock); }

static inline size_t round_up(size_t n, size_t a) { return (n + a - 1) & ~(a - 1); }
static inline size_t chunk_of(const void* p) {
  return ((uintptr_t)p >> HK_SEG_SHIFT) & (HK_MAP_ENTRIES - 1);
}

/* Offset of the user pointer from the mapping start for an alignment. */
static size_t user_offset(size_t align) {
  return align <= HK_OS_PAGE ? HK_OS_PAGE : align;
}

static hk_huge_t* header_of(const void* p) { return (hk_huge_t*)((uintptr_t)p - sizeof(hk_huge_t)); }

/* How far from its mapping's start the object of h may have touched pages
 * (page-rounded; the pages past it read zero). */
static size_t touched_end(const hk_huge_t* h) {
  const uint8_t* user = (const uint8_t*)h + sizeof(hk_huge_t);
  return round_up((size_t)(user - (const uint8_t*)h->base) + h->dirty, HK_OS_PAGE);
}

static void* place(void* base, size_t map_len, size_t off, size_t n, bool several) {
  uint8_t* user = (uint8_t*)base + off;
  hk_huge_t* h = header_of(user);
  h->magic = HK_HUGE_MAGIC ^ (uintptr_t)user;
  h->base = base;
  h->map_len = map_len;
  h->size = n;
  h->state = HK_HUGE_LIVE;
  h->several = several;
  h->next_cached = NULL;
  _hk_map[chunk_of(user)] = HK_MAP_HUGE;
  return user;
}

/* The cache holds up to HK_HUGE_CACHE_BYTES whatever is live: a program
 * that replaces big buffers keeps the pages it will touch again, and what
 * a burst left behind does not stay resident for long, since the decay
 * pass (_hk_huge_decay) gives back whatever a whole drain interval did not
 * reuse. Before that pass existed the cache held half of what was live in
 * huge objects, between 32 and 128 MiB, and kept it for good: on
 * mimalloc-bench's mstress (2 threads replacing objects up to 5 MiB, few
 * live at a time) 414 of its 1,250 huge objects were mapped afresh, and
 * it took 3.3x the page faults it takes with 128 MiB. */
static _Atomic size_t budget_bytes = HK_HUGE_CACHE_BYTES;
static size_t cache_budget(void) { return hk_load_relaxed(&budget_bytes); }

/* The policy's retain_mib (options.c install) bounds the budget too, so a
 * program told to keep little freed memory keeps little of either kind
 * (sqlite3's shell grows a buffer by realloc to 64 MiB and frees it every
 * statement: with only the slab pages' cap lowered, the cache still held
 * 100 MiB of those mappings). */
void _hk_huge_retain(uint32_t mib) {
  size_t b = (size_t)mib << 20;
  hk_store_relaxed(&budget_bytes, b < HK_HUGE_CACHE_BYTES ? b : HK_HUGE_CACHE_BYTES);
}

/* Gives a mapping (or part of one) that committed_bytes counts back to the OS. */
static void unmap_range(void* p, size_t len) {
  hk_sub_relaxed(&_hk_proc.committed_bytes, len);
  _hk_os_unmap(p, len);
}

/* Takes the cached mapping at *link out of the cache; its user chunk is
 * no longer marked huge. Called with huge_lock held. */
static hk_huge_t* cache_unlink(hk_huge_t** link) {
  hk_huge_t* h = *link;
  *link = h->next_cached;
  cache_count--;
  cache_bytes -= h->map_len;
  _hk_map[chunk_of((uint8_t*)h + sizeof(hk_huge_t))] = HK_MAP_NONE;
  return h;
}

/* Caches the mapping of h, dropping the oldest entries to make room;
 * false (nothing done) when it is bigger than the whole budget. Called
 * with huge_lock held. */
static bool cache_put(hk_huge_t* h, size_t budget) {
  if (h->map_len > budget) return false;
  while (cache_count >= HK_HUGE_CACHE_MAX || cache_bytes + h->map_len > budget) {
    hk_huge_t** link = &cache;
    while ((*link)->next_cached) link = &(*link)->next_cached;
    hk_huge_t* old = cache_unlink(link);
    unmap_range(old->base, old->map_len);
  }
  h->state = HK_HUGE_CACHED;
  h->aged = 0;
  h->next_cached = cache;
  cache = h;
  cache_count++;
  cache_bytes += h->map_len;
  return true;
}

/* A cached mapping that serves n at offset off as it is: big enough, not
 * holding on to much more than it needs (half the size plus a chunk), and
 * with every page the new object will write already touched by earlier
 * objects, so it costs no page fault at all; of those, the smallest. Pages
 * an earlier, bigger object touched past the new one stay as they are
 * (giving them back with madvise only to fault them in again when the
 * mapping next serves a bigger object cost large_churn 60% more page
 * faults). Anything short of that is left to take_pieces, which can split
 * a mapping or join several. *dirty_out gets how far from the user pointer
 * pages may be touched. Called with huge_lock held. */
static void* cache_take(size_t n, size_t off, size_t* dirty_out) {
  size_t need = round_up(off + n, HK_SEG_SIZE);
  size_t new_end = round_up(off + n, HK_OS_PAGE);
  hk_huge_t** best = NULL;
  for (hk_huge_t** link = &cache; *link; link = &(*link)->next_cached) {
    hk_huge_t* h = *link;
    if (h->map_len < need || h->map_len > need + need / 2 + HK_SEG_SIZE) continue;
    if (((uintptr_t)h->base + off) & (off - 1)) continue; /* alignment */
    if (touched_end(h) < new_end) continue;
    if (!best || h->map_len < (*best)->map_len) best = link;
  }
  if (!best) return NULL;
  /* The old object's header lies inside the new object if off grew. */
  hk_huge_t* h = cache_unlink(best);
  void* base = h->base;
  size_t map_len = h->map_len;
  size_t old_end = touched_end(h);
  bool several = h->several;
  HK_VG_DEFINED(base, map_len);   /* the old object was "freed" for memcheck */
  hk_add_relaxed(&_hk_proc.huge_cache_hits, 1);
  *dirty_out = old_end - off;
  return place(base, map_len, off, n, several);
}

/* ---- pieces ------------------------------------------------------------------
 * When no cached mapping serves a request as it is, the new object is put
 * together from the touched pages of cached ones, as a page heap would
 * split and coalesce spans: the mapping whose first chunks hold the most
 * touched pages first, then the next for what is left, each moved with
 * mremap (page tables only: its pages stay resident and need no fault)
 * into a fresh reservation, or used where it lies when it alone covers
 * the request. A mapping longer than what is left is split at a chunk
 * boundary: its touched remainder goes back to the cache as a mapping of
 * its own, its untouched tail to the OS. On large_churn (20 live buffers
 * of 5..25 MiB replaced at random) this took the page faults after the
 * first buffers from 55k to 26k in a model of the cache run over the
 * benchmark's own sizes, against tcmalloc's 31k.
 *
 * Pieces and remainders are whole chunks, so every mapping boundary inside
 * an object lies on a chunk boundary, and a header's `several` says
 * whether its mapping may have any: move_range moves such a mapping chunk
 * by chunk, each inside one kernel mapping (move_range says why). */
typedef struct piece_s {
  uint8_t* base;
  size_t   len;       /* bytes used from base (whole chunks) */
  size_t   touched;   /* of those, how far earlier objects may have written */
  bool     several;   /* may be several kernel mappings */
} piece_t;

/* A piece is worth a mremap when it brings half a chunk of touched pages. */
#define PIECE_MIN_TOUCHED (HK_SEG_SIZE / 2)

typedef struct pieces_s {
  piece_t  p[HK_HUGE_CACHE_MAX];
  unsigned n;
  piece_t  drop[2 * HK_HUGE_CACHE_MAX];   /* untouched tails and remainders the cache refused */
  unsigned ndrop;
} pieces_t;

/* The part of a split mapping past `used`, as a cached mapping of its own
 * (its header written in its first page, which earlier objects touched). */
static hk_huge_t* cached_remainder(uint8_t* base, size_t len, size_t touched, bool several) {
  HK_VG_DEFINED(base + HK_OS_PAGE - sizeof(hk_huge_t), sizeof(hk_huge_t));
  hk_huge_t* h = header_of(place(base, len, HK_OS_PAGE, 0, several));
  h->dirty = touched - HK_OS_PAGE;   /* touched_end(h) == touched */
  h->state = HK_HUGE_CACHED;         /* cache_put says so too, if it takes it */
  return h;
}

/* Unlinks the pieces for an object of need bytes (whole chunks) into *pc:
 * while some cached mapping brings PIECE_MIN_TOUCHED touched bytes to what
 * is left, the one that brings most (of equals, the shorter). Called with
 * huge_lock held; what is to be unmapped is only listed. */
static void take_pieces(size_t need, size_t budget, pieces_t* pc) {
  hk_huge_t* rem[HK_HUGE_CACHE_MAX];
  unsigned nrem = 0;
  size_t pos = 0;
  pc->n = pc->ndrop = 0;
  while (pos < need && cache) {
    size_t room = need - pos;
    hk_huge_t** best = NULL;
    size_t best_gain = 0;
    for (hk_huge_t** link = &cache; *link; link = &(*link)->next_cached) {
      hk_huge_t* h = *link;
      size_t te = touched_end(h);
      size_t gain = te < room ? te : room;
      if (!best || gain > best_gain || (gain == best_gain && h->map_len < (*best)->map_len)) {
        best = link;
        best_gain = gain;
      }
    }
    if (!best || best_gain < PIECE_MIN_TOUCHED) break;
    hk_huge_t* h = cache_unlink(best);
    uint8_t* base = h->base;
    size_t len = h->map_len, te = touched_end(h);
    bool several = h->several;
    size_t used = len < room ? len : room;
    pc->p[pc->n++] = (piece_t){base, used, te < used ? te : used, several};
    if (len > used) {
      size_t kept = 0;
      if (te > used) {
        kept = round_up(te - used, HK_SEG_SIZE);
        rem[nrem++] = cached_remainder(base + used, kept, te - used, several);
      }
      if (used + kept < len)
        pc->drop[pc->ndrop++] = (piece_t){base + used + kept, len - used - kept, 0, false};
    }
    pos += used;
  }
  for (unsigned i = 0; i < nrem; i++)
    if (!cache_put(rem[i], budget)) {
      _hk_map[chunk_of((uint8_t*)rem[i] + sizeof(hk_huge_t))] = HK_MAP_NONE;
      pc->drop[pc->ndrop++] = (piece_t){rem[i]->base, rem[i]->map_len, 0, false};
    }
}

/* Moves [src, src+len) to dst: in one call where it is one kernel
 * mapping, else chunk by chunk, each inside one. Never a range that may
 * be several mappings in one call: before Linux 6.17 the kernel refuses
 * that (EFAULT) only after it has unmapped the destination, and another
 * thread's mmap could take the hole before a chunk-by-chunk retry filled
 * it again (MREMAP_FIXED would then unmap that thread's memory). A chunk
 * that will not move goes back to the OS and dst keeps fresh pages there,
 * mapped again if the failed call had unmapped them. false, with *hole,
 * when that failed too: dst has a hole at dst + *hole. */
static bool move_range(uint8_t* src, size_t len, uint8_t* dst, bool several, size_t* hole) {
  if (!several && _hk_os_move(src, len, dst) == 0) return true;
  for (size_t o = 0; o < len; o += HK_SEG_SIZE) {
    if (_hk_os_move(src + o, HK_SEG_SIZE, dst + o) == 0) continue;
    _hk_os_unmap(src + o, HK_SEG_SIZE);
    if (!_hk_os_refill(dst + o, HK_SEG_SIZE)) {
      if (o + HK_SEG_SIZE < len) _hk_os_unmap(src + o + HK_SEG_SIZE, len - o - HK_SEG_SIZE);
      *hole = o;
      return false;
    }
  }
  return true;
}

/* A mapping of map_len bytes for an object at offset off, made of cached
 * pieces where they bring touched pages. *dirty_end gets how far from the
 * base pages may have been touched (0: all fresh). NULL when mapping
 * fails (the pieces are then given back to the OS). */
static void* map_reusing(size_t off, size_t map_len, size_t align_map, size_t* dirty_end,
                         bool* several) {
  *dirty_end = 0;
  *several = false;
  pieces_t pc;
  pc.n = pc.ndrop = 0;
  if (cache) {
    size_t budget = cache_budget();
    _hk_lock(&huge_lock);
    take_pieces(map_len, budget, &pc);
    _hk_unlock(&huge_lock);
  }
  for (unsigned i = 0; i < pc.ndrop; i++) unmap_range(pc.drop[i].base, pc.drop[i].len);
  if (pc.n == 1 && pc.p[0].len == map_len && ((uintptr_t)pc.p[0].base & (align_map - 1)) == 0) {
    HK_VG_DEFINED(pc.p[0].base, map_len);
    hk_add_relaxed(&_hk_proc.huge_cache_hits, 1);
    *dirty_end = pc.p[0].touched;
    *several = pc.p[0].several;
    return pc.p[0].base;   /* counted as committed already */
  }
  void* base;
  if (_hk_os_map_aligned(map_len, align_map, false, &base) != 0) {
    for (unsigned i = 0; i < pc.n; i++) unmap_range(pc.p[i].base, pc.p[i].len);
    return NULL;
  }
  hk_add_relaxed(&_hk_proc.committed_bytes, map_len);
  size_t pos = 0;
  for (unsigned i = 0; i < pc.n; i++) {
    size_t hole;
    bool moved = move_range(pc.p[i].base, pc.p[i].len, (uint8_t*)base + pos, pc.p[i].several, &hole);
    /* The moved pages replace fresh ones already counted as committed. */
    hk_sub_relaxed(&_hk_proc.committed_bytes, pc.p[i].len);
    if (!moved) {
      /* No object over a hole: the rest goes back, around the hole (no
       * longer ours to unmap), and the object gets fresh pages. */
      for (unsigned j = i + 1; j < pc.n; j++) unmap_range(pc.p[j].base, pc.p[j].len);
      hk_sub_relaxed(&_hk_proc.committed_bytes, HK_SEG_SIZE);
      unmap_range(base, pos + hole);
      unmap_range((uint8_t*)base + pos + hole + HK_SEG_SIZE, map_len - pos - hole - HK_SEG_SIZE);
      *dirty_end = 0;
      if (_hk_os_map_aligned(map_len, align_map, false, &base) != 0) return NULL;
      hk_add_relaxed(&_hk_proc.committed_bytes, map_len);
      return base;
    }
    HK_VG_DEFINED((uint8_t*)base + pos, pc.p[i].len);
    if (pc.p[i].touched) *dirty_end = pos + pc.p[i].touched;
    pos += pc.p[i].len;
  }
  if (pc.n) hk_add_relaxed(&_hk_proc.huge_cache_hits, 1);
  *several = pc.n > 0;   /* moved pieces and fresh pages are separate mappings */
  return base;
}

void* _hk_huge_alloc(size_t n, size_t align, bool zero) {
  size_t off = user_offset(align);
  if (n > ((size_t)1 << 46) || off > ((size_t)1 << 40)) { errno = ENOMEM; return NULL; }
  size_t map_len = round_up(off + n, HK_SEG_SIZE);
  hk_add_relaxed(&_hk_proc.huge_allocs, 1);
  hk_central_t* c0 = &_hk_central[0];
  void* user = NULL;
  size_t dirty = 0;   /* bytes from user that earlier objects may have touched
                         (page-rounded; pages past it read zero) */
  _hk_lock(&huge_lock);
  if (cache) user = cache_take(n, off, &dirty);
  _hk_unlock(&huge_lock);
  if (!user) {
    size_t align_map = off > HK_SEG_SIZE ? off : HK_SEG_SIZE;
    size_t end;
    bool several;
    void* base = map_reusing(off, map_len, align_map, &end, &several);
    /* Out of memory (address space, under a `ulimit -v`): everything the
     * allocator caches goes back to the OS, warm slabs first so that the
     * segments they leave empty go too, and the mapping gets one more try. */
    if (!base) {
      bool any = _hk_trim_warm();
      any |= _hk_segment_trim();
      any |= _hk_huge_trim();
      if (any) base = map_reusing(off, map_len, align_map, &end, &several);
    }
    if (!base) { errno = ENOMEM; return NULL; }
    dirty = end > off ? end - off : 0;
    _hk_lock(&huge_lock);
    user = place(base, map_len, off, n, several);
    _hk_unlock(&huge_lock);
  }
  header_of(user)->dirty = dirty > n ? dirty : n;
  HK_VG_ALLOC_ZERO(user, round_up(n, HK_OS_PAGE), zero);   /* fresh pages are zero */
  if (zero && dirty) memset(user, 0, dirty < n ? dirty : n);
  hk_add_relaxed(&c0->c.allocs, 1);
  hk_add_relaxed(&c0->c.live_bytes, n);
  return user;
}

static hk_huge_t* checked_header(const void* p) {
  if (((uintptr_t)p & (HK_OS_PAGE - 1)) != 0) _hk_invalid_free(p, "not the start of a huge object");
  hk_huge_t* h = header_of(p);
  if (h->magic != (HK_HUGE_MAGIC ^ (uintptr_t)p)) _hk_invalid_free(p, "not the start of a huge object");
  if (h->state != HK_HUGE_LIVE) _hk_invalid_free(p, "double free of a huge object");
  return h;
}

void _hk_huge_free(void* p) {
  hk_huge_t* h = checked_header(p);
#if HK_VALGRIND
  VALGRIND_FREELIKE_BLOCK(p, 0);
#endif
  hk_central_t* c0 = &_hk_central[0];
  hk_sub_relaxed(&c0->c.live_bytes, h->size);
  hk_add_relaxed(&c0->c.frees, 1);
  void* base = h->base;
  size_t map_len = h->map_len;
  size_t budget = cache_budget();
  _hk_lock(&huge_lock);
  if (cache_put(h, budget)) {
    _hk_unlock(&huge_lock);
    return;
  }
  h->magic = 0;
  _hk_map[chunk_of(p)] = HK_MAP_NONE;
  _hk_unlock(&huge_lock);
  unmap_range(base, map_len);
}

/* The request rounded up to whole pages: usable without touching pages
 * beyond what the program asked for. */
size_t _hk_huge_usable(const void* p) {
  hk_huge_t* h = checked_header(p);
  return round_up(h->size, HK_OS_PAGE);
}

/* Resizes in place when the mapping has room or can grow where it is. */
void* _hk_huge_realloc(void* p, size_t n) {
  hk_huge_t* h = checked_header(p);
  size_t off = (size_t)((uint8_t*)p - (uint8_t*)h->base);
  size_t need = round_up(off + n, HK_SEG_SIZE);
  if (n > ((size_t)1 << 46)) return NULL;
  hk_central_t* c0 = &_hk_central[0];
  if (need > h->map_len) {
    /* Its last chunk grows: a mapping joined from pieces is several kernel
     * mappings, which mremap will not grow as one, and the last chunk lies
     * inside the last of them (huge.c "pieces"). */
    uint8_t* last = (uint8_t*)h->base + h->map_len - HK_SEG_SIZE;
    if (_hk_os_grow_in_place(last, HK_SEG_SIZE, need - h->map_len + HK_SEG_SIZE) != 0) return NULL;
    hk_add_relaxed(&_hk_proc.committed_bytes, need - h->map_len);
    h->map_len = need;
  } else if (need + HK_SEG_SIZE < h->map_len && n < h->size / 2) {
    /* Much smaller: give the tail back rather than keep it mapped. */
    _hk_lock(&huge_lock);
    _hk_os_shrink(h->base, h->map_len, need);
    _hk_unlock(&huge_lock);
    hk_sub_relaxed(&_hk_proc.committed_bytes, h->map_len - need);
    h->map_len = need;
    if (h->dirty > need - off) h->dirty = need - off;   /* never past the end */
  }
  hk_add_relaxed(&c0->c.live_bytes, n);
  hk_sub_relaxed(&c0->c.live_bytes, h->size);
  HK_VG_RESIZE(p, round_up(h->size, HK_OS_PAGE), round_up(n, HK_OS_PAGE));
  h->size = n;
  if (n > h->dirty) h->dirty = n;
  return p;
}

/* Once per drain interval (slab.c _hk_warm_decay): a mapping that was
 * already cached at the last pass and served nothing since goes back to
 * the OS, so what a burst of big buffers left behind is given back within
 * two intervals, however large the budget. */
void _hk_huge_decay(void) {
  if (!cache) return;   /* racy peek: a miss waits for the next pass */
  hk_huge_t* out = NULL;
  _hk_lock(&huge_lock);
  for (hk_huge_t** link = &cache; *link;) {
    hk_huge_t* h = *link;
    if (h->aged) {
      cache_unlink(link);   /* *link is now the next one */
      h->next_cached = out;
      out = h;
    } else {
      h->aged = 1;
      link = &h->next_cached;
    }
  }
  _hk_unlock(&huge_lock);
  while (out) {
    hk_huge_t* next = out->next_cached;
    unmap_range(out->base, out->map_len);
    out = next;
  }
}

/* After a lowered budget (hk_policy_set): the oldest mappings over it go
 * back now, not when the next free finds the cache full. */
void _hk_huge_fit(void) {
  if (!cache) return;   /* racy peek: nothing cached, nothing to fit */
  size_t budget = cache_budget();
  hk_huge_t* out = NULL;
  _hk_lock(&huge_lock);
  while (cache && cache_bytes > budget) {
    hk_huge_t** link = &cache;
    while ((*link)->next_cached) link = &(*link)->next_cached;
    hk_huge_t* h = cache_unlink(link);
    h->next_cached = out;
    out = h;
  }
  _hk_unlock(&huge_lock);
  while (out) {
    hk_huge_t* next = out->next_cached;
    unmap_range(out->base, out->map_len);
    out = next;
  }
}

bool _hk_huge_trim(void) {
  _hk_lock(&huge_lock);
  hk_huge_t* list = cache;
  cache = NULL;
  cache_count = 0;
  cache_bytes = 0;
  for (hk_huge_t* h = list; h; h = h->next_cached)
    _hk_map[chunk_of((uint8_t*)h + sizeof(hk_huge_t))] = HK_MAP_NONE;
  _hk_unlock(&huge_lock);
  bool any = list != NULL;
  while (list) {
    hk_huge_t* next = list->next_cached;
    unmap_range(list->base, list->map_len);
    list = next;
  }
  return any;
}
