/* test_stress.c — multi-threaded allocation stress checked against a shadow
 * model. Not a benchmark: every object carries a byte pattern derived from
 * (thread, slot, generation, byte index) that is verified before the object is
 * freed or reallocated, by whichever thread frees it.
 *
 *   test_stress [threads [iterations-per-thread [seed]]]
 *   STRESS_SCALE=0.05 test_stress      (scale iterations, e.g. under valgrind)
 *
 * Phases:
 *   mixed      T threads on private slot arrays: malloc/calloc/realloc/
 *              posix_memalign/aligned_alloc, realloc grow/shrink, and a share
 *              of objects handed to other threads through per-thread mailboxes
 *              (the receiver verifies and frees them).
 *   remote     one producer allocates, T-1 consumers verify and free.
 *   flush      the mixed phase again with hk_thread_flush() calls in between.
 *   policy     the mixed phase while another thread keeps switching the
 *              runtime policy (tiny/zero caches, no warm slabs, 1 ms drains,
 *              back to the default) with hk_policy_set.
 *   stats      once all threads have exited: live bytes exactly where they
 *              started, nothing cached, one thread left, and per class the
 *              counters agree with each other (blocks out of slabs = live
 *              + cached, frees = allocs - live, refills/drains present
 *              wherever refilled/drained blocks are).
 *
 * The test itself never allocates outside the objects under test: mailboxes
 * and shadows are static arrays, output goes through harness_say (write(2)).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <malloc.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "hakmem.h"
#include "harness.h"
#include "testutil.h"

#define MAX_THREADS 32
#define NSLOTS 128          /* shadow slots per thread */
#define FULL_LIMIT 4096     /* objects up to this size are filled entirely */
#define EDGE 256            /* bytes written at each end of bigger objects */
#define NPROBES 8           /* random single-byte probes in bigger objects */
#define MBOX_CAP 256

/* ---- configuration ------------------------------------------------------ */
static int g_threads = 4;
static long g_iters = 40000;    /* per thread, mixed phase */
static uint64_t g_seed = 0x5eed1234abcdULL;

/* ---- patterns (mix64, rnd, pat, FAILF: testutil.h) ---------------------- */
static inline size_t probe_pos(uint64_t seed, int k, size_t n) {
  return (size_t)(mix64(seed + (uint64_t)k + 1) % n);
}

static void fill_range(unsigned char* p, size_t lo, size_t hi, uint64_t seed) {
  for (size_t i = lo; i < hi; i++) p[i] = pat(seed, i);
}

/* Writes the pattern positions of an object of n bytes. */
static void fill(unsigned char* p, size_t n, uint64_t seed) {
  if (n <= FULL_LIMIT) {
    fill_range(p, 0, n, seed);
    return;
  }
  fill_range(p, 0, EDGE, seed);
  fill_range(p, n - EDGE, n, seed);
  for (int k = 0; k < NPROBES; k++) {
    size_t i = probe_pos(seed, k, n);
    p[i] = pat(seed, i);
  }
}

static int check_range(const unsigned char* p, size_t lo, size_t hi,
                       uint64_t seed, size_t n, const char* what) {
  for (size_t i = lo; i < hi; i++) {
    unsigned char e = pat(seed, i);
    if (p[i] != e) {
      FAILF("  MISMATCH %s: obj %p size %zu at byte %zu: got 0x%02x want 0x%02x\n",
            what, (const void*)p, n, i, p[i], e);
      return 0;
    }
  }
  return 1;
}

/* Verifies the pattern positions of an object of n bytes that lie below
 * limit (limit = n for the whole object; a smaller limit after realloc). */
static int verify(const unsigned char* p, size_t n, uint64_t seed, size_t limit,
                  const char* what) {
  if (limit > n) limit = n;
  if (n <= FULL_LIMIT) return check_range(p, 0, limit, seed, n, what);
  size_t a = EDGE < limit ? EDGE : limit;
  if (!check_range(p, 0, a, seed, n, what)) return 0;
  if (n - EDGE < limit && !check_range(p, n - EDGE, limit, seed, n, what))
    return 0;
  for (int k = 0; k < NPROBES; k++) {
    size_t i = probe_pos(seed, k, n);
    if (i < limit && !check_range(p, i, i + 1, seed, n, what)) return 0;
  }
  return 1;
}

