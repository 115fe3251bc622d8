/* test_checkin.c — every thread checks in (alloc.c "check-in"): a thread
 * whose cache serves every call still takes up a new policy, a malloc_trim
 * and the drain interval, and its allocation counts stay exact.
 *
 * Each worker below warms a class, then allocates and frees one 64-byte
 * block in a loop: after the first call every call is a cache hit, so only
 * the countdown can bring it to a slow path. LOOP is more than the longest
 * countdown (CHECKIN_MAX_BLOCKS + 1 = 32769 allocations of one class). */
#define _GNU_SOURCE
#include <limits.h>
#include <malloc.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "hakmem.h"
#include "harness.h"
#include "testutil.h"
/* White-box for one thing: whether a thread's free is still trapped
 * (thread.c "reaching every thread"), which no counter shows. */
#include "../src/types.h"
extern __thread hk_tcache_t _hk_tc __attribute__((tls_model("initial-exec")));

#define LOOP 40000
#define PARK 300

static unsigned cls_of(size_t n) { return hk_size_class(n); }

static uint64_t cached_blocks(unsigned cls) {
  hk_stats_t st;
  hk_stats_get(&st);
  return st.cls[cls].cached_bytes / st.cls[cls].size;
}

static void hot_loop(size_t size, long n) {
  for (long i = 0; i < n; i++) {
    void* volatile p = malloc(size);
    free(p);
  }
}

/* A worker that parks PARK blocks of `park_size`, then waits for `go` to
 * reach its step before the hot loop. */
typedef struct {
  size_t park_size;
  atomic_int step;       /* 1: parked; 2: go; 3: loop done */
  double idle_s;         /* extra sleep after go, before the loop */
  double loop_s;         /* run the hot loop at least this long (0: loop_n calls) */
  long loop_n;           /* calls in the hot loop (0: LOOP) */
  int trapped_after;     /* after the loop: its 64-byte bin's free still trapped */
} worker_t;

static void wait_step(atomic_int* s, int want) {
  while (atomic_load(s) < want) sched_yield();
}

static void* worker(void* arg) {
  worker_t* w = arg;
  void* v[PARK];
  for (int i = 0; i < PARK; i++) v[i] = malloc(w->park_size);
  for (int i = 0; i < PARK; i++) free(v[i]);
  hot_loop(64, 10);           /* the 64-byte class has a block cached */
  hk_stats_t st;
  hk_stats_get(&st);          /* publishes this thread's cache counts */
  atomic_store(&w->step, 1);
  wait_step(&w->step, 2);
  if (w->idle_s > 0) {
    struct timespec ts = {0, (long)(w->idle_s * 1e9)};
    nanosleep(&ts, NULL);
  }
  if (w->loop_s > 0) {
    double end = now_s() + w->loop_s;
    while (now_s() < end) hot_loop(64, 1000);
  } else {
    hot_loop(64, w->loop_n ? w->loop_n : LOOP);
  }
  hk_stats_get(&st);          /* publishes this thread's cache counts */
  w->trapped_after = _hk_tc.bin[cls_of(64)].limit == 0;
  atomic_store(&w->step, 3);
  wait_step(&w->step, 4);     /* stay alive: its records stay in the registry */
  return NULL;
}

static void run_worker(worker_t* w, pthread_t* t) {
  atomic_store(&w->step, 0);
  if (pthread_create(t, NULL, worker, w) != 0) { harness_say("pthread_create failed\n"); _exit(1); }
  wait_step(&w->step, 1);
}

/* A worker parks PARK 64-byte blocks, the capacity drops to 4, and the
 * worker then makes loop_n malloc+free calls (0: LOOP). */
static void lower_capacity_then(long loop_n) {
  hk_policy_t saved, p;
  hk_policy_get(&saved);
  unsigned c = cls_of(64);
  worker_t w = {.park_size = 64, .loop_n = loop_n};
  pthread_t t;
  run_worker(&w, &t);
  REQUIRE(cached_blocks(c) >= PARK - 1);
  p = saved;
  p.tcache_cap[c] = 4;
  p.tcache_batch[c] = 2;
  REQUIRE(hk_policy_set(&p) != 0);
  atomic_store(&w.step, 2);
  wait_step(&w.step, 3);
  CHECK(cached_blocks(c) <= 4);
  CHECK_EQ(w.trapped_after, 0);   /* its frees are back on the fast path */
  atomic_store(&w.step, 4);
  pthread_join(t, NULL);
  hk_policy_set(&saved);
}

