/* mid_large_mt — the random_mixed scheme with 8..32 KiB objects, one
 * private working set per thread: the medium-size path (LESSONS.md 12) and
 * how it scales with threads. ITERS is per thread; ops = THREADS * ITERS
 * (one malloc or one free each). */
#include "common.h"
#include <pthread.h>

#define MIN_SIZE (8 * 1024)
#define MAX_SIZE (32 * 1024)

static uint64_t iters, ws, seed;
static pthread_barrier_t start;
static span_t span;

static void *worker(void *arg) {
  uint64_t id = (uint64_t)(uintptr_t)arg;
  void **slots = calloc(ws, sizeof *slots);
  rng_t r = rng_seed(seed + id * 0x1000193);
  pthread_barrier_wait(&start);
  span_start(&span);
  mixed_steps(&r, slots, ws, iters, MIN_SIZE, MAX_SIZE);
  span_end(&span);
  free_slots(slots, ws);
  return NULL;
}

int main(int argc, char **argv) {
  bench_usage_line = "mid_large_mt [THREADS=2] [ITERS=1000000 per thread] [WS=400] [SEED=42]";
  uint64_t threads = arg_u64(argc, argv, 1, 2);
  iters = arg_u64(argc, argv, 2, 1000000);
  ws = arg_u64(argc, argv, 3, 400);
  seed = arg_u64(argc, argv, 4, 42);
  bench_require(threads > 0 && threads <= 1024 && ws > 0, "need 1 <= THREADS <= 1024 and WS > 0");

  pthread_t tid[threads];
  pthread_barrier_init(&start, NULL, (unsigned)threads);
  for (uint64_t i = 0; i < threads; i++)
    if (pthread_create(&tid[i], NULL, worker, (void *)(uintptr_t)i)) {
      fprintf(stderr, "pthread_create failed\n");
      return 1;
    }
  for (uint64_t i = 0; i < threads; i++) pthread_join(tid[i], NULL);

  bench_report("mid_large_mt", (int)threads, threads * iters, span_seconds(&span),
               "\"iters_per_thread\":%" PRIu64 ",\"ws\":%" PRIu64 ",\"seed\":%" PRIu64
               ",\"min\":%d,\"max\":%d,\"op\":\"one malloc or one free\"",
               iters, ws, seed, MIN_SIZE, MAX_SIZE);
  return 0;
}
