/* test_fork.c — fork (and fork+exec) from a multi-threaded program.
 *
 * Four worker threads malloc/free continuously (random sizes, cross-thread
 * frees through mailboxes) while another thread forks. Every child must be
 * able to use the allocator at once: verify and free objects the parent made
 * before the fork, run a few thousand malloc/calloc/realloc/free of all sizes
 * (including > 1 MiB), start a thread that allocates, and exit 0. A child
 * that does not finish within the deadline (10 s, 60 s under valgrind) is
 * deemed deadlocked: the parent kills it and the test fails.
 *
 * Tests:
 *   fork_main_thread     50 forks from the main thread while workers run
 *   fork_from_worker     forks from a thread other than the main one
 *   nested_fork          a child forks again (grandchild allocates too)
 *   fork_exec            fork + execv("/bin/true"), and posix_spawn
 *   parent_intact        the parent's pre-fork objects are unchanged after
 *                        children scribbled on and freed their copies
 */
#define _GNU_SOURCE
#include <errno.h>
#include <malloc.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>

#include "hakmem.h"
#include "harness.h"
#include "testutil.h" /* g_errors: parent-side failures (pattern, NULL) */

extern char** environ;

#define NWORKERS 4
#define WSLOTS 64
#define MBOX_CAP 128
#define PARENT_N 300
#define NFORKS 50

/* ---- patterns (mix64, rnd, pat: testutil.h) ----------------------------- */
/* Small objects entirely; big ones: 256 bytes at each end and every 64 KiB. */
static void fill(unsigned char* p, size_t n, uint64_t seed) {
  if (n <= 4096) {
    for (size_t i = 0; i < n; i++) p[i] = pat(seed, i);
    return;
  }
  for (size_t i = 0; i < 256; i++) p[i] = pat(seed, i);
  for (size_t i = n - 256; i < n; i++) p[i] = pat(seed, i);
  for (size_t i = 4096; i < n; i += 65536) p[i] = pat(seed, i);
}

/* Returns 1 if every pattern position below limit matches. */
static int verify(const unsigned char* p, size_t n, uint64_t seed, size_t limit) {
  if (limit > n) limit = n;
  if (n <= 4096) {
    for (size_t i = 0; i < limit; i++)
      if (p[i] != pat(seed, i)) return 0;
    return 1;
  }
  for (size_t i = 0; i < 256 && i < limit; i++)
    if (p[i] != pat(seed, i)) return 0;
  for (size_t i = n - 256; i < limit; i++)
    if (p[i] != pat(seed, i)) return 0;
  for (size_t i = 4096; i < limit; i += 65536)
    if (p[i] != pat(seed, i)) return 0;
  return 1;
}

/* 60% 8..512, 25% ..16 KiB, 12% ..256 KiB, 3% 1..3 MiB */
static size_t rand_size(uint64_t* s) {
  unsigned r = (unsigned)(rnd(s) % 100);
  if (r < 60) return 8 + rnd(s) % 505;
  if (r < 85) return 512 + rnd(s) % 16384;
  if (r < 97) return 16384 + rnd(s) % 245761;
  return (1u << 20) + rnd(s) % (2u << 20);
}

typedef struct {
  unsigned char* p;
  size_t size;
  uint64_t seed;
} obj_t;

static double g_deadline_s = 10.0;

/* ---- objects the parent made before forking ------------------------------ */
static obj_t g_parent[PARENT_N];

static void make_parent_objects(void) {
  uint64_t rs = 0x9a7e47ULL;
  for (int i = 0; i < PARENT_N; i++) {
    size_t n = rand_size(&rs);
    if (i == 0 || i == 1) n = (2u << 20) + 100; /* always some big ones */
    unsigned char* p = malloc(n);
    if (!p) {
      FAILF("  malloc(%zu) for parent object failed\n", n);
      g_parent[i].p = NULL;
      continue;
    }
    g_parent[i] = (obj_t){p, n, mix64(0xabcULL + (uint64_t)i)};
    fill(p, n, g_parent[i].seed);
  }
}

static int parent_objects_ok(void) {
  int bad = 0;
  for (int i = 0; i < PARENT_N; i++)
    if (g_parent[i].p && !verify(g_parent[i].p, g_parent[i].size, g_parent[i].seed,
                                 g_parent[i].size))
      bad++;
  return bad == 0;
}

