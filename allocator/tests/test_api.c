/* test_api.c — API semantics of hakmem's malloc family, glibc-compatible.
 *
 * What is asserted (each TEST says more):
 *   - malloc: sizes 0..4096 byte by byte and a geometric sweep to 64 MiB:
 *     non-NULL, 16-byte aligned, malloc_usable_size >= n, the whole usable
 *     size writable and keeping its contents, live blocks never overlap;
 *     malloc(0) gives distinct freeable pointers; impossible sizes give
 *     NULL + ENOMEM.
 *   - calloc zeroes (also memory recycled from dirty frees), overflow ->
 *     NULL + ENOMEM, calloc(0, x) / calloc(x, 0) freeable.
 *   - reallocarray overflow -> NULL + ENOMEM, old block intact.
 *   - realloc keeps contents across every size-class range transition
 *     (small/medium/huge both ways), NULL + ENOMEM with the old block intact
 *     for impossible sizes, in place when the usable size already fits.
 *     realloc(p, 0) frees p and returns NULL, as glibc's does (the free is
 *     seen in the counters). Huge blocks grow in place with mremap when the
 *     address space after them is free (same pointer, one mremap, no new
 *     mapping) and move, contents kept, when it is not (the mapping there
 *     left untouched).
 *   - posix_memalign / aligned_alloc / memalign / valloc / pvalloc.
 *   - free(NULL), free_sized, free_aligned_sized.
 *   - glibc extras: mallopt (always 1: accepted, ignored), malloc_trim (1
 *     when it returned something, 0 when there was nothing left; committed
 *     bytes back to what they were before a slab-heavy and a huge-block
 *     pattern, resident memory down), mallinfo2 / mallinfo (exact: the live
 *     bytes of the counters), malloc_stats, malloc_info.
 *   - hakmem's own API: size classes, hk_stats_get (this thread's counts
 *     exact), hk_policy_version.
 *   - a deterministic random mix of sizes 16 B..2 MiB freed in random order.
 *
 * Large blocks (> DENSE_MAX) are checked sparsely (head and tail 4 KiB in
 * full, one word per 64 bytes in between) to keep the run short under
 * valgrind; everything up to DENSE_MAX is checked byte for byte.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <sys/mman.h>
#include <fcntl.h>
#include <malloc.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "hakmem.h"
#include "harness.h"
#include "testutil.h"
#include <sys/resource.h>
#include <sys/wait.h>

/* C23 / glibc 2.39 calls; hakmem exports them, glibc 2.36 headers lack them. */
extern void free_sized(void*, size_t);
extern void free_aligned_sized(void*, size_t, size_t);

#define KiB ((size_t)1024)
#define MiB ((size_t)1024 * 1024)
#define DENSE_MAX MiB

/* Sizes no allocator can satisfy; volatile so the compiler neither warns
 * about nor folds the calls. */
static volatile size_t v_size_max = SIZE_MAX;
static volatile size_t v_ptrdiff_max_1 = (size_t)PTRDIFF_MAX + 1;
static volatile size_t v_1_62 = (size_t)1 << 62;
static volatile size_t v_1_33 = (size_t)1 << 33;

/* Calls expected to fail and leave their block alone go through these, so
 * that gcc's -Wuse-after-free does not flag the later (valid) uses. */
static void* (*volatile realloc_may_fail)(void*, size_t) = realloc;
static void* (*volatile reallocarray_may_fail)(void*, size_t, size_t) = reallocarray;

static int aligned_to(const void* p, size_t a) { return ((uintptr_t)p & (a - 1)) == 0; }

/* ---- deterministic patterns -------------------------------------------- */

static uint64_t pat_word(uint64_t tag, size_t i) {
  uint64_t x = (tag * 0x9E3779B97F4A7C15ull) ^ ((uint64_t)i * 0xD6E8FEB86659FD93ull) ^ (tag >> 7);
  x ^= x >> 29;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 32;
  return x;
}
static unsigned char pat_byte(uint64_t tag, size_t off) {
  return (unsigned char)(pat_word(tag, off / 8) >> (8 * (off % 8)));
}
/* Word index after i in the fill order of a block of nw whole words. */
static size_t pat_next(size_t i, size_t nw, int dense) {
  size_t tail = nw > 512 ? nw - 512 : 0; /* the last 512 words are all visited */
  if (dense || i < 512 || i + 1 >= tail) return i + 1;
  return i + 8 < tail ? i + 8 : tail;
}
static int pat_selected(size_t i, size_t nw, int dense) {
  return dense || i < 512 || i + 512 >= nw || (i - 512) % 8 == 0;
}

/* Writes the pattern of `tag` over n bytes. */
static void fill_pat(void* p, size_t n, uint64_t tag) {
  unsigned char* b = p;
  size_t nw = n / 8;
  int dense = n <= DENSE_MAX;
  for (size_t i = 0; i < nw; i = pat_next(i, nw, dense)) {
    uint64_t w = pat_word(tag, i);
    memcpy(b + 8 * i, &w, 8);
  }
  for (size_t off = nw * 8; off < n; off++) b[off] = pat_byte(tag, off);
}

/* Checks the first n bytes of a block that fill_pat(p, filled, tag) wrote
 * (n <= filled). Returns -1 if intact, else the offset of the first
 * difference. */
static long check_pat(const void* p, size_t n, size_t filled, uint64_t tag) {
  const unsigned char* b = p;
  size_t nw = filled / 8;
  int dense = filled <= DENSE_MAX;
  size_t full = n / 8;  /* whole words inside n */
  for (size_t i = 0; i < full && i < nw; i = pat_next(i, nw, dense)) {
    uint64_t w;
    memcpy(&w, b + 8 * i, 8);
    if (w != pat_word(tag, i)) {
      for (size_t k = 0; k < 8; k++)
        if (b[8 * i + k] != pat_byte(tag, 8 * i + k)) return (long)(8 * i + k);
    }
  }
  /* The partial word at the end of n (or the byte tail of the fill). */
  if (full >= nw || pat_selected(full, nw, dense))
    for (size_t off = full * 8; off < n; off++)
      if (b[off] != pat_byte(tag, off)) return (long)off;
  return -1;
}

#define CHECK_PAT(p, n, filled, tag)                                          \
  do {                                                                        \
    long off_ = check_pat((p), (n), (filled), (tag));                         \
    if (off_ >= 0)                                                            \
      harness_say("  pattern mismatch at offset %ld of %zu (block %p)\n",     \
                  off_, (size_t)(n), (void*)(p));                             \
    CHECK(off_ < 0);                                                          \
  } while (0)

/* xorshift64, deterministic. */
static uint64_t rng_state = 0x2545F4914F6CDD1Dull;
static uint64_t rng(void) {
  uint64_t x = rng_state;
  x ^= x << 13;
  x ^= x >> 7;
  x ^= x << 17;
  return rng_state = x;
}

/* ---- live-block bookkeeping -------------------------------------------- */

typedef struct {
  unsigned char* p;
  size_t n;      /* requested */
  size_t u;      /* usable (filled) */
  uint64_t tag;
} blk_t;

static int overlaps(const blk_t* a, const blk_t* b) {
  uintptr_t a0 = (uintptr_t)a->p, a1 = a0 + a->u;
  uintptr_t b0 = (uintptr_t)b->p, b1 = b0 + b->u;
  return a0 < b1 && b0 < a1;
}

static uint64_t next_tag = 1;