/* Past the countdown, even a worker that never left its fast path until
 * then keeps no more than the new capacity. */
TEST(a_lowered_capacity_reaches_a_thread_that_only_hits) { lower_capacity_then(0); }

/* thread.c "reaching every thread": a thread that wakes for a call or two
 * takes a new policy at its first free, not after 512 or more allocations
 * of a class. */
TEST(a_new_policy_reaches_a_thread_at_its_next_free) { lower_capacity_then(1); }

/* A thread whose first allocation comes from another key's destructor on
 * pthread's last round never runs the exit hook: its record stays in the
 * registry, pointing at TLS that is gone. Here that TLS sits in a stack
 * the test owns and unmaps after the join, so a trap written there faults. */
static pthread_key_t late_key;
static atomic_int late_rounds;

static void late_destructor(void* v) {
  if (atomic_fetch_add(&late_rounds, 1) + 1 < PTHREAD_DESTRUCTOR_ITERATIONS) {
    pthread_setspecific(late_key, v);   /* one more round */
    return;
  }
  void* volatile p = malloc(64);       /* the thread's first allocation */
  free(p);
}

static void* late_thread(void* arg) {
  pthread_setspecific(late_key, arg);  /* no allocation before the destructors */
  return NULL;
}

TEST(a_trap_never_writes_a_thread_gone_without_its_exit_hook) {
  REQUIRE(pthread_key_create(&late_key, late_destructor) == 0);
  size_t len = 1u << 20;
  void* stack = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  REQUIRE(stack != MAP_FAILED);
  pthread_attr_t a;
  pthread_attr_init(&a);
  REQUIRE(pthread_attr_setstack(&a, stack, len) == 0);
  hk_stats_t s0, s1;
  hk_stats_get(&s0);
  pthread_t t;
  REQUIRE(pthread_create(&t, &a, late_thread, (void*)1) == 0);
  pthread_join(t, NULL);
  pthread_attr_destroy(&a);
  REQUIRE(atomic_load(&late_rounds) == PTHREAD_DESTRUCTOR_ITERATIONS);
  munmap(stack, len);                  /* its TLS with it */
  /* No stats call before the trap: one would sweep the record away. */
  hk_policy_t p;
  hk_policy_get(&p);
  REQUIRE(hk_policy_set(&p) != 0);     /* traps every live thread */
  malloc_trim(0);                      /* and so does this */
  hk_stats_get(&s1);
  CHECK_EQ(s1.threads_total, s0.threads_total + 1);   /* it had a cache, and a record */
  pthread_key_delete(late_key);
}

TEST(malloc_trim_reaches_an_idle_thread_at_its_next_free) {
  unsigned c = cls_of(128);
  worker_t w = {.park_size = 128, .loop_n = 1};
  pthread_t t;
  run_worker(&w, &t);
  CHECK(cached_blocks(c) >= PARK - 1);
  malloc_trim(0);
  atomic_store(&w.step, 2);   /* one 64-byte malloc and free */
  wait_step(&w.step, 3);
  CHECK_EQ(cached_blocks(c), 0);
  CHECK_EQ(w.trapped_after, 0);
  atomic_store(&w.step, 4);
  pthread_join(t, NULL);
}

TEST(malloc_trim_reaches_an_idle_thread_when_it_allocates_again) {
  unsigned c = cls_of(128);
  worker_t w = {.park_size = 128};
  pthread_t t;
  run_worker(&w, &t);
  CHECK(cached_blocks(c) >= PARK - 1);
  malloc_trim(0);
  /* The documented exception: a thread that does not allocate keeps its
   * cache until it does (no thread touches another's cache). */
  CHECK(cached_blocks(c) >= PARK - 1);
  atomic_store(&w.step, 2);   /* it allocates 64-byte blocks only */
  wait_step(&w.step, 3);
  CHECK_EQ(cached_blocks(c), 0);
  atomic_store(&w.step, 4);
  pthread_join(t, NULL);
}

