/* test_knobs.c — each policy knob has a real, measurable effect, the
 * environment overrides are read at start, and bad policies are rejected
 * whole. Counters come from hk_stats_get, so this also checks they move. */
#define _GNU_SOURCE
#include <errno.h>
#include <malloc.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "hakmem.h"
#include "harness.h"
#include "testutil.h"

static hk_stats_t st0, st1;
static hk_policy_t start_policy;   /* the default: main reads it before any test */
static void sleep_ms(int ms);

static void snap(hk_stats_t* s) { hk_stats_get(s); }

static void set_all(uint32_t cap, uint32_t batch, uint32_t warm, uint32_t drain_ms) {
  hk_policy_t p;
  hk_policy_get(&p);
  for (unsigned c = 1; c < HK_NUM_CLASSES; c++) {
    hk_policy_bounds_t b;
    hk_policy_bounds(c, &b);
    p.tcache_cap[c] = cap > b.cap_max ? b.cap_max : cap;
    uint32_t cmax = p.tcache_cap[c] ? p.tcache_cap[c] : 1;
    p.tcache_batch[c] = batch > cmax ? cmax : batch;
    p.warm_slabs[c] = warm > b.warm_max ? b.warm_max : warm;
  }
  p.drain_ms = drain_ms;
  uint64_t v = hk_policy_set(&p);
  if (v == 0) harness_say("  policy rejected unexpectedly\n");
}

/* Empty warm pools for the classes of sizes a and b only; every other class
 * keeps its largest pool, so the policy keeps at least the default's empty
 * memory and the page level its whole dirty cap (options.c: dirty_share_of). */
static void warm_zero_only(size_t a, size_t b) {
  hk_policy_t p;
  hk_policy_get(&p);
  for (unsigned c = 1; c < HK_NUM_CLASSES; c++) {
    hk_policy_bounds_t bd;
    hk_policy_bounds(c, &bd);
    p.warm_slabs[c] = c == hk_size_class(a) || c == hk_size_class(b) ? 0 : bd.warm_max;
  }
  if (hk_policy_set(&p) == 0) harness_say("  policy rejected unexpectedly\n");
}

/* Batches of 100 allocations then 100 frees, as servers handle requests. */
static void batches(size_t size, int rounds) {
  void* p[100];
  for (int r = 0; r < rounds; r++) {
    for (int i = 0; i < 100; i++) { p[i] = malloc(size); ((char*)p[i])[0] = (char)i; }
    for (int i = 0; i < 100; i++) free(p[i]);
  }
}

TEST(capacity_one_makes_nearly_every_allocation_a_refill) {
  unsigned c = hk_size_class(64);
  set_all(1, 1, 4, 0);
  batches(64, 5);
  snap(&st0);
  batches(64, 200);
  snap(&st1);
  uint64_t allocs = st1.cls[c].allocs - st0.cls[c].allocs;
  uint64_t refills = st1.cls[c].refills - st0.cls[c].refills;
  harness_say("  cap 1: %llu refills for %llu allocations\n", (unsigned long long)refills,
              (unsigned long long)allocs);
  CHECK(allocs >= 20000);
  CHECK(refills * 100 >= allocs * 90);
}

TEST(large_capacity_makes_refills_rare) {
  unsigned c = hk_size_class(64);
  set_all(1024, 128, 4, 0);
  batches(64, 5);
  snap(&st0);
  batches(64, 200);
  snap(&st1);
  uint64_t allocs = st1.cls[c].allocs - st0.cls[c].allocs;
  uint64_t refills = st1.cls[c].refills - st0.cls[c].refills;
  harness_say("  cap 1024: %llu refills for %llu allocations\n", (unsigned long long)refills,
              (unsigned long long)allocs);
  CHECK(allocs >= 20000);
  CHECK(refills * 100 <= allocs);
  uint64_t hits = st1.cls[c].hits - st0.cls[c].hits;
  CHECK(hits * 100 >= allocs * 99);
  CHECK(st1.cls[c].local_frees + st1.cls[c].remote_frees == st1.cls[c].frees);
}

/* Fill many slabs of one class, free everything, repeat: the emptied slabs
 * either wait in the warm pool or go back to the OS. */
static void slab_churn(size_t size, int rounds) {
  enum { N = 3000 };
  static void* p[N];
  for (int r = 0; r < rounds; r++) {
    for (int i = 0; i < N; i++) { p[i] = malloc(size); memset(p[i], r, 64); }
    for (int i = 0; i < N; i++) free(p[i]);
    hk_thread_flush();
  }
}

