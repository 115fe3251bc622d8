/* init.c — start-up, threads, fork and exit.
 *
 * Initialization happens on the first allocation, which may come from the
 * dynamic loader or libc's own start-up before any constructor ran, so it
 * uses nothing that allocates: static tables, mmap, and our own environment
 * walk. pthread_atfork (which may allocate) is registered from a constructor,
 * when malloc already works.
 *
 * SYNCHRONIZATION
 *  1. init_lock serializes the one-time initialization; _hk_initialized is
 *     published with release order and read with acquire on the slow path.
 *  2. registry_lock guards the registry of thread records and its free list.
 *     A thread writes its own record's counters (relaxed atomics) without
 *     the lock; stats read them under it.
 *  3. Fork: the parent takes every allocator lock in a fixed order (init,
 *     policy, registry, classes, segments, huge) before fork and releases them after;
 *     the child re-initializes them and keeps only its own thread cache.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <fcntl.h>
#include <sched.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "internal.h"
#include "prim.h"

__thread hk_tcache_t _hk_tc __attribute__((tls_model("initial-exec")));

hk_class_info_t _hk_class[HK_NUM_CLASSES];
uint8_t _hk_small_class[HK_SMALL_MAX / 16 + 1];
uint8_t _hk_medium_class[HK_MEDIUM_MAX / 128 + 1];
hk_div_t _hk_div[HK_NUM_CLASSES] __attribute__((aligned(64)));
uint8_t _hk_align_class[HK_ALIGN_LEVELS][64];
uint8_t _hk_align_small[HK_ALIGN_LEVELS][HK_SMALL_MAX / 16 + 1] HK_SPARSE_BSS;
uint8_t _hk_align_medium[HK_ALIGN_LEVELS][HK_MEDIUM_MAX / 128 + 1] HK_SPARSE_BSS;
hk_proc_counters_t _hk_proc;
int _hk_initialized;

static hk_lock_t init_lock;
static hk_lock_t registry_lock;
static pthread_key_t thread_key;
static bool thread_key_ok;

/* ---- locks ------------------------------------------------------------------ */
void _hk_lock_slow(hk_lock_t* l) {
  for (unsigned spins = 0;; spins++) {
    if (hk_load_relaxed(&l->v) == 0) {
      int expect = 0;
      if (atomic_compare_exchange_weak_explicit(&l->v, &expect, 1,
            memory_order_acquire, memory_order_relaxed)) return;
    }
    if (spins < 64) __builtin_ia32_pause();
    else sched_yield();
  }
}

void _hk_registry_lock(void) { _hk_lock(&registry_lock); }
void _hk_registry_unlock(void) { _hk_unlock(&registry_lock); }

/* ---- size classes ----------------------------------------------------------- */
static uint32_t class_size_formula(unsigned cls) {
  if (cls <= 8) return cls * 16u;
  unsigned k = cls - 9;              /* 0.. */
  unsigned b = 7 + k / 4;            /* doubling above 2^b */
  return (uint32_t)((5u + k % 4) << (b - 2));
}