/* malloc(n) with the basic checks; fills the whole usable size. */
static int take(blk_t* b, size_t n, const blk_t* live, size_t nlive) {
  b->p = malloc(n);
  b->n = n;
  if (!b->p) {
    harness_say("  malloc(%zu) returned NULL\n", n);
    CHECK(b->p != NULL);
    return 0;
  }
  b->u = malloc_usable_size(b->p);
  b->tag = next_tag++;
  if (!aligned_to(b->p, 16) || b->u < n)
    harness_say("  malloc(%zu) = %p usable %zu\n", n, (void*)b->p, b->u);
  CHECK(aligned_to(b->p, 16));
  CHECK(b->u >= n);
  if (b->u < n) b->u = n;
  for (size_t i = 0; i < nlive; i++) {
    if (live[i].p && overlaps(b, &live[i])) {
      harness_say("  overlap: %p+%zu and live %p+%zu\n", (void*)b->p, b->u,
                  (void*)live[i].p, live[i].u);
      CHECK(!overlaps(b, &live[i]));
    }
  }
  fill_pat(b->p, b->u, b->tag);
  return 1;
}

static void give(blk_t* b) {
  if (!b->p) return;
  CHECK_PAT(b->p, b->u, b->u, b->tag);
  free(b->p);
  b->p = NULL;
}

/* ---- malloc -------------------------------------------------------------- */

/* Everything below assumes malloc is hakmem's. Under valgrind it is only if
 * valgrind is told not to replace malloc in the (statically linked) main
 * program: --soname-synonyms=somalloc=nouserintercepts. */
TEST(malloc_is_hakmem) {
  static hk_stats_t s0, s1;
  unsigned c = hk_size_class(100);
  REQUIRE(hk_stats_get(&s0) == 0);
  void* p[16];
  for (int i = 0; i < 16; i++) p[i] = malloc(100);
  REQUIRE(hk_stats_get(&s1) == 0);
  for (int i = 0; i < 16; i++) free(p[i]);
  int ok = s1.cls[c].allocs >= s0.cls[c].allocs + 16;
  if (!ok)
    harness_say("  malloc is not hakmem's: under valgrind, run with "
                "--soname-synonyms=somalloc=nouserintercepts\n");
  REQUIRE(ok);
}

#define RING 256

TEST(malloc_every_small_size) {
  static blk_t ring[RING];
  memset(ring, 0, sizeof ring);
  for (size_t n = 0; n <= 4096; n++) {
    blk_t* slot = &ring[n % RING];
    give(slot);
    blk_t b;
    if (!take(&b, n, ring, RING)) return;
    *slot = b;
  }
  for (size_t i = 0; i < RING; i++) give(&ring[(i * 97) % RING]);
}

TEST(malloc_geometric_to_64MiB) {
  size_t sizes[128], ns = 0;
  for (size_t p = 4096; p <= 64 * MiB; p *= 2) {
    if (p <= MiB) {
      size_t s[] = {p - 1, p, p + 1, p + p / 4, p + p / 2, p + 3 * p / 4};
      for (size_t i = 0; i < 6; i++) sizes[ns++] = s[i];
    } else if (p < 64 * MiB) {
      size_t s[] = {p - 1, p + 1, p + p / 2};
      for (size_t i = 0; i < 3; i++) sizes[ns++] = s[i];
    } else {
      sizes[ns++] = p - 1;
      sizes[ns++] = p;
    }
  }
  enum { LIVE = 8 };
  blk_t live[LIVE];
  memset(live, 0, sizeof live);
  for (size_t i = 0; i < ns; i++) {
    blk_t* slot = &live[i % LIVE];
    give(slot);
    blk_t b;
    if (!take(&b, sizes[i], live, LIVE)) return;
    *slot = b;
  }
  for (size_t i = 0; i < LIVE; i++) give(&live[i]);
}

TEST(malloc_zero_unique) {
  void* a = malloc(0);
  void* b = malloc(0);
  CHECK(a != NULL);
  CHECK(b != NULL);
  CHECK(a != b);
  CHECK(aligned_to(a, 16));
  CHECK(aligned_to(b, 16));
  free(a);
  free(b);
  /* Many of them stay distinct. */
  void* z[64];
  for (int i = 0; i < 64; i++) z[i] = malloc(0);
  for (int i = 0; i < 64; i++) {
    CHECK(z[i] != NULL);
    for (int j = 0; j < i; j++) CHECK(z[i] != z[j]);
  }
  for (int i = 0; i < 64; i++) free(z[i]);
}

TEST(malloc_impossible_sizes) {
  size_t bad[] = {v_size_max, v_ptrdiff_max_1, v_1_62, v_size_max - 4096, v_size_max - 15};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    errno = 0;
    void* p = malloc(bad[i]);
    if (p) harness_say("  malloc(%zu) = %p\n", bad[i], p);
    CHECK(p == NULL);
    CHECK_EQ(errno, ENOMEM);
    free(p);
  }
  void* ok = malloc(100); /* still works */
  CHECK(ok != NULL);
  free(ok);
}

/* ---- calloc -------------------------------------------------------------- */

TEST(calloc_zeroed) {
  for (size_t n = 1; n <= 2048; n += (n < 256 ? 1 : 7)) {
    unsigned char* p = calloc(1, n);
    REQUIRE(p != NULL);
    CHECK(aligned_to(p, 16));
    CHECK(check_byte(p, n, 0) < 0);
    memset(p, 0xAA, malloc_usable_size(p));
    free(p);
  }
  for (size_t n = 4096; n <= 8 * MiB; n = n * 3 / 2 + 16) {
    unsigned char* p = calloc(n / 16, 16);
    REQUIRE(p != NULL);
    CHECK(malloc_usable_size(p) >= n / 16 * 16);
    CHECK(check_byte(p, n / 16 * 16, 0) < 0);
    free(p);
  }
}

TEST(calloc_after_dirty_free) {
  static const size_t sizes[] = {16,     24,     48,        64,      100,      128,
                                 256,    1000,   4096,      8192,    20000,    65536,
                                 100000, 262144, MiB - 16,  MiB,     MiB + MiB / 2,
                                 2 * MiB, 20 * MiB};
  enum { K = 8 };
  for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
    size_t n = sizes[s];
    int k = n >= MiB ? 1 : K;
    int rounds = n >= 8 * MiB ? 2 : 4;
    for (int r = 0; r < rounds; r++) {
      void* d[K];
      for (int i = 0; i < k; i++) {
        d[i] = malloc(n);
        REQUIRE(d[i] != NULL);
        memset(d[i], 0xAA, malloc_usable_size(d[i]));
      }
      for (int i = 0; i < k; i++) free(d[i]);
      for (int i = 0; i < k; i++) {
        d[i] = (r & 1) ? calloc(n / 8, 8) : calloc(n, 1);
        REQUIRE(d[i] != NULL);
        size_t m = (r & 1) ? n / 8 * 8 : n;
        long off = check_byte(d[i], m, 0);
        if (off >= 0) harness_say("  calloc(%zu) byte %ld not zero\n", m, off);
        CHECK(off < 0);
        memset(d[i], 0xAA, m);
      }
      for (int i = 0; i < k; i++) free(d[i]);
    }
  }
}

/* A cached huge mapping serves a request of another size: the pages an
 * earlier object touched must be zeroed for calloc however far they reach,
 * and the fresh ones past them read zero on their own. */
