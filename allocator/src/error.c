/* error.c — reporting misuse and corruption.
 *
 * These run when the heap may already be damaged, so they never allocate,
 * never take an allocator lock and never call stdio: they format into a stack
 * buffer and write(2) it, then abort().
 */
#define _GNU_SOURCE
#include <stdarg.h>
#include <stdlib.h>

#include "internal.h"
#include "prim.h"

static size_t put_str(char* buf, size_t cap, size_t at, const char* s) {
  while (*s && at + 1 < cap) buf[at++] = *s++;
  return at;
}

static size_t put_uint(char* buf, size_t cap, size_t at, uint64_t v, unsigned base) {
  char tmp[24];
  int n = 0;
  do { tmp[n++] = "0123456789abcdef"[v % base]; v /= base; } while (v);
  while (n > 0 && at + 1 < cap) buf[at++] = tmp[--n];
  return at;
}

/* Understands %s, %p, %u (unsigned), %lu/%zu (64-bit), %x, %%. */
size_t _hk_fmt(char* buf, size_t cap, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  size_t at = 0;
  for (const char* f = fmt; *f && at + 1 < cap; f++) {
    if (*f != '%') { buf[at++] = *f; continue; }
    f++;
    if (*f == 'l' || *f == 'z') {
      f++;
      uint64_t v = va_arg(ap, uint64_t);
      at = put_uint(buf, cap, at, v, *f == 'x' ? 16 : 10);
      continue;
    }
    switch (*f) {
      case 's': at = put_str(buf, cap, at, va_arg(ap, const char*)); break;
      case 'p': at = put_str(buf, cap, at, "0x");
                at = put_uint(buf, cap, at, (uintptr_t)va_arg(ap, void*), 16); break;
      case 'u': at = put_uint(buf, cap, at, va_arg(ap, unsigned), 10); break;
      case 'x': at = put_uint(buf, cap, at, va_arg(ap, unsigned), 16); break;
      case '%': buf[at++] = '%'; break;
      default:  break;
    }
  }
  va_end(ap);
  if (cap) buf[at < cap ? at : cap - 1] = 0;
  return at;
}

void _hk_invalid_free(const void* p, const char* why) {
  char buf[256];
  size_t n = _hk_fmt(buf, sizeof buf, "hakmem: invalid free of %p (%s)\n", p, why);
  _hk_os_write(2, buf, n);
  abort();
}

void _hk_fatal(const char* msg, const void* p) {
  char buf[256];
  size_t n = _hk_fmt(buf, sizeof buf, "hakmem: %s at %p\n", msg, p);
  _hk_os_write(2, buf, n);
  abort();
}

void _hk_assert_fail(const char* c, const char* f, int l) {
  char buf[384];
  size_t n = _hk_fmt(buf, sizeof buf, "hakmem: assertion failed: %s (%s:%u)\n", c, f, (unsigned)l);
  _hk_os_write(2, buf, n);
  abort();
}

void _hk_warn(const char* msg, const char* detail) {
  char buf[384];
  size_t n = _hk_fmt(buf, sizeof buf, "hakmem: %s%s%s\n", msg, detail ? ": " : "", detail ? detail : "");
  _hk_os_write(2, buf, n);
}
