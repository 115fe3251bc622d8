/* realloc_grow — string-builder growth: buffers grown by realloc in random
 * appends of 1..256 bytes up to a target size, then checked and freed.
 * Targets spread log-uniformly from 256 B to FINAL; one buffer in 32 grows
 * further, up to 16 x FINAL. LIVE buffers grow at once, interleaved, so a
 * buffer's neighbours keep changing (in-place growth is not a given).
 *
 * Every byte appended is written, and when a buffer is done its whole
 * content is compared with what was appended; a mismatch exits 1. That
 * check is not timed. ops = realloc calls. */
#include "common.h"

#define LIVE 16
#define APPEND_MAX 256
#define PAT (1u << 16)

/* Buffer content is a window of this random pattern: byte i of a buffer is
 * pattern[(off + i) % PAT]. The APPEND_MAX extra bytes repeat the start so
 * that one memcpy serves any append. */
static unsigned char pattern[PAT + APPEND_MAX];

typedef struct {
  unsigned char *p;
  size_t size, target, off;
} buf_t;

/* About log-uniform in [lo, hi]: a uniform power of two, then uniform
 * within it. */
static uint64_t log_uniform(rng_t *r, uint64_t lo, uint64_t hi) {
  unsigned lb = 63 - __builtin_clzll(lo), hb = 63 - __builtin_clzll(hi);
  unsigned k = (unsigned)rng_range(r, lb, hb);
  uint64_t a = (1ull << k) > lo ? (1ull << k) : lo;
  uint64_t b = (2ull << k) - 1 < hi ? (2ull << k) - 1 : hi;
  return rng_range(r, a, b);
}

static void start_buffer(buf_t *b, rng_t *r, uint64_t final) {
  b->p = NULL;
  b->size = 0;
  b->target = rng_below(r, 32) == 0 ? log_uniform(r, final, 16 * final) : log_uniform(r, 256, final);
  b->off = rng_below(r, PAT);
}

/* Compares the buffer with the pattern window it should hold. */
static int content_ok(const buf_t *b, size_t *bad_at) {
  for (size_t pos = 0; pos < b->size;) {
    size_t at = (b->off + pos) % PAT, n = PAT - at;
    if (n > b->size - pos) n = b->size - pos;
    if (memcmp(b->p + pos, pattern + at, n)) {
      *bad_at = pos;
      return 0;
    }
    pos += n;
  }
  return 1;
}

int main(int argc, char **argv) {
  bench_usage_line = "realloc_grow [BUFFERS=400] [FINAL=1048576] [SEED=42]";
  uint64_t buffers = arg_u64(argc, argv, 1, 400);
  uint64_t final = arg_u64(argc, argv, 2, 1 << 20);
  uint64_t seed = arg_u64(argc, argv, 3, 42);
  bench_require(buffers > 0 && final >= 256 && final <= (1ull << 36), "need BUFFERS > 0 and 256 <= FINAL <= 64 GiB");

  rng_t r = rng_seed(seed);
  for (size_t i = 0; i < PAT; i++) pattern[i] = (unsigned char)rng_next(&r);
  memcpy(pattern + PAT, pattern, APPEND_MAX);

  buf_t live[LIVE];
  uint64_t nlive = buffers < LIVE ? buffers : LIVE, started = nlive, finished = 0;
  uint64_t reallocs = 0, bytes = 0;
  double unmeasured = 0; /* seconds spent checking contents */
  for (uint64_t i = 0; i < nlive; i++) start_buffer(&live[i], &r, final);

  double t0 = bench_now();
  while (nlive) {
    buf_t *b = &live[rng_below(&r, nlive)];
    size_t n = rng_range(&r, 1, APPEND_MAX);
    if (n > b->target - b->size) n = b->target - b->size;
    unsigned char *p = realloc(b->p, b->size + n);
    if (!p) {
      fprintf(stderr, "realloc_grow: realloc(%zu) failed\n", b->size + n);
      return 1;
    }
    memcpy(p + b->size, pattern + (b->off + b->size) % PAT, n);
    b->p = p;
    b->size += n;
    reallocs++;
    bytes += n;
    if (b->size < b->target) continue;

    double c0 = bench_now();
    size_t bad_at;
    if (!content_ok(b, &bad_at)) {
      fprintf(stderr, "realloc_grow: buffer %" PRIu64 " lost its content at byte %zu of %zu\n",
              finished, bad_at, b->size);
      return 1;
    }
    unmeasured += bench_now() - c0;
    free(b->p);
    finished++;
    if (started < buffers) {
      start_buffer(b, &r, final);
      started++;
    } else {
      *b = live[--nlive];
    }
  }
  double t1 = bench_now();

  bench_report("realloc_grow", 1, reallocs, t1 - t0 - unmeasured,
               "\"buffers\":%" PRIu64 ",\"final\":%" PRIu64 ",\"seed\":%" PRIu64
               ",\"bytes_appended\":%" PRIu64 ",\"verified\":true,\"op\":\"one realloc\"",
               buffers, final, seed, bytes);
  return 0;
}
