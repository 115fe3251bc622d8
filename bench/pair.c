/* pair.c — N malloc+free pairs of one size, for instruction counts of the
 * fast path under callgrind (bench/callgrind.sh). 100 pairs first, so the
 * class's bin holds a block before the counted loop. */
#include <stdlib.h>

int main(int argc, char** argv) {
  long n = argc > 1 ? atol(argv[1]) : 0;
  size_t size = argc > 2 ? (size_t)atol(argv[2]) : 64;
  for (int i = 0; i < 100; i++) {
    void* volatile p = malloc(size);
    free(p);
  }
  for (long i = 0; i < n; i++) {
    void* volatile p = malloc(size);
    free(p);
  }
  return 0;
}
