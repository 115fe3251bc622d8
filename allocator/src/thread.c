/* thread.c — threads: the registry of thread records, a thread cache's
 * set-up and exit, and publishing its counters.
 *
 * SYNCHRONIZATION
 *  1. registry_lock guards the registry of thread records and its free list.
 *     A thread writes its own record's counters (relaxed atomics) without
 *     the lock; stats read them under it (_hk_registry_sum).
 *  2. A thread's cache (_hk_tc, initial-exec TLS) is touched only by its
 *     thread; others see its record alone.
 *  3. Fork (init.c): the parent holds registry_lock across fork; the child
 *     re-initializes it and keeps only its own record
 *     (_hk_thread_after_fork_child).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stddef.h>

#include "internal.h"
#include "trace.h"
#include "prim.h"

__thread hk_tcache_t _hk_tc __attribute__((tls_model("initial-exec")));

static hk_lock_t registry_lock;
static pthread_key_t thread_key;
static bool thread_key_ok;

void _hk_registry_lock(void) { _hk_lock(&registry_lock); }
void _hk_registry_unlock(void) { _hk_unlock(&registry_lock); }

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
  /* Not the inboxes: a thread may be pushing a block there on a stale
   * read of a slab's owner (slab.c "ownership"); the record's next thread,
   * or the decay pass, takes what arrives. */
  memset(r, 0, offsetof(hk_thread_rec_t, inbox));
  r->next = rec_free;
  rec_free = r;
  rec_count--;
}

/* Drops records of threads that no longer exist. Their allocation counts
 * stay in the totals; their cached blocks stay counted as cached (they were
 * in the dead thread's TLS and cannot be reached any more). */
