/* aligned — posix_memalign / aligned_alloc / memalign, mixed, with
 * alignments 16..4096 and sizes 8..8192 (for aligned_alloc, rounded up to
 * a multiple of the alignment as C11 requires). Every pointer is checked:
 * a misaligned one is reported on stderr and exits 3 — an allocator that
 * gets alignment wrong must fail here, not score. A working set of WS
 * slots keeps frees interleaved; each op is one aligned allocation (and the
 * free of the block it replaces). */
#include "common.h"
#include <malloc.h>

#define WS 256
#define MIN_SIZE 8
#define MAX_SIZE 8192

int main(int argc, char **argv) {
  bench_usage_line = "aligned [OPS=5000000] [SEED=42]";
  uint64_t ops = arg_u64(argc, argv, 1, 5000000);
  uint64_t seed = arg_u64(argc, argv, 2, 42);
  static const char *const fn[] = {"posix_memalign", "aligned_alloc", "memalign"};

  void *slots[WS] = {0};
  rng_t r = rng_seed(seed);

  double t0 = bench_now();
  for (uint64_t i = 0; i < ops; i++) {
    void **slot = &slots[rng_below(&r, WS)];
    free(*slot);
    unsigned kind = (unsigned)rng_below(&r, 3);
    size_t align = (size_t)16 << rng_below(&r, 9); /* 16 .. 4096 */
    size_t size = rng_range(&r, MIN_SIZE, MAX_SIZE);
    void *p = NULL;
    switch (kind) {
    case 0:
      if (posix_memalign(&p, align, size)) p = NULL;
      break;
    case 1:
      size = (size + align - 1) & ~(align - 1);
      p = aligned_alloc(align, size);
      break;
    default:
      p = memalign(align, size);
      break;
    }
    if (!p) {
      fprintf(stderr, "aligned: %s(%zu, %zu) failed\n", fn[kind], align, size);
      return 1;
    }
    if ((uintptr_t)p & (align - 1)) {
      fprintf(stderr, "aligned: misaligned pointer %p for alignment %zu (size %zu)\n", p, align, size);
      return 3;
    }
    touch(p, size);
    *slot = p;
  }
  double t1 = bench_now();

  for (int i = 0; i < WS; i++) free(slots[i]);
  bench_report("aligned", 1, ops, t1 - t0,
               "\"seed\":%" PRIu64 ",\"ws\":%d,\"min_align\":16,\"max_align\":4096,\"min\":%d,\"max\":%d"
               ",\"op\":\"one aligned allocation and one free\"",
               seed, WS, MIN_SIZE, MAX_SIZE);
  return 0;
}