/* ---- workers ------------------------------------------------------------- */
typedef struct {
  pthread_mutex_t mu;
  unsigned head, count;
  obj_t items[MBOX_CAP];
} mbox_t;

static mbox_t g_mbox[NWORKERS];
static atomic_int g_stop;
static atomic_long g_worker_ops;
static pthread_barrier_t g_wbarrier;

static int mbox_push(mbox_t* m, obj_t o) {
  int ok = 0;
  pthread_mutex_lock(&m->mu);
  if (m->count < MBOX_CAP) {
    m->items[(m->head + m->count) % MBOX_CAP] = o;
    m->count++;
    ok = 1;
  }
  pthread_mutex_unlock(&m->mu);
  return ok;
}

static int mbox_pop(mbox_t* m, obj_t* o) {
  int ok = 0;
  pthread_mutex_lock(&m->mu);
  if (m->count) {
    *o = m->items[m->head];
    m->head = (m->head + 1) % MBOX_CAP;
    m->count--;
    ok = 1;
  }
  pthread_mutex_unlock(&m->mu);
  return ok;
}

static void check_free(obj_t o, const char* what) {
  if (!verify(o.p, o.size, o.seed, o.size))
    FAILF("  pattern mismatch (%s) in %p size %zu\n", what, (void*)o.p, o.size);
  free(o.p);
}

/* Runs until g_stop; then (after all stopped) drains its mailbox, frees all. */
static void* worker(void* arg) {
  int self = (int)(intptr_t)arg;
  uint64_t rs = mix64(0x1234567ULL * (uint64_t)(self + 1)) | 1;
  obj_t slots[WSLOTS];
  memset(slots, 0, sizeof slots);
  long ops = 0;
  while (!atomic_load_explicit(&g_stop, memory_order_relaxed)) {
    /* a short nap per 64 operations leaves the forked children some CPU */
    struct timespec nap = {0, 50000};
    nanosleep(&nap, NULL);
    obj_t o;
    while (mbox_pop(&g_mbox[self], &o)) check_free(o, "worker remote free");
    for (int k = 0; k < 64; k++, ops++) {
      int s = (int)(rnd(&rs) % WSLOTS);
      if (!slots[s].p) {
        size_t n = rand_size(&rs);
        if (n > (1u << 20) && (rnd(&rs) & 7)) n >>= 4; /* fewer big ones here */
        unsigned char* p = (rnd(&rs) & 3) ? malloc(n) : calloc(1, n);
        if (!p) {
          FAILF("  worker malloc(%zu) = NULL\n", n);
          continue;
        }
        slots[s] = (obj_t){p, n, rnd(&rs)};
        fill(p, n, slots[s].seed);
      } else if (rnd(&rs) & 1) {
        check_free(slots[s], "worker local free");
        slots[s].p = NULL;
      } else {
        int to = (self + 1) % NWORKERS;
        if (!mbox_push(&g_mbox[to], slots[s])) check_free(slots[s], "worker local free");
        slots[s].p = NULL;
      }
    }
  }
  atomic_fetch_add(&g_worker_ops, ops);
  pthread_barrier_wait(&g_wbarrier);
  obj_t o;
  while (mbox_pop(&g_mbox[self], &o)) check_free(o, "worker final remote free");
  for (int s = 0; s < WSLOTS; s++)
    if (slots[s].p) check_free(slots[s], "worker final free");
  return NULL;
}

static pthread_t g_workers[NWORKERS];

static int start_workers(void) {
  atomic_store(&g_stop, 0);
  pthread_barrier_init(&g_wbarrier, NULL, NWORKERS);
  for (int i = 0; i < NWORKERS; i++) {
    if (pthread_create(&g_workers[i], NULL, worker, (void*)(intptr_t)i) != 0) {
      harness_say("  pthread_create failed\n");
      _exit(2);
    }
  }
  return 1;
}

static void stop_workers(void) {
  atomic_store(&g_stop, 1);
  for (int i = 0; i < NWORKERS; i++) pthread_join(g_workers[i], NULL);
  pthread_barrier_destroy(&g_wbarrier);
}