/* With no warm pool the class gives every emptied slab back to the page
 * level, where its pages stay dirty (segment.c "dirty pages") for the next
 * slab of any class: no OS call while they fit under the cap (no drain
 * interval here, so no decay), and malloc_trim hands them all to the OS. */
TEST(warm_pool_zero_sends_slab_churn_to_the_page_level) {
  unsigned c = hk_size_class(1000);
  set_all(16, 8, 0, 0);
  warm_zero_only(1000, 1000);
  slab_churn(1000, 2);
  snap(&st0);
  slab_churn(1000, 10);
  snap(&st1);
  uint64_t to_os = st1.cls[c].slabs_to_os - st0.cls[c].slabs_to_os;
  uint64_t madv = st1.madvise_calls - st0.madvise_calls;
  uint64_t from_warm = st1.cls[c].slabs_from_warm - st0.cls[c].slabs_from_warm;
  harness_say("  warm 0: %llu slabs released, %llu madvise, %llu from warm\n",
              (unsigned long long)to_os, (unsigned long long)madv, (unsigned long long)from_warm);
  CHECK(to_os >= 10 * 40);
  CHECK_EQ(madv, 0);
  CHECK_EQ(from_warm, 0);
  hk_stats_t t;
  malloc_trim(0);
  snap(&t);
  harness_say("  malloc_trim: %llu madvise, committed %llu -> %llu KiB\n",
              (unsigned long long)(t.madvise_calls - st1.madvise_calls),
              (unsigned long long)st1.committed_bytes >> 10, (unsigned long long)t.committed_bytes >> 10);
  CHECK(t.madvise_calls > st1.madvise_calls);
  CHECK(st1.committed_bytes >= t.committed_bytes + 2 * 1024 * 1024);   /* the churn's ~3 MiB */
}

/* Pages one class emptied serve another class's new slabs without faulting
 * in fresh memory: 3 MiB of 1000-byte blocks freed, then 3 MiB of 3000-byte
 * blocks written whole. Without the dirty pages that is ~750 faults. */
TEST(freed_pages_serve_another_class_without_faults) {
  set_all(16, 8, 0, 0);
  warm_zero_only(1000, 3000);
  malloc_trim(0);
  enum { N = 3000 };
  static void* p[N];
  for (int i = 0; i < N; i++) { p[i] = malloc(1000); memset(p[i], 1, 1000); }
  for (int i = 0; i < N; i++) free(p[i]);
  hk_thread_flush();
  long f0 = minor_faults();
  for (int i = 0; i < N / 3; i++) { p[i] = malloc(3000); memset(p[i], 2, 3000); }
  long faults = minor_faults() - f0;
  for (int i = 0; i < N / 3; i++) free(p[i]);
  harness_say("  3 MiB of another class on freed pages: %ld page faults\n", faults);
  CHECK(faults < 100);
  malloc_trim(0);
}

/* A segment that empties keeps its dirty pages for the next slabs, as a
 * slab's pages do: 21 MB (six segments) of 3000-byte blocks freed, then 21
 * MB of 1000-byte blocks written whole. Unmapping every empty segment but
 * two threw their pages away: 2,291 faults, against 710 kept. */
TEST(emptied_segments_keep_their_dirty_pages) {
  set_all(16, 8, 0, 0);
  warm_zero_only(1000, 3000);
  malloc_trim(0);
  enum { N = 7000 };   /* 3000-byte blocks: 21 MB */
  static void* p[3 * N];
  for (int i = 0; i < N; i++) { p[i] = malloc(3000); memset(p[i], 1, 3000); }
  for (int i = 0; i < N; i++) free(p[i]);
  hk_thread_flush();
  long f0 = minor_faults();
  for (int i = 0; i < 3 * N; i++) { p[i] = malloc(1000); memset(p[i], 2, 1000); }
  long faults = minor_faults() - f0;
  for (int i = 0; i < 3 * N; i++) free(p[i]);
  harness_say("  21 MB of another class on emptied segments: %ld page faults\n", faults);
  CHECK(faults < 1200);
  malloc_trim(0);
}

/* Dirty pages nobody took for a whole drain interval go back to the OS by
 * themselves, while another class keeps the slow paths running. */