TEST(calloc_huge_reuses_other_sizes) {
  static const size_t pairs[][2] = {{20 * MiB, 18 * MiB}, {6 * MiB, 9 * MiB}, {13 * MiB, 12 * MiB},
                                    {5 * MiB, 7 * MiB}, {24 * MiB, 17 * MiB}, {9 * MiB, 9 * MiB + 100}};
  for (int r = 0; r < 2; r++)
    for (size_t i = 0; i < sizeof pairs / sizeof pairs[0]; i++) {
      unsigned char* a = malloc(pairs[i][0]);
      REQUIRE(a != NULL);
      memset(a, 0xAA, malloc_usable_size(a));
      unsigned char* keep = malloc(3 * MiB);   /* so the cache holds more than one */
      REQUIRE(keep != NULL);
      memset(keep, 0xBB, 3 * MiB);
      free(a);
      unsigned char* c = calloc(1, pairs[i][1]);
      REQUIRE(c != NULL);
      long off = check_byte(c, pairs[i][1], 0);
      if (off >= 0) harness_say("  %zu then calloc(%zu): byte %ld not zero\n", pairs[i][0], pairs[i][1], off);
      CHECK(off < 0);
      memset(c, 0xCC, pairs[i][1]);
      free(keep);
      free(c);
    }
}

TEST(calloc_overflow_and_zero) {
  errno = 0;
  void* p = calloc(v_size_max / 2, 3);
  CHECK(p == NULL);
  CHECK_EQ(errno, ENOMEM);
  errno = 0;
  p = calloc(v_1_33, v_1_33);
  CHECK(p == NULL);
  CHECK_EQ(errno, ENOMEM);
  errno = 0;
  p = calloc(v_size_max, v_size_max);
  CHECK(p == NULL);
  CHECK_EQ(errno, ENOMEM);
  errno = 0;
  p = calloc(v_ptrdiff_max_1 / 2, 2); /* no overflow, but too large */
  CHECK(p == NULL);
  CHECK_EQ(errno, ENOMEM);
  errno = 0;
  p = calloc(1, v_1_62);
  CHECK(p == NULL);
  CHECK_EQ(errno, ENOMEM);

  void* a = calloc(0, 100);
  void* b = calloc(100, 0);
  void* c = calloc(0, 0);
  CHECK(a != NULL);
  CHECK(b != NULL);
  CHECK(c != NULL);
  CHECK(a != b && b != c && a != c);
  free(a);
  free(b);
  free(c);
}

/* ---- reallocarray -------------------------------------------------------- */

TEST(reallocarray_semantics) {
  unsigned char* p = reallocarray(NULL, 10, 10);
  REQUIRE(p != NULL);
  CHECK(malloc_usable_size(p) >= 100);
  fill_pat(p, 100, 77);
  errno = 0;
  void* q = reallocarray_may_fail(p, v_size_max / 2, 3);
  CHECK(q == NULL);
  CHECK_EQ(errno, ENOMEM);
  errno = 0;
  q = reallocarray_may_fail(p, v_1_33, v_1_33);
  CHECK(q == NULL);
  CHECK_EQ(errno, ENOMEM);
  CHECK_PAT(p, 100, 100, 77); /* old block untouched */
  q = reallocarray(p, 1000, 10);
  REQUIRE(q != NULL);
  p = q;
  CHECK(malloc_usable_size(p) >= 10000);
  CHECK_PAT(p, 100, 100, 77);
  memset(p + 100, 1, 10000 - 100);
  q = reallocarray(p, 5, 4);
  REQUIRE(q != NULL);
  CHECK_PAT(q, 20, 100, 77);
  free(q);
}

/* ---- realloc ------------------------------------------------------------- */

TEST(realloc_null_is_malloc) {
  size_t sizes[] = {0, 1, 15, 16, 17, 100, 4096, 40000, 300000, 2 * MiB, 5 * MiB};
  for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
    unsigned char* p = realloc(NULL, sizes[i]);
    REQUIRE(p != NULL);
    CHECK(aligned_to(p, 16));
    CHECK(malloc_usable_size(p) >= sizes[i]);
    fill_pat(p, sizes[i], 5);
    CHECK_PAT(p, sizes[i], sizes[i], 5);
    free(p);
  }
}

static const size_t realloc_sizes[] = {
    1,     16,     24,     100,    512,      1024,     4000,    8192,
    20000, 32768,  100000, 500000, MiB - 16, MiB + 16, 2 * MiB, 20 * MiB};
#define N_REALLOC_SIZES (sizeof realloc_sizes / sizeof realloc_sizes[0])

TEST(realloc_every_transition) {
  for (size_t i = 0; i < N_REALLOC_SIZES; i++) {
    for (size_t j = 0; j < N_REALLOC_SIZES; j++) {
      size_t a = realloc_sizes[i], b = realloc_sizes[j];
      size_t m = a < b ? a : b;
      uint64_t tag = next_tag++;
      unsigned char* p = malloc(a);
      REQUIRE(p != NULL);
      fill_pat(p, a, tag);
      unsigned char* q = realloc(p, b);
      if (!q) harness_say("  realloc(%zu -> %zu) = NULL\n", a, b);
      REQUIRE(q != NULL);
      CHECK(aligned_to(q, 16));
      CHECK(malloc_usable_size(q) >= b);
      long off = check_pat(q, m, a, tag);
      if (off >= 0) harness_say("  realloc %zu -> %zu lost byte %ld\n", a, b, off);
      CHECK(off < 0);
      /* The whole new size is writable; then go back to the old size. */
      uint64_t tag2 = next_tag++;
      fill_pat(q, b, tag2);
      unsigned char* r = realloc(q, a);
      REQUIRE(r != NULL);
      CHECK(malloc_usable_size(r) >= a);
      off = check_pat(r, m, b, tag2);
      if (off >= 0) harness_say("  realloc back %zu -> %zu lost byte %ld\n", b, a, off);
      CHECK(off < 0);
      free(r);
    }
  }
}

TEST(realloc_growth_chain) {
  /* Vector-like growth by 1.5x to 8 MiB, then shrinking back down. */
  uint64_t tag = next_tag++;
  size_t n = 1;
  unsigned char* p = malloc(n);
  REQUIRE(p != NULL);
  fill_pat(p, n, tag);
  while (n < 8 * MiB) {
    size_t nn = n * 3 / 2 + 1;
    unsigned char* q = realloc(p, nn);
    REQUIRE(q != NULL);
    /* fill_pat over [0, nn) with one tag: positions agree for any length
     * only in dense mode, so check against the previous fill length. */
    CHECK_PAT(q, n, n, tag);
    fill_pat(q, nn, tag);
    p = q;
    n = nn;
  }
  while (n > 1) {
    size_t nn = n / 3;
    if (nn == 0) nn = 1;
    unsigned char* q = realloc(p, nn);
    REQUIRE(q != NULL);
    CHECK_PAT(q, nn, n, tag);
    fill_pat(q, nn, tag);
    p = q;
    n = nn;
  }
  free(p);
}

TEST(realloc_impossible_keeps_block) {
  size_t sizes[] = {100, 40000, 3 * MiB};
  size_t bad[] = {v_size_max, v_ptrdiff_max_1, v_1_62, v_size_max - 4096};
  for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
    unsigned char* p = malloc(sizes[i]);
    REQUIRE(p != NULL);
    fill_pat(p, sizes[i], 99 + i);
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
      errno = 0;
      void* q = realloc_may_fail(p, bad[k]);
      CHECK(q == NULL);
      CHECK_EQ(errno, ENOMEM);
      if (q) p = q;
    }
    CHECK_PAT(p, sizes[i], sizes[i], 99 + i);
    CHECK(malloc_usable_size(p) >= sizes[i]);
    free(p);
  }
}

