/* harness.h — a tiny header-only test harness for hakmem's C tests.
 *
 *   TEST(name) { CHECK(cond); CHECK_EQ(a, b); ... }
 *   int main(void) { RUN(name); ...; return harness_done(); }
 *
 * A failed CHECK prints file:line and the expression, marks the test failed
 * and goes on with the next check (so one run shows every failure). The
 * harness itself never allocates: output goes through write(2) on a stack
 * buffer, so it is safe to use while the allocator under test is broken.
 * Each test program ends with one line "NAME: N passed, N failed" (and
 * ", N skipped" when a test skipped).
 *
 * SKIP("reason", ...) ends the current test as skipped: it prints
 * "skip NAME: reason", which allocator/tests/run.sh shows as a SKIP line of
 * its own (the program's other tests still count as its PASS). A reason
 * that starts with "ci-exempt: " says why CI cannot run the test; under
 * CI=true any other skip fails the run (README "How to add a test").
 */
#ifndef HK_HARNESS_H
#define HK_HARNESS_H

#include <stdarg.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

static int harness_passed, harness_failed, harness_skipped, harness_cur_failed, harness_cur_skipped;
static const char* harness_cur_name;

__attribute__((format(printf, 1, 2), unused))
static void harness_say(const char* fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  if (n < 0) return;
  if (n > (int)sizeof buf - 1) n = (int)sizeof buf - 1;
  ssize_t w = write(2, buf, (size_t)n);
  (void)w;
}

#define TEST(name) static void test_##name(void)

#define CHECK(cond)                                                           \
  do {                                                                        \
    if (!(cond)) {                                                            \
      harness_say("  FAIL %s:%d: %s (in %s)\n", __FILE__, __LINE__, #cond,    \
                  harness_cur_name);                                          \
      harness_cur_failed = 1;                                                 \
    }                                                                         \
  } while (0)

#define CHECK_EQ(a, b)                                                        \
  do {                                                                        \
    long long ha_ = (long long)(a), hb_ = (long long)(b);                     \
    if (ha_ != hb_) {                                                         \
      harness_say("  FAIL %s:%d: %s == %s (%lld != %lld) (in %s)\n",          \
                  __FILE__, __LINE__, #a, #b, ha_, hb_, harness_cur_name);    \
      harness_cur_failed = 1;                                                 \
    }                                                                         \
  } while (0)

/* Stop the current test at once (for checks later code depends on). */
#define REQUIRE(cond)                                                         \
  do {                                                                        \
    if (!(cond)) {                                                            \
      harness_say("  FAIL %s:%d: required %s (in %s)\n", __FILE__, __LINE__,  \
                  #cond, harness_cur_name);                                   \
      harness_cur_failed = 1;                                                 \
      return;                                                                 \
    }                                                                         \
  } while (0)

/* Ends the current test as skipped, saying why (printf format). */
#define SKIP(...)                                                             \
  do {                                                                        \
    char hs_[400];                                                            \
    snprintf(hs_, sizeof hs_, __VA_ARGS__);                                   \
    harness_say("skip %s: %s\n", harness_cur_name, hs_);                      \
    harness_cur_skipped = 1;                                                  \
    return;                                                                   \
  } while (0)

#define RUN(name)                                                             \
  do {                                                                        \
    harness_cur_name = #name;                                                 \
    harness_cur_failed = 0;                                                   \
    harness_cur_skipped = 0;                                                  \
    test_##name();                                                            \
    if (harness_cur_skipped && !harness_cur_failed) {                         \
      harness_skipped++;                                                      \
    } else if (harness_cur_failed) {                                          \
      harness_failed++;                                                       \
      harness_say("not ok %s\n", #name);                                      \
    } else {                                                                  \
      harness_passed++;                                                       \
      harness_say("ok %s\n", #name);                                          \
    }                                                                         \
  } while (0)

__attribute__((unused))
static int harness_done_named(const char* prog) {
  if (harness_skipped)
    harness_say("%s: %d passed, %d failed, %d skipped\n", prog, harness_passed, harness_failed,
                harness_skipped);
  else
    harness_say("%s: %d passed, %d failed\n", prog, harness_passed, harness_failed);
  return harness_failed ? 1 : 0;
}
#define harness_done() harness_done_named(__FILE__)

#endif /* HK_HARNESS_H */
