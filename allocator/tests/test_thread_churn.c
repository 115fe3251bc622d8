/* test_thread_churn.c — thousands of short-lived threads must not grow memory.
 *
 *   test_thread_churn            (5000 threads; CHURN_THREADS=N to change)
 *
 * Tests:
 *   churn            5000 threads, 8 at a time, each allocating a few hundred
 *                    objects of mixed sizes: some freed by the thread itself
 *                    (left in its cache at exit), some handed to the main
 *                    thread to free, some handed to a thread of the next wave
 *                    (freed after their allocating thread died). RSS after all
 *                    threads is within 8 MiB of RSS after the first 10%
 *                    (500), hk_stats threads (live thread caches) drops back
 *                    to <= 2 and threads_total grew by >= the thread count.
 *   no_alloc_threads threads that never allocate, and threads whose only
 *                    allocator call is free() of a block main allocated.
 *   nested_exit      pthread_exit() from three calls deep after allocating;
 *                    the exit value is a heap object main verifies and frees.
 *   cancel           threads cancelled while blocked, holding heap objects
 *                    in cleanup handlers that free them.
 *   tsd_destructors  pthread key destructors that free, allocate and hand
 *                    objects to main while the thread is being torn down.
 *   detached         detached threads that allocate and exit on their own.
 *   final_gauges     threads gauge back to <= 2 after everything.
 *   first_alloc_in_last_dtor_round
 *                    a thread whose first allocation happens in a TSD
 *                    destructor on the last destructor round: its thread
 *                    cache must not stay registered after the thread is gone
 *                    (run in a child with a deadline: a corrupted registry
 *                    makes hk_stats_get loop forever).
 *
 * RSS is read from /proc/self/statm with open/read into a stack buffer.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <malloc.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <limits.h>
#include <signal.h>
#include <sys/wait.h>
#include <time.h>

#include "hakmem.h"
#include "harness.h"
#include "testutil.h"

#define WAVE 8
#define PER_THREAD 300
#define HANDOFF_MAX 96

static long g_total = 5000;
/* the other tests' thread counts scale with CHURN_THREADS / 5000 */
static long scaled(long n, long min) {
  long v = n * g_total / 5000;
  return v < min ? min : v;
}
/* 70% 16..512, 25% 512..8 KiB, 5% 8..128 KiB */
static size_t rand_size(uint64_t* s) {
  unsigned r = (unsigned)(rnd(s) % 100);
  if (r < 70) return 16 + rnd(s) % 497;
  if (r < 95) return 512 + rnd(s) % 7681;
  return 8192 + rnd(s) % 122881;
}

/* Objects carry their size and a tag in their first 16 bytes and a tag byte
 * at the end; enough to see a block handed out twice or overwritten. */
typedef struct {
  unsigned char* p;
  size_t size;
  uint64_t tag;
} obj_t;

static unsigned char* make_obj(size_t n, uint64_t tag) {
  if (n < 24) n = 24;
  unsigned char* p = malloc(n);
  if (!p) {
    FAILF("  malloc(%zu) = NULL\n", n);
    return NULL;
  }
  memcpy(p, &n, sizeof n);
  memcpy(p + 8, &tag, sizeof tag);
  p[n - 1] = (unsigned char)(tag ^ 0x5a);
  /* touch the middle too, so freed-and-reused memory is really in use */
  p[n / 2 < 16 ? 16 : n / 2] = (unsigned char)tag;
  return p;
}

static int obj_ok(const unsigned char* p, uint64_t tag) {
  size_t n;
  uint64_t t;
  memcpy(&n, p, sizeof n);
  memcpy(&t, p + 8, sizeof t);
  if (t != tag || n < 24 || n > (1u << 20) || p[n - 1] != (unsigned char)(tag ^ 0x5a) ||
      p[n / 2 < 16 ? 16 : n / 2] != (unsigned char)tag) {
    FAILF("  object %p corrupted (tag %llx want %llx, size %zu)\n", (const void*)p,
          (unsigned long long)t, (unsigned long long)tag, n);
    return 0;
  }
  return 1;
}