TEST(realloc_to_zero) {
  /* glibc: realloc(p, 0) frees p and returns NULL; hakmem does the same
   * (README "API"). The free is seen in this thread's counters: the class's
   * frees go up by one and its live bytes down by the block. */
  size_t sizes[] = {1, 100, 40000, 3 * MiB};
  static hk_stats_t a, b;
  for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
    void* p = malloc(sizes[i]);
    REQUIRE(p != NULL);
    unsigned c = hk_size_class(sizes[i]);
    REQUIRE(hk_stats_get(&a) == 0);
    void* q = realloc(p, 0);
    REQUIRE(hk_stats_get(&b) == 0);
    if (q) harness_say("  realloc(p of %zu, 0) = %p, not NULL\n", sizes[i], q);
    CHECK(q == NULL);
    CHECK_EQ(b.cls[c].frees - a.cls[c].frees, 1);
    CHECK_EQ(b.cls[c].allocs - a.cls[c].allocs, 0);
    CHECK_EQ(a.cls[c].live_bytes - b.cls[c].live_bytes, c ? hk_class_size(c) : sizes[i]);
    if (q) free(q);
  }
  void* ok = malloc(64); /* heap still fine */
  CHECK(ok != NULL);
  free(ok);
}

TEST(realloc_in_place_when_fits) {
  size_t sizes[] = {1, 17, 100, 1000, 5000, 40000, 300000, MiB + MiB / 2, 3 * MiB};
  for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
    size_t n = sizes[i];
    unsigned char* p = malloc(n);
    REQUIRE(p != NULL);
    size_t u = malloc_usable_size(p);
    fill_pat(p, n, 4242);
    size_t tries[] = {n, u, n + (u - n) / 2, n > 1 ? n - 1 : 1};
    for (size_t t = 0; t < 4; t++) {
      void* q = realloc_may_fail(p, tries[t]);
      if (q != p)
        harness_say("  realloc(p, %zu) moved a block of %zu (usable %zu)\n",
                    tries[t], n, u);
      CHECK(q == p);
      REQUIRE(q != NULL);
      p = q;
      CHECK(malloc_usable_size(p) >= tries[t]);
    }
    CHECK_PAT(p, n - 1, n, 4242);
    free(p);
  }
}

/* ---- aligned allocation -------------------------------------------------- */

TEST(posix_memalign_all_alignments) {
  for (size_t a = sizeof(void*); a <= 4 * MiB; a *= 2) {
    size_t sizes[] = {1, a - 1, a, a + 1, 3 * a, 100000};
    blk_t b[6];
    for (int i = 0; i < 6; i++) {
      void* p = (void*)0x1;
      int rc = posix_memalign(&p, a, sizes[i]);
      if (rc != 0) harness_say("  posix_memalign(%zu, %zu) = %d\n", a, sizes[i], rc);
      CHECK_EQ(rc, 0);
      REQUIRE(rc == 0 && p != NULL);
      b[i].p = p;
      b[i].n = sizes[i];
      b[i].u = malloc_usable_size(p);
      b[i].tag = next_tag++;
      if (!aligned_to(p, a)) harness_say("  posix_memalign(%zu) = %p\n", a, p);
      CHECK(aligned_to(p, a));
      CHECK(aligned_to(p, 16));
      CHECK(b[i].u >= sizes[i]);
      if (b[i].u < sizes[i]) b[i].u = sizes[i];
      for (int j = 0; j < i; j++) CHECK(!overlaps(&b[i], &b[j]));
      fill_pat(p, b[i].u, b[i].tag);
    }
    for (int i = 0; i < 6; i++) give(&b[i]);
  }
  void* p = (void*)0x1;
  CHECK_EQ(posix_memalign(&p, 64, 0), 0); /* NULL or freeable */
  free(p);
}

TEST(posix_memalign_invalid) {
  size_t bad[] = {0, 1, 2, 3, 4, sizeof(void*) / 2, 12, 24, 48, 100, 4095, 4097,
                  3 * sizeof(void*), ((size_t)1 << 20) + 8};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    void* sentinel = (void*)(uintptr_t)0x5A5A5A50;
    void* p = sentinel;
    int rc = posix_memalign(&p, bad[i], 64);
    if (rc != EINVAL) harness_say("  posix_memalign(align %zu) = %d\n", bad[i], rc);
    CHECK_EQ(rc, EINVAL);
    CHECK(p == sentinel);
    if (rc == 0 && p != sentinel) free(p);
  }
  size_t big[] = {v_size_max, v_size_max - 4096, v_ptrdiff_max_1, v_1_62};
  size_t al[] = {16, 64, 4096, 2 * MiB};
  for (size_t i = 0; i < sizeof big / sizeof big[0]; i++)
    for (size_t k = 0; k < sizeof al / sizeof al[0]; k++) {
      void* p = NULL;
      int rc = posix_memalign(&p, al[k], big[i]);
      if (rc != ENOMEM)
        harness_say("  posix_memalign(%zu, %zu) = %d\n", al[k], big[i], rc);
      CHECK_EQ(rc, ENOMEM);
      if (rc == 0) free(p);
    }
}

TEST(aligned_alloc_memalign) {
  for (size_t a = 1; a <= 4 * MiB; a *= 2) {
    size_t sizes[] = {1, a / 2 + 1, a, 3 * a + 5};
    for (int i = 0; i < 4; i++) {
      unsigned char* p = aligned_alloc(a, sizes[i]);
      REQUIRE(p != NULL);
      CHECK(aligned_to(p, a));
      CHECK(malloc_usable_size(p) >= sizes[i]);
      fill_pat(p, sizes[i], a + i);
      unsigned char* q = memalign(a, sizes[i]);
      REQUIRE(q != NULL);
      CHECK(aligned_to(q, a));
      CHECK(malloc_usable_size(q) >= sizes[i]);
      fill_pat(q, sizes[i], a + i + 100);
      CHECK_PAT(p, sizes[i], sizes[i], a + i);
      CHECK_PAT(q, sizes[i], sizes[i], a + i + 100);
      free(p);
      free(q);
    }
  }
}

TEST(valloc_pvalloc) {
  size_t pg = (size_t)sysconf(_SC_PAGESIZE);
  size_t sizes[] = {1, 100, pg - 1, pg, pg + 1, 100000, 3 * MiB + 7};
  for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
    size_t n = sizes[i];
    unsigned char* p = valloc(n);
    REQUIRE(p != NULL);
    CHECK(aligned_to(p, pg));
    CHECK(malloc_usable_size(p) >= n);
    fill_pat(p, n, 11);
    size_t rounded = (n + pg - 1) / pg * pg;
    unsigned char* q = pvalloc(n);
    REQUIRE(q != NULL);
    CHECK(aligned_to(q, pg));
    CHECK(malloc_usable_size(q) >= rounded);
    fill_pat(q, rounded, 12);
    CHECK_PAT(p, n, n, 11);
    CHECK_PAT(q, rounded, rounded, 12);
    free(p);
    free(q);
  }
}

/* ---- free variants ------------------------------------------------------- */

TEST(free_variants) {
  free(NULL);
  free_sized(NULL, 0);
  free_aligned_sized(NULL, 64, 0);
  size_t sizes[] = {1, 16, 100, 1000, 5000, 40000, 300000, 2 * MiB};
  for (int rep = 0; rep < 3; rep++) {
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
      size_t n = sizes[i];
      void* p = malloc(n);
      REQUIRE(p != NULL);
      memset(p, 0x5C, n);
      free_sized(p, n);
      size_t a = (size_t)64 << (i % 8); /* 64 .. 8 KiB */
      size_t na = (n + a - 1) / a * a;
      void* q = aligned_alloc(a, na);
      REQUIRE(q != NULL);
      CHECK(aligned_to(q, a));
      memset(q, 0x5D, na);
      free_aligned_sized(q, a, na);
    }
  }
  void* p = malloc(32); /* heap still works */
  CHECK(p != NULL);
  free(p);
}

/* ---- glibc extras -------------------------------------------------------- */

