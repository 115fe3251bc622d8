/* test_old_kernel_mremap.c — huge blocks joined from pieces (huge.c
 * "pieces"), on a kernel that moves no range made of several mappings.
 *
 * Before Linux 6.17 (Debian 12 runs 6.1) mremap(MREMAP_FIXED) refuses a
 * source that is not one kernel mapping with EFAULT, and it does so after
 * it has unmapped the destination. An allocator that tries such a move
 * and then fills the destination again chunk by chunk leaves a window in
 * which another thread's mmap can land in the hole, and the refill then
 * unmaps that thread's memory. This machine's kernel may be newer, so this
 * program defines mremap and mmap itself (hakmem, linked statically, calls
 * them) and behaves as those kernels do:
 *   - a MREMAP_FIXED move whose source spans several mappings (read from
 *     /proc/self/maps) unmaps the destination and fails with EFAULT; the
 *     test fails if hakmem ever asks for one;
 *   - on request, the next moves fail before the destination is unmapped
 *     (ENOMEM: the kernel's map-count check) or after (ENOMEM from the
 *     move itself), and the next MAP_FIXED_NOREPLACE mapping fails.
 * What is asserted: the object is whole (every byte writable: a hole in
 * it kills this program), calloc reads zero, moved pages keep needing no
 * fault, and the committed bytes come back exactly once all is trimmed.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <malloc.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "hakmem.h"
#include "harness.h"
#include "testutil.h"

#define MiB ((size_t)1 << 20)

/* ---- the kernel as it was ------------------------------------------------------ */
static int refused_after_unmap;   /* multi-mapping moves asked for */
static int moves;                 /* MREMAP_FIXED moves asked for */
static int fail_before, fail_after, fail_refill;   /* injected failures to come */
static char maps_buf[1 << 18];

static long raw_mremap(void* old, size_t old_len, size_t new_len, int flags, void* dst) {
  return syscall(SYS_mremap, old, old_len, new_len, flags, dst);
}

/* Whether [a, a+len) lies inside one line of /proc/self/maps (one kernel
 * mapping, as vma_to_resize checks). Raw system calls and a static buffer:
 * this runs inside the allocator. */
