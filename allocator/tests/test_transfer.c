/* test_transfer.c — blocks freed by another thread (slab.c "ownership"): a
 * drain sends each block of a slab another thread owns to that thread's
 * inbox, a chain per owner, and the owner's next refill takes a chain
 * whole; chains waiting in an inbox go back to their slabs at malloc_trim
 * and at the decay pass, also while another thread still frees into them,
 * so they never pin memory for long; and a thread
 * that ends hands its slabs to their class, whose blocks then come back
 * under the class lock, also while another thread takes those slabs over. */
#define _GNU_SOURCE
#include <malloc.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "hakmem.h"
#include "harness.h"
#include "testutil.h"

enum { SIZE = 96, CAP = 16, BATCH = 8, N = 64, MANY = 4096 };

static unsigned cls;
static void* blocks[MANY];

static void set_policy_cap(uint32_t cap, uint32_t batch, uint32_t warm, uint32_t drain_ms) {
  hk_policy_t p;
  hk_policy_get(&p);
  p.tcache_cap[cls] = cap;
  p.tcache_batch[cls] = batch;
  p.warm_slabs[cls] = warm;
  p.drain_ms = drain_ms;
  REQUIRE(hk_policy_set(&p) != 0);
  free(malloc(SIZE));   /* a slow path: this thread takes the policy up */
  hk_thread_flush();
}

static void set_policy(uint32_t warm, uint32_t drain_ms) { set_policy_cap(CAP, BATCH, warm, drain_ms); }

static int nfree;

static void* free_all(void* arg) {
  for (int i = 0; i < nfree; i++) free(blocks[i]);
  return arg;
}

static void* alloc_all(void* arg) {
  for (int i = 0; i < nfree; i++) {
    blocks[i] = malloc(SIZE);
    memset(blocks[i], i, SIZE);
  }
  return arg;
}

static void in_thread(void* (*fn)(void*), int n) {
  nfree = n;
  pthread_t t;
  REQUIRE(pthread_create(&t, NULL, fn, NULL) == 0);
  pthread_join(t, NULL);
}

/* This thread allocates n blocks, leaves its cache empty, and another
 * thread frees them all. */
static void freed_by_another(int n) {
  nfree = n;
  alloc_all(NULL);
  hk_thread_flush();
  in_thread(free_all, n);
}

/* Another thread frees N blocks this one allocated: every one is a remote
 * free, sent in chains of BATCH (and, at that thread's end, one of the CAP
 * its cache still held). This thread's next refill, whose slow start
 * would take 4 blocks from a slab, takes that last chain whole. */
TEST(a_drained_chain_goes_to_its_owner_and_feeds_its_refill_whole) {
  set_policy(4, 0);
  hk_stats_t a, b, c;
  hk_stats_get(&a);
  freed_by_another(N);
  hk_stats_get(&b);
  harness_say("  freer: %llu drains of %llu blocks, %llu remote\n",
              (unsigned long long)(b.cls[cls].drains - a.cls[cls].drains),
              (unsigned long long)(b.cls[cls].drain_blocks - a.cls[cls].drain_blocks),
              (unsigned long long)(b.cls[cls].remote_frees - a.cls[cls].remote_frees));
  CHECK_EQ(b.cls[cls].remote_frees - a.cls[cls].remote_frees, N);
  CHECK_EQ(b.cls[cls].live_bytes, a.cls[cls].live_bytes);
  void* p = malloc(SIZE);
  hk_stats_get(&c);
  harness_say("  owner's next refill: %llu refill(s) of %llu blocks\n",
              (unsigned long long)(c.cls[cls].refills - b.cls[cls].refills),
              (unsigned long long)(c.cls[cls].refill_blocks - b.cls[cls].refill_blocks));
  CHECK_EQ(c.cls[cls].refills - b.cls[cls].refills, 1);
  CHECK_EQ(c.cls[cls].refill_blocks - b.cls[cls].refill_blocks, CAP);
  free(p);
  malloc_trim(0);
}

/* Chains waiting in this thread's inbox hold MANY blocks out of their
 * slabs, which therefore cannot empty; malloc_trim gives them back, and
 * with no warm pool every slab but the one a class keeps goes to the OS. */