static void check_free(unsigned char* p, uint64_t tag) {
  if (p) obj_ok(p, tag);
  free(p);
}

/* ---- RSS and stats -------------------------------------------------------- */
static long rss_bytes(void) {
  char buf[128];
  int fd = open("/proc/self/statm", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0) return -1;
  buf[n] = 0;
  char* e;
  strtol(buf, &e, 10);              /* size */
  long res = strtol(e, NULL, 10);   /* resident */
  return res * sysconf(_SC_PAGESIZE);
}

static hk_stats_t g_st; /* static: the struct is ~7 KiB */

static void stats(uint64_t* threads, uint64_t* total) {
  if (hk_stats_get(&g_st) != 0) {
    FAILF("  hk_stats_get failed\n");
    *threads = *total = 0;
    return;
  }
  *threads = g_st.threads;
  *total = g_st.threads_total;
}

/* ---- churn ---------------------------------------------------------------- */
typedef struct {
  long index;
  /* to main */
  int n_main;
  obj_t to_main[HANDOFF_MAX];
  /* to a thread of the next wave */
  int n_next;
  obj_t to_next[HANDOFF_MAX];
  /* from a thread of the previous wave */
  int n_prev;
  obj_t from_prev[HANDOFF_MAX];
} churn_arg_t;

static churn_arg_t g_args[WAVE];

static void* churn_thread(void* argp) {
  churn_arg_t* a = argp;
  uint64_t rs = mix64((uint64_t)a->index + 1) | 1;

  /* free what the previous wave's thread (now dead) allocated */
  for (int i = 0; i < a->n_prev; i++) check_free(a->from_prev[i].p, a->from_prev[i].tag);
  a->n_prev = 0;

  enum { KEEP = 64 };
  obj_t keep[KEEP];
  memset(keep, 0, sizeof keep);
  a->n_main = a->n_next = 0;
  for (int i = 0; i < PER_THREAD; i++) {
    size_t n = rand_size(&rs);
    uint64_t tag = rnd(&rs);
    unsigned char* p = make_obj(n, tag);
    if (!p) continue;
    unsigned r = (unsigned)(rnd(&rs) % 100);
    if (r < 20 && a->n_main < HANDOFF_MAX) {
      a->to_main[a->n_main++] = (obj_t){p, n, tag};
    } else if (r < 35 && a->n_next < HANDOFF_MAX) {
      a->to_next[a->n_next++] = (obj_t){p, n, tag};
    } else {
      /* keep a while in a small ring, freeing the one it replaces */
      int k = (int)(rnd(&rs) % KEEP);
      if (keep[k].p) check_free(keep[k].p, keep[k].tag);
      keep[k] = (obj_t){p, n, tag};
    }
  }
  /* free the rest: these blocks are in the thread cache when it exits */
  for (int k = 0; k < KEEP; k++)
    if (keep[k].p) check_free(keep[k].p, keep[k].tag);
  return NULL;
}

static long g_rss_warm, g_rss_end;