/* calloc'd memory must read as zero: fully for small objects, at the pattern
 * positions and one byte per stride for bigger ones. */
static int check_zero(const unsigned char* p, size_t n) {
  if (n <= 65536) {
    for (size_t i = 0; i < n; i++)
      if (p[i]) goto bad;
    return 1;
  }
  for (size_t i = 0; i < EDGE; i++)
    if (p[i] || p[n - 1 - i]) goto bad;
  size_t stride = n / 256 > 4096 ? n / 256 : 4096;
  for (size_t i = 0; i < n; i += stride)
    if (p[i]) goto bad;
  return 1;
bad:
  FAILF("  calloc(%zu) returned non-zero memory at %p\n", n, (const void*)p);
  return 0;
}

/* 70% 16..1024, 20% 1 KiB..64 KiB, 8% 64 KiB..1 MiB, 2% 1..8 MiB */
static size_t rand_size(uint64_t* s) {
  unsigned r = (unsigned)(rnd(s) % 100);
  if (r < 70) return 16 + rnd(s) % (1024 - 16 + 1);
  if (r < 90) return 1024 + rnd(s) % (65536 - 1024 + 1);
  if (r < 98) return 65536 + rnd(s) % ((1u << 20) - 65536 + 1);
  return (1u << 20) + rnd(s) % ((7u << 20) + 1);
}

/* Mostly small: for the remote-free-heavy phase. */
static size_t rand_small_size(uint64_t* s) {
  unsigned r = (unsigned)(rnd(s) % 100);
  if (r < 85) return 8 + rnd(s) % (1024 - 8 + 1);
  if (r < 99) return 1024 + rnd(s) % (32768 - 1024 + 1);
  return 65536 + rnd(s) % (262144 - 65536 + 1);
}

/* ---- objects, slots, mailboxes ------------------------------------------ */
typedef struct {
  unsigned char* p;
  size_t size;
  uint64_t seed;
} obj_t;

typedef struct {
  obj_t o;
  uint32_t gen;
} slot_t;

typedef struct {
  pthread_mutex_t mu;
  pthread_cond_t nonempty, nonfull;
  unsigned head, count;
  obj_t items[MBOX_CAP];
} mbox_t;

typedef struct {
  long allocs, frees, reallocs, sent, received, verified, flushes, sent_full;
  long by_kind[5];
} tstats_t;

static slot_t g_slots[MAX_THREADS][NSLOTS];
static mbox_t g_mbox[MAX_THREADS];
static tstats_t g_tstats[MAX_THREADS];
static pthread_barrier_t g_barrier;

static void mbox_init_all(void) {
  for (int i = 0; i < MAX_THREADS; i++) {
    pthread_mutex_init(&g_mbox[i].mu, NULL);
    pthread_cond_init(&g_mbox[i].nonempty, NULL);
    pthread_cond_init(&g_mbox[i].nonfull, NULL);
    g_mbox[i].head = g_mbox[i].count = 0;
  }
}

/* Non-blocking push; 0 if the mailbox is full. */
static int mbox_try_push(mbox_t* m, obj_t o) {
  int ok = 0;
  pthread_mutex_lock(&m->mu);
  if (m->count < MBOX_CAP) {
    m->items[(m->head + m->count) % MBOX_CAP] = o;
    m->count++;
    ok = 1;
    pthread_cond_signal(&m->nonempty);
  }
  pthread_mutex_unlock(&m->mu);
  return ok;
}

