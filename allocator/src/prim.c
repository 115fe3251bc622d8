/* prim.c — OS calls (see prim.h for the convention). */
#define _GNU_SOURCE
#include "prim.h"

#include <errno.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

static int map_raw(size_t len, bool reserve, void** out) {
  hk_add_relaxed(&_hk_proc.mmap_calls, 1);
  void* p = mmap(NULL, len, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | (reserve ? MAP_NORESERVE : 0), -1, 0);
  if (p == MAP_FAILED) { *out = NULL; return errno ? errno : ENOMEM; }
  *out = p;
  return 0;
}

int _hk_os_unmap(void* p, size_t len) {
  if (len == 0) return 0;
  hk_add_relaxed(&_hk_proc.munmap_calls, 1);
  return munmap(p, len) == 0 ? 0 : errno;
}

int _hk_os_map_aligned(size_t len, size_t align, bool reserve, void** out) {
  *out = NULL;
  if (align < HK_OS_PAGE) align = HK_OS_PAGE;
  if (len > SIZE_MAX - align) return ENOMEM;
  /* Map with slack and cut both ends off: one mmap and at most two munmaps.
   * (Trying an exact-size mapping first rarely pays: the kernel hands out
   * page-aligned addresses, so a 4 MiB boundary is hit 1 time in 1024.) */
  void* p;
  int err;
  if (align == HK_OS_PAGE) return map_raw(len, reserve, out);
  err = map_raw(len + align, reserve, &p);
  if (err) return err;
  uintptr_t a = ((uintptr_t)p + align - 1) & ~(uintptr_t)(align - 1);
  size_t head = a - (uintptr_t)p;
  size_t tail = align - head;
  if (head) _hk_os_unmap(p, head);
  if (tail) _hk_os_unmap((void*)(a + len), tail);
  *out = (void*)a;
  return 0;
}

int _hk_os_map_file(int fd, size_t len, void** out) {
  hk_add_relaxed(&_hk_proc.mmap_calls, 1);
  void* p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) { *out = NULL; return errno ? errno : ENOMEM; }
  *out = p;
  return 0;
}

int _hk_os_unmap_file(void* p, size_t len) { return _hk_os_unmap(p, len); }

int _hk_os_decommit(void* p, size_t len) {
  if (len == 0) return 0;
  hk_add_relaxed(&_hk_proc.madvise_calls, 1);
  return madvise(p, len, MADV_DONTNEED) == 0 ? 0 : errno;
}

int _hk_os_grow_in_place(void* p, size_t old_len, size_t new_len) {
  hk_add_relaxed(&_hk_proc.mmap_calls, 1);
  void* q = mremap(p, old_len, new_len, 0);
  return q == MAP_FAILED ? errno : 0;
}

int _hk_os_move(void* p, size_t len, void* dst) {
  hk_add_relaxed(&_hk_proc.mmap_calls, 1);
  void* q = mremap(p, len, len, MREMAP_MAYMOVE | MREMAP_FIXED, dst);
  return q == MAP_FAILED ? errno : 0;
}

int _hk_os_shrink(void* p, size_t old_len, size_t new_len) {
  if (new_len >= old_len) return 0;
  return _hk_os_unmap((char*)p + new_len, old_len - new_len);
}

uint64_t _hk_os_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

uint64_t _hk_os_now_coarse_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

uint32_t _hk_os_tid(void) { return (uint32_t)syscall(SYS_gettid); }

void _hk_os_write(int fd, const char* buf, size_t len) {
  while (len > 0) {
    ssize_t w = write(fd, buf, len);
    if (w < 0) { if (errno == EINTR) continue; return; }
    buf += w;
    len -= (size_t)w;
  }
}