TEST(churn) {
  uint64_t th0, tot0, th1, tot1;
  stats(&th0, &tot0);
  long warm_at = g_total / 10;
  if (warm_at < 1) warm_at = 1;
  pthread_t t[WAVE];
  long done = 0;
  g_rss_warm = -1;
  double t0 = now_s();
  while (done < g_total) {
    int w = (int)(g_total - done < WAVE ? g_total - done : WAVE);
    for (int i = 0; i < w; i++) {
      g_args[i].index = done + i;
      int rc = pthread_create(&t[i], NULL, churn_thread, &g_args[i]);
      if (rc) {
        harness_say("  pthread_create: %d after %ld threads\n", rc, done + i);
        REQUIRE(rc == 0);
      }
    }
    for (int i = 0; i < w; i++) {
      pthread_join(t[i], NULL);
      churn_arg_t* a = &g_args[i];
      for (int k = 0; k < a->n_main; k++) check_free(a->to_main[k].p, a->to_main[k].tag);
      a->n_main = 0;
      /* pass to_next on to the thread that gets this slot in the next wave */
      memcpy(a->from_prev, a->to_next, sizeof(obj_t) * (size_t)a->n_next);
      a->n_prev = a->n_next;
      a->n_next = 0;
    }
    done += w;
    /* malloc_trim first, here and at the end: freed pages the allocator
     * keeps dirty for reuse (segment.c, up to 32 MiB) are a cache, not
     * growth; what this bounds is memory that dead threads strand. */
    if (g_rss_warm < 0 && done >= warm_at) {
      malloc_trim(0);
      g_rss_warm = rss_bytes();
    }
  }
  /* objects nobody of a next wave took */
  for (int i = 0; i < WAVE; i++) {
    for (int k = 0; k < g_args[i].n_prev; k++)
      check_free(g_args[i].from_prev[k].p, g_args[i].from_prev[k].tag);
    g_args[i].n_prev = 0;
  }
  malloc_trim(0);
  g_rss_end = rss_bytes();
  double t1 = now_s();
  stats(&th1, &tot1);
  harness_say("  %ld threads in %.2f s; RSS after %ld: %ld KiB, after %ld: %ld KiB "
              "(growth %ld KiB); threads gauge %llu -> %llu, threads_total %llu -> %llu\n",
              g_total, t1 - t0, warm_at, g_rss_warm / 1024, g_total, g_rss_end / 1024,
              (g_rss_end - g_rss_warm) / 1024, (unsigned long long)th0,
              (unsigned long long)th1, (unsigned long long)tot0, (unsigned long long)tot1);
  CHECK(g_rss_warm > 0 && g_rss_end > 0);
  /* Under valgrind RSS is mostly the tool's own shadow memory, which grows
   * with every page touched: the bound holds for the program, natively. */
  if (under_valgrind())
    harness_say("  note: under valgrind, RSS bound not checked\n");
  else
    CHECK(g_rss_end - g_rss_warm < 8L << 20);
  CHECK(th1 <= 2);
  CHECK(tot1 - tot0 >= (uint64_t)g_total);
  CHECK_EQ(atomic_load(&g_errors), 0);
}

/* ---- threads that never allocate, or only free ---------------------------- */
static void* idle_thread(void* arg) { return arg; }

static void* free_only_thread(void* arg) {
  unsigned char* p = arg;
  check_free(p, 0x77);
  return NULL;
}

TEST(no_alloc_threads) {
  uint64_t th0, tot0, th1, tot1;
  stats(&th0, &tot0);
  long rss0 = rss_bytes();
  long waves = scaled(1000, 20);
  for (long i = 0; i < waves; i++) {
    pthread_t t[WAVE];
    for (int k = 0; k < WAVE; k++) {
      void* arg = NULL;
      void* (*fn)(void*) = idle_thread;
      if (k & 1) {
        arg = make_obj(64 + (size_t)k * 100, 0x77);
        fn = free_only_thread;
      }
      REQUIRE(pthread_create(&t[k], NULL, fn, arg) == 0);
    }
    for (int k = 0; k < WAVE; k++) pthread_join(t[k], NULL);
  }
  stats(&th1, &tot1);
  long rss1 = rss_bytes();
  harness_say("  %ld threads (half only free): threads gauge %llu -> %llu, "
              "threads_total +%llu, RSS %+ld KiB\n", waves * WAVE,
              (unsigned long long)th0, (unsigned long long)th1,
              (unsigned long long)(tot1 - tot0), (rss1 - rss0) / 1024);
  CHECK(th1 <= 2);
  CHECK(rss1 - rss0 < 8L << 20);
  CHECK_EQ(atomic_load(&g_errors), 0);
}