static int one_mapping(uintptr_t a, size_t len) {
  int fd = (int)syscall(SYS_openat, AT_FDCWD, "/proc/self/maps", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 1;
  size_t n = 0;
  for (;;) {
    long r = syscall(SYS_read, fd, maps_buf + n, sizeof maps_buf - 1 - n);
    if (r <= 0) break;
    n += (size_t)r;
    if (n == sizeof maps_buf - 1) break;
  }
  syscall(SYS_close, fd);
  maps_buf[n] = 0;
  for (char* line = maps_buf; *line;) {
    char* end;
    uintptr_t lo = strtoull(line, &end, 16);
    uintptr_t hi = *end == '-' ? strtoull(end + 1, &end, 16) : 0;
    if (lo <= a && a < hi) return a + len <= hi;
    char* nl = strchr(line, '\n');
    if (!nl) break;
    line = nl + 1;
  }
  return 0;
}

void* mremap(void* old, size_t old_len, size_t new_len, int flags, ...) {
  void* dst = NULL;
  if (flags & MREMAP_FIXED) {
    va_list ap;
    va_start(ap, flags);
    dst = va_arg(ap, void*);
    va_end(ap);
    moves++;
    if (fail_before > 0) {
      fail_before--;
      errno = ENOMEM;
      return MAP_FAILED;
    }
    if (!one_mapping((uintptr_t)old, old_len)) {
      refused_after_unmap++;
      syscall(SYS_munmap, dst, new_len);
      errno = EFAULT;
      return MAP_FAILED;
    }
    if (fail_after > 0) {
      fail_after--;
      syscall(SYS_munmap, dst, new_len);
      errno = ENOMEM;
      return MAP_FAILED;
    }
  }
  long r = raw_mremap(old, old_len, new_len, flags, dst);   /* syscall(2) sets errno */
  return r == -1 ? MAP_FAILED : (void*)r;
}

void* mmap(void* addr, size_t len, int prot, int flags, int fd, off_t off) {
  if ((flags & MAP_FIXED_NOREPLACE) && fail_refill > 0) {
    fail_refill--;
    errno = ENOMEM;
    return MAP_FAILED;
  }
  long r = syscall(SYS_mmap, addr, len, prot, flags, fd, off);
  return r == -1 ? MAP_FAILED : (void*)r;
}

/* ---- helpers -------------------------------------------------------------------- */
static hk_stats_t s0, s1;

static void start(void) {
  malloc_trim(0);
  hk_stats_get(&s0);
  refused_after_unmap = moves = fail_before = fail_after = fail_refill = 0;
}

/* Everything trimmed: the committed bytes are what they were (a hole
 * counted as ours, or a piece counted twice, shows here). */
static void finish(void) {
  CHECK_EQ(fail_before + fail_after + fail_refill, 0);   /* every injected failure was met */
  malloc_trim(0);
  hk_stats_get(&s1);
  CHECK_EQ(s1.committed_bytes, s0.committed_bytes);
  CHECK_EQ(s1.cls[0].live_bytes, s0.cls[0].live_bytes);
  CHECK_EQ(refused_after_unmap, 0);
}

/* A written object of `mib` MiB, freed: cached, all of it touched. */
static void cached_written(size_t mib) {
  unsigned char* p = malloc(mib * MiB);
  if (!p) abort();
  memset(p, 0x5A, mib * MiB);
  free(p);
}

/* calloc(n): zero throughout, and every byte writable. */
static unsigned char* calloc_whole(size_t n, unsigned char fill) {
  unsigned char* p = calloc(1, n);
  if (!p) return NULL;
  long bad = check_byte(p, n, 0);
  if (bad >= 0) harness_say("  byte %ld of %zu not zero\n", bad, n);
  CHECK(bad < 0);
  memset(p, fill, n);
  return p;
}

/* ---- tests ---------------------------------------------------------------------- */
/* The test_api sequence that makes an object of several mappings (24 MiB
 * split into 5 + 15, both joined into 26) and then moves it as one piece
 * into a 30 MiB object: it goes chunk by chunk, never as a whole. */
TEST(joined_object_moves_chunk_by_chunk) {
  int count = !under_valgrind();
  start();
  cached_written(24);
  unsigned char* a = calloc_whole(5 * MiB, 0x11);
  unsigned char* b = calloc_whole(15 * MiB, 0x22);
  REQUIRE(a && b);
  free(a);
  free(b);
  unsigned char* c = calloc_whole(26 * MiB, 0x33);
  REQUIRE(c != NULL);
  int joined_moves = moves;
  CHECK(joined_moves > 0);   /* the pieces were moved: the rest means something */
  free(c);
  long f0 = minor_faults();
  unsigned char* e = calloc_whole(30 * MiB, 0x44);
  long f1 = minor_faults();
  REQUIRE(e != NULL);
  CHECK(moves > joined_moves);
  if (refused_after_unmap)
    harness_say("  %d moves of several mappings at once: before Linux 6.17 each unmapped its "
                "destination and failed\n", refused_after_unmap);
  if (count) {
    harness_say("  joined, then moved: %ld page faults for 30 MiB, %d moves\n", f1 - f0,
                moves - joined_moves);
    CHECK(f1 - f0 < 1536);   /* fresh: 7680 */
  }
  CHECK(check_byte(e, 30 * MiB, 0x44) < 0);
  free(e);
  finish();
}

/* A 12 MiB object written and freed (a 16 MiB mapping), then a 20 MiB
 * calloc, more than any cached mapping: that one piece is moved, with the
 * failures given, and the object must still be whole and zero. */
static void one_piece_moved(int before, int after, int refill, unsigned char fill) {
  start();
  cached_written(12);
  fail_before = before;
  fail_after = after;
  fail_refill = refill;
  unsigned char* p = calloc_whole(20 * MiB, fill);
  REQUIRE(p != NULL);
  CHECK(check_byte(p, 20 * MiB, fill) < 0);
  free(p);
  finish();
}

/* A move that fails after the kernel unmapped the destination (out of
 * memory in the move itself), twice: the whole piece, then its first
 * chunk. That chunk's old pages go back and fresh ones fill the hole. */
TEST(move_fails_after_destination_unmapped) { one_piece_moved(0, 2, 0, 0x66); }

/* The same, and the hole cannot be filled either: that object is given
 * up (around the hole, no longer ours), and the allocation is served by a
 * fresh mapping. */
TEST(hole_that_cannot_be_filled) { one_piece_moved(0, 2, 1, 0x77); }

/* Moves refused before anything is unmapped (the map-count check): the
 * pieces' pages go back and the object is fresh pages where they were. */
TEST(moves_refused_before_unmapping) {
  one_piece_moved(5, 0, 0, 0x55);   /* the whole piece, then each of its 4 chunks */
}

int main(void) {
  RUN(joined_object_moves_chunk_by_chunk);
  RUN(move_fails_after_destination_unmapped);
  RUN(hole_that_cannot_be_filled);
  RUN(moves_refused_before_unmapping);
  return harness_done();
}