TEST(idle_dirty_pages_go_back_within_two_intervals) {
  set_all(16, 8, 0, 50);
  warm_zero_only(1000, 1000);
  malloc_trim(0);
  slab_churn(1000, 1);     /* ~3 MiB of dirty pages */
  hk_stats_t a, b;
  snap(&a);
  for (int t = 0; t < 8; t++) {
    sleep_ms(60);
    static void* busy[600];
    for (int i = 0; i < 600; i++) busy[i] = malloc(48);
    for (int i = 0; i < 600; i++) free(busy[i]);
  }
  snap(&b);
  harness_say("  idle dirty pages: %llu madvise, committed %llu -> %llu KiB\n",
              (unsigned long long)(b.madvise_calls - a.madvise_calls),
              (unsigned long long)a.committed_bytes >> 10, (unsigned long long)b.committed_bytes >> 10);
  CHECK(b.madvise_calls > a.madvise_calls);
  CHECK(a.committed_bytes >= b.committed_bytes + 2 * 1024 * 1024);
  set_all(16, 8, 0, 0);
}

/* A policy that keeps no empty slabs keeps no freed pages either: the
 * slabs a churn empties go back to the OS as they are released, and what
 * the page level held when the policy came in goes back at once, so
 * resident memory follows the policy within the call that sets it. */
TEST(keeping_no_empty_slabs_keeps_no_dirty_pages) {
  set_all(16, 8, 0, 0);
  warm_zero_only(1000, 1000);
  malloc_trim(0);
  slab_churn(1000, 1);                  /* ~3 MiB of dirty pages */
  hk_stats_t a, b, c;
  snap(&a);
  set_all(16, 8, 0, 0);                 /* no class keeps an empty slab */
  snap(&b);
  harness_say("  policy of no warm pools: committed %llu -> %llu KiB, %llu madvise\n",
              (unsigned long long)a.committed_bytes >> 10, (unsigned long long)b.committed_bytes >> 10,
              (unsigned long long)(b.madvise_calls - a.madvise_calls));
  CHECK(a.committed_bytes >= b.committed_bytes + 2 * 1024 * 1024);
  slab_churn(1000, 4);
  snap(&c);
  uint64_t madv = c.madvise_calls - b.madvise_calls;
  uint64_t to_os = c.cls[hk_size_class(1000)].slabs_to_os - b.cls[hk_size_class(1000)].slabs_to_os;
  harness_say("  churn under it: %llu slabs released, %llu madvise, committed %llu KiB after\n",
              (unsigned long long)to_os, (unsigned long long)madv, (unsigned long long)c.committed_bytes >> 10);
  CHECK(to_os >= 4 * 40);
  CHECK(madv >= to_os);                 /* each released slab went back */
  CHECK(c.committed_bytes <= b.committed_bytes + 512 * 1024);
}

/* Halving every class's warm pool from the default halves the dirty cap:
 * 512 MiB of 1000-byte blocks freed leaves 128 MiB dirty, not 256. */
/* What 512 MiB of 1000-byte blocks leave committed once freed, one block
 * in 1024 staying live so that no segment empties whole (an empty segment
 * is unmapped, dirty pages and all): the kept pages and the pins' 32 MiB. */
static uint64_t kept_after_512_mib(void) {
  malloc_trim(0);
  hk_stats_t a, b;
  snap(&a);
  enum { N = 512 * 1024, PIN_EVERY = 1024 };
  static void* blk[N];
  for (int i = 0; i < N; i++) { blk[i] = malloc(1000); memset(blk[i], 1, 1000); }
  for (int i = 0; i < N; i++)
    if (i % PIN_EVERY) free(blk[i]);
  hk_thread_flush();
  snap(&b);
  for (int i = 0; i < N; i += PIN_EVERY) free(blk[i]);
  hk_thread_flush();
  return b.committed_bytes - a.committed_bytes;
}

TEST(the_dirty_cap_follows_the_policys_warm_pools) {
  set_all(16, 8, 0, 0);
  hk_policy_t p;
  hk_policy_get(&p);
  uint64_t dirty[2];
  for (int half = 0; half < 2; half++) {
    /* the default's pools, then half of each */
    for (unsigned c = 1; c < HK_NUM_CLASSES; c++)
      p.warm_slabs[c] = half ? start_policy.warm_slabs[c] / 2 : start_policy.warm_slabs[c];
    p.warm_slabs[hk_size_class(1000)] = 0;
    REQUIRE(hk_policy_set(&p) != 0);
    dirty[half] = kept_after_512_mib();
  }
  harness_say("  kept after 512 MiB freed: default pools %llu KiB, half of them %llu KiB\n",
              (unsigned long long)dirty[0] >> 10, (unsigned long long)dirty[1] >> 10);
  CHECK(dirty[0] >= 280ull << 20 && dirty[0] <= 296ull << 20);   /* 256 MiB and the pins' 32 MiB */
  CHECK(dirty[1] >= 152ull << 20 && dirty[1] <= 168ull << 20);
  malloc_trim(0);
}