/* ---- pthread_exit from nested calls ------------------------------------- */
static __attribute__((noinline)) void level3(uint64_t seed) {
  uint64_t rs = seed | 1;
  unsigned char* keep[8] = {0};
  uint64_t tags[8] = {0};
  for (int i = 0; i < 100; i++) {
    uint64_t tag = seed + (uint64_t)i;
    unsigned char* p = make_obj(rand_size(&rs), tag);
    if (i % 2 == 0) {
      check_free(p, tag);
    } else {
      int k = (i / 2) % 8;
      if (keep[k]) check_free(keep[k], tags[k]);
      keep[k] = p;
      tags[k] = tag;
    }
  }
  /* i = 99 went to keep[49 % 8 = 1]: exit with it, free the others */
  for (int k = 0; k < 8; k++)
    if (k != 1 && keep[k]) check_free(keep[k], tags[k]);
  pthread_exit(keep[1]);
}

static __attribute__((noinline)) void level2(uint64_t seed) {
  unsigned char* local = make_obj(5000, seed ^ 1);
  check_free(local, seed ^ 1);
  level3(seed);
}

static __attribute__((noinline)) void level1(uint64_t seed) {
  unsigned char* big = make_obj(200000, seed ^ 2);
  check_free(big, seed ^ 2);
  level2(seed);
  FAILF("  pthread_exit returned\n");
}

static void* nested_thread(void* arg) {
  level1((uint64_t)(uintptr_t)arg);
  return NULL;
}

TEST(nested_exit) {
  uint64_t th0, tot0;
  stats(&th0, &tot0);
  int got = 0, n = (int)scaled(200, 20);
  for (int i = 0; i < n; i++) {
    pthread_t t;
    uint64_t seed = 1000 + (uint64_t)i * 1000;
    REQUIRE(pthread_create(&t, NULL, nested_thread, (void*)(uintptr_t)seed) == 0);
    void* ret = NULL;
    pthread_join(t, &ret);
    if (ret && obj_ok(ret, seed + 99)) got++;
    free(ret);
  }
  CHECK_EQ(got, n);
  CHECK_EQ(atomic_load(&g_errors), 0);
}

/* ---- cancellation with cleanup handlers that free ------------------------ */
static void cleanup_free(void* p) { check_free(p, 0xCA); }

static void* cancel_thread(void* arg) {
  atomic_int* ready = arg;
  unsigned char* p = make_obj(3000, 0xCA);
  pthread_cleanup_push(cleanup_free, p);
  for (int i = 0; i < 50; i++) free(make_obj(100 + (size_t)i * 37, 5));
  atomic_store(ready, 1);
  for (;;) {
    struct timespec ts = {1, 0};
    nanosleep(&ts, NULL); /* cancellation point */
  }
  pthread_cleanup_pop(1);
  return NULL;
}

TEST(cancel) {
  int cancelled = 0, n = (int)scaled(50, 10);
  for (int i = 0; i < n; i++) {
    atomic_int ready = 0;
    pthread_t t;
    REQUIRE(pthread_create(&t, NULL, cancel_thread, &ready) == 0);
    while (!atomic_load(&ready)) {
      struct timespec ts = {0, 100000};
      nanosleep(&ts, NULL);
    }
    pthread_cancel(t);
    void* ret = NULL;
    pthread_join(t, &ret);
    if (ret == PTHREAD_CANCELED) cancelled++;
  }
  CHECK_EQ(cancelled, n);
  CHECK_EQ(atomic_load(&g_errors), 0);
}

/* ---- TSD destructors that use the allocator during thread teardown ------- */
static pthread_key_t g_key1, g_key2;
#define TSD_N 400
static unsigned char* g_from_dtor[TSD_N];
static atomic_int g_dtor_runs;

typedef struct {
  int index;
  int rounds; /* key2's destructor re-arms itself this many times */
} tsd_val_t;

static void dtor1(void* v) {
  /* free the value, allocate and free some more, hand one object to main */
  tsd_val_t* tv = v;
  int idx = tv->index;
  free(tv);
  for (int i = 0; i < 20; i++) free(make_obj(16 + (size_t)i * 50, 9));
  g_from_dtor[idx] = make_obj(1000 + (size_t)idx, 0xD0 + (uint64_t)idx);
  atomic_fetch_add(&g_dtor_runs, 1);
}

