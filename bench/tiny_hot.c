/* tiny_hot — the hottest path there is: 64-byte objects, 100 allocated then
 * the same 100 freed, over and over. Measures the thread cache alone.
 * ops = OPS rounded down to whole batches; an op is one malloc or one free. */
#include "common.h"

#define SIZE 64
#define BATCH 100

int main(int argc, char **argv) {
  bench_usage_line = "tiny_hot [OPS=20000000]";
  uint64_t ops = arg_u64(argc, argv, 1, 20000000);
  uint64_t batches = ops / (2 * BATCH);
  bench_require(batches > 0, "need OPS >= 200");
  void *ptrs[BATCH];

  double t0 = bench_now();
  for (uint64_t b = 0; b < batches; b++) {
    for (int i = 0; i < BATCH; i++) {
      ptrs[i] = xmalloc(SIZE);
      touch(ptrs[i], SIZE);
    }
    for (int i = 0; i < BATCH; i++) free(ptrs[i]);
  }
  double t1 = bench_now();

  bench_report("tiny_hot", 1, batches * 2 * BATCH, t1 - t0,
               "\"size\":%d,\"batch\":%d,\"op\":\"one malloc or one free\"", SIZE, BATCH);
  return 0;
}
