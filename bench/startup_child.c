/* startup_child — the short-lived process that `startup` spawns: ALLOCS
 * allocations of mixed small sizes (one in 16 of 1..4 KiB), about half of
 * them freed again at random, the rest left for exit, as a small tool
 * does. Prints nothing; exits 0. */
#include "common.h"

int main(int argc, char **argv) {
  bench_usage_line = "startup_child [ALLOCS=3000] [SEED=1]";
  uint64_t allocs = arg_u64(argc, argv, 1, 3000);
  uint64_t seed = arg_u64(argc, argv, 2, 1);
  bench_require(allocs > 0, "need ALLOCS > 0");

  rng_t r = rng_seed(seed);
  void **ptrs = calloc(allocs, sizeof *ptrs);
  for (uint64_t i = 0; i < allocs; i++) {
    size_t n = rng_below(&r, 16) ? rng_range(&r, 8, 512) : rng_range(&r, 1024, 4096);
    ptrs[i] = xmalloc(n);
    touch(ptrs[i], n);
    if (rng_below(&r, 2)) {
      void **victim = &ptrs[rng_below(&r, i + 1)];
      free(*victim);
      *victim = NULL;
    }
  }
  return 0;
}