static void dtor2(void* v) {
  tsd_val_t* tv = v;
  if (tv->rounds-- > 0) {
    /* re-set the key: glibc calls destructors again (up to 4 rounds) */
    tsd_val_t* nv = malloc(sizeof *nv);
    if (!nv) return;
    *nv = *tv;
    free(tv);
    pthread_setspecific(g_key2, nv);
    free(make_obj(4096, 1));
    return;
  }
  free(tv);
}

static void* tsd_thread(void* arg) {
  int idx = (int)(intptr_t)arg;
  for (int i = 0; i < 30; i++) free(make_obj(32 + (size_t)i * 64, 3));
  tsd_val_t* v1 = malloc(sizeof *v1);
  tsd_val_t* v2 = malloc(sizeof *v2);
  if (!v1 || !v2) return NULL;
  v1->index = idx;
  v1->rounds = 0;
  v2->index = idx;
  v2->rounds = 2;
  pthread_setspecific(g_key1, v1);
  pthread_setspecific(g_key2, v2);
  return NULL;
}

TEST(tsd_destructors) {
  uint64_t th0, tot0, th1, tot1;
  REQUIRE(pthread_key_create(&g_key1, dtor1) == 0);
  REQUIRE(pthread_key_create(&g_key2, dtor2) == 0);
  stats(&th0, &tot0);
  int n = (int)scaled(TSD_N, 40) / WAVE * WAVE;
  if (n > TSD_N) n = TSD_N;
  for (int i = 0; i < n; i += WAVE) {
    pthread_t t[WAVE];
    for (int k = 0; k < WAVE; k++)
      REQUIRE(pthread_create(&t[k], NULL, tsd_thread, (void*)(intptr_t)(i + k)) == 0);
    for (int k = 0; k < WAVE; k++) pthread_join(t[k], NULL);
  }
  stats(&th1, &tot1);
  CHECK_EQ(atomic_load(&g_dtor_runs), n);
  int ok = 0;
  for (int i = 0; i < n; i++) {
    if (g_from_dtor[i] && obj_ok(g_from_dtor[i], 0xD0 + (uint64_t)i)) ok++;
    free(g_from_dtor[i]);
    g_from_dtor[i] = NULL;
  }
  CHECK_EQ(ok, n);
  harness_say("  threads gauge after TSD threads: %llu\n", (unsigned long long)th1);
  CHECK(th1 <= 2);
  CHECK_EQ(atomic_load(&g_errors), 0);
  pthread_key_delete(g_key1);
  pthread_key_delete(g_key2);
}

/* ---- detached threads ----------------------------------------------------- */
static atomic_int g_detached_done;

static void* detached_thread(void* arg) {
  uint64_t rs = mix64((uint64_t)(uintptr_t)arg) | 1;
  unsigned char* keep[16] = {0};
  for (int i = 0; i < 200; i++) {
    int k = (int)(rnd(&rs) % 16);
    if (keep[k]) check_free(keep[k], 0xDE);
    keep[k] = make_obj(rand_size(&rs), 0xDE);
  }
  for (int k = 0; k < 16; k++)
    if (keep[k]) check_free(keep[k], 0xDE);
  atomic_fetch_add(&g_detached_done, 1);
  return NULL;
}