/* ---- what a child does ---------------------------------------------------- */
/* Child-side failures go to stderr and into the exit status. */
static int c_errors;
#define CFAIL(...)                                                            \
  do {                                                                        \
    if (c_errors++ < 5) harness_say(__VA_ARGS__);                             \
  } while (0)

typedef struct {
  uint64_t seed;
  obj_t handoff; /* allocated by the child's thread, freed by child's main */
  int errors;
} cthread_arg_t;

static void* child_thread(void* argp) {
  cthread_arg_t* a = argp;
  uint64_t rs = a->seed | 1;
  obj_t keep[32];
  memset(keep, 0, sizeof keep);
  for (int i = 0; i < 1000; i++) {
    int s = (int)(rnd(&rs) % 32);
    if (keep[s].p) {
      if (!verify(keep[s].p, keep[s].size, keep[s].seed, keep[s].size)) a->errors++;
      free(keep[s].p);
      keep[s].p = NULL;
    } else {
      size_t n = rand_size(&rs);
      unsigned char* p = malloc(n);
      if (!p) {
        a->errors++;
        continue;
      }
      keep[s] = (obj_t){p, n, rnd(&rs)};
      fill(p, n, keep[s].seed);
    }
  }
  for (int s = 1; s < 32; s++)
    if (keep[s].p) {
      if (!verify(keep[s].p, keep[s].size, keep[s].seed, keep[s].size)) a->errors++;
      free(keep[s].p);
    }
  if (!keep[0].p) {
    size_t n = 777;
    keep[0] = (obj_t){malloc(n), n, 42};
    if (keep[0].p) fill(keep[0].p, n, 42);
  }
  a->handoff = keep[0];
  return NULL;
}

/* A few thousand operations of every kind and size; returns errors. */
static void child_workload(uint64_t seed, int ops) {
  uint64_t rs = mix64(seed) | 1;
  enum { CS = 128 };
  obj_t slots[CS];
  memset(slots, 0, sizeof slots);
  for (int i = 0; i < ops; i++) {
    int s = (int)(rnd(&rs) % CS);
    obj_t* o = &slots[s];
    unsigned r = (unsigned)(rnd(&rs) % 100);
    if (!o->p) {
      size_t n = rand_size(&rs);
      unsigned char* p;
      if (r < 50) {
        p = malloc(n);
      } else if (r < 75) {
        p = calloc(n, 1);
        if (p)
          for (size_t k = 0; k < n; k += (n <= 4096 ? 1 : 4093))
            if (p[k]) {
              CFAIL("  child: calloc(%zu) not zeroed at %zu\n", n, k);
              break;
            }
      } else if (r < 90) {
        p = realloc(NULL, n);
      } else {
        void* q = NULL;
        size_t al = (size_t)16 << (rnd(&rs) % 9);
        if (posix_memalign(&q, al, n) != 0) q = NULL;
        if (q && ((uintptr_t)q & (al - 1))) CFAIL("  child: misaligned %p/%zu\n", q, al);
        p = q;
      }
      if (!p) {
        CFAIL("  child: allocation of %zu failed\n", n);
        continue;
      }
      *o = (obj_t){p, n, rnd(&rs)};
      fill(p, n, o->seed);
    } else if (r < 40) {
      size_t n = rand_size(&rs);
      if (!verify(o->p, o->size, o->seed, o->size)) CFAIL("  child: mismatch before realloc\n");
      unsigned char* q = realloc(o->p, n);
      if (!q) {
        CFAIL("  child: realloc(%zu) failed\n", n);
        continue;
      }
      if (!verify(q, o->size, o->seed, n < o->size ? n : o->size))
        CFAIL("  child: realloc %zu -> %zu lost content\n", o->size, n);
      *o = (obj_t){q, n, rnd(&rs)};
      fill(q, n, o->seed);
    } else {
      if (!verify(o->p, o->size, o->seed, o->size))
        CFAIL("  child: mismatch in %p size %zu\n", (void*)o->p, o->size);
      free(o->p);
      o->p = NULL;
    }
  }
  for (int s = 0; s < CS; s++)
    if (slots[s].p) {
      if (!verify(slots[s].p, slots[s].size, slots[s].seed, slots[s].size))
        CFAIL("  child: mismatch at final free\n");
      free(slots[s].p);
    }
}

