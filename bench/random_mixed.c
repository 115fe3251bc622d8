/* random_mixed — one thread, a working set of WS slots; each step frees a
 * random occupied slot or fills an empty one with a random size in
 * [MIN, MAX]. The general small-object mix: many sizes, frees in random
 * order, about WS/2 objects live. ops = ITERS (one malloc or one free). */
#include "common.h"

int main(int argc, char **argv) {
  bench_usage_line = "random_mixed [ITERS=20000000] [WS=400] [SEED=42] [MIN=16] [MAX=1024]";
  uint64_t iters = arg_u64(argc, argv, 1, 20000000);
  uint64_t ws = arg_u64(argc, argv, 2, 400);
  uint64_t seed = arg_u64(argc, argv, 3, 42);
  uint64_t min = arg_u64(argc, argv, 4, 16);
  uint64_t max = arg_u64(argc, argv, 5, 1024);
  bench_require(ws > 0 && min > 0 && min <= max, "need WS > 0 and 0 < MIN <= MAX");

  void **slots = calloc(ws, sizeof *slots);
  rng_t r = rng_seed(seed);

  double t0 = bench_now();
  mixed_steps(&r, slots, ws, iters, min, max);
  double t1 = bench_now();

  free_slots(slots, ws);
  bench_report("random_mixed", 1, iters, t1 - t0,
               "\"iters\":%" PRIu64 ",\"ws\":%" PRIu64 ",\"seed\":%" PRIu64 ",\"min\":%" PRIu64
               ",\"max\":%" PRIu64 ",\"op\":\"one malloc or one free\"",
               iters, ws, seed, min, max);
  return 0;
}
