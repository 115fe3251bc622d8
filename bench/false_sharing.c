/* false_sharing — does the allocator put two threads' small blocks on one
 * cache line? Each thread owns one small block and writes it WRITES times
 * per round; if another thread's block shares its cache line, every write
 * bounces the line between cores and the run is many times slower.
 *   active:  each thread allocates its own blocks (ROUNDS of them, one at a
 *            time: allocate, write WRITES times, free).
 *   passive: the main thread allocates one block per thread and hands them
 *            out; each thread frees the block it was given (a remote free)
 *            and then allocates its own, which an allocator that reuses the
 *            remotely freed block hands back on the main thread's line.
 * ops = writes over all threads.
 *
 * The patterns of the "cache-thrash" (active) and "cache-scratch"
 * (passive) benchmarks of the Hoard papers, written from their
 * description. The thread count is also the number of distinct lines a
 * well-behaved allocator uses: run with THREADS <= cores. */
#include "common.h"
#include <pthread.h>

static uint64_t threads, rounds, writes, size;
static int passive;
static void **handed;
static pthread_barrier_t start;
static span_t span;

static void hammer(volatile unsigned char *p) {
  for (uint64_t w = 0; w < writes; w++)
    for (uint64_t j = 0; j < size; j++) p[j] = (unsigned char)(p[j] + 1);
}

static void *worker(void *arg) {
  uint64_t id = (uint64_t)(uintptr_t)arg;
  pthread_barrier_wait(&start);
  span_start(&span);
  if (passive) free(handed[id]);
  for (uint64_t r = 0; r < rounds; r++) {
    unsigned char *p = xmalloc(size);
    memset(p, 0, size);
    hammer(p);
    bench_escape(p);
    free(p);
  }
  span_end(&span);
  return NULL;
}

int main(int argc, char **argv) {
  bench_usage_line = "false_sharing active|passive [THREADS=2] [ROUNDS=1000] [WRITES=10000] [SIZE=8]";
  bench_require(argc > 1 && (!strcmp(argv[1], "active") || !strcmp(argv[1], "passive")),
                "the first argument is active or passive");
  passive = !strcmp(argv[1], "passive");
  threads = arg_u64(argc, argv, 2, 2);
  rounds = arg_u64(argc, argv, 3, 1000);
  writes = arg_u64(argc, argv, 4, 10000);
  size = arg_u64(argc, argv, 5, 8);
  bench_require(threads > 0 && threads <= 1024 && rounds > 0 && size > 0 && size <= 64,
                "need 1 <= THREADS <= 1024, ROUNDS > 0 and 0 < SIZE <= 64");

  handed = xmalloc(threads * sizeof *handed);
  for (uint64_t i = 0; i < threads; i++) {
    handed[i] = xmalloc(size);
    memset(handed[i], 0, size);
  }
  pthread_t tid[threads];
  pthread_barrier_init(&start, NULL, (unsigned)threads);
  for (uint64_t i = 0; i < threads; i++)
    if (pthread_create(&tid[i], NULL, worker, (void *)(uintptr_t)i)) {
      fprintf(stderr, "pthread_create failed\n");
      return 1;
    }
  for (uint64_t i = 0; i < threads; i++) pthread_join(tid[i], NULL);
  if (!passive)
    for (uint64_t i = 0; i < threads; i++) free(handed[i]);
  free(handed);

  bench_report("false_sharing", (int)threads, threads * rounds * writes, span_seconds(&span),
               "\"mode\":\"%s\",\"rounds\":%" PRIu64 ",\"writes\":%" PRIu64 ",\"size\":%" PRIu64
               ",\"op\":\"one pass of writes over a block\"",
               passive ? "passive" : "active", rounds, writes, size);
  return 0;
}