static void mbox_push(mbox_t* m, obj_t o) {
  pthread_mutex_lock(&m->mu);
  while (m->count == MBOX_CAP) pthread_cond_wait(&m->nonfull, &m->mu);
  m->items[(m->head + m->count) % MBOX_CAP] = o;
  m->count++;
  pthread_cond_signal(&m->nonempty);
  pthread_mutex_unlock(&m->mu);
}

/* Takes up to max items; blocks for at least one if wait. */
static unsigned mbox_take(mbox_t* m, obj_t* out, unsigned max, int wait) {
  unsigned n = 0;
  pthread_mutex_lock(&m->mu);
  while (wait && m->count == 0) pthread_cond_wait(&m->nonempty, &m->mu);
  while (m->count > 0 && n < max) {
    out[n++] = m->items[m->head];
    m->head = (m->head + 1) % MBOX_CAP;
    m->count--;
  }
  if (n) pthread_cond_broadcast(&m->nonfull);
  pthread_mutex_unlock(&m->mu);
  return n;
}

static void verify_and_free(obj_t o, const char* what) {
  verify(o.p, o.size, o.seed, o.size, what);
  free(o.p);
}

static void drain_mbox(int self) {
  obj_t buf[64];
  unsigned n;
  while ((n = mbox_take(&g_mbox[self], buf, 64, 0)) > 0) {
    for (unsigned i = 0; i < n; i++) verify_and_free(buf[i], "remote free");
    g_tstats[self].received += n;
    g_tstats[self].frees += n;
  }
}

/* ---- allocation through a random entry point ---------------------------- */
enum { K_MALLOC, K_CALLOC, K_REALLOC_NULL, K_MEMALIGN, K_ALIGNED_ALLOC };

static unsigned char* alloc_random(uint64_t* rs, size_t* size_io, int* kind_out) {
  size_t n = *size_io;
  unsigned r = (unsigned)(rnd(rs) % 100);
  unsigned char* p = NULL;
  size_t align = 16;
  int kind;
  if (r < 45) {
    kind = K_MALLOC;
    p = malloc(n);
  } else if (r < 60) {
    kind = K_CALLOC;
    /* nmemb * size split a few ways */
    size_t m = (n % 3 == 0) ? 3 : (n % 2 == 0 ? 2 : 1);
    p = calloc(n / m, m);
    if (p && !check_zero(p, n)) {
      FAILF("    (calloc %zu x %zu)\n", n / m, m);
    }
  } else if (r < 70) {
    kind = K_REALLOC_NULL;
    p = realloc(NULL, n);
  } else if (r < 85) {
    kind = K_MEMALIGN;
    align = (size_t)16 << (rnd(rs) % 9); /* 16..4096 */
    void* q = NULL;
    int rc = posix_memalign(&q, align, n);
    if (rc != 0) {
      FAILF("  posix_memalign(%zu, %zu) = %d\n", align, n, rc);
      q = NULL;
    }
    p = q;
  } else {
    kind = K_ALIGNED_ALLOC;
    align = (size_t)16 << (rnd(rs) % 9);
    n = (n + align - 1) & ~(align - 1); /* C11: size a multiple of align */
    p = aligned_alloc(align, n);
  }
  if (!p) {
    FAILF("  allocation of %zu bytes (kind %d, align %zu) returned NULL\n", n,
          kind, align);
    return NULL;
  }
  if (((uintptr_t)p & (align - 1)) != 0)
    FAILF("  kind %d: %p not aligned to %zu (size %zu)\n", kind, (void*)p, align, n);
  if (malloc_usable_size(p) < n)
    FAILF("  malloc_usable_size(%p) = %zu < %zu\n", (void*)p,
          malloc_usable_size(p), n);
  *size_io = n;
  *kind_out = kind;
  return p;
}

static uint64_t slot_seed(int tid, int slot, uint32_t gen) {
  return mix64(g_seed ^ ((uint64_t)tid << 48) ^ ((uint64_t)slot << 32) ^ gen);
}

