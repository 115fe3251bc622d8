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

static void* place(void* base, size_t map_len, size_t off, size_t n) {
  uint8_t* user = (uint8_t*)base + off;
  hk_huge_t* h = header_of(user);
  h->magic = HK_HUGE_MAGIC ^ (uintptr_t)user;
  h->base = base;
  h->map_len = map_len;
  h->size = n;
  h->state = HK_HUGE_LIVE;
  h->next_cached = NULL;
  _hk_map[chunk_of(user)] = HK_MAP_HUGE;
  return user;
}

/* The cache may hold half of what is live in huge objects, between a
 * floor and HK_HUGE_CACHE_MAX_BYTES: a program that replaces many big
 * buffers keeps the pages it will touch again, one with a few big buffers
 * does not keep a multiple of them resident. */
static size_t cache_budget(void) {
  size_t budget = hk_load_relaxed(&_hk_central[0].c.live_bytes) / 2;
  if (budget < HK_HUGE_CACHE_MIN_BYTES) budget = HK_HUGE_CACHE_MIN_BYTES;
  if (budget > HK_HUGE_CACHE_MAX_BYTES) budget = HK_HUGE_CACHE_MAX_BYTES;
  return budget;
}

/* Caches the mapping of h, dropping the oldest entries to make room;
 * false (nothing done) when it is bigger than the whole budget. Called
 * with huge_lock held. */
static bool cache_put(hk_huge_t* h, size_t budget) {
  if (h->map_len > budget) return false;
  while (cache_count >= HK_HUGE_CACHE_MAX || cache_bytes + h->map_len > budget) {
    hk_huge_t** link = &cache;
    while ((*link)->next_cached) link = &(*link)->next_cached;
    hk_huge_t* old = *link;
    *link = NULL;
    cache_count--;
    cache_bytes -= old->map_len;
    _hk_map[chunk_of((uint8_t*)old + sizeof(hk_huge_t))] = HK_MAP_NONE;
    hk_sub_relaxed(&_hk_proc.committed_bytes, old->map_len);
    _hk_os_unmap(old->base, old->map_len);
  }
  h->state = HK_HUGE_CACHED;
  h->next_cached = cache;
  cache = h;
  cache_count++;
  cache_bytes += h->map_len;
  return true;
}

/* A cached mapping that fits n at offset off without holding on to much
 * more than it needs: of those, the one whose pages touched by earlier
 * objects cover most of the new object (each page not covered is a page
 * fault when the program writes it), then the smallest. Pages an earlier,
 * bigger object touched past the new one stay as they are: the window
 * bounds them (half the size plus a chunk), and giving them back with
 * madvise only to fault them in again when the mapping next serves a
 * bigger object cost large_churn 60% more page faults. *dirty_out gets how
 * far from the user pointer pages may be touched. Called with huge_lock
 * held. */
static void* cache_take(size_t n, size_t off, size_t* dirty_out) {
  size_t need = round_up(off + n, HK_SEG_SIZE);
  size_t new_end = round_up(off + n, HK_OS_PAGE);
  hk_huge_t** best = NULL;
  size_t best_fresh = 0;
  for (hk_huge_t** link = &cache; *link; link = &(*link)->next_cached) {
    hk_huge_t* h = *link;
    if (h->map_len < need || h->map_len > need + need / 2 + HK_SEG_SIZE) continue;
    if (((uintptr_t)h->base + off) & (off - 1)) continue; /* alignment */
    size_t old_end = touched_end(h);
    size_t fresh = new_end > old_end ? new_end - old_end : 0;
    if (!best || fresh < best_fresh || (fresh == best_fresh && h->map_len < (*best)->map_len)) {
      best = link;
      best_fresh = fresh;
    }
  }
  if (!best) return NULL;
  hk_huge_t* h = *best;
  *best = h->next_cached;
  cache_count--;
  cache_bytes -= h->map_len;
  void* base = h->base;
  size_t map_len = h->map_len;
  uint8_t* old_user = (uint8_t*)h + sizeof(hk_huge_t);
  size_t old_end = touched_end(h);
  /* The old object's header lies inside the new object if off grew. */
  _hk_map[chunk_of(old_user)] = HK_MAP_NONE;
  HK_VG_DEFINED(base, map_len);   /* the old object was "freed" for memcheck */
  size_t kept_end = old_end > new_end ? old_end : new_end;
  hk_add_relaxed(&_hk_proc.huge_cache_hits, 1);
  *dirty_out = kept_end - off;
  return place(base, map_len, off, n);
}