static void sweep_dead(void) {   /* registry lock held */
  for (hk_thread_rec_t* r = registry, *next; r; r = next) {
    next = r->next;
    if (_hk_os_thread_gone(r->tid)) {
      _hk_slabs_orphan(r);
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
  hk_store_relaxed(&r->cached[cls], _hk_bin_count(&tc->bin[cls]));
}

void _hk_publish_all(hk_tcache_t* tc) {
  for (unsigned cls = 1; cls < HK_NUM_CLASSES; cls++) _hk_publish(tc, cls);
}

static void thread_exit(void* arg) {
  hk_tcache_t* tc = &_hk_tc;
  if (tc->state != HK_TC_ACTIVE) return;
  _hk_trace_thread_exit(tc);   /* THREAD_EXIT, and the bins untrapped */
  _hk_flush_thread(tc);
  if (tc->rec) {
    _hk_lock(&tc->rec->slabs);   /* a decay pass may be giving its inbox back */
    _hk_slabs_orphan(tc->rec);
    _hk_unlock(&tc->rec->slabs);
  }
  _hk_registry_lock();
  for (unsigned cls = 1; cls < HK_NUM_CLASSES; cls++) {
    hk_add_relaxed(&_hk_central[cls].c.allocs, _hk_bin_allocs(&tc->bin[cls]));
    tc->cold[cls].mark = 0;
    tc->bin[cls].left = 0;
    tc->cold[cls].cap = 0;   /* from now on every call goes the direct way */
    tc->bin[cls].room = 0;  /* flushed: count 0 */
    tc->bin[cls].limit = 0;
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
    r->tc = tc;
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
  /* Until now every free failed the bins' block-start test (limit 0). */
  for (unsigned cls = 1; cls < HK_NUM_CLASSES; cls++) {
    tc->bin[cls].magic = _hk_div[cls].magic;
    tc->bin[cls].limit = _hk_div[cls].limit;
  }
  _hk_tcache_apply_policy(tc);
  /* A non-NULL value makes pthread call thread_exit when the thread ends.
   * Our key is made first thing, so it sits in the static key array and
   * setting it does not allocate. */
  if (thread_key_ok) pthread_setspecific(thread_key, tc);
  return tc;
}

/* ---- reaching every thread ----------------------------------------------------
 * A thread takes up a new policy, and a malloc_trim, on its own slow path:
 * at a check-in, 512 or more allocations of one class after the last. A
 * thread that wakes for a few calls at a time gets there only after several
 * wake-ups, and until then its cache keeps the old capacity. Measured on
 * bench-learn's idle-threads (32 threads, mostly asleep) with the policy
 * switched by hand to cap=4 drain=100: the program's CPU rose within 0.25 s
 * of the switch, as the first threads drained, but its RSS fell only
 * 0.25-1.2 s after it, so a 2-s window ending 0.25-0.5 s after the switch
 * cost 1.040-1.057 times the default's median (3 runs); and learnd's A/B
 * trials, in blocks of one or two 1-s windows, measured a blend of the two
 * policies.
 *
 * So whoever installs a policy (hk_policy_set) or trims sets every live
 * thread's block-start limits to 0: the trap free() already has for a new
 * or ended thread and for a capture, so the fast paths stay as they are.
 * That thread's next free of a block of its own class fails the test and
 * takes the slow path, which puts the limits back (_hk_untrap_if_trapped)
 * and then takes up the policy and the trim (tcache_slow). A limit the
 * owner writes back over a trap, when both come at once, loses that trap:
 * the thread then takes the policy at its next check-in, as before. The
 * fast path reads the limit with a plain load, which sees an aligned
 * 8-byte store whole.
 *
 * The same switch by hand, 3 runs each (interleaved, at ad8d902 and with
 * this): the RSS came within 5% of the new policy's level 0.49-0.61 s after
 * the switch against 0.95-1.12 s, and the memory above that level over the
 * 5 s after it was 18.8-19.3 MiB*s against 32.4-38.2. The worst 2-s window
 * did not change beyond noise (1.060-1.086 against 1.042-1.079 times the
 * default's median, 6 runs each): the drains' CPU still comes before the
 * pages go. The fast path is unchanged (bench/callgrind.sh: 47.01
 * instructions a malloc(64)+free pair, both).
 *
 * Another thread's TLS is written only while that thread lives: its record
 * leaves the registry in thread_exit, under the lock held here, before its
 * TLS goes. A thread whose exit hook never runs (its first allocation came
 * from another key's destructor on pthread's last round: "threads" above)
 * keeps its record until a sweep, so the liveness test (tgkill with signal
 * 0) comes before each write: one system call per thread per policy
 * (hk_policy_set with 1,000 sleeping threads: 0.5 ms; with 10: 5 us), which
 * a program pays once a second at most (learnd's A/B switches). What that leaves is a thread of that kind ending between its
 * test and its write, with its stack unmapped in that time. */
void _hk_threads_trap(void) {
  /* The policy (its version) and the trim epoch before any trap: a thread
   * that sees a limit of 0 sees them (_hk_untrap_if_trapped). */
  atomic_thread_fence(memory_order_release);
  int saved_errno = errno;   /* the test's ESRCH is no business of the caller's */
  _hk_registry_lock();
  for (hk_thread_rec_t* r = registry; r; r = r->next) {
    hk_tcache_t* tc = r->tc;
    if (!tc) continue;
    if (tc != &_hk_tc && _hk_os_thread_gone(r->tid)) continue;
    for (unsigned cls = 1; cls < HK_NUM_CLASSES; cls++) __atomic_store_n(&tc->bin[cls].limit, 0, __ATOMIC_RELAXED);
  }
  _hk_registry_unlock();
  errno = saved_errno;
}

/* A free whose bin's limit is 0. Trapped by a capture (trace.h), or not
 * set up yet, or ended: left alone. Else _hk_threads_trap's trap: every
 * limit goes back, and the caller's tcache_slow takes up what came. */
void _hk_untrap_if_trapped(hk_tcache_t* tc) {
  if (tc->state != HK_TC_ACTIVE || _hk_trace_tls.trapped) return;
  atomic_thread_fence(memory_order_acquire);
  for (unsigned cls = 1; cls < HK_NUM_CLASSES; cls++) __atomic_store_n(&tc->bin[cls].limit, _hk_div[cls].limit, __ATOMIC_RELAXED);
  /* The limits written back before the version is read again, so a trap
   * for a newer policy is either seen now or lands after them. */
  atomic_thread_fence(memory_order_seq_cst);
}

/* Blocks freed into the inboxes of records that no thread has (slab.c
 * "ownership") go to their slabs: run by the decay pass. */
void _hk_inbox_sweep_free_records(void) {
  _hk_registry_lock();
  for (hk_thread_rec_t* r = rec_free; r; r = r->next) _hk_inbox_sweep(r);
  _hk_registry_unlock();
}

/* Inboxes of live threads that no refill took for a whole interval go to
 * their slabs (slab.c "idle owners"): run by the decay pass. */
void _hk_inbox_sweep_idle(void) {
  _hk_registry_lock();
  for (hk_thread_rec_t* r = registry; r; r = r->next) _hk_inbox_idle(r);
  _hk_registry_unlock();
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

/* The key whose destructor runs thread_exit (once, at initialization). */
void _hk_thread_init(void) {
  if (pthread_key_create(&thread_key, thread_exit) == 0) thread_key_ok = true;
}

/* In the child of a fork, after the allocator's other locks are reset. */
void _hk_thread_after_fork_child(void) {
  _hk_lock_reinit(&registry_lock);
  /* Only the forking thread exists now. The other threads' records go, as
   * a sweep would drop them; their cached blocks stay out of their slabs
   * (a bounded leak, as in every allocator). */
  hk_tcache_t* me = &_hk_tc;
  for (hk_thread_rec_t* r = registry, *next; r; r = next) {
    next = r->next;
    if (r == me->rec) continue;
    _hk_slabs_orphan(r);
    for (unsigned cls = 1; cls < HK_NUM_CLASSES; cls++) {
      hk_add_relaxed(&_hk_central[cls].c.allocs, hk_load_relaxed(&r->allocs[cls]));
      hk_add_relaxed(&_hk_central[cls].c.lost_blocks, hk_load_relaxed(&r->cached[cls]));
    }
    rec_unlink(r);
  }
  rec_count_at_sweep = rec_count;
  if (me->state == HK_TC_ACTIVE) {
    me->tid = _hk_os_tid();
    if (me->rec) {
      me->rec->tid = me->tid;
      _hk_lock_reinit(&me->rec->slabs);
    }
  }
  hk_store_relaxed(&_hk_proc.threads, me->state == HK_TC_ACTIVE ? 1 : 0);
}