TEST(the_drain_interval_reaches_a_thread_that_slept) {
  hk_policy_t saved, p;
  hk_policy_get(&saved);
  p = saved;
  p.drain_ms = 20;
  REQUIRE(hk_policy_set(&p) != 0);
  unsigned c = cls_of(192);
  /* Sleeps three intervals, then allocates for ten more: its 192-byte
   * blocks were not used in a whole interval, so they go back. (Sizes whose default capacity holds PARK blocks.) */
  worker_t w = {.park_size = 192, .idle_s = 0.06, .loop_s = 0.2};
  pthread_t t;
  run_worker(&w, &t);
  CHECK(cached_blocks(c) >= PARK - 1);
  atomic_store(&w.step, 2);
  wait_step(&w.step, 3);
  CHECK_EQ(cached_blocks(c), 0);
  atomic_store(&w.step, 4);
  pthread_join(t, NULL);
  hk_policy_set(&saved);
}

/* The countdown replaced the allocation counter: counts must stay exact
 * through check-ins, through the aligned path (which asks a due bin twice)
 * and after the thread ends. */
TEST(allocation_counts_stay_exact) {
  unsigned c = cls_of(64);
  hk_stats_t a, b;
  hk_stats_get(&a);
  hot_loop(64, 3 * LOOP + 7);
  hk_stats_get(&b);
  CHECK_EQ(b.cls[c].allocs - a.cls[c].allocs, 3 * LOOP + 7);
  CHECK_EQ(b.cls[c].frees - a.cls[c].frees, 3 * LOOP + 7);
  CHECK_EQ(b.cls[c].hits, b.cls[c].allocs - b.cls[c].refills);

  hk_stats_get(&a);
  for (long i = 0; i < 2 * LOOP + 3; i++) {
    void* p = NULL;
    REQUIRE(posix_memalign(&p, 64, 64) == 0);
    REQUIRE(((uintptr_t)p & 63) == 0);
    free(p);
  }
  hk_stats_get(&b);
  CHECK_EQ(b.cls[c].allocs - a.cls[c].allocs, 2 * LOOP + 3);

  hk_stats_get(&a);
  worker_t w = {.park_size = 64};
  pthread_t t;
  run_worker(&w, &t);
  atomic_store(&w.step, 2);
  wait_step(&w.step, 3);
  atomic_store(&w.step, 4);
  pthread_join(t, NULL);
  hk_stats_get(&b);
  /* PARK parked, 10 warming, LOOP in the loop; all freed. */
  CHECK_EQ(b.cls[c].allocs - a.cls[c].allocs, PARK + 10 + LOOP);
  CHECK_EQ(b.cls[c].frees - a.cls[c].frees, PARK + 10 + LOOP);
}

/* The countdown is drawn in 0.5..1.5 MiB of the class's blocks: 8192 to
 * 24576 64-byte allocations between check-ins (the `checkins` counter). */
TEST(checkins_come_within_the_drawn_bounds) {
  unsigned c = cls_of(64);
  hk_stats_t a, b;
  hot_loop(64, 1);
  hk_stats_get(&a);
  const long n = 1000000;
  hot_loop(64, n);
  hk_stats_get(&b);
  uint64_t k = b.cls[c].checkins - a.cls[c].checkins;
  harness_say("  %llu check-ins in %ld allocations\n", (unsigned long long)k, n);
  CHECK(k >= n / 24577);
  CHECK(k <= n / 8193 + 1);
}

int main(void) {
  hang_alarm(under_valgrind() ? 600 : 60, "test_checkin: hung\n");
  RUN(a_lowered_capacity_reaches_a_thread_that_only_hits);
  RUN(a_new_policy_reaches_a_thread_at_its_next_free);
  RUN(malloc_trim_reaches_an_idle_thread_at_its_next_free);
  RUN(a_trap_never_writes_a_thread_gone_without_its_exit_hook);
  RUN(malloc_trim_reaches_an_idle_thread_when_it_allocates_again);
  RUN(the_drain_interval_reaches_a_thread_that_slept);
  RUN(allocation_counts_stay_exact);
  RUN(checkins_come_within_the_drawn_bounds);
  return harness_done();
}
