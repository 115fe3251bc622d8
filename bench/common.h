/* common.h — what every benchmark shares: argument parsing, a seeded PRNG,
 * the timer, memory touching, allocator detection and the JSON result line.
 *
 * The benchmarks link against glibc only; the allocator under test is
 * swapped with LD_PRELOAD so that every allocator runs the same binary
 * (LESSONS.md 4). Each one prints, as its last line, one JSON object naming
 * the allocator it actually ran under (LESSONS.md 3), which the runner
 * checks against the one it meant to run.
 */
#ifndef BENCH_COMMON_H
#define BENCH_COMMON_H

#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ---- arguments ----------------------------------------------------------
 * Positional, each with a default: argv[i] if present, else def. A value
 * that is not a number exits 2 with the usage line. */

static const char *bench_usage_line = "";

static inline void bench_usage_exit(const char *bad) {
  fprintf(stderr, "bad argument '%s'\nusage: %s\n", bad, bench_usage_line);
  exit(2);
}

static inline uint64_t arg_u64(int argc, char **argv, int i, uint64_t def) {
  if (i >= argc) return def;
  char *end;
  errno = 0;
  unsigned long long v = strtoull(argv[i], &end, 0);
  if (errno || end == argv[i] || *end || argv[i][0] == '-') bench_usage_exit(argv[i]);
  return v;
}

static inline double arg_double(int argc, char **argv, int i, double def) {
  if (i >= argc) return def;
  char *end;
  errno = 0;
  double v = strtod(argv[i], &end);
  if (errno || end == argv[i] || *end || !(v >= 0)) bench_usage_exit(argv[i]);
  return v;
}

/* Exits 2 with `msg` when a parameter combination makes no sense. */
static inline void bench_require(int ok, const char *msg) {
  if (!ok) {
    fprintf(stderr, "%s\nusage: %s\n", msg, bench_usage_line);
    exit(2);
  }
}

/* ---- PRNG ---------------------------------------------------------------
 * splitmix64: one add and three multiply/xor-shift rounds per number, good
 * enough statistically for choosing slots and sizes, and deterministic for
 * a seed (unlike rand(), whose sequence depends on the libc). */

typedef struct { uint64_t s; } rng_t;

static inline rng_t rng_seed(uint64_t seed) { return (rng_t){seed * 0x9E3779B97F4A7C15ull + 1}; }