TEST(malloc_trim_gives_an_inbox_back_to_its_slabs) {
  set_policy(0, 0);
  malloc_trim(0);
  hk_stats_t a, b, c;
  hk_stats_get(&a);
  freed_by_another(MANY);
  hk_stats_get(&b);
  malloc_trim(0);
  hk_stats_get(&c);
  uint64_t waiting = b.cls[cls].slabs_to_os - a.cls[cls].slabs_to_os;
  uint64_t trimmed = c.cls[cls].slabs_to_os - b.cls[cls].slabs_to_os;
  harness_say("  slabs to the OS: %llu while the inbox held the blocks, %llu at malloc_trim\n",
              (unsigned long long)waiting, (unsigned long long)trimmed);
  CHECK_EQ(waiting, 0);
  CHECK(trimmed >= 4);
}

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* The decay pass does the same for a class this thread left idle, run by
 * its own slow paths in another class. */
TEST(the_idle_pass_gives_an_inbox_back) {
  set_policy(0, 30);
  malloc_trim(0);
  hk_stats_t a, b;
  hk_stats_get(&a);
  freed_by_another(MANY);
  for (int t = 0; t < 6; t++) {   /* another class keeps the slow paths going */
    sleep_ms(40);
    static void* q[600];
    for (int i = 0; i < 600; i++) q[i] = malloc(3000);
    for (int i = 0; i < 600; i++) free(q[i]);
  }
  hk_stats_get(&b);
  uint64_t back = b.cls[cls].slabs_to_os - a.cls[cls].slabs_to_os;
  harness_say("  after idle intervals, %llu slabs went to the OS\n", (unsigned long long)back);
  CHECK(back >= 4);
  set_policy(0, 0);
}

/* The pass of a thread that goes on allocating in other classes gives back
 * the inbox of a class it left idle at every interval, also while another
 * thread still frees into it: the slabs empty as the frees arrive. The
 * pass over idle owners (slab.c) waits for an inbox to stay unchanged a
 * whole interval, which a steady freer never lets happen, so only the
 * owner's own pass does this. The freer frees a slice every 3 ms (a tenth
 * of the interval); the count is taken before its last slice. */
static _Atomic int slices_done, may_end;
enum { SLICES = 64, SLICE = MANY / SLICES };

static void* free_in_slices(void* arg) {
  for (int s = 0; s < SLICES - 1; s++) {
    for (int i = s * SLICE; i < (s + 1) * SLICE; i++) free(blocks[i]);
    atomic_store(&slices_done, s + 1);
    sleep_ms(3);
  }
  while (!atomic_load(&may_end)) sleep_ms(1);
  for (int i = (SLICES - 1) * SLICE; i < MANY; i++) free(blocks[i]);
  return arg;
}

TEST(an_inbox_still_filling_goes_back_while_its_owner_works_elsewhere) {
  set_policy(0, 30);
  malloc_trim(0);
  nfree = MANY;
  alloc_all(NULL);
  hk_thread_flush();
  atomic_store(&slices_done, 0);
  atomic_store(&may_end, 0);
  hk_stats_t a, b;
  hk_stats_get(&a);
  pthread_t t;
  REQUIRE(pthread_create(&t, NULL, free_in_slices, NULL) == 0);
  static void* q[200];
  while (atomic_load(&slices_done) < SLICES - 1) {   /* another class keeps the slow paths going */
    for (int i = 0; i < 200; i++) q[i] = malloc(3000);
    for (int i = 0; i < 200; i++) free(q[i]);
    sleep_ms(2);
  }
  hk_stats_get(&b);
  atomic_store(&may_end, 1);
  pthread_join(t, NULL);
  uint64_t back = b.cls[cls].slabs_to_os - a.cls[cls].slabs_to_os;
  harness_say("  %d of %d slices freed: %llu slabs went to the OS meanwhile\n", SLICES - 1, SLICES,
              (unsigned long long)back);
  CHECK(back >= 3);
  set_policy(0, 0);
}

/* A thread allocates MANY blocks and ends without freeing them: its slabs
 * go to the class, and this thread's frees return them there, not to an
 * inbox nobody reads: the emptied slabs go to the OS. Each free is still a
 * remote one: another thread allocated the block. */
TEST(an_ended_threads_slabs_go_to_their_class) {
  set_policy(0, 0);
  malloc_trim(0);
  hk_stats_t a, b;
  hk_stats_get(&a);
  in_thread(alloc_all, MANY);
  for (int i = 0; i < MANY; i++) free(blocks[i]);
  hk_thread_flush();
  hk_stats_get(&b);
  uint64_t remote = b.cls[cls].remote_frees - a.cls[cls].remote_frees;
  uint64_t back = b.cls[cls].slabs_to_os - a.cls[cls].slabs_to_os;
  harness_say("  %llu remote frees, %llu slabs to the OS\n", (unsigned long long)remote,
              (unsigned long long)back);
  CHECK_EQ(remote, MANY);
  CHECK(back >= 4);
  CHECK_EQ(b.cls[cls].live_bytes, a.cls[cls].live_bytes);
}