/* Puts object p of n bytes in slot s as its next generation, patterned. */
static void slot_set(int tid, int s, slot_t* sl, unsigned char* p, size_t n) {
  sl->gen++;
  sl->o.p = p;
  sl->o.size = n;
  sl->o.seed = slot_seed(tid, s, sl->gen);
  fill(p, n, sl->o.seed);
}

static void slot_alloc(int tid, int s, slot_t* sl, uint64_t* rs) {
  size_t n = rand_size(rs);
  int kind;
  unsigned char* p = alloc_random(rs, &n, &kind);
  if (!p) return;
  slot_set(tid, s, sl, p, n);
  g_tstats[tid].allocs++;
  g_tstats[tid].by_kind[kind]++;
}

static void slot_realloc(int tid, int s, slot_t* sl, uint64_t* rs) {
  size_t old = sl->o.size, n;
  if (rnd(rs) % 2) {
    /* small change: -25% .. +25% */
    size_t d = old / 4 + 1;
    n = old - d + rnd(rs) % (2 * d + 1);
    if (n < 1) n = 1;
  } else {
    n = rand_size(rs);
  }
  if (!verify(sl->o.p, old, sl->o.seed, old, "before realloc")) {
    free(sl->o.p);
    sl->o.p = NULL;
    return;
  }
  unsigned char* q = realloc(sl->o.p, n);
  if (!q) {
    FAILF("  realloc(%p, %zu) returned NULL\n", (void*)sl->o.p, n);
    return; /* old block still valid */
  }
  size_t keep = old < n ? old : n;
  if (!verify(q, old, sl->o.seed, keep, "prefix after realloc"))
    FAILF("    (realloc %zu -> %zu, %p -> %p)\n", old, n, (void*)sl->o.p, (void*)q);
  if (((uintptr_t)q & 15) != 0) FAILF("  realloc returned %p, not 16-aligned\n", (void*)q);
  if (malloc_usable_size(q) < n)
    FAILF("  malloc_usable_size(%p) = %zu < %zu after realloc\n", (void*)q,
          malloc_usable_size(q), n);
  slot_set(tid, s, sl, q, n);
  g_tstats[tid].reallocs++;
}

/* ---- phase: mixed -------------------------------------------------------- */
typedef struct {
  int tid;
  long iters;
  int flush_every;  /* 0: never */
  uint64_t seed;
} mixed_arg_t;

static void* mixed_thread(void* argp) {
  mixed_arg_t* a = argp;
  int self = a->tid;
  uint64_t rs = mix64(a->seed + 0x1000 * (uint64_t)(self + 1)) | 1;
  slot_t* slots = g_slots[self];
  tstats_t* st = &g_tstats[self];

  for (long op = 0; op < a->iters; op++) {
    if ((op & 31) == 0) drain_mbox(self);
    if (a->flush_every && op % a->flush_every == 0) {
      hk_thread_flush();
      st->flushes++;
    }
    int s = (int)(rnd(&rs) % NSLOTS);
    slot_t* sl = &slots[s];
    if (!sl->o.p) {
      slot_alloc(self, s, sl, &rs);
      continue;
    }
    unsigned r = (unsigned)(rnd(&rs) % 100);
    if (r < 35) {
      verify_and_free(sl->o, "local free");
      sl->o.p = NULL;
      st->frees++;
    } else if (r < 60) {
      slot_realloc(self, s, sl, &rs);
    } else if (r < 85 && g_threads > 1) {
      int to = (self + 1 + (int)(rnd(&rs) % (uint64_t)(g_threads - 1))) % g_threads;
      verify(sl->o.p, sl->o.size, sl->o.seed, sl->o.size, "before send");
      if (mbox_try_push(&g_mbox[to], sl->o)) {
        st->sent++;
      } else {
        st->sent_full++;
        verify_and_free(sl->o, "local free (mailbox full)");
        st->frees++;
      }
      sl->o.p = NULL;
    } else {
      verify(sl->o.p, sl->o.size, sl->o.seed, sl->o.size, "in place");
      st->verified++;
    }
  }

  /* Everyone stops sending; then drain what arrived and free the rest. */
  pthread_barrier_wait(&g_barrier);
  drain_mbox(self);
  for (int s = 0; s < NSLOTS; s++) {
    if (slots[s].o.p) {
      verify_and_free(slots[s].o, "final free");
      slots[s].o.p = NULL;
      st->frees++;
    }
  }
  if (a->flush_every) hk_thread_flush();
  return NULL;
}