static int huge_kept, huge_returned;    /* huge_free_and_again's findings */
static uint64_t huge_hits;

static void set_retain(uint32_t mib) {
  hk_policy_t p;
  hk_policy_get(&p);
  p.retain_mib = mib;
  if (hk_policy_set(&p) == 0) harness_say("  policy rejected unexpectedly\n");
}

/* retain_mib is the floor of the freed pages' cap, whatever the warm pools:
 * with the default's pools, 64 keeps 64 MiB of the 512 freed and 0 keeps
 * none, every released slab going back as it is released. */
TEST(retain_caps_the_freed_pages_any_class_reuses) {
  set_all(16, 8, 0, 0);
  hk_policy_t p;
  hk_policy_get(&p);
  memcpy(p.warm_slabs, start_policy.warm_slabs, sizeof p.warm_slabs);
  p.warm_slabs[hk_size_class(1000)] = 0;
  REQUIRE(hk_policy_set(&p) != 0);
  uint64_t kept[3];
  const uint32_t retain[3] = {256, 64, 0};
  for (int i = 0; i < 3; i++) {
    set_retain(retain[i]);
    kept[i] = kept_after_512_mib();
  }
  harness_say("  kept after 512 MiB freed: retain 256: %llu KiB, 64: %llu KiB, 0: %llu KiB\n",
              (unsigned long long)kept[0] >> 10, (unsigned long long)kept[1] >> 10,
              (unsigned long long)kept[2] >> 10);
  CHECK(kept[0] >= 280ull << 20 && kept[0] <= 296ull << 20);   /* 256 MiB and the pins' 32 MiB */
  CHECK(kept[1] >= 88ull << 20 && kept[1] <= 104ull << 20);
  CHECK(kept[2] >= 30ull << 20 && kept[2] <= 36ull << 20);
  set_retain(start_policy.retain_mib);
  malloc_trim(0);
}

/* Lowering retain_mib gives back what is over the new cap in the call that
 * sets it, not at the next decay pass (none runs here: no drain interval). */
TEST(lowering_retain_gives_back_the_excess_at_once) {
  set_all(16, 8, 0, 0);
  warm_zero_only(1000, 1000);
  set_retain(start_policy.retain_mib);
  malloc_trim(0);
  enum { N = 48 * 1024, PIN_EVERY = 1024 };   /* 48 MiB, 3 MiB of it pinned */
  static void* blk[N];
  for (int i = 0; i < N; i++) { blk[i] = malloc(1000); memset(blk[i], 1, 1000); }
  for (int i = 0; i < N; i++)
    if (i % PIN_EVERY) free(blk[i]);
  hk_thread_flush();
  hk_stats_t a, b;
  snap(&a);
  set_retain(8);
  snap(&b);
  harness_say("  retain 256 -> 8: committed %llu -> %llu KiB, %llu madvise\n",
              (unsigned long long)a.committed_bytes >> 10, (unsigned long long)b.committed_bytes >> 10,
              (unsigned long long)(b.madvise_calls - a.madvise_calls));
  CHECK(a.committed_bytes >= b.committed_bytes + (32ull << 20));
  CHECK(b.madvise_calls > a.madvise_calls);
  for (int i = 0; i < N; i += PIN_EVERY) free(blk[i]);
  set_retain(start_policy.retain_mib);
  malloc_trim(0);
}

/* A huge buffer of n bytes written whole, freed, and asked for again:
 * committed bytes before and after the free, and whether the second one
 * came from the cache. */
static void huge_free_and_again(size_t n, const char* what) {
  hk_stats_t a, b, c;
  char* x = malloc(n);
  memset(x, 1, n);
  snap(&a);
  free(x);
  snap(&b);
  x = malloc(n);
  snap(&c);
  free(x);
  harness_say("  %s: committed %llu -> %llu KiB after the free, %llu cache hit(s)\n", what,
              (unsigned long long)a.committed_bytes >> 10, (unsigned long long)b.committed_bytes >> 10,
              (unsigned long long)(c.huge_cache_hits - b.huge_cache_hits));
  huge_kept = b.committed_bytes + (1u << 20) >= a.committed_bytes;
  huge_returned = a.committed_bytes >= b.committed_bytes + n;
  huge_hits = c.huge_cache_hits - b.huge_cache_hits;
}

/* The huge cache's budget is retain_mib too (at most 128 MiB): a freed
 * 24 MiB buffer is kept and serves the next one under the default, goes
 * back at once under 16, and a lowered budget gives back what it cached. */