/* No cached mapping is big enough: unlinks the one whose touched pages
 * cover most of the request, if they are worth moving (a quarter of it at
 * least). Called with huge_lock held. */
static hk_huge_t* cache_take_smaller(size_t n, size_t off) {
  size_t need = round_up(off + n, HK_SEG_SIZE);
  hk_huge_t** best = NULL;
  size_t best_end = round_up(off + n, HK_OS_PAGE) / 4;
  for (hk_huge_t** link = &cache; *link; link = &(*link)->next_cached) {
    hk_huge_t* h = *link;
    if (h->map_len >= need) continue;
    size_t end = touched_end(h);
    if (end > best_end) { best = link; best_end = end; }
  }
  if (!best) return NULL;
  hk_huge_t* h = *best;
  *best = h->next_cached;
  cache_count--;
  cache_bytes -= h->map_len;
  _hk_map[chunk_of((uint8_t*)h + sizeof(hk_huge_t))] = HK_MAP_NONE;
  return h;
}

/* A new mapping of map_len bytes whose first pages are those of a smaller
 * cached mapping, moved there by mremap: its touched pages need no fault.
 * *dirty_end gets how far from the new base they reach (0: a plain new
 * mapping). NULL when mapping fails. */
static void* map_reusing(size_t n, size_t off, size_t map_len, size_t align_map, size_t* dirty_end) {
  *dirty_end = 0;
  hk_huge_t* h = NULL;
  if (cache) {
    _hk_lock(&huge_lock);
    h = cache_take_smaller(n, off);
    _hk_unlock(&huge_lock);
  }
  void* base;
  if (_hk_os_map_aligned(map_len, align_map, false, &base) != 0) {
    if (h) {   /* give it back to the OS, as eviction would have */
      hk_sub_relaxed(&_hk_proc.committed_bytes, h->map_len);
      _hk_os_unmap(h->base, h->map_len);
    }
    return NULL;
  }
  hk_add_relaxed(&_hk_proc.committed_bytes, map_len);
  if (h) {
    size_t old_len = h->map_len;
    size_t end = touched_end(h);
    void* old_base = h->base;
    /* The moved pages replace fresh ones already counted as committed. */
    hk_sub_relaxed(&_hk_proc.committed_bytes, old_len);
    if (_hk_os_move(old_base, old_len, base) == 0) {
      *dirty_end = end;
      HK_VG_DEFINED(base, old_len);
    } else {
      _hk_os_unmap(old_base, old_len);
    }
  }
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
    void* base = map_reusing(n, off, map_len, align_map, &end);
    /* Out of memory (address space, under a `ulimit -v`): everything the
     * allocator caches goes back to the OS, warm slabs first so that the
     * segments they leave empty go too, and the mapping gets one more try. */
    if (!base) {
      bool any = _hk_trim_warm();
      any |= _hk_segment_trim();
      any |= _hk_huge_trim();
      if (any) base = map_reusing(n, off, map_len, align_map, &end);
    }
    if (!base) { errno = ENOMEM; return NULL; }
    dirty = end > off ? end - off : 0;
    _hk_lock(&huge_lock);
    user = place(base, map_len, off, n);
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
  hk_sub_relaxed(&_hk_proc.committed_bytes, map_len);
  _hk_os_unmap(base, map_len);
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
    if (_hk_os_grow_in_place(h->base, h->map_len, need) != 0) return NULL;
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
    hk_sub_relaxed(&_hk_proc.committed_bytes, list->map_len);
    _hk_os_unmap(list->base, list->map_len);
    list = next;
  }
  return any;
}