static void run_mixed(long iters, int flush_every, uint64_t seed) {
  pthread_t th[MAX_THREADS];
  mixed_arg_t args[MAX_THREADS];
  memset(g_tstats, 0, sizeof g_tstats);
  pthread_barrier_init(&g_barrier, NULL, (unsigned)g_threads);
  for (int i = 0; i < g_threads; i++) {
    args[i] = (mixed_arg_t){i, iters, flush_every, seed};
    int rc = pthread_create(&th[i], NULL, mixed_thread, &args[i]);
    if (rc) {
      FAILF("  pthread_create: %d\n", rc);
      /* a missing thread would hang the barrier */
      _exit(2);
    }
  }
  for (int i = 0; i < g_threads; i++) pthread_join(th[i], NULL);
  pthread_barrier_destroy(&g_barrier);
  tstats_t t = {0};
  for (int i = 0; i < g_threads; i++) {
    t.allocs += g_tstats[i].allocs;
    t.frees += g_tstats[i].frees;
    t.reallocs += g_tstats[i].reallocs;
    t.sent += g_tstats[i].sent;
    t.received += g_tstats[i].received;
    t.sent_full += g_tstats[i].sent_full;
    t.flushes += g_tstats[i].flushes;
    for (int k = 0; k < 5; k++) t.by_kind[k] += g_tstats[i].by_kind[k];
  }
  harness_say("  %d threads x %ld ops: %ld allocs (malloc %ld calloc %ld "
              "realloc(NULL) %ld posix_memalign %ld aligned_alloc %ld), %ld reallocs, "
              "%ld frees, %ld cross-thread (%ld sent to full mailbox), %ld flushes\n",
              g_threads, iters, t.allocs, t.by_kind[0], t.by_kind[1], t.by_kind[2],
              t.by_kind[3], t.by_kind[4], t.reallocs, t.frees, t.received,
              t.sent_full, t.flushes);
  if (t.sent != t.received)
    FAILF("  sent %ld objects, received %ld\n", t.sent, t.received);
  if (t.allocs != t.frees)
    FAILF("  allocs %ld != frees %ld (shadow accounting)\n", t.allocs, t.frees);
}

/* ---- phase: one producer, many consumers (remote-free heavy) ------------- */
typedef struct {
  int tid;
  long count;
  uint64_t seed;
} pc_arg_t;

static void* producer_thread(void* argp) {
  pc_arg_t* a = argp;
  uint64_t rs = mix64(a->seed) | 1;
  int consumers = g_threads - 1;
  for (long i = 0; i < a->count; i++) {
    size_t n = rand_small_size(&rs);
    unsigned char* p = (rnd(&rs) % 8 == 0) ? calloc(1, n) : malloc(n);
    if (!p) {
      FAILF("  producer: malloc(%zu) returned NULL\n", n);
      continue;
    }
    obj_t o = {p, n, mix64(a->seed ^ (uint64_t)i)};
    fill(p, n, o.seed);
    mbox_push(&g_mbox[1 + (int)(i % consumers)], o);
    g_tstats[0].sent++;
    /* now and then a local alloc/free too, so the producer's own free path
     * interleaves with remote frees of its blocks */
    if (i % 16 == 0) {
      size_t m = rand_small_size(&rs);
      unsigned char* q = malloc(m);
      if (q) {
        fill(q, m, o.seed + 1);
        verify(q, m, o.seed + 1, m, "producer local");
        free(q);
      }
    }
  }
  for (int c = 1; c <= consumers; c++) mbox_push(&g_mbox[c], (obj_t){NULL, 0, 0});
  return NULL;
}