static void classes_init(void) {
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

/* ---- threads ----------------------------------------------------------------
 * Each thread with a cache has a record in the registry. Records live in
 * metadata pages that are never unmapped, so the registry cannot dangle even
 * when a thread ends without our exit hook: that happens when its very first
 * allocation comes from another key's destructor on the last destructor
 * round, after which pthread calls no more destructors. Such records (and the
 * few blocks their thread cached) are found by a liveness sweep (tgkill with
 * signal 0) when records pile up, and on every stats call while the registry
 * is small.
 */
static hk_thread_rec_t* registry;      /* live records */
static hk_thread_rec_t* rec_free;      /* reusable records */
/* The first thread's record is static: most processes have one thread, and
 * it saves them a 64 KiB mapping (an mmap and a page fault) at their first
 * allocation. Later chunks are mapped as needed. */
static hk_thread_rec_t rec_first;
static uint8_t* rec_chunk = (uint8_t*)&rec_first;   /* bump area for new records */
static size_t rec_chunk_left = sizeof rec_first;
static size_t rec_count, rec_count_at_sweep;

#define REC_CHUNK (64u << 10)

static hk_thread_rec_t* rec_alloc(void) {   /* registry lock held */
  hk_thread_rec_t* r = rec_free;
  if (r) { rec_free = r->next; return r; }
  if (rec_chunk_left < sizeof *r) {
    void* p;
    if (_hk_os_map_aligned(REC_CHUNK, HK_OS_PAGE, false, &p) != 0) return NULL;
    rec_chunk = p;
    rec_chunk_left = REC_CHUNK;
  }
  r = (hk_thread_rec_t*)rec_chunk;
  rec_chunk += sizeof *r;
  rec_chunk_left -= sizeof *r;
  return r;
}

static void rec_unlink(hk_thread_rec_t* r) {   /* registry lock held */
  if (r->prev) r->prev->next = r->next; else registry = r->next;
  if (r->next) r->next->prev = r->prev;
  memset(r, 0, sizeof *r);
  r->next = rec_free;
  rec_free = r;
  rec_count--;
}

/* Drops records of threads that no longer exist. Their allocation counts
 * stay in the totals; their cached blocks stay counted as cached (they were
 * in the dead thread's TLS and cannot be reached any more). */
static void sweep_dead(void) {   /* registry lock held */
  pid_t pid = getpid();
  for (hk_thread_rec_t* r = registry, *next; r; r = next) {
    next = r->next;
    if (syscall(SYS_tgkill, pid, (pid_t)r->tid, 0) != 0 && errno == ESRCH) {
      for (unsigned cls = 1; cls < HK_NUM_CLASSES; cls++) {
        hk_add_relaxed(&_hk_central[cls].c.allocs, hk_load_relaxed(&r->allocs[cls]));
        hk_add_relaxed(&_hk_central[cls].c.lost_blocks, hk_load_relaxed(&r->cached[cls]));
      }
      rec_unlink(r);
      hk_sub_relaxed(&_hk_proc.threads, 1);
    }
  }
  rec_count_at_sweep = rec_count;
}

void _hk_publish(hk_tcache_t* tc, unsigned cls) {
  hk_thread_rec_t* r = tc->rec;
  if (!r) return;
  hk_store_relaxed(&r->allocs[cls], _hk_bin_allocs(&tc->bin[cls]));
  hk_store_relaxed(&r->cached[cls], tc->bin[cls].count);
}

void _hk_publish_all(hk_tcache_t* tc) {
  for (unsigned cls = 1; cls < HK_NUM_CLASSES; cls++) _hk_publish(tc, cls);
}

static void thread_exit(void* arg) {
  hk_tcache_t* tc = &_hk_tc;
  if (tc->state != HK_TC_ACTIVE) return;
  _hk_flush_thread(tc);
  _hk_registry_lock();
  for (unsigned cls = 1; cls < HK_NUM_CLASSES; cls++) {
    hk_add_relaxed(&_hk_central[cls].c.allocs, _hk_bin_allocs(&tc->bin[cls]));
    tc->bin[cls].mark = 0;
    tc->bin[cls].left = 0;
    tc->bin[cls].cap = 0;   /* from now on every call goes the direct way */
  }
  if (tc->rec) rec_unlink(tc->rec);
  tc->rec = NULL;
  hk_sub_relaxed(&_hk_proc.threads, 1);
  tc->state = HK_TC_DEAD;
  _hk_registry_unlock();
}

hk_tcache_t* _hk_tcache_setup(void) {
  hk_tcache_t* tc = &_hk_tc;
  if (!__atomic_load_n(&_hk_initialized, __ATOMIC_ACQUIRE)) _hk_init();
  if (tc->state != HK_TC_NEW) return tc;
  tc->tid = _hk_os_tid();
  tc->last_gc_ns = _hk_os_now_coarse_ns();
  /* Check-in draws differ between threads and between runs. */
  tc->rng = (tc->last_gc_ns ^ ((uint64_t)tc->tid * 0x9e3779b97f4a7c15ull)) | 1;
  _hk_registry_lock();
  if (rec_count >= 64 && rec_count >= 2 * rec_count_at_sweep) sweep_dead();
  hk_thread_rec_t* r = rec_alloc();
  if (r) {
    r->tid = tc->tid;
    r->prev = NULL;
    r->next = registry;
    if (registry) registry->prev = r;
    registry = r;
    rec_count++;
  }
  tc->rec = r;
  hk_add_relaxed(&_hk_proc.threads, 1);
  hk_add_relaxed(&_hk_proc.threads_total, 1);
  tc->state = HK_TC_ACTIVE;
  _hk_registry_unlock();
  _hk_tcache_apply_policy(tc);
  /* A non-NULL value makes pthread call thread_exit when the thread ends.
   * Our key is made first thing, so it sits in the static key array and
   * setting it does not allocate. */
  if (thread_key_ok) pthread_setspecific(thread_key, tc);
  return tc;
}

/* Sums every live thread's published counters (stats.c). */
void _hk_registry_sum(uint64_t* allocs, uint64_t* cached_blocks) {
  hk_tcache_t* me = &_hk_tc;
  if (me->state == HK_TC_ACTIVE) _hk_publish_all(me);
  _hk_registry_lock();
  if (rec_count <= 64 || rec_count >= 2 * rec_count_at_sweep) sweep_dead();
  for (hk_thread_rec_t* r = registry; r; r = r->next)
    for (unsigned cls = 1; cls < HK_NUM_CLASSES; cls++) {
      allocs[cls] += hk_load_relaxed(&r->allocs[cls]);
      cached_blocks[cls] += hk_load_relaxed(&r->cached[cls]);
    }
  _hk_registry_unlock();
}

/* ---- fork ------------------------------------------------------------------- */
static void fork_prepare(void) {
  _hk_lock(&init_lock);   /* a fork during initialization waits for it */
  _hk_policy_lock();
  _hk_registry_lock();
  _hk_central_lock_all();
  _hk_segment_lock();
  _hk_huge_lock();
}

static void fork_parent(void) {
  _hk_huge_unlock();
  _hk_segment_unlock();
  _hk_central_unlock_all();
  _hk_registry_unlock();
  _hk_policy_unlock();
  _hk_unlock(&init_lock);
}

static void fork_child(void) {
  _hk_lock_reinit(&init_lock);
  _hk_huge_reinit_lock();
  _hk_segment_reinit_lock();
  _hk_central_reinit_locks();
  _hk_lock_reinit(&registry_lock);
  _hk_policy_reinit_lock();
  _hk_tel_after_fork_child();
  /* Only the forking thread exists now. The other threads' records go, as
   * a sweep would drop them; their cached blocks stay out of their slabs
   * (a bounded leak, as in every allocator). */
  hk_tcache_t* me = &_hk_tc;
  for (hk_thread_rec_t* r = registry, *next; r; r = next) {
    next = r->next;
    if (r == me->rec) continue;
    for (unsigned cls = 1; cls < HK_NUM_CLASSES; cls++) {
      hk_add_relaxed(&_hk_central[cls].c.allocs, hk_load_relaxed(&r->allocs[cls]));
      hk_add_relaxed(&_hk_central[cls].c.lost_blocks, hk_load_relaxed(&r->cached[cls]));
    }
    rec_unlink(r);
  }
  rec_count_at_sweep = rec_count;
  if (me->state == HK_TC_ACTIVE) {
    me->tid = _hk_os_tid();
    if (me->rec) me->rec->tid = me->tid;
  }
  hk_store_relaxed(&_hk_proc.threads, me->state == HK_TC_ACTIVE ? 1 : 0);
}

/* ---- start and exit --------------------------------------------------------- */
void _hk_init(void) {
  _hk_lock(&init_lock);
  if (!__atomic_load_n(&_hk_initialized, __ATOMIC_ACQUIRE)) {
    classes_init();
    _hk_stats_clock_start();
    _hk_options_init();
    if (pthread_key_create(&thread_key, thread_exit) == 0) thread_key_ok = true;
    __atomic_store_n(&_hk_initialized, 1, __ATOMIC_RELEASE);
  }
  _hk_unlock(&init_lock);
}

/* Programs may close stderr before exit (coreutils does, in an atexit
 * handler); the exit-time table goes to a copy of it taken at start. */
static int stats_fd = -1;

__attribute__((constructor(101))) static void hk_constructor(void) {
  if (!_hk_initialized) _hk_init();
  /* Initialized from inside the loader, before the environment was set up:
   * read the options now, before main. */
  if (_hk_options_env_missing()) _hk_options_init();
  pthread_atfork(fork_prepare, fork_parent, fork_child);
  if (_hk_stats_at_exit()) stats_fd = fcntl(2, F_DUPFD_CLOEXEC, 64);
  _hk_tel_start();
}

/* The exit-time table and the telemetry file's last record come from one
 * snapshot, so a reader's totals equal the printed ones. */
__attribute__((destructor(101))) static void hk_destructor(void) {
  static hk_stats_t st HK_SPARSE_BSS;
  if (!_hk_stats_at_exit() && !_hk_tel_on) return;
  hk_stats_get(&st);
  _hk_tel_exit(&st);
  if (_hk_stats_at_exit()) _hk_stats_print_snapshot(stats_fd >= 0 ? stats_fd : 2, &st);
}