TEST(retain_bounds_the_huge_cache) {
  const size_t n = 24u << 20;
  set_retain(start_policy.retain_mib);
  malloc_trim(0);
  huge_free_and_again(n, "default");
  CHECK(huge_kept);
  CHECK_EQ(huge_hits, 1);
  hk_stats_t a, b;
  snap(&a);                       /* the second buffer's mapping is cached */
  set_retain(16);                 /* and its 28 MiB are over the new budget */
  snap(&b);
  harness_say("  retain 16 over a cached mapping: committed %llu -> %llu KiB\n",
              (unsigned long long)a.committed_bytes >> 10, (unsigned long long)b.committed_bytes >> 10);
  CHECK(a.committed_bytes >= b.committed_bytes + n);
  huge_free_and_again(n, "retain 16");
  CHECK(huge_returned);
  CHECK_EQ(huge_hits, 0);
  set_retain(start_policy.retain_mib);
  malloc_trim(0);
}

TEST(large_warm_pool_keeps_slab_churn_off_the_os) {
  unsigned c = hk_size_class(1000);
  set_all(16, 8, 1024, 0);
  slab_churn(1000, 2);
  snap(&st0);
  slab_churn(1000, 10);
  snap(&st1);
  uint64_t to_os = st1.cls[c].slabs_to_os - st0.cls[c].slabs_to_os;
  uint64_t madv = st1.madvise_calls - st0.madvise_calls;
  uint64_t from_warm = st1.cls[c].slabs_from_warm - st0.cls[c].slabs_from_warm;
  harness_say("  warm max: %llu slabs to the OS, %llu madvise, %llu from warm\n",
              (unsigned long long)to_os, (unsigned long long)madv, (unsigned long long)from_warm);
  CHECK_EQ(to_os, 0);
  CHECK_EQ(madv, 0);
  CHECK(from_warm >= 10 * 40);
  malloc_trim(0);   /* gives the warm slabs back */
}

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* Park blocks of one class in the cache, then keep only another class busy
 * (through its slow path) for longer than the drain interval. */
static uint64_t cached_after_idle(uint32_t drain_ms) {
  unsigned idle = hk_size_class(48);
  set_all(256, 8, 4, drain_ms);
  batches(48, 3);              /* up to 100 blocks of class 48 now cached */
  for (int t = 0; t < 6; t++) {
    sleep_ms(40);
    static void* busy[600];   /* more than the cap: refills and drains */
    for (int i = 0; i < 600; i++) busy[i] = malloc(3000);
    for (int i = 0; i < 600; i++) free(busy[i]);
  }
  hk_stats_t s;
  snap(&s);
  return s.cls[idle].cached_bytes;
}

TEST(drain_interval_returns_idle_caches) {
  hk_thread_flush();
  uint64_t kept = cached_after_idle(0);
  hk_thread_flush();
  uint64_t drained = cached_after_idle(50);
  harness_say("  idle class cached bytes: drain never %llu, drain 50 ms %llu\n",
              (unsigned long long)kept, (unsigned long long)drained);
  CHECK(kept >= 48 * 50);
  CHECK_EQ(drained, 0);
}

/* Fill the warm pool of one class, then keep only another class busy: with a
 * drain interval the idle pool goes back to the OS a half at a time. */
static uint64_t warm_released_while_idle(uint32_t drain_ms) {
  unsigned c = hk_size_class(1000);
  set_all(16, 8, 1024, drain_ms);
  slab_churn(1000, 1);             /* ~45 empty slabs now in the warm pool */
  hk_stats_t a, b;
  snap(&a);
  for (int t = 0; t < 8; t++) {
    sleep_ms(60);
    static void* busy[600];
    for (int i = 0; i < 600; i++) busy[i] = malloc(3000);
    for (int i = 0; i < 600; i++) free(busy[i]);
  }
  snap(&b);
  return b.cls[c].slabs_to_os - a.cls[c].slabs_to_os;
}

TEST(drain_interval_shrinks_idle_warm_pools) {
  uint64_t kept = warm_released_while_idle(0);
  malloc_trim(0);
  uint64_t released = warm_released_while_idle(50);
  malloc_trim(0);
  harness_say("  idle warm pool slabs returned: drain never %llu, drain 50 ms %llu\n",
              (unsigned long long)kept, (unsigned long long)released);
  CHECK_EQ(kept, 0);
  CHECK(released >= 40);
}

/* Fill the warm pool of one class (~45 slabs), then draw ~5 slabs from it
 * and give them back every interval: the pool is drawn from each time, but
 * the ~40 slabs below what is drawn served nothing, and go back to the OS a
 * half at a time (slab.c:_hk_warm_decay), while the draws keep coming from
 * the pool, not from new slabs. */
