/* xthread_mixed — many short-lived threads sharing one working set of
 * mixed-size objects: each step swaps a fresh object into a random shared
 * slot and frees the one it displaced, which another thread (often one
 * that has since exited) allocated. So nearly every free is remote, many
 * go to a thread that no longer exists, and sizes span tiny to tens of KiB.
 * Threads are replaced every round, as a thread pool that recycles its
 * workers would; a quarter of the slots hold long-lived objects that are
 * replaced ten times less often. ops = steps (one malloc and one free
 * each) over all rounds and threads.
 *
 * The pattern of mimalloc-bench's "test-stress" family, written from its
 * description: cross-thread frees, from many threads, of mixed sizes. */
#include "common.h"
#include <pthread.h>

static _Atomic(void *) *slots;
static uint64_t nslots, steps_per_thread, seed;
static span_t span;

/* Mostly small (a program's strings and nodes), a tail of medium and a
 * rarer tail of large objects: 1 in 16 up to 4 KiB, 1 in 256 up to 64 KiB. */
static size_t pick_size(rng_t *r) {
  uint64_t x = rng_next(r);
  if ((x & 0xff) == 0) return 4096 + (size_t)((x >> 8) % (60 * 1024));
  if ((x & 0xf) == 0) return 256 + (size_t)((x >> 8) % 3840);
  return 8 + (size_t)((x >> 8) % 248);
}

static void *worker(void *arg) {
  uint64_t id = (uint64_t)(uintptr_t)arg;
  rng_t r = rng_seed(seed ^ (id * 0x9E3779B97F4A7C15ull));
  uint64_t retained = nslots / 4;
  span_start(&span);
  for (uint64_t i = 0; i < steps_per_thread; i++) {
    uint64_t s = rng_below(&r, nslots);
    /* Long-lived slots: 9 of 10 steps that land there leave them alone. */
    if (s < retained && rng_below(&r, 10) != 0) continue;
    size_t n = pick_size(&r);
    unsigned char *p = xmalloc(n);
    touch(p, n);
    unsigned char *old = atomic_exchange_explicit(&slots[s], p, memory_order_acq_rel);
    if (old) {
      bench_escape(old);
      free(old);
    }
  }
  span_end(&span);
  return NULL;
}

int main(int argc, char **argv) {
  bench_usage_line = "xthread_mixed [THREADS=8] [ROUNDS=20] [STEPS=100000 per thread and round] [SLOTS=4000] [SEED=42]";
  uint64_t threads = arg_u64(argc, argv, 1, 8);
  uint64_t rounds = arg_u64(argc, argv, 2, 20);
  steps_per_thread = arg_u64(argc, argv, 3, 100000);
  nslots = arg_u64(argc, argv, 4, 4000);
  seed = arg_u64(argc, argv, 5, 42);
  bench_require(threads > 0 && threads <= 1024 && rounds > 0 && nslots >= 4,
                "need 1 <= THREADS <= 1024, ROUNDS > 0 and SLOTS >= 4");

  slots = calloc(nslots, sizeof *slots);
  pthread_t tid[threads];
  for (uint64_t round = 0; round < rounds; round++) {
    for (uint64_t i = 0; i < threads; i++)
      if (pthread_create(&tid[i], NULL, worker, (void *)(uintptr_t)(round * threads + i))) {
        fprintf(stderr, "pthread_create failed\n");
        return 1;
      }
    for (uint64_t i = 0; i < threads; i++) pthread_join(tid[i], NULL);
  }
  for (uint64_t i = 0; i < nslots; i++) free(atomic_load(&slots[i]));
  free((void *)slots);

  bench_report("xthread_mixed", (int)threads, threads * rounds * steps_per_thread, span_seconds(&span),
               "\"rounds\":%" PRIu64 ",\"steps_per_thread\":%" PRIu64 ",\"slots\":%" PRIu64
               ",\"seed\":%" PRIu64 ",\"op\":\"one step: at most one malloc and one free\"",
               rounds, steps_per_thread, nslots, seed);
  return 0;
}
