/* object_replace — one thread keeps a set of LIVE objects of MIN..MAX bytes
 * (4 KiB to 1 MiB by default: buffers, pages, documents), and each step
 * replaces a random one: free it, allocate one of a new random size and
 * write it whole. What it measures is whether memory freed at one size is
 * reused for another without going back to the OS and faulting in fresh
 * pages. ops = replacements.
 *
 * Between random_mixed's small objects and large_churn's multi-MiB buffers:
 * the sizes where an allocator's largest classes meet its page heap. */
#include "common.h"

int main(int argc, char **argv) {
  bench_usage_line = "object_replace [STEPS=200000] [LIVE=64] [MIN=4096] [MAX=1048576] [SEED=42]";
  uint64_t steps = arg_u64(argc, argv, 1, 200000);
  uint64_t live = arg_u64(argc, argv, 2, 64);
  uint64_t min = arg_u64(argc, argv, 3, 4096);
  uint64_t max = arg_u64(argc, argv, 4, 1048576);
  uint64_t seed = arg_u64(argc, argv, 5, 42);
  bench_require(live > 0 && min > 0 && min <= max, "need LIVE > 0 and 0 < MIN <= MAX");

  rng_t r = rng_seed(seed);
  void **obj = xmalloc(live * sizeof *obj);
  for (uint64_t i = 0; i < live; i++) {
    size_t n = rng_range(&r, min, max);
    obj[i] = xmalloc(n);
    memset(obj[i], 1, n);
  }
  double t0 = bench_now();
  for (uint64_t s = 0; s < steps; s++) {
    uint64_t i = rng_below(&r, live);
    free(obj[i]);
    size_t n = rng_range(&r, min, max);
    obj[i] = xmalloc(n);
    memset(obj[i], (int)(s & 0xff), n);
    bench_escape(obj[i]);
  }
  double secs = bench_now() - t0;
  for (uint64_t i = 0; i < live; i++) free(obj[i]);
  free(obj);

  bench_report("object_replace", 1, steps, secs,
               "\"live\":%" PRIu64 ",\"min\":%" PRIu64 ",\"max\":%" PRIu64 ",\"seed\":%" PRIu64
               ",\"op\":\"one replacement: a free, a malloc and a write of the whole object\"",
               live, min, max, seed);
  return 0;
}