static void warm_surplus_while_drawn(uint32_t drain_ms, uint64_t* to_os, uint64_t* from_os) {
  unsigned c = hk_size_class(1000);
  set_all(16, 8, 1024, drain_ms);
  slab_churn(1000, 1);
  hk_stats_t a, b;
  snap(&a);
  for (int t = 0; t < 10; t++) {
    sleep_ms(60);
    static void* some[330];
    for (int i = 0; i < 330; i++) { some[i] = malloc(1000); memset(some[i], t, 64); }
    for (int i = 0; i < 330; i++) free(some[i]);
    hk_thread_flush();
  }
  snap(&b);
  *to_os = b.cls[c].slabs_to_os - a.cls[c].slabs_to_os;
  *from_os = b.cls[c].slabs_from_os - a.cls[c].slabs_from_os;
}

TEST(drain_interval_returns_the_warm_slabs_a_drawn_pool_never_reaches) {
  uint64_t kept, kept_new, released, released_new;
  warm_surplus_while_drawn(0, &kept, &kept_new);
  malloc_trim(0);
  warm_surplus_while_drawn(50, &released, &released_new);
  malloc_trim(0);
  harness_say("  drawn pool's surplus slabs returned: drain never %llu, drain 50 ms %llu "
              "(new slabs meanwhile: %llu, %llu)\n", (unsigned long long)kept, (unsigned long long)released,
              (unsigned long long)kept_new, (unsigned long long)released_new);
  CHECK_EQ(kept, 0);
  CHECK(released >= 30);
  CHECK(released_new <= 8);
}

/* A worker parks blocks in its cache and waits; main calls malloc_trim;
 * the worker's next slow path hands its cached blocks back. */
static pthread_barrier_t trim_bar;
static uint64_t trim_cached_before, trim_cached_after;

static void* trim_worker(void* arg) {
  unsigned c = hk_size_class(48);
  batches(48, 2);                       /* blocks of class 48 now cached */
  hk_stats_t s;
  hk_stats_get(&s);                     /* publishes this thread's counts */
  trim_cached_before = s.cls[c].cached_bytes;
  pthread_barrier_wait(&trim_bar);      /* main trims */
  pthread_barrier_wait(&trim_bar);
  free(malloc(200000));                 /* any slow path */
  hk_stats_get(&s);
  trim_cached_after = s.cls[c].cached_bytes;
  return arg;
}

TEST(malloc_trim_reaches_other_threads_caches) {
  hk_thread_flush();
  set_all(256, 8, 4, 0);
  pthread_t t;
  pthread_barrier_init(&trim_bar, NULL, 2);
  REQUIRE(pthread_create(&t, NULL, trim_worker, NULL) == 0);
  pthread_barrier_wait(&trim_bar);
  malloc_trim(0);
  pthread_barrier_wait(&trim_bar);
  pthread_join(t, NULL);
  pthread_barrier_destroy(&trim_bar);
  harness_say("  other thread's cached bytes: before trim %llu, after its next slow path %llu\n",
              (unsigned long long)trim_cached_before, (unsigned long long)trim_cached_after);
  CHECK(trim_cached_before >= 48 * 50);
  CHECK_EQ(trim_cached_after, 0);
}

TEST(lowering_capacity_drains_the_excess) {
  unsigned c = hk_size_class(64);
  set_all(1024, 128, 4, 0);
  batches(64, 3);
  snap(&st0);
  CHECK(st0.cls[c].cached_bytes >= 64 * 100);
  set_all(4, 2, 4, 0);
  free(malloc(4000));   /* any slow path applies the new policy */
  free(malloc(4000));
  snap(&st1);
  CHECK(st1.cls[c].cached_bytes <= 64 * 4);
}