static void* consumer_thread(void* argp) {
  pc_arg_t* a = argp;
  obj_t buf[64];
  for (;;) {
    unsigned n = mbox_take(&g_mbox[a->tid], buf, 64, 1);
    for (unsigned i = 0; i < n; i++) {
      if (!buf[i].p) {
        /* sentinel: it is the last item this consumer gets */
        if (i + 1 != n) FAILF("  consumer %d: items after sentinel\n", a->tid);
        return NULL;
      }
      verify_and_free(buf[i], "consumer free");
      g_tstats[a->tid].received++;
    }
  }
}

static void run_producer_consumer(long count, uint64_t seed) {
  if (g_threads < 2) return;
  pthread_t th[MAX_THREADS];
  pc_arg_t args[MAX_THREADS];
  memset(g_tstats, 0, sizeof g_tstats);
  for (int i = 1; i < g_threads; i++) {
    args[i] = (pc_arg_t){i, 0, seed};
    pthread_create(&th[i], NULL, consumer_thread, &args[i]);
  }
  args[0] = (pc_arg_t){0, count, seed};
  pthread_create(&th[0], NULL, producer_thread, &args[0]);
  for (int i = 0; i < g_threads; i++) pthread_join(th[i], NULL);
  long recv = 0;
  for (int i = 1; i < g_threads; i++) recv += g_tstats[i].received;
  harness_say("  1 producer, %d consumers: %ld objects freed remotely\n",
              g_threads - 1, recv);
  if (recv != g_tstats[0].sent)
    FAILF("  produced %ld, consumed %ld\n", g_tstats[0].sent, recv);
}

/* ---- stats ---------------------------------------------------------------- */
static int64_t live_bytes_sum(void) {
  hk_stats_t s;
  if (hk_stats_get(&s) != 0) return -1;
  uint64_t sum = 0;
  for (unsigned c = 0; c < HK_NUM_CLASSES; c++) sum += s.cls[c].live_bytes;
  return (int64_t)sum;
}

static int64_t g_live_start;
static hk_stats_t g_stats_start;

/* ---- tests ---------------------------------------------------------------- */
static void* idle_thread(void* arg) { return arg; }

TEST(stats_start) {
  /* glibc keeps the stacks of exited threads for reuse (up to 40 MiB), each
   * with its thread's TLS vector, a block it allocated with calloc; blocks
   * that stay live past the threads' end, which the allocator rightly
   * counts. Filling that cache first (more threads at once than the tests
   * run) makes them part of the starting figure, so the end can be exact. */
  pthread_t th[2 * MAX_THREADS];
  int n = 2 * MAX_THREADS;
  for (int i = 0; i < n; i++) REQUIRE(pthread_create(&th[i], NULL, idle_thread, NULL) == 0);
  for (int i = 0; i < n; i++) pthread_join(th[i], NULL);
  hk_stats_t s;
  CHECK_EQ(hk_stats_get(&s), 0);
  CHECK_EQ(s.struct_size, sizeof(hk_stats_t));
  CHECK_EQ(s.num_classes, HK_NUM_CLASSES);
  g_live_start = live_bytes_sum();
  CHECK(g_live_start >= 0);
  CHECK_EQ(hk_stats_get(&g_stats_start), 0);
  harness_say("  live_bytes at start: %lld\n", (long long)g_live_start);
}

TEST(mixed) {
  long before = atomic_load(&g_errors);
  run_mixed(g_iters, 0, g_seed);
  CHECK_EQ(atomic_load(&g_errors) - before, 0);
}

TEST(remote_free_heavy) {
  long before = atomic_load(&g_errors);
  long count = g_iters * 2 < 1000 ? 1000 : g_iters * 2;
  run_producer_consumer(count, g_seed ^ 0xC0FFEE);
  CHECK_EQ(atomic_load(&g_errors) - before, 0);
}