TEST(mallopt_and_trim) {
  CHECK_EQ(mallopt(M_MMAP_THRESHOLD, 256 * 1024), 1);
  CHECK_EQ(mallopt(M_ARENA_MAX, 1), 1);
  int params[] = {M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX, M_ARENA_TEST, M_MXFAST, 12345, -7};
  int vals[] = {128 * 1024, 128 * 1024, 65536, 8, 64, 1, 1};
  /* hakmem accepts and ignores every glibc knob, unknown ones included. */
  for (size_t i = 0; i < sizeof params / sizeof params[0]; i++) CHECK_EQ(mallopt(params[i], vals[i]), 1);
  void* keep[64];
  for (int i = 0; i < 64; i++) keep[i] = malloc(1000 * (size_t)(i + 1));
  for (int i = 0; i < 64; i += 2) free(keep[i]);
  /* Freed blocks sit in this thread's cache: there is something to return. */
  CHECK_EQ(malloc_trim(0), 1);
  for (int i = 1; i < 64; i += 2) {
    memset(keep[i], 3, 1000 * (size_t)(i + 1));
    free(keep[i]);
  }
  CHECK_EQ(malloc_trim(0), 1);
  /* Right after a trim nothing is cached anywhere: nothing to return. */
  CHECK_EQ(malloc_trim(0), 0);
  static hk_stats_t st;
  REQUIRE(hk_stats_get(&st) == 0);
  for (unsigned c = 1; c < HK_NUM_CLASSES; c++) CHECK_EQ(st.cls[c].cached_bytes, 0);
  for (int i = 0; i < 64; i++) {
    keep[i] = malloc(5000);
    CHECK(keep[i] != NULL);
    if (keep[i]) memset(keep[i], 1, 5000);
  }
  for (int i = 0; i < 64; i++) free(keep[i]);
}

TEST(mallinfo2_plausible) {
  struct mallinfo2 before = mallinfo2();
  enum { N = 1200 };
  static void* b[N];
  for (int i = 0; i < N; i++) {
    b[i] = malloc(1024);
    REQUIRE(b[i] != NULL);
    memset(b[i], 7, 1024);
  }
  struct mallinfo2 during = mallinfo2();
  if (during.uordblks < before.uordblks + MiB)
    harness_say("  uordblks %zu -> %zu with 1.2 MiB more live\n", before.uordblks,
                during.uordblks);
  /* This thread's counts are exact: 1200 more blocks of the 1 KiB class. */
  CHECK_EQ(during.uordblks - before.uordblks, N * 1024);
  CHECK(during.arena + during.hblkhd >= during.uordblks);
  CHECK_EQ(during.fordblks, during.arena - during.uordblks);
  static hk_stats_t st;
  REQUIRE(hk_stats_get(&st) == 0);
  uint64_t live = 0;
  for (unsigned c = 0; c < HK_NUM_CLASSES; c++) live += st.cls[c].live_bytes;
  CHECK_EQ(during.uordblks, live);
  CHECK_EQ(during.hblkhd, st.cls[0].live_bytes);
  CHECK_EQ(during.arena, st.committed_bytes);
  for (int i = 0; i < N; i++) free(b[i]);
  struct mallinfo2 after = mallinfo2();
  CHECK_EQ(after.uordblks, before.uordblks);

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
  struct mallinfo old = mallinfo();
#pragma GCC diagnostic pop
  struct mallinfo2 now = mallinfo2();
  CHECK_EQ(old.uordblks, (int)now.uordblks);
  CHECK_EQ(old.arena, (int)now.arena);
  CHECK_EQ(old.hblkhd, (int)now.hblkhd);
}

/* Runs fn with fd 2 redirected to a temporary file; returns bytes written. */
static long capture_stderr(void (*fn)(void), char* head, size_t headsz) {
  char path[] = "/tmp/hk_test_api_XXXXXX";
  int fd = mkstemp(path);
  if (fd < 0) return -1;
  unlink(path);
  fflush(stderr);
  int saved = dup(2);
  dup2(fd, 2);
  fn();
  fflush(stderr);
  dup2(saved, 2);
  close(saved);
  long len = (long)lseek(fd, 0, SEEK_END);
  memset(head, 0, headsz);
  if (pread(fd, head, headsz - 1, 0) < 0) head[0] = 0;
  close(fd);
  return len;
}

static void call_malloc_stats(void) { malloc_stats(); }
static void call_hk_stats_print(void) { hk_stats_print(2); }

TEST(malloc_stats_and_info) {
  void* p = malloc(1000);
  char head[64];
  long len = capture_stderr(call_malloc_stats, head, sizeof head);
  CHECK(len > 0);
  len = capture_stderr(call_hk_stats_print, head, sizeof head);
  CHECK(len > 0);
  free(p);

  char* buf = NULL;
  size_t sz = 0;
  FILE* f = open_memstream(&buf, &sz);
  REQUIRE(f != NULL);
  CHECK_EQ(malloc_info(0, f), 0);
  fclose(f);
  REQUIRE(buf != NULL);
  CHECK(strncmp(buf, "<malloc", 7) == 0);
  free(buf);
}

/* ---- hakmem's own API ---------------------------------------------------- */

TEST(hk_size_classes) {
  CHECK_EQ(hk_class_size(0), 0);
  CHECK_EQ(hk_class_size(HK_NUM_CLASSES), 0);
  CHECK_EQ(hk_class_size(100000), 0);
  size_t prev = 0;
  for (unsigned c = 1; c < HK_NUM_CLASSES; c++) {
    size_t s = hk_class_size(c);
    if (s <= prev || s % 16 != 0 || hk_size_class(s) != c)
      harness_say("  class %u size %zu (prev %zu) maps back to %u\n", c, s, prev,
                  hk_size_class(s));
    CHECK(s > prev);
    CHECK_EQ(s % 16, 0);
    CHECK_EQ(hk_size_class(s), c);
    if (c > 1) CHECK_EQ(hk_size_class(prev + 1), c);
    prev = s;
  }
  size_t max = hk_class_size(HK_NUM_CLASSES - 1);
  REQUIRE(max > 0);
  CHECK_EQ(hk_size_class(max + 1), 0);
  CHECK_EQ(hk_size_class(max + 4096), 0);
  CHECK_EQ(hk_size_class(v_size_max), 0);
  CHECK_EQ(hk_size_class(v_ptrdiff_max_1), 0);
  /* Waste bound: about 4 classes per doubling. Every n up to 2 MiB; the
   * worst case of each class (previous size + 1) above that. */
  long bad = 0;
  size_t lim = max < 2 * MiB ? max : 2 * MiB;
  for (size_t n = 1; n <= lim; n++) {
    unsigned c = hk_size_class(n);
    size_t s = hk_class_size(c);
    if (c == 0 || s < n || (double)s >= (double)n * 1.34 + 16) {
      if (bad++ < 5) harness_say("  n=%zu -> class %u size %zu\n", n, c, s);
    }
  }
  for (unsigned c = 2; c < HK_NUM_CLASSES; c++) {
    size_t n = hk_class_size(c - 1) + 1;
    size_t s = hk_class_size(hk_size_class(n));
    if (s < n || (double)s >= (double)n * 1.34 + 16) {
      if (bad++ < 10) harness_say("  n=%zu -> size %zu\n", n, s);
    }
  }
  CHECK_EQ(bad, 0);
  /* malloc of each class size gets at least that much. */
  for (unsigned c = 1; c < HK_NUM_CLASSES; c++) {
    size_t s = hk_class_size(c);
    void* p = malloc(s);
    REQUIRE(p != NULL);
    CHECK(malloc_usable_size(p) >= s);
    free(p);
  }
}