/* Exits: 0 ok, 1 pattern/alloc errors, 3 thread errors. */
static void child_main(int index, int use_parent_objects) {
  if (use_parent_objects) {
    for (int i = 0; i < PARENT_N; i++) {
      obj_t* o = &g_parent[i];
      if (!o->p) continue;
      if (!verify(o->p, o->size, o->seed, o->size))
        CFAIL("  child %d: parent object %d (%zu bytes) corrupted\n", index, i, o->size);
      /* scribble on the copy: must not reach the parent */
      memset(o->p, 0xA5, o->size < 8192 ? o->size : 8192);
      if (i % 2 == 0) {
        free(o->p);
      } else {
        unsigned char* q = realloc(o->p, o->size / 2 + 1);
        if (!q) CFAIL("  child: realloc of parent object failed\n");
        else free(q);
      }
      o->p = NULL;
    }
  }
  child_workload(0x777ULL * (uint64_t)(index + 1), 3000);

  pthread_t t;
  cthread_arg_t ca = {mix64((uint64_t)index + 99), {0}, 0};
  int rc = pthread_create(&t, NULL, child_thread, &ca);
  if (rc != 0) {
    CFAIL("  child %d: pthread_create = %d\n", index, rc);
  } else {
    pthread_join(t, NULL);
    if (ca.errors) CFAIL("  child %d: %d errors in its thread\n", index, ca.errors);
    if (ca.handoff.p) {
      if (!verify(ca.handoff.p, ca.handoff.size, ca.handoff.seed, ca.handoff.size))
        CFAIL("  child %d: object from its thread corrupted\n", index);
      free(ca.handoff.p);
    }
  }
  child_workload(0x999ULL * (uint64_t)(index + 1), 500);
  exit(c_errors ? 1 : 0);
}

/* Waits for pid with a deadline; kills it past the deadline. Returns the
 * wait status, or -1 after a timeout. */