TEST(out_of_bounds_policies_are_rejected_whole) {
  hk_policy_t p;
  hk_policy_get(&p);
  uint64_t v0 = hk_policy_version();
  hk_stats_t s0, s1;
  snap(&s0);
  hk_policy_bounds_t b;
  hk_policy_bounds(1, &b);
  hk_policy_t bad = p;
  bad.tcache_cap[1] = b.cap_max + 1;
  CHECK_EQ(hk_policy_set(&bad), 0);
  bad = p;
  bad.tcache_batch[5] = 0;
  CHECK_EQ(hk_policy_set(&bad), 0);
  bad = p;
  bad.tcache_cap[7] = 8;
  bad.tcache_batch[7] = 9;   /* batch above capacity */
  CHECK_EQ(hk_policy_set(&bad), 0);
  bad = p;
  bad.warm_slabs[HK_NUM_CLASSES - 1] = 1u << 30;
  CHECK_EQ(hk_policy_set(&bad), 0);
  bad = p;
  bad.drain_ms = 0xffffffffu;
  CHECK_EQ(hk_policy_set(&bad), 0);
  bad = p;
  bad.retain_mib = b.retain_mib_max + 1;
  CHECK_EQ(hk_policy_set(&bad), 0);
  CHECK_EQ(hk_policy_set(NULL), 0);
  snap(&s1);
  CHECK_EQ(hk_policy_version(), v0);
  CHECK_EQ(s1.policies_rejected - s0.policies_rejected, 7);
  hk_policy_t now;
  hk_policy_get(&now);
  CHECK(memcmp(now.tcache_cap, p.tcache_cap, sizeof p.tcache_cap) == 0);
  CHECK(hk_policy_set(&p) == v0 + 1);
}

/* Runs this binary again with extra environment; returns exit status and
 * stderr in err. */
static int rerun(const char* mode, const char* env1, const char* env2, char* err, size_t cap) {
  char* envp[] = {(char*)env1, (char*)env2, NULL};
  return rerun_self(mode, envp, err, cap);
}

/* Child mode: prints the caps of two classes and the drain interval. */
static int child_report(void) {
  hk_policy_t p;
  hk_policy_get(&p);
  harness_say("caps %u %u batch %u warm %u drain %u retain %u\n", p.tcache_cap[hk_size_class(16)],
              p.tcache_cap[hk_size_class(20000)], p.tcache_batch[hk_size_class(16)],
              p.warm_slabs[hk_size_class(16)], p.drain_ms, p.retain_mib);
  hk_stats_t a, b;
  unsigned c = hk_size_class(16);
  hk_stats_get(&a);
  batches(16, 10);
  hk_stats_get(&b);
  harness_say("refills %llu allocs %llu\n", (unsigned long long)(b.cls[c].refills - a.cls[c].refills),
              (unsigned long long)(b.cls[c].allocs - a.cls[c].allocs));
  return 0;
}

/* Child mode: HAKMEM_TCACHE_CAP (in the environment) against every class's
 * own bound: each cap is the value clamped to that class's cap_max, and the
 * policy in force is one hk_policy_set accepts again. */
static int child_caps(void) {
  const char* e = getenv("HAKMEM_TCACHE_CAP");
  long want = e ? atol(e) : -1;
  hk_policy_t p;
  hk_policy_get(&p);
  int bad = 0;
  for (unsigned c = 1; c < HK_NUM_CLASSES; c++) {
    hk_policy_bounds_t b;
    hk_policy_bounds(c, &b);
    uint32_t expect = want > (long)b.cap_max ? b.cap_max : (uint32_t)want;
    if (p.tcache_cap[c] != expect || p.tcache_batch[c] > (p.tcache_cap[c] ? p.tcache_cap[c] : 1)) {
      if (bad++ < 3)
        harness_say("class %u (%zu B): cap %u, batch %u; expected cap %u (bound %u)\n", c, hk_class_size(c),
                    p.tcache_cap[c], p.tcache_batch[c], expect, b.cap_max);
    }
  }
  uint64_t v = hk_policy_set(&p);
  harness_say("caps checked: %d wrong; the policy in force set again: %s\n", bad, v ? "accepted" : "rejected");
  return bad || !v ? 1 : 0;
}

TEST(environment_capacity_is_clamped_to_each_class_bound) {
  char err[4096];
  const char* caps[] = {"HAKMEM_TCACHE_CAP=4096", "HAKMEM_TCACHE_CAP=100", "HAKMEM_TCACHE_CAP=0"};
  for (int i = 0; i < 3; i++) {
    int rc = rerun("caps", caps[i], NULL, err, sizeof err);
    if (rc != 0) harness_say("  %s: exit %d: %s", caps[i], rc, err);
    CHECK_EQ(rc, 0);
    CHECK(strstr(err, "0 wrong; the policy in force set again: accepted") != NULL);
  }
}