static inline uint64_t rng_next(rng_t *r) {
  uint64_t z = (r->s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* Uniform in [0, n) by multiply-shift (Lemire): no division on the hot
 * path; the bias for n far below 2^32 is negligible here. */
static inline uint64_t rng_below(rng_t *r, uint64_t n) {
  return (uint64_t)(((unsigned __int128)rng_next(r) * n) >> 64);
}

/* Uniform in [lo, hi]. */
static inline uint64_t rng_range(rng_t *r, uint64_t lo, uint64_t hi) {
  return lo + rng_below(r, hi - lo + 1);
}

/* ---- timer --------------------------------------------------------------*/

static inline uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static inline double bench_now(void) { return (double)now_ns() * 1e-9; }

/* Start and end of a multi-threaded run, spanned over all its threads:
 * each thread calls span_start() after the start barrier and span_end()
 * when done. Taking the start time in the main thread instead would be
 * wrong whenever the scheduler runs the workers first (2 cores, 3 threads):
 * the clock would start after the work. */
typedef struct {
  _Atomic uint64_t first_ns, last_ns;
} span_t;

static inline void span_start(span_t *s) {
  uint64_t t = now_ns(), cur = atomic_load(&s->first_ns);
  while ((cur == 0 || t < cur) && !atomic_compare_exchange_weak(&s->first_ns, &cur, t)) {}
}

static inline void span_end(span_t *s) {
  uint64_t t = now_ns(), cur = atomic_load(&s->last_ns);
  while (t > cur && !atomic_compare_exchange_weak(&s->last_ns, &cur, t)) {}
}

static inline double span_seconds(span_t *s) {
  return (double)(atomic_load(&s->last_ns) - atomic_load(&s->first_ns)) * 1e-9;
}

/* ---- memory -------------------------------------------------------------*/

/* Tells the compiler that p's memory is used, so that -O2 cannot drop a
 * malloc/touch/free sequence it proves dead (GCC removes unused
 * malloc/free pairs). Emits no instruction. */
static inline void bench_escape(void *p) { __asm__ volatile("" : : "r"(p) : "memory"); }

/* Writes the first and last byte of a fresh block, so an allocator that
 * hands out memory it never backs (or backs lazily) pays for the pages
 * like any other. */
static inline void touch(void *p, size_t n) {
  unsigned char *b = p;
  b[0] = (unsigned char)n;
  b[n - 1] = (unsigned char)(n >> 8);
  bench_escape(p);
}

/* malloc that exits 1 on NULL: a benchmark never measures a failed call. */
static inline void *xmalloc(size_t n) {
  void *p = malloc(n);
  if (!p) {
    fprintf(stderr, "malloc(%zu) failed\n", n);
    exit(1);
  }
  return p;
}

/* The random_mixed step loop, shared with mid_large_mt: each step picks a
 * random slot of the working set, frees it if occupied, else allocates a
 * random size in [min, max] into it. About half the slots are live in the
 * steady state. */
static inline void mixed_steps(rng_t *r, void **slots, uint64_t ws, uint64_t steps,
                               uint64_t min, uint64_t max) {
  for (uint64_t i = 0; i < steps; i++) {
    void **slot = &slots[rng_below(r, ws)];
    if (*slot) {
      free(*slot);
      *slot = NULL;
    } else {
      size_t n = rng_range(r, min, max);
      *slot = xmalloc(n);
      touch(*slot, n);
    }
  }
}

/* Frees whatever a working set still holds (after the timed loop). */
static inline void free_slots(void **slots, uint64_t ws) {
  for (uint64_t i = 0; i < ws; i++) free(slots[i]);
  free(slots);
}

/* ---- which allocator is this? -------------------------------------------
 * Looks for a symbol only that allocator exports, in the whole process
 * (the preloaded library included). */
static inline const char *bench_allocator(void) {
  static const struct { const char *sym, *name; } probes[] = {
    {"hk_stats_get", "hakmem"},
    {"mi_version", "mimalloc"},
    {"mallctl", "jemalloc"},
    {"tc_malloc", "tcmalloc"},
    {"MallocExtension_GetNumericProperty", "tcmalloc"},
  };
  for (size_t i = 0; i < sizeof probes / sizeof probes[0]; i++)
    if (dlsym(RTLD_DEFAULT, probes[i].sym)) return probes[i].name;
  return "glibc";
}

/* ---- peak memory --------------------------------------------------------
 * Peak resident memory of this process since its exec, in KiB: VmHWM of
 * /proc/self/status. Not getrusage/wait4's ru_maxrss: at exec the kernel
 * folds the high-water mark of the image being replaced into it, so a
 * benchmark started by a Python runner reports the runner's ~20 MiB instead
 * of its own 2. Read with open/read after the timed loop, so no FILE buffer
 * is allocated. 0 when unavailable. */
static inline long bench_peak_rss_kb(void) {
  char buf[8192];
  int fd = open("/proc/self/status", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0) return 0;
  buf[n] = 0;
  const char *p = strstr(buf, "VmHWM:");
  return p ? strtol(p + 6, NULL, 10) : 0;
}

/* Peak RSS of child processes in KiB, for benchmarks that spawn some
 * (startup); bench_report reports the larger of it and our own. */
static long bench_children_peak_kb;

/* ---- result -------------------------------------------------------------
 * Prints the one-line JSON result: the fields every benchmark has (peak
 * RSS included), then
 * the benchmark's own (`extra_fmt` is printf-style text of
 * `"key":value` pairs separated by commas, or NULL). */
static inline void bench_report(const char *bench, int threads, uint64_t ops, double seconds,
                         const char *extra_fmt, ...) {
  long peak = bench_peak_rss_kb();
  if (bench_children_peak_kb > peak) peak = bench_children_peak_kb;
  printf("{\"bench\":\"%s\",\"allocator\":\"%s\",\"threads\":%d,\"ops\":%" PRIu64
         ",\"seconds\":%.6f,\"ops_per_sec\":%.1f,\"peak_rss_kb\":%ld",
         bench, bench_allocator(), threads, ops, seconds, seconds > 0 ? (double)ops / seconds : 0.0, peak);
  if (extra_fmt) {
    va_list ap;
    va_start(ap, extra_fmt);
    putchar(',');
    vprintf(extra_fmt, ap);
    va_end(ap);
  }
  printf("}\n");
  fflush(stdout);
}

#endif