TEST(detached) {
  pthread_attr_t at;
  pthread_attr_init(&at);
  pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
  int started = 0, n = (int)scaled(400, 40);
  for (int i = 0; i < n; i++) {
    pthread_t t;
    if (pthread_create(&t, &at, detached_thread, (void*)(uintptr_t)i) == 0) started++;
    /* keep at most ~WAVE running */
    while (started - atomic_load(&g_detached_done) >= WAVE) {
      struct timespec ts = {0, 50000};
      nanosleep(&ts, NULL);
    }
  }
  pthread_attr_destroy(&at);
  CHECK_EQ(started, n);
  while (atomic_load(&g_detached_done) < started) {
    struct timespec ts = {0, 100000};
    nanosleep(&ts, NULL);
  }
  /* the last ones may still be tearing down: give them up to 5 s */
  uint64_t th = 0, tot = 0;
  for (int i = 0; i < 500; i++) {
    stats(&th, &tot);
    if (th <= 2) break;
    struct timespec ts = {0, 10000000};
    nanosleep(&ts, NULL);
  }
  CHECK(th <= 2);
  CHECK_EQ(atomic_load(&g_errors), 0);
}

TEST(final_gauges) {
  uint64_t th, tot;
  stats(&th, &tot);
  long rss = rss_bytes();
  harness_say("  threads %llu, threads_total %llu, RSS %ld KiB, committed %llu KiB\n",
              (unsigned long long)th, (unsigned long long)tot, rss / 1024,
              (unsigned long long)g_st.committed_bytes / 1024);
  CHECK(th <= 2);
  CHECK(tot >= (uint64_t)g_total);
}

/* ---- first allocation on the last TSD destructor round ------------------- */
static pthread_key_t g_late_key;
static char g_late_marker;
static __thread int g_late_round;

static void late_dtor(void* v) {
  (void)v;
  if (++g_late_round < PTHREAD_DESTRUCTOR_ITERATIONS) {
    pthread_setspecific(g_late_key, &g_late_marker); /* re-arm, no allocation */
    return;
  }
  free(make_obj(100, 0x1a7e)); /* the thread's first allocator call */
}

static void* late_body(void* a) {
  pthread_setspecific(g_late_key, &g_late_marker);
  return a;
}

TEST(first_alloc_in_last_dtor_round) {
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    if (pthread_key_create(&g_late_key, late_dtor) != 0) _exit(3);
    uint64_t th, tot;
    stats(&th, &tot);
    /* one at a time: the second thread reuses the first one's stack and TLS */
    for (int i = 0; i < 3; i++) {
      pthread_t t;
      if (pthread_create(&t, NULL, late_body, NULL) != 0) _exit(3);
      pthread_join(t, NULL);
      stats(&th, &tot); /* walks the registry of thread caches */
    }
    /* pthread_join returns once the thread cleared its tid, a moment before
     * the kernel is done with it; until then tgkill(tid, 0) still finds it and
     * the sweep keeps its record. Leaked records would stay for good, so
     * polling longer costs only a failing run: up to 5 s (the kernel takes
     * well under 200 ms, but a loaded CI machine once took longer). */
    for (int i = 0; i < 500 && th > 2; i++) {
      struct timespec ts = {0, 10000000};
      nanosleep(&ts, NULL);
      stats(&th, &tot);
    }
    harness_say("  child: threads gauge %llu after 3 such threads\n", (unsigned long long)th);
    _exit(th <= 2 ? 0 : 1);
  }
  int st = 0;
  double waited = 0;
  while (waitpid(pid, &st, WNOHANG) == 0) {
    if (waited > 10.0) {
      harness_say("  child still running after 10 s: hk_stats_get is looping "
                  "(thread cache registry corrupted?); killing it\n");
      kill(pid, SIGKILL);
      waitpid(pid, &st, 0);
      break;
    }
    struct timespec ts = {0, 5000000};
    nanosleep(&ts, NULL);
    waited += 0.005;
  }
  CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
}

int main(void) {
  const char* e = getenv("CHURN_THREADS");
  if (e && *e) {
    long n = atol(e);
    if (n >= 10) g_total = n;
  }
  hang_alarm(600, "test_thread_churn: timed out (hang)\n");
  RUN(churn);
  RUN(no_alloc_threads);
  RUN(nested_exit);
  RUN(cancel);
  RUN(tsd_destructors);
  RUN(detached);
  RUN(final_gauges);
  RUN(first_alloc_in_last_dtor_round);
  return harness_done();
}