static int wait_deadline(pid_t pid, double deadline_s, const char* what) {
  double t0 = now_s();
  int st = 0;
  for (;;) {
    pid_t r = waitpid(pid, &st, WNOHANG);
    if (r == pid) return st;
    if (r < 0 && errno != EINTR) {
      harness_say("  waitpid(%d): errno %d\n", (int)pid, errno);
      return -2;
    }
    if (now_s() - t0 > deadline_s) {
      harness_say("  %s: child %d did not exit within %.0f s (deadlock?), killing it\n",
                  what, (int)pid, deadline_s);
      kill(pid, SIGKILL);
      waitpid(pid, &st, 0);
      return -1;
    }
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
}

static int status_ok(int st, const char* what, int i) {
  if (st < 0) return 0;
  if (WIFEXITED(st) && WEXITSTATUS(st) == 0) return 1;
  if (WIFEXITED(st))
    harness_say("  %s %d: child exited with %d\n", what, i, WEXITSTATUS(st));
  else if (WIFSIGNALED(st))
    harness_say("  %s %d: child killed by signal %d\n", what, i, WTERMSIG(st));
  return 0;
}

/* ---- tests --------------------------------------------------------------- */
TEST(fork_main_thread) {
  make_parent_objects();
  start_workers();
  int ok = 0;
  double worst = 0;
  for (int i = 0; i < NFORKS; i++) {
    /* let the workers get going between forks */
    struct timespec ts = {0, 2000000};
    nanosleep(&ts, NULL);
    double t0 = now_s();
    pid_t pid = fork();
    if (pid == 0) child_main(i, 1);
    REQUIRE(pid > 0);
    int st = wait_deadline(pid, g_deadline_s, "fork_main_thread");
    double dt = now_s() - t0;
    if (dt > worst) worst = dt;
    if (status_ok(st, "fork", i)) ok++;
  }
  stop_workers();
  harness_say("  %d/%d children ok, slowest %.3f s; workers did %ld ops\n", ok, NFORKS,
              worst, atomic_load(&g_worker_ops));
  CHECK_EQ(ok, NFORKS);
  CHECK(atomic_load(&g_worker_ops) > 0);
}

TEST(parent_intact) {
  CHECK(parent_objects_ok());
  for (int i = 0; i < PARENT_N; i++) {
    free(g_parent[i].p);
    g_parent[i].p = NULL;
  }
}

typedef struct {
  int nforks;
  int ok;
} forker_arg_t;

static void* forker_thread(void* argp) {
  forker_arg_t* a = argp;
  for (int i = 0; i < a->nforks; i++) {
    /* hold some memory across the fork from this thread too */
    unsigned char* mine = malloc(5000);
    if (mine) fill(mine, 5000, 5000 + (uint64_t)i);
    pid_t pid = fork();
    if (pid == 0) {
      if (!mine || !verify(mine, 5000, 5000 + (uint64_t)i, 5000)) _exit(1);
      free(mine);
      child_main(100 + i, 0);
    }
    if (pid < 0) break;
    if (status_ok(wait_deadline(pid, g_deadline_s, "fork_from_worker"), "worker fork", i))
      a->ok++;
    if (mine && !verify(mine, 5000, 5000 + (uint64_t)i, 5000))
      FAILF("  forker: own object corrupted\n");
    free(mine);
  }
  return NULL;
}

TEST(fork_from_worker) {
  start_workers();
  forker_arg_t fa = {10, 0};
  pthread_t t;
  REQUIRE(pthread_create(&t, NULL, forker_thread, &fa) == 0);
  pthread_join(t, NULL);
  stop_workers();
  CHECK_EQ(fa.ok, fa.nforks);
}

TEST(nested_fork) {
  start_workers();
  int ok = 0;
  for (int i = 0; i < 5; i++) {
    pid_t pid = fork();
    if (pid == 0) {
      /* child: start its own allocating thread, then fork a grandchild */
      pthread_t t;
      cthread_arg_t ca = {77, {0}, 0};
      if (pthread_create(&t, NULL, child_thread, &ca) != 0) _exit(4);
      pid_t g = fork();
      if (g == 0) child_main(200 + i, 0);
      pthread_join(t, NULL);
      free(ca.handoff.p);
      if (g < 0) _exit(5);
      int st = wait_deadline(g, g_deadline_s / 2, "grandchild");
      if (!(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0)) _exit(6);
      child_workload(31337, 1000);
      exit(c_errors || ca.errors ? 1 : 0);
    }
    REQUIRE(pid > 0);
    if (status_ok(wait_deadline(pid, g_deadline_s, "nested_fork"), "nested fork", i)) ok++;
  }
  stop_workers();
  CHECK_EQ(ok, 5);
}

TEST(fork_exec) {
  start_workers();
  int ok = 0, spawned = 0;
  for (int i = 0; i < 20; i++) {
    pid_t pid = fork();
    if (pid == 0) {
      char* argv[] = {(char*)"/bin/true", NULL};
      if (i % 2) free(malloc(100)); /* allocate between fork and exec */
      execv("/bin/true", argv);
      _exit(127);
    }
    REQUIRE(pid > 0);
    if (status_ok(wait_deadline(pid, g_deadline_s, "fork_exec"), "fork+exec", i)) ok++;
  }
  for (int i = 0; i < 10; i++) {
    pid_t pid;
    char* argv[] = {(char*)"/bin/true", NULL};
    int rc = posix_spawn(&pid, "/bin/true", NULL, NULL, argv, environ);
    if (rc != 0) {
      harness_say("  posix_spawn: %d\n", rc);
      continue;
    }
    if (status_ok(wait_deadline(pid, g_deadline_s, "posix_spawn"), "posix_spawn", i))
      spawned++;
  }
  stop_workers();
  CHECK_EQ(ok, 20);
  CHECK_EQ(spawned, 10);
}

TEST(no_worker_errors) {
  CHECK_EQ(atomic_load(&g_errors), 0);
}

int main(void) {
  if (under_valgrind()) g_deadline_s = 60.0;
  hang_alarm(under_valgrind() ? 1200 : 120, "test_fork: parent timed out (deadlock in parent?)\n");
  for (int i = 0; i < NWORKERS; i++) pthread_mutex_init(&g_mbox[i].mu, NULL);

  RUN(fork_main_thread);
  RUN(parent_intact);
  RUN(fork_from_worker);
  RUN(nested_fork);
  RUN(fork_exec);
  RUN(no_worker_errors);
  return harness_done();
}
