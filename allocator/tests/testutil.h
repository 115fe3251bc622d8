/* testutil.h — helpers shared by hakmem's C/C++ tests (alongside harness.h).
 *
 *   mix64(x)          a 64-bit finalizer (splitmix64/murmur3 style)
 *   rnd(&s)           xorshift64* step; s must be non-zero
 *   pat(seed, i)      the pattern byte at position i of an object
 *   now_s()           CLOCK_MONOTONIC in seconds
 *   under_valgrind()  whether valgrind's preload is in LD_PRELOAD
 *   minor_faults()    this process's minor page faults so far
 *   check_byte(p,n,v) the offset of the first byte of p[0..n) that is not v, or -1
 *   rerun_self(mode, envp, out, cap)  this test program again as `PROG MODE`
 *                     with only envp's variables; its stderr in out; its
 *                     exit status (128 + the signal that ended it)
 *   FAILF(fmt, ...)   C only: counts a failure in g_errors and reports the
 *                     first 20 through harness_say (include harness.h first)
 *
 * Everything here is static inline and never allocates, so tests may use it
 * from threads, forked children and signal-sensitive paths alike.
 */
#ifndef HK_TESTUTIL_H
#define HK_TESTUTIL_H

#include <unistd.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>

static inline uint64_t mix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

static inline uint64_t rnd(uint64_t* s) { /* xorshift64* */
  uint64_t x = *s;
  x ^= x >> 12;
  x ^= x << 25;
  x ^= x >> 27;
  *s = x;
  return x * 0x2545F4914F6CDD1DULL;
}

static inline unsigned char pat(uint64_t seed, size_t i) {
  uint64_t w = seed ^ ((uint64_t)(i >> 3) * 0x9E3779B97F4A7C15ULL);
  w ^= w >> 29;
  return (unsigned char)(w >> ((i & 7) * 8));
}

static inline double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static inline int under_valgrind(void) {
  const char* p = getenv("LD_PRELOAD");
  return p && strstr(p, "vgpreload") != NULL;
}

static inline long minor_faults(void) {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_minflt;
}

static inline long check_byte(const void* p, size_t n, unsigned char v) {
  const unsigned char* b = (const unsigned char*)p;
  uint64_t vv = 0x0101010101010101ull * v;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    memcpy(&w, b + i, 8);
    if (w != vv) break;
  }
  for (; i < n; i++)
    if (b[i] != v) return (long)i;
  return -1;
}

/* Ends the test with `msg` on stderr (write(2), allocation-free) if it is
 * still running after `secs` seconds: a hang fails instead of blocking CI. */
static const char* hang_msg_;
static inline void hang_alarm_handler_(int sig) {
  (void)sig;
  ssize_t w = write(2, hang_msg_, strlen(hang_msg_));
  (void)w;
  _exit(3);
}
static inline void hang_alarm(unsigned secs, const char* msg) {
  hang_msg_ = msg;
  signal(SIGALRM, hang_alarm_handler_);
  alarm(secs);
}

#ifndef __cplusplus
#include <stdatomic.h>

/* Failures counted from any thread; a test checks g_errors == 0. */
static atomic_long g_errors __attribute__((unused));

#define FAILF(...)                                                            \
  do {                                                                        \
    if (atomic_fetch_add(&g_errors, 1) < 20) harness_say(__VA_ARGS__);        \
  } while (0)
#endif

/* The real path, not /proc/self/exe itself: under valgrind exec'ing that
 * would start the tool, not this test. */
static inline int rerun_self(const char* mode, char* const envp[], char* out, size_t cap) {
  static char self[4096];
  ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
  if (len <= 0) return -1;
  self[len] = 0;
  int fds[2];
  if (pipe(fds) != 0) return -1;
  pid_t pid = fork();
  if (pid == 0) {
    dup2(fds[1], 2);
    close(fds[0]);
    char* argv[] = {self, (char*)mode, NULL};
    execve(self, argv, envp);
    _exit(127);
  }
  close(fds[1]);
  size_t got = 0;
  ssize_t n;
  while (got + 1 < cap && (n = read(fds[0], out + got, cap - 1 - got)) > 0) got += (size_t)n;
  out[got] = 0;
  close(fds[0]);
  int status;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

#endif /* HK_TESTUTIL_H */
