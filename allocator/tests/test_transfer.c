/* test_transfer.c — the transfer cache (slab.c "transfer"): a drained chain
 * of at most a batch is parked whole and the next refill of any thread takes
 * it whole; parked blocks go back to their slabs at the decay pass and at
 * malloc_trim, so they never pin memory for long. */
#define _GNU_SOURCE
#include <malloc.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "hakmem.h"
#include "harness.h"
#include "testutil.h"

enum { SIZE = 96, CAP = 16, BATCH = 8, N = 64 };

static unsigned cls;
static void* blocks[N];

static void set_policy(uint32_t warm, uint32_t drain_ms) {
  hk_policy_t p;
  hk_policy_get(&p);
  p.tcache_cap[cls] = CAP;
  p.tcache_batch[cls] = BATCH;
  p.warm_slabs[cls] = warm;
  p.drain_ms = drain_ms;
  REQUIRE(hk_policy_set(&p) != 0);
  free(malloc(SIZE));   /* a slow path: this thread takes the policy up */
  hk_thread_flush();
}

static void* free_all(void* arg) {
  for (int i = 0; i < N; i++) free(blocks[i]);
  return arg;
}

static hk_stats_t first_refill;

static void* allocate_one(void* arg) {
  hk_stats_t a;
  hk_stats_get(&a);
  void* p = malloc(SIZE);
  hk_stats_get(&first_refill);
  first_refill.cls[cls].refills -= a.cls[cls].refills;
  first_refill.cls[cls].refill_blocks -= a.cls[cls].refill_blocks;
  free(p);
  hk_thread_flush();
  return arg;
}

/* Another thread frees N blocks this thread allocated: its drains park
 * chains of BATCH. A new thread's first refill, which on its slow start
 * would take 4 blocks from the slabs, takes a parked chain of BATCH. */
static void park_chains(void);
static uint64_t new_threads_first_refill(void);
TEST(a_drained_chain_feeds_another_threads_refill_whole) {
  set_policy(4, 0);
  for (int i = 0; i < N; i++) {
    blocks[i] = malloc(SIZE);
    memset(blocks[i], i, SIZE);
  }
  hk_stats_t a, b;
  hk_stats_get(&a);
  pthread_t t;
  REQUIRE(pthread_create(&t, NULL, free_all, NULL) == 0);
  pthread_join(t, NULL);
  hk_stats_get(&b);
  harness_say("  freer: %llu drains of %llu blocks, %llu remote\n",
              (unsigned long long)(b.cls[cls].drains - a.cls[cls].drains),
              (unsigned long long)(b.cls[cls].drain_blocks - a.cls[cls].drain_blocks),
              (unsigned long long)(b.cls[cls].remote_frees - a.cls[cls].remote_frees));
  CHECK(b.cls[cls].drain_blocks - a.cls[cls].drain_blocks == N);
  /* Every block came from a slab this thread refilled from: all remote. */
  CHECK_EQ(b.cls[cls].remote_frees - a.cls[cls].remote_frees, N);
  REQUIRE(pthread_create(&t, NULL, allocate_one, NULL) == 0);
  pthread_join(t, NULL);
  harness_say("  new thread's first refill: %llu refill(s) of %llu blocks\n",
              (unsigned long long)first_refill.cls[cls].refills,
              (unsigned long long)first_refill.cls[cls].refill_blocks);
  CHECK_EQ(first_refill.cls[cls].refills, 1);
  CHECK_EQ(first_refill.cls[cls].refill_blocks, BATCH);
  malloc_trim(0);
}

/* Parks chains the way the first test does (another thread frees N blocks
 * this one allocated). */
static void park_chains(void) {
  for (int i = 0; i < N; i++) {
    blocks[i] = malloc(SIZE);
    memset(blocks[i], i, SIZE);
  }
  pthread_t t;
  REQUIRE(pthread_create(&t, NULL, free_all, NULL) == 0);
  pthread_join(t, NULL);
}

/* A new thread's first refill: BATCH blocks from a parked chain, or its
 * slow start's 4 from the slabs when nothing is parked. */
static uint64_t new_threads_first_refill(void) {
  pthread_t t;
  if (pthread_create(&t, NULL, allocate_one, NULL) != 0) {
    FAILF("  pthread_create failed\n");
    return 0;
  }
  pthread_join(t, NULL);
  return first_refill.cls[cls].refill_blocks;
}

/* malloc_trim hands parked chains back to their slabs (where a slab they
 * emptied can go back to the OS). */
TEST(malloc_trim_returns_parked_chains_to_their_slabs) {
  set_policy(0, 0);
  park_chains();
  malloc_trim(0);
  uint64_t got = new_threads_first_refill();
  harness_say("  after malloc_trim, a new thread's first refill takes %llu blocks\n",
              (unsigned long long)got);
  CHECK_EQ(got, 4);
}

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* The decay pass (once per drain interval) does the same by itself, run by
 * whichever thread's slow path notices the interval. */
TEST(the_decay_pass_returns_parked_chains) {
  set_policy(0, 30);
  malloc_trim(0);
  park_chains();
  for (int t = 0; t < 6; t++) {   /* another class keeps the slow paths going */
    sleep_ms(40);
    static void* q[600];
    for (int i = 0; i < 600; i++) q[i] = malloc(3000);
    for (int i = 0; i < 600; i++) free(q[i]);
  }
  uint64_t got = new_threads_first_refill();
  harness_say("  after idle intervals, a new thread's first refill takes %llu blocks\n",
              (unsigned long long)got);
  CHECK_EQ(got, 4);
  set_policy(0, 0);
}

int main(void) {
  hang_alarm(under_valgrind() ? 600 : 60, "test_transfer: hung\n");
  cls = hk_size_class(SIZE);
  RUN(a_drained_chain_feeds_another_threads_refill_whole);
  RUN(malloc_trim_returns_parked_chains_to_their_slabs);
  RUN(the_decay_pass_returns_parked_chains);
  return harness_done();
}