TEST(mixed_with_flush) {
  long before = atomic_load(&g_errors);
  run_mixed(g_iters / 2 > 0 ? g_iters / 2 : 1, 61, g_seed ^ 0xF1005);
  hk_thread_flush();
  CHECK_EQ(atomic_load(&g_errors) - before, 0);
}

/* Switches between the default policy and extreme ones until told to stop. */
static atomic_int g_policy_stop;
static atomic_long g_policy_sets;

static void* policy_thread(void* arg) {
  static hk_policy_t def, small, zero;
  hk_policy_get(&def);
  small = def;
  zero = def;
  for (unsigned c = 1; c < HK_NUM_CLASSES; c++) {
    small.tcache_cap[c] = 2;
    small.tcache_batch[c] = 1;
    small.warm_slabs[c] = 0;
    zero.tcache_cap[c] = 0; /* every call goes to the central lists */
    zero.tcache_batch[c] = 1;
  }
  small.drain_ms = 1;
  zero.drain_ms = 0;
  const hk_policy_t* seq[] = {&small, &def, &zero, &def};
  unsigned i = 0;
  while (!atomic_load(&g_policy_stop)) {
    if (hk_policy_set(seq[i++ % 4]) == 0) {
      FAILF("  hk_policy_set rejected policy %u\n", (i - 1) % 4);
      break;
    }
    atomic_fetch_add(&g_policy_sets, 1);
    struct timespec ts = {0, 2000000};
    nanosleep(&ts, NULL);
  }
  if (hk_policy_set(&def) == 0) FAILF("  could not restore the default policy\n");
  return NULL;
}

TEST(mixed_with_policy_changes) {
  long before = atomic_load(&g_errors);
  pthread_t pt;
  atomic_store(&g_policy_stop, 0);
  REQUIRE(pthread_create(&pt, NULL, policy_thread, NULL) == 0);
  run_mixed(g_iters / 2 > 0 ? g_iters / 2 : 1, 0, g_seed ^ 0x9011C7);
  run_producer_consumer(g_iters / 2 < 1000 ? 1000 : g_iters / 2, g_seed ^ 0x9011C8);
  atomic_store(&g_policy_stop, 1);
  pthread_join(pt, NULL);
  harness_say("  %ld policies installed meanwhile\n", atomic_load(&g_policy_sets));
  CHECK(atomic_load(&g_policy_sets) > 0);
  CHECK_EQ(atomic_load(&g_errors) - before, 0);
}

/* A single thread that only allocates then flushes; another frees it all
 * after the first one has exited (frees into an orphaned thread's slabs). */
#define ORPHAN_N 4096
static obj_t g_orphans[ORPHAN_N];

static void* orphan_maker(void* arg) {
  uint64_t rs = mix64(g_seed ^ 0x0b0e) | 1;
  for (int i = 0; i < ORPHAN_N; i++) {
    size_t n = rand_small_size(&rs);
    unsigned char* p = malloc(n);
    if (!p) {
      FAILF("  orphan_maker: malloc(%zu) = NULL\n", n);
      g_orphans[i].p = NULL;
      continue;
    }
    g_orphans[i] = (obj_t){p, n, mix64(g_seed + (uint64_t)i * 7)};
    fill(p, n, g_orphans[i].seed);
    if (i % 3 == 0) free(malloc(n)); /* leave some blocks in the cache */
  }
  if (arg) hk_thread_flush();
  return NULL;
}

static void* orphan_freer(void* arg) {
  for (int i = 0; i < ORPHAN_N; i++)
    if (g_orphans[i].p) verify_and_free(g_orphans[i], "orphan free");
  return NULL;
}

TEST(free_after_owner_exit) {
  long before = atomic_load(&g_errors);
  for (int round = 0; round < 2; round++) {
    pthread_t a, b;
    REQUIRE(pthread_create(&a, NULL, orphan_maker, round ? (void*)1 : NULL) == 0);
    pthread_join(a, NULL);
    REQUIRE(pthread_create(&b, NULL, orphan_freer, NULL) == 0);
    pthread_join(b, NULL);
  }
  CHECK_EQ(atomic_load(&g_errors) - before, 0);
}