/* Slabs change hands while blocks of theirs are on their way back: a
 * thread ends with every block it allocated still out (its slabs go to
 * the class), two threads free those blocks (under the class lock: the
 * slabs have no owner) while a third allocates in the class and so takes
 * the same slabs over. A block given back as to a central slab after its
 * slab was taken over would race the new owner's lock-free takes: blocks
 * handed out twice, which the fill patterns below catch. */
enum { PER = 4096 };
static void* orphans[PER];
static _Atomic int damaged;

static uint64_t tag_of(const void* p, uint64_t salt) {
  return ((uint64_t)(uintptr_t)p * 0x9e3779b97f4a7c15ull) ^ salt;
}

static void fill(void* p, uint64_t salt) {
  uint64_t* w = p;
  for (unsigned i = 0; i < SIZE / 8; i++) w[i] = tag_of(p, salt + i);
}

static void verify(void* p, uint64_t salt) {
  uint64_t* w = p;
  for (unsigned i = 0; i < SIZE / 8; i++)
    if (w[i] != tag_of(p, salt + i)) { damaged = 1; return; }
}

static void* end_holding_all(void* arg) {
  for (int i = 0; i < PER; i++) {
    orphans[i] = malloc(SIZE);
    fill(orphans[i], 1);
  }
  return arg;
}

static void* free_half(void* arg) {
  int h = (int)(intptr_t)arg;
  for (int i = h; i < PER; i += 2) {
    verify(orphans[i], 1);
    free(orphans[i]);
  }
  return NULL;
}

static void* churn(void* arg) {
  static __thread void* mine[PER];
  uint64_t salt = (uint64_t)(uintptr_t)&mine;
  for (int round = 0; round < 3; round++) {
    for (int i = 0; i < PER; i++) {
      mine[i] = malloc(SIZE);
      fill(mine[i], salt);
    }
    for (int i = 0; i < PER; i++) {
      verify(mine[i], salt);
      free(mine[i]);
    }
  }
  return arg;
}

TEST(slabs_taken_over_while_their_blocks_come_back) {
  /* Long drains: the freers read each slab's owner well before they take
   * the lock. */
  set_policy_cap(2048, 1024, 1, 0);
  hk_stats_t a, b;
  hk_stats_get(&a);
  int rounds = under_valgrind() ? 10 : 300;
  for (int r = 0; r < rounds && !damaged; r++) {
    pthread_t t[3];
    REQUIRE(pthread_create(&t[0], NULL, end_holding_all, NULL) == 0);
    pthread_join(t[0], NULL);
    REQUIRE(pthread_create(&t[0], NULL, free_half, (void*)0) == 0);
    REQUIRE(pthread_create(&t[1], NULL, churn, NULL) == 0);
    REQUIRE(pthread_create(&t[2], NULL, free_half, (void*)1) == 0);
    for (int i = 0; i < 3; i++) pthread_join(t[i], NULL);
  }
  hk_thread_flush();
  hk_stats_get(&b);
  harness_say("  %d rounds; class live bytes %llu before, %llu after; %llu blocks sent on to a new owner\n", rounds,
              (unsigned long long)a.cls[cls].live_bytes, (unsigned long long)b.cls[cls].live_bytes,
              (unsigned long long)(b.cls[cls].remote_frees - a.cls[cls].remote_frees));
  CHECK(!damaged);
  CHECK_EQ(b.cls[cls].live_bytes, a.cls[cls].live_bytes);
}

int main(void) {
  hang_alarm(under_valgrind() ? 600 : 60, "test_transfer: hung\n");
  cls = hk_size_class(SIZE);
  RUN(a_drained_chain_goes_to_its_owner_and_feeds_its_refill_whole);
  RUN(malloc_trim_gives_an_inbox_back_to_its_slabs);
  RUN(the_idle_pass_gives_an_inbox_back);
  RUN(an_inbox_still_filling_goes_back_while_its_owner_works_elsewhere);
  RUN(an_ended_threads_slabs_go_to_their_class);
  RUN(slabs_taken_over_while_their_blocks_come_back);
  return harness_done();
}