TEST(hk_stats) {
  CHECK_EQ(hk_stats_get(NULL), EINVAL);
  static hk_stats_t s0, s1, s2;
  memset(&s0, 0xFF, sizeof s0);
  REQUIRE(hk_stats_get(&s0) == 0);
  CHECK_EQ(s0.struct_size, sizeof(hk_stats_t));
  CHECK_EQ(s0.num_classes, HK_NUM_CLASSES);
  for (unsigned c = 1; c < HK_NUM_CLASSES; c++) CHECK_EQ(s0.cls[c].size, hk_class_size(c));
  CHECK(s0.policy_version >= 1);

  unsigned c = hk_size_class(100);
  REQUIRE(c >= 1 && c < HK_NUM_CLASSES);
  enum { N = 1000 };
  static void* b[N];
  for (int i = 0; i < N; i++) {
    b[i] = malloc(100);
    REQUIRE(b[i] != NULL);
  }
  REQUIRE(hk_stats_get(&s1) == 0);
  if (s1.cls[c].live_bytes < 100000 || s1.cls[c].allocs < s0.cls[c].allocs + N)
    harness_say("  class %u: live_bytes %llu, allocs %llu -> %llu\n", c,
                (unsigned long long)s1.cls[c].live_bytes,
                (unsigned long long)s0.cls[c].allocs, (unsigned long long)s1.cls[c].allocs);
  /* One thread: its own counts are exact (hk_stats_get publishes them). */
  CHECK_EQ(s1.cls[c].allocs - s0.cls[c].allocs, N);
  CHECK_EQ(s1.cls[c].frees - s0.cls[c].frees, 0);
  CHECK_EQ(s1.cls[c].live_bytes - s0.cls[c].live_bytes, (uint64_t)N * hk_class_size(c));
  CHECK_EQ(s1.cls[c].hits, s1.cls[c].allocs - s1.cls[c].refills);
  for (int i = 0; i < N; i++) free(b[i]);
  REQUIRE(hk_stats_get(&s2) == 0);
  CHECK_EQ(s2.cls[c].frees - s1.cls[c].frees, N);
  CHECK_EQ(s2.cls[c].allocs, s1.cls[c].allocs);
  CHECK_EQ(s2.cls[c].live_bytes, s0.cls[c].live_bytes);
  CHECK(hk_policy_version() >= 1);
}

/* ---- random mix ---------------------------------------------------------- */

static size_t random_size(void) {
  uint64_t r = rng();
  unsigned pick = (unsigned)(r % 100);
  r >>= 8;
  if (pick < 80) return 16 + (size_t)(r % 1009);               /* 16 B .. 1 KiB */
  if (pick < 95) return KiB + (size_t)(r % (63 * KiB));        /* .. 64 KiB */
  if (pick < 99) return 64 * KiB + (size_t)(r % (960 * KiB));  /* .. 1 MiB */
  return MiB + (size_t)(r % (MiB + 1));                        /* .. 2 MiB */
}

static int cmp_blk(const void* a, const void* b) {
  uintptr_t x = (uintptr_t)((const blk_t*)a)->p, y = (uintptr_t)((const blk_t*)b)->p;
  return x < y ? -1 : x > y;
}

TEST(random_mix) {
  enum { SLOTS = 512, OPS = 12000 };
  static blk_t slot[SLOTS], sorted[SLOTS];
  memset(slot, 0, sizeof slot);
  rng_state = 0x9E3779B97F4A7C15ull;
  for (int op = 0; op < OPS; op++) {
    blk_t* s = &slot[rng() % SLOTS];
    if (s->p) {
      give(s);
    } else {
      size_t n = random_size();
      s->p = malloc(n);
      REQUIRE(s->p != NULL);
      s->n = n;
      s->u = malloc_usable_size(s->p);
      CHECK(s->u >= n);
      CHECK(aligned_to(s->p, 16));
      if (s->u < n) s->u = n;
      s->tag = next_tag++;
      fill_pat(s->p, s->u, s->tag);
    }
    if (op % 2000 == 1999) { /* live blocks are pairwise disjoint */
      size_t k = 0;
      for (int i = 0; i < SLOTS; i++)
        if (slot[i].p) sorted[k++] = slot[i];
      qsort(sorted, k, sizeof sorted[0], cmp_blk);
      for (size_t i = 1; i < k; i++) CHECK(!overlaps(&sorted[i - 1], &sorted[i]));
    }
  }
  /* Free the rest in a random order. */
  int order[SLOTS];
  for (int i = 0; i < SLOTS; i++) order[i] = i;
  for (int i = SLOTS - 1; i > 0; i--) {
    int j = (int)(rng() % (uint64_t)(i + 1));
    int t = order[i];
    order[i] = order[j];
    order[j] = t;
  }
  for (int i = 0; i < SLOTS; i++) give(&slot[order[i]]);
}

/* A request the kernel's overcommit policy refuses for a plain private
 * mapping (what glibc uses) must fail in malloc too, not succeed on reserved
 * address space that faults later. Skipped where the kernel commits it. */
TEST(malloc_beyond_what_the_kernel_commits) {
  size_t n = (size_t)1 << 40;
  void* m = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m != MAP_FAILED) {
    munmap(m, n);
    /* malloc_beyond_the_address_limit checks the same refusal everywhere. */
    SKIP("ci-exempt: this kernel commits a 1 TiB private mapping (vm.overcommit_memory=1): "
         "no refusal to pass on");
  }
  errno = 0;
  void* p = malloc(n);
  CHECK(p == NULL);
  CHECK_EQ(errno, ENOMEM);
  free(p);
  errno = 0;
  p = calloc(1, n);
  CHECK(p == NULL);
  CHECK_EQ(errno, ENOMEM);
}

/* Under an address-space limit (what `ulimit -v` sets) a request past it
 * fails with ENOMEM, whatever the kernel's overcommit policy; in a child,
 * so the limit does not outlive the case. */
TEST(malloc_beyond_the_address_limit) {
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    struct rlimit rl = {(rlim_t)8 << 30, (rlim_t)8 << 30};   /* 8 GiB of address space */
    if (setrlimit(RLIMIT_AS, &rl) != 0) _exit(2);
    errno = 0;
    void* p = malloc((size_t)16 << 30);
    if (p != NULL || errno != ENOMEM) _exit(3);
    errno = 0;
    p = calloc(1, (size_t)9 << 30);
    if (p != NULL || errno != ENOMEM) _exit(4);
    void* ok = malloc(64 * MiB);   /* within the limit: still served */
    if (!ok) _exit(5);
    memset(ok, 1, 64 * MiB);
    free(ok);
    _exit(0);
  }
  int st = 0;
  REQUIRE(waitpid(pid, &st, 0) == pid);
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
    harness_say("  child: %s %d (2 setrlimit, 3 malloc, 4 calloc, 5 malloc within the limit)\n",
                WIFEXITED(st) ? "exit" : "signal", WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st));
  CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
}

/* ---- what malloc_trim gives back ------------------------------------------ */
static long rss_kib(void) {
  char buf[256];
  int fd = open("/proc/self/statm", O_RDONLY);
  if (fd < 0) return -1;
  ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0) return -1;
  buf[n] = 0;
  char* sp = strchr(buf, ' ');
  return sp ? strtol(sp + 1, NULL, 10) * (sysconf(_SC_PAGESIZE) / 1024) : -1;
}

/* Slab-heavy: 48 MiB in blocks of three classes, written, freed. What the
 * allocator kept (this thread's cache, and the default 1 MiB of warm slabs
 * per class: over 3 MiB) goes back at malloc_trim: committed bytes fall by
 * at least that, to where they were after the trim before the pattern (give
 * or take the one empty slab each class keeps as its partial slab, and the
 * header pages of segments emptied), and so does the resident set (not
 * checked under valgrind, whose own memory is counted there). Then huge
 * blocks: the huge cache's mappings go, committed bytes exactly back. */
