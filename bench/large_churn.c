/* large_churn — big buffers replaced at random: LIVE buffers of MIN_MB to
 * MAX_MB MiB; each round frees one and allocates a new one of random size,
 * zero-filled with memset (as code that does not trust malloc would). What
 * it measures is how an allocator gets huge blocks from the OS and gives
 * them back: mmap/munmap per round, page faults on fresh pages, or reuse.
 * ops = ROUNDS. */
#include "common.h"

int main(int argc, char **argv) {
  bench_usage_line = "large_churn [ROUNDS=2000] [LIVE=20] [MIN_MB=5] [MAX_MB=25] [SEED=42]";
  uint64_t rounds = arg_u64(argc, argv, 1, 2000);
  uint64_t live = arg_u64(argc, argv, 2, 20);
  uint64_t min_mb = arg_u64(argc, argv, 3, 5);
  uint64_t max_mb = arg_u64(argc, argv, 4, 25);
  uint64_t seed = arg_u64(argc, argv, 5, 42);
  bench_require(live > 0 && min_mb > 0 && min_mb <= max_mb && max_mb <= 4096,
                "need LIVE > 0 and 0 < MIN_MB <= MAX_MB <= 4096");
  uint64_t min = min_mb << 20, max = max_mb << 20;

  rng_t r = rng_seed(seed);
  void **bufs = xmalloc(live * sizeof *bufs);
  for (uint64_t i = 0; i < live; i++) {
    size_t n = rng_range(&r, min, max);
    bufs[i] = xmalloc(n);
    bench_escape(bufs[i]);
    memset(bufs[i], 0, n);
  }

  uint64_t bytes = 0;
  double t0 = bench_now();
  for (uint64_t i = 0; i < rounds; i++) {
    void **slot = &bufs[rng_below(&r, live)];
    free(*slot);
    size_t n = rng_range(&r, min, max);
    *slot = xmalloc(n);
    /* Without this, GCC fuses malloc + memset(0) into calloc, and an
     * allocator that knows its pages are fresh would skip the writes. */
    bench_escape(*slot);
    memset(*slot, 0, n);
    bytes += n;
  }
  double t1 = bench_now();

  for (uint64_t i = 0; i < live; i++) free(bufs[i]);
  free(bufs);
  bench_report("large_churn", 1, rounds, t1 - t0,
               "\"live\":%" PRIu64 ",\"min_mb\":%" PRIu64 ",\"max_mb\":%" PRIu64 ",\"seed\":%" PRIu64
               ",\"bytes_zeroed\":%" PRIu64 ",\"op\":\"one free, one malloc and its memset\"",
               live, min_mb, max_mb, seed, bytes);
  return 0;
}