TEST(environment_overrides_are_read_at_start) {
  char err[4096];
  CHECK_EQ(rerun("report", "HAKMEM_TCACHE_CAP=3", "HAKMEM_DRAIN_MS=250", err, sizeof err), 0);
  CHECK(strstr(err, "caps 3 3 batch 1 ") != NULL);
  CHECK(strstr(err, "drain 250") != NULL);
  CHECK_EQ(rerun("report", "HAKMEM_WARM_SLABS=0", "HAKMEM_TCACHE_BATCH=2", err, sizeof err), 0);
  CHECK(strstr(err, "batch 2 warm 0 ") != NULL);
  CHECK_EQ(rerun("report", "HAKMEM_RETAIN_MIB=64", NULL, err, sizeof err), 0);
  CHECK(strstr(err, "retain 64\n") != NULL);
  CHECK_EQ(rerun("report", "HAKMEM_RETAIN_MIB=65537", NULL, err, sizeof err), 0);
  CHECK(strstr(err, "hakmem: bad option: HAKMEM_RETAIN_MIB=65537") != NULL);
  CHECK(strstr(err, "retain 256\n") != NULL);
}

TEST(bad_environment_values_warn_and_keep_the_default) {
  char base[4096], err[4096];
  CHECK_EQ(rerun("report", "X=1", NULL, base, sizeof base), 0);
  CHECK_EQ(rerun("report", "HAKMEM_TCACHE_CAP=lots", "HAKMEM_DRAIN_MS=-5", err, sizeof err), 0);
  CHECK(strstr(err, "hakmem: bad option: HAKMEM_TCACHE_CAP=lots") != NULL);
  CHECK(strstr(err, "hakmem: bad option: HAKMEM_DRAIN_MS=-5") != NULL);
  const char* a = strstr(base, "caps ");
  const char* b = strstr(err, "caps ");
  REQUIRE(a && b);
  CHECK(strncmp(a, b, strcspn(a, "\n")) == 0);
  CHECK_EQ(rerun("report", "HAKMEM_TCACHE_CAP=999999", NULL, err, sizeof err), 0);
  CHECK(strstr(err, "bad option") != NULL);
}

TEST(stats_at_exit_prints_the_class_table) {
  char err[16384];
  CHECK_EQ(rerun("report", "HAKMEM_STATS=1", NULL, err, sizeof err), 0);
  CHECK(strstr(err, "hakmem: stats") != NULL);
  CHECK(strstr(err, "refills") != NULL);
  CHECK(strstr(err, "HAKMEM_TCACHE_CAP") != NULL);
  CHECK_EQ(rerun("report", "HAKMEM_STATS=0", NULL, err, sizeof err), 0);
  CHECK(strstr(err, "hakmem: stats") == NULL);
}

TEST(check_mode_disables_thread_caches) {
  char err[4096];
  CHECK_EQ(rerun("report", "HAKMEM_CHECK=1", NULL, err, sizeof err), 0);
  CHECK(strstr(err, "refills 1000 allocs 1000") != NULL);
  CHECK_EQ(rerun("report", "HAKMEM_CHECK=0", NULL, err, sizeof err), 0);
  CHECK(strstr(err, "refills 1000 ") == NULL);
}

int main(int argc, char** argv) {
  if (argc > 1 && strcmp(argv[1], "report") == 0) return child_report();
  if (argc > 1 && strcmp(argv[1], "caps") == 0) return child_caps();
  hk_policy_get(&start_policy);
  RUN(capacity_one_makes_nearly_every_allocation_a_refill);
  RUN(large_capacity_makes_refills_rare);
  RUN(warm_pool_zero_sends_slab_churn_to_the_page_level);
  RUN(freed_pages_serve_another_class_without_faults);
  RUN(emptied_segments_keep_their_dirty_pages);
  RUN(idle_dirty_pages_go_back_within_two_intervals);
  RUN(keeping_no_empty_slabs_keeps_no_dirty_pages);
  RUN(the_dirty_cap_follows_the_policys_warm_pools);
  RUN(retain_caps_the_freed_pages_any_class_reuses);
  RUN(lowering_retain_gives_back_the_excess_at_once);
  RUN(retain_bounds_the_huge_cache);
  RUN(large_warm_pool_keeps_slab_churn_off_the_os);
  RUN(drain_interval_returns_idle_caches);
  RUN(drain_interval_shrinks_idle_warm_pools);
  RUN(drain_interval_returns_the_warm_slabs_a_drawn_pool_never_reaches);
  RUN(malloc_trim_reaches_other_threads_caches);
  RUN(lowering_capacity_drains_the_excess);
  RUN(out_of_bounds_policies_are_rejected_whole);
  RUN(environment_overrides_are_read_at_start);
  RUN(environment_capacity_is_clamped_to_each_class_bound);
  RUN(bad_environment_values_warn_and_keep_the_default);
  RUN(stats_at_exit_prints_the_class_table);
  RUN(check_mode_disables_thread_caches);
  return harness_done();
}