TEST(malloc_trim_returns_memory_to_the_os) {
  static hk_stats_t s0, s1, s2;
  malloc_trim(0);
  REQUIRE(hk_stats_get(&s0) == 0);
  long rss0 = rss_kib();
  enum { N = 3 * 4096 };
  static void* b[N];
  static const size_t sz[3] = {1024, 2048, 8192};   /* 4 + 8 + 36 MiB */
  for (int i = 0; i < N; i++) {
    size_t n = sz[i % 3] * (i % 3 == 2 ? 9 : 1) / (i % 3 == 2 ? 2 : 1);
    b[i] = malloc(n);
    REQUIRE(b[i] != NULL);
    memset(b[i], 0x5A, n);
  }
  for (int i = 0; i < N; i++) free(b[i]);
  REQUIRE(hk_stats_get(&s1) == 0);
  long rss1 = rss_kib();
  CHECK(s1.committed_bytes > s0.committed_bytes);   /* something kept to give back */
  CHECK_EQ(malloc_trim(0), 1);
  REQUIRE(hk_stats_get(&s2) == 0);
  long rss2 = rss_kib();
  harness_say("  slabs: committed %llu KiB before, %llu after the frees, %llu after trim\n",
                (unsigned long long)s0.committed_bytes >> 10, (unsigned long long)s1.committed_bytes >> 10,
                (unsigned long long)s2.committed_bytes >> 10);
  CHECK(s1.committed_bytes - s2.committed_bytes >= 3 * MiB);
  CHECK(s2.committed_bytes <= s0.committed_bytes + 3 * MiB);
  CHECK(s2.committed_bytes + 64 * 4096 >= s0.committed_bytes);
  CHECK(s2.madvise_calls + s2.munmap_calls > s1.madvise_calls + s1.munmap_calls);
  for (unsigned c = 1; c < HK_NUM_CLASSES; c++) CHECK_EQ(s2.cls[c].cached_bytes, 0);
  if (!under_valgrind()) {
    harness_say("  slabs: rss %ld KiB, %ld after the frees, %ld after trim\n", rss0, rss1, rss2);
    CHECK(rss1 - rss2 >= 3 * 1024);
    CHECK(rss2 - rss0 <= 4 * 1024);
  }
  s0 = s2;

  /* Huge blocks: freed ones stay mapped in the huge cache (up to 128 MiB
   * while little is live); trim unmaps them all. */
  enum { H = 6 };
  void* h[H];
  for (int i = 0; i < H; i++) {
    h[i] = malloc(5 * MiB + (size_t)i * 4096);
    REQUIRE(h[i] != NULL);
    memset(h[i], 0x6B, 5 * MiB);
  }
  for (int i = 0; i < H; i++) free(h[i]);
  REQUIRE(hk_stats_get(&s1) == 0);
  rss1 = rss_kib();
  CHECK(s1.committed_bytes >= s0.committed_bytes + 16 * MiB);   /* the cache kept some */
  CHECK_EQ(s1.cls[0].live_bytes, s0.cls[0].live_bytes);
  uint64_t unmaps = s1.munmap_calls;
  CHECK_EQ(malloc_trim(0), 1);
  REQUIRE(hk_stats_get(&s2) == 0);
  rss2 = rss_kib();
  CHECK_EQ(s2.committed_bytes, s0.committed_bytes);
  CHECK(s2.munmap_calls > unmaps);
  CHECK_EQ(malloc_trim(0), 0);
  if (!under_valgrind()) {
    harness_say("  huge: rss %ld KiB after the frees, %ld after trim\n", rss1, rss2);
    CHECK(rss1 - rss2 >= 16 * 1024);
  }
}

/* ---- huge blocks grow in place ------------------------------------------- */
/* Whether [a, a+len) is free address space: a MAP_FIXED_NOREPLACE mapping
 * there succeeds (kept in *m when m is given, else unmapped). */