TEST(stats_end) {
  hk_thread_flush();
  hk_stats_t s;
  CHECK_EQ(hk_stats_get(&s), 0);
  int64_t end = live_bytes_sum();
  int64_t d = end - g_live_start;
  uint64_t cached = 0;
  for (unsigned c = 0; c < HK_NUM_CLASSES; c++) cached += s.cls[c].cached_bytes;
  harness_say("  live_bytes at end: %lld (delta %lld), cached_bytes %llu, "
              "threads %llu, threads_total %llu, committed %llu, huge_allocs %llu\n",
              (long long)end, (long long)d, (unsigned long long)cached,
              (unsigned long long)s.threads, (unsigned long long)s.threads_total,
              (unsigned long long)s.committed_bytes,
              (unsigned long long)s.huge_allocs);
  /* Every thread but this one has been joined (its counters folded in,
   * its cache drained) and every block freed, and this thread flushed its
   * cache: the counters are exact, and nothing is live or cached that was
   * not at the start. */
  for (unsigned c = 0; c < HK_NUM_CLASSES; c++)
    if (s.cls[c].live_bytes != g_stats_start.cls[c].live_bytes)
      harness_say("  class %u (%llu B): live bytes %llu at start, %llu at end\n", c,
                  (unsigned long long)s.cls[c].size, (unsigned long long)g_stats_start.cls[c].live_bytes,
                  (unsigned long long)s.cls[c].live_bytes);
  CHECK_EQ(d, 0);
  CHECK_EQ(cached, 0);
  CHECK_EQ(s.threads, 1);
  CHECK(s.threads_total >= (uint64_t)g_threads);
  for (unsigned c = 1; c < HK_NUM_CLASSES; c++) {
    const hk_class_stats_t* k = &s.cls[c];
    /* blocks out of slabs = live + cached (stats.c), and nothing is cached */
    CHECK_EQ(k->refill_blocks - k->drain_blocks - k->lost_blocks, k->live_bytes / k->size);
    CHECK_EQ(k->frees, k->allocs - k->live_bytes / k->size);
    CHECK_EQ(k->hits, k->allocs - k->refills);
    if (k->refill_blocks) CHECK(k->refills > 0);
    if (k->drain_blocks) CHECK(k->drains > 0);
    CHECK(k->drain_blocks <= k->drains * 4096);   /* a drain moves at most a cache: cap <= 4096 */
    CHECK(k->refill_blocks <= k->refills * 1024);  /* a refill takes at most a batch */
  }
}

static void usage_exit(void) {
  harness_say("usage: test_stress [threads(2..%d) [iterations [seed]]]\n", MAX_THREADS);
  _exit(2);
}

int main(int argc, char** argv) {
  if (argc > 1) {
    g_threads = atoi(argv[1]);
    if (g_threads < 2 || g_threads > MAX_THREADS) usage_exit();
  }
  if (argc > 2) {
    g_iters = atol(argv[2]);
    if (g_iters < 1) usage_exit();
  }
  if (argc > 3) g_seed = strtoull(argv[3], NULL, 0);
  const char* sc = getenv("STRESS_SCALE");
  if (sc && *sc) {
    double f = strtod(sc, NULL);
    if (f > 0) g_iters = (long)((double)g_iters * f);
    if (g_iters < 100) g_iters = 100;
  }
  harness_say("test_stress: %d threads, %ld iterations, seed 0x%llx\n", g_threads,
              g_iters, (unsigned long long)g_seed);
  mbox_init_all();

  RUN(stats_start);
  RUN(mixed);
  RUN(remote_free_heavy);
  RUN(mixed_with_flush);
  RUN(free_after_owner_exit);
  RUN(mixed_with_policy_changes);
  RUN(stats_end);
  if (atomic_load(&g_errors) > 20)
    harness_say("  (%ld errors in all, first 20 shown)\n", atomic_load(&g_errors));
  return harness_done();
}