static int space_free(uintptr_t a, size_t len, void** m) {
  void* r = mmap((void*)a, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
  if (r == MAP_FAILED) return 0;
  if (r != (void*)a) { munmap(r, len); return 0; }   /* old kernels: a hint only */
  if (m) *m = r; else munmap(r, len);
  return 1;
}

/* README: "huge blocks grow in place with mremap when the address space
 * after them is free". A 40 MiB block shrunk to 8 MiB gives its mapping's
 * tail back (the space after it is then free), and growing it again must
 * keep the pointer, with one mremap and no new mapping. With a page of
 * someone else's mapped right after it, growing must move the block,
 * contents intact, and leave that page alone. */
TEST(huge_realloc_grows_in_place) {
  static hk_stats_t a, b;
  if (under_valgrind())
    SKIP("ci-exempt: valgrind places mappings and refuses to grow them in place itself; "
         "checked by the release and debug runs");
  for (int blocked = 0; blocked < 2; blocked++) {
    unsigned char* p = malloc(40 * MiB);
    REQUIRE(p != NULL);
    fill_pat(p, 8 * MiB, 300 + blocked);
    unsigned char* q = realloc(p, 8 * MiB);
    REQUIRE(q == p);
    uintptr_t end = (uintptr_t)p - 4096 + 12 * MiB;   /* header page + 8 MiB, in 4 MiB chunks */
    void* mine = NULL;
    REQUIRE(space_free(end, 4096, blocked ? &mine : NULL));
    if (mine) memset(mine, 0x77, 4096);
    REQUIRE(hk_stats_get(&a) == 0);
    q = realloc(p, 40 * MiB);
    REQUIRE(hk_stats_get(&b) == 0);
    REQUIRE(q != NULL);
    CHECK_PAT(q, 8 * MiB, 8 * MiB, 300 + blocked);
    memset(q + 8 * MiB, 0x11, 32 * MiB);   /* the grown part is ours to write */
    if (!blocked) {
      if (q != p) harness_say("  40 MiB -> 8 MiB -> 40 MiB moved %p -> %p\n", (void*)p, (void*)q);
      CHECK(q == p);
      CHECK_EQ(b.mmap_calls - a.mmap_calls, 1);      /* the mremap */
      CHECK_EQ(b.munmap_calls - a.munmap_calls, 0);
      CHECK_EQ(b.committed_bytes - a.committed_bytes, 32 * MiB);
    } else {
      CHECK(q != p);
      CHECK(check_byte(mine, 4096, 0x77) < 0);
      munmap(mine, 4096);
    }
    CHECK_EQ(b.cls[0].live_bytes - a.cls[0].live_bytes, 32 * MiB);
    free(q);
  }
}

/* ---- the huge cache decays -------------------------------------------------- */
/* huge.c "_hk_huge_decay": a freed huge mapping is kept for reuse, but one
 * that served nothing for a whole drain interval goes back to the OS by
 * itself (no malloc_trim), as the warm pools and dirty pages do. Seen from
 * outside: right after a free, the next huge request of that size is a
 * cache hit; after a few idle intervals (with slow paths that notice them)
 * it is a fresh mapping, and the committed bytes are back where they were. */
static long huge_hits_of_one(size_t n) {   /* -1: malloc failed */
  static hk_stats_t a, b;
  hk_stats_get(&a);
  void* p = malloc(n);
  if (!p) return -1;
  memset(p, 0x3C, n);
  hk_stats_get(&b);
  free(p);
  return (long)(b.huge_cache_hits - a.huge_cache_hits);
}

TEST(huge_cache_gives_back_idle_mappings) {
  const size_t n = 6 * MiB;
  hk_policy_t keep, p;
  hk_policy_get(&keep);
  p = keep;
  p.drain_ms = 20;
  REQUIRE(hk_policy_set(&p) != 0);
  REQUIRE(malloc_trim(0) >= 0);
  static hk_stats_t s0, s1;
  REQUIRE(hk_stats_get(&s0) == 0);
  REQUIRE(huge_hits_of_one(n) >= 0);         /* now cached */
  CHECK_EQ(huge_hits_of_one(n), 1);          /* reused at once, cached again */
  REQUIRE(hk_stats_get(&s1) == 0);
  CHECK(s1.committed_bytes >= s0.committed_bytes + n);
  for (int i = 0; i < 10; i++) {             /* 10 x 30 ms, slow paths in each */
    struct timespec ts = {0, 30 * 1000000L};
    nanosleep(&ts, NULL);
    static void* q[600];
    for (int k = 0; k < 600; k++) q[k] = malloc(3000);
    for (int k = 0; k < 600; k++) free(q[k]);
    hk_thread_flush();
  }
  REQUIRE(hk_stats_get(&s1) == 0);
  harness_say("  committed: %lld KiB more than before, after idle intervals\n",
              (long long)(s1.committed_bytes - s0.committed_bytes) / 1024);
  CHECK(s1.committed_bytes < s0.committed_bytes + n);
  CHECK_EQ(huge_hits_of_one(n), 0);          /* the mapping went: a fresh one */
  REQUIRE(hk_policy_set(&keep) != 0);
  REQUIRE(malloc_trim(0) >= 0);
}

/* ---- huge blocks put together from cached pieces ------------------------------ */
/* huge.c "pieces": a freed mapping much bigger than a new request is split
 * (the request served where it lies, the touched remainder cached on its
 * own), and a request bigger than any cached mapping is joined from
 * several, their touched pages moved, not faulted in again. Each step is
 * checked by where the object lands, its contents (calloc reads zero where
 * earlier objects wrote), the page faults its memset takes (a fresh
 * mapping would take one per page: 1280 for 5 MiB) and the committed bytes
 * once everything is trimmed. */
/* The stats once trimmed and still: the decay thread unmaps what it takes
 * off the huge cache outside the lock (huge.c _hk_huge_decay), so a
 * malloc_trim can return while those bytes are still committed. Under
 * memcheck that lasted long enough to be read: 23 MiB committed at this
 * test's start against 12.5 at its end (the fresh-clone CI of cdbe2d1). */
static int trimmed_stats(hk_stats_t* s) {
  uint64_t last = UINT64_MAX;
  for (int i = 0; i < 100; i++) {
    malloc_trim(0);
    if (hk_stats_get(s) != 0) return -1;
    if (s->committed_bytes == last) return 0;
    last = s->committed_bytes;
    struct timespec ts = {0, 50 * 1000000L};
    nanosleep(&ts, NULL);
  }
  return 0;
}

TEST(huge_pieces_split_and_join) {
  static hk_stats_t s0, s1;
  REQUIRE(trimmed_stats(&s0) == 0);
  int count = !under_valgrind();   /* memcheck's own pages fault too */

  /* Split: 24 MiB written and freed, then 5 MiB (a 8 MiB mapping) and 15 MiB. */
  unsigned char* big = malloc(24 * MiB);
  REQUIRE(big != NULL);
  memset(big, 0x5A, 24 * MiB);
  free(big);
  long f0 = minor_faults();
  unsigned char* a = calloc(1, 5 * MiB);
  REQUIRE(a != NULL);
  CHECK(a == big);                              /* split where it lay */
  CHECK(check_byte(a, 5 * MiB, 0) < 0);
  memset(a, 0x11, 5 * MiB);
  unsigned char* b = calloc(1, 15 * MiB);
  REQUIRE(b != NULL);
  CHECK(b == big + 8 * MiB);                    /* the remainder, cached on its own */
  CHECK(check_byte(b, 15 * MiB, 0) < 0);
  memset(b, 0x22, 15 * MiB);
  long f1 = minor_faults();
  if (count) {
    harness_say("  split: %ld page faults for 5 + 15 MiB\n", f1 - f0);
    CHECK(f1 - f0 < 256);
  }

  /* Join: both freed (8 + 20 MiB cached, 16 + 5 MiB of them touched), then
   * 26 MiB, more than either: about 5 MiB of fresh pages (the remainder's
   * untouched chunk and the end), where one piece moved would leave 10. */
  free(a);
  free(b);
  f0 = minor_faults();
  unsigned char* c = calloc(1, 26 * MiB);
  REQUIRE(c != NULL);
  long bad = check_byte(c, 26 * MiB, 0);
  if (bad >= 0) harness_say("  joined: byte %ld not zero\n", bad);
  CHECK(bad < 0);
  memset(c, 0x33, 26 * MiB);
  f1 = minor_faults();
  if (count) {
    harness_say("  joined: %ld page faults for 26 MiB\n", f1 - f0);
    CHECK(f1 - f0 < 1536);
  }
  CHECK(check_byte(c, 26 * MiB, 0x33) < 0);

  /* A mapping joined from pieces is several kernel mappings: moved chunk
   * by chunk into a bigger object (test_old_kernel_mremap says why), its
   * pages still need no fault. */
  free(c);
  f0 = minor_faults();
  unsigned char* e = calloc(1, 30 * MiB);
  REQUIRE(e != NULL);
  CHECK(check_byte(e, 30 * MiB, 0) < 0);
  memset(e, 0x44, 30 * MiB);
  f1 = minor_faults();
  if (count) {
    harness_say("  joined, then moved: %ld page faults for 30 MiB\n", f1 - f0);
    CHECK(f1 - f0 < 1536);
  }
  /* And grows in place where the space after it is free (its last chunk
   * grows: mremap will not grow several mappings as one). */
  uintptr_t after = (uintptr_t)e - 4096 + 32 * MiB;
  int room = space_free(after, 12 * MiB, NULL);
  unsigned char* d = realloc(e, 40 * MiB);
  REQUIRE(d != NULL);
  if (room && !under_valgrind()) CHECK(d == e);
  CHECK(check_byte(d, 30 * MiB, 0x44) < 0);
  memset(d + 30 * MiB, 0x55, 10 * MiB);
  free(d);

  CHECK_EQ(malloc_trim(0), 1);
  REQUIRE(trimmed_stats(&s1) == 0);
  CHECK_EQ(s1.committed_bytes, s0.committed_bytes);
  CHECK_EQ(s1.cls[0].live_bytes, s0.cls[0].live_bytes);
}

int main(void) {
  RUN(malloc_is_hakmem);
  RUN(malloc_every_small_size);
  RUN(malloc_geometric_to_64MiB);
  RUN(malloc_zero_unique);
  RUN(malloc_impossible_sizes);
  RUN(malloc_beyond_what_the_kernel_commits);
  RUN(malloc_beyond_the_address_limit);
  RUN(calloc_zeroed);
  RUN(calloc_after_dirty_free);
  RUN(calloc_huge_reuses_other_sizes);
  RUN(calloc_overflow_and_zero);
  RUN(reallocarray_semantics);
  RUN(realloc_null_is_malloc);
  RUN(realloc_every_transition);
  RUN(realloc_growth_chain);
  RUN(realloc_impossible_keeps_block);
  RUN(realloc_to_zero);
  RUN(realloc_in_place_when_fits);
  RUN(huge_realloc_grows_in_place);
  RUN(huge_pieces_split_and_join);
  RUN(huge_cache_gives_back_idle_mappings);
  RUN(posix_memalign_all_alignments);
  RUN(posix_memalign_invalid);
  RUN(aligned_alloc_memalign);
  RUN(valloc_pvalloc);
  RUN(free_variants);
  RUN(hk_size_classes);
  RUN(hk_stats);
  RUN(random_mix);
  RUN(mallinfo2_plausible);
  RUN(malloc_stats_and_info);
  RUN(mallopt_and_trim);
  RUN(malloc_trim_returns_memory_to_the_os);
  return harness_done();
}
