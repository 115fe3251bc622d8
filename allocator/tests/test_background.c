/* test_background.c — memory goes back while the program makes no call
 * (background.c), and the thread that does it stays out of the program's way.
 *
 * Each case runs in a fresh copy of this program (re-exec'd with its own
 * environment), since the thread starts at most once per process and only
 * after the process has run for a second. */
#define _GNU_SOURCE
#include <dirent.h>
#include <pthread.h>
#include <errno.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <malloc.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>

#include "hakmem.h"
#include "harness.h"
#include "testutil.h"

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {}
}

static uint64_t committed(void) {
  hk_stats_t s;
  hk_stats_get(&s);
  return s.committed_bytes;
}

/* 64 MiB of 1000-byte blocks, written, then freed but for one in 1024 (so
 * no segment empties whole: an empty one goes back at once, whatever the
 * thread does). The process is over a second old by then, and the slow
 * paths of the allocation pass the drain gate: the thread may start. */
enum { N = 64 * 1024, PIN_EVERY = 1024 };
static void* blk[N];

static void peak_then_free(void) {
  void* early = malloc(64);   /* this thread's cache exists from here */
  free(early);
  sleep_ms(1100);
  for (int i = 0; i < N; i++) {
    blk[i] = malloc(1000);
    memset(blk[i], 1, 1000);
  }
  for (int i = 0; i < N; i++)
    if (i % PIN_EVERY) free(blk[i]);
  hk_thread_flush();
}

/* Child: the peak, then idle for 6 drain intervals (HAKMEM_DRAIN_MS=100):
 * prints what is committed just after the frees and after the idle time;
 * then what the two threads' memory calls counted (learnd prices the pages
 * the program's threads give back and leaves the decay thread's calls out):
 * while idle, and for a malloc_trim by this thread after it. */
static int child_idle(void) {
  uint64_t base = committed();
  peak_then_free();
  hk_stats_t a, b, c;
  hk_stats_get(&a);
  uint64_t after_free = a.committed_bytes - base;
  sleep_ms(600);
  hk_stats_get(&b);
  uint64_t after_idle = b.committed_bytes > base ? b.committed_bytes - base : 0;   /* a forked child's base holds its parent's pages */
  malloc_trim(0);
  hk_stats_get(&c);
  harness_say("after free %llu KiB after idle %llu KiB\n", (unsigned long long)after_free >> 10,
              (unsigned long long)after_idle >> 10);
  harness_say("decay calls while idle %llu returned while idle %llu KiB trim returned %llu KiB decay calls in all %llu\n",
              (unsigned long long)(b.decay_syscalls - a.decay_syscalls),
              (unsigned long long)(b.returned_bytes - a.returned_bytes) >> 10,
              (unsigned long long)(c.returned_bytes - b.returned_bytes) >> 10, (unsigned long long)c.decay_syscalls);
  return 0;
}

/* What another thread frees of this thread's blocks waits in this
 * thread's inbox until it refills the class (slab.c "idle owners"). */
static void* free_all_but_pins(void* arg) {
  (void)arg;
  for (int i = 0; i < N; i++)
    if (i % PIN_EVERY) free(blk[i]);
  return NULL;   /* its end drains its cache into the owner's inbox */
}

/* Child: the peak made by this thread, freed by another that then ends,
 * then idle for 6 drain intervals: what is committed after each. */
static int child_remote(void) {
  uint64_t base = committed();
  void* early = malloc(64);
  free(early);
  sleep_ms(1100);   /* the background thread may start from the next slow path */
  for (int i = 0; i < N; i++) {
    blk[i] = malloc(1000);
    memset(blk[i], 1, 1000);
  }
  pthread_t t;
  if (pthread_create(&t, NULL, free_all_but_pins, NULL) != 0 || pthread_join(t, NULL) != 0) return 2;
  uint64_t after_free = committed() - base;
  sleep_ms(600);
  uint64_t now = committed();
  harness_say("after free %llu KiB after idle %llu KiB\n", (unsigned long long)after_free >> 10,
              (unsigned long long)(now > base ? now - base : 0) >> 10);
  return 0;
}

/* Child: owners that idle for a few drain intervals between bursts while
 * another thread frees their blocks, so that the decay pass gives their
 * inboxes back while they wake (HAKMEM_DRAIN_MS=5: a pass every 15 ms).
 * Each block carries its owner and round; one handed out twice, or given
 * back while still out, shows as a pattern that changed under the freer. */
enum { RACE_OWNERS = 3, RACE_BLOCKS = 1500, RACE_SIZE = 320 };
typedef struct {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  uint64_t* batch[RACE_OWNERS];   /* a batch waiting for the freer, or NULL */
  void** blocks[RACE_OWNERS];
  int count[RACE_OWNERS];
  bool done;
} race_t;
static race_t race = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, {0}, {0}, {0}, false};
static atomic_long race_rounds, race_bad;

static void* race_owner(void* arg) {
  long id = (long)arg;
  void** mine = malloc(RACE_BLOCKS * sizeof *mine);
  struct timespec t0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (uint64_t round = 1;; round++) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    if (now.tv_sec - t0.tv_sec >= 2) break;
    /* A short round after a long one leaves chains in the stash beside
     * the inbox the freer fills: the pass gives back both. */
    int n = round % 2 ? RACE_BLOCKS : RACE_BLOCKS / 3;
    for (int i = 0; i < n; i++) {
      uint64_t* b = malloc(RACE_SIZE);
      for (unsigned w = 0; w < RACE_SIZE / 8; w++) b[w] = ((uint64_t)id << 56) | (round << 20) | (uint64_t)i;
      mine[i] = b;
    }
    pthread_mutex_lock(&race.mu);
    while (race.blocks[id]) pthread_cond_wait(&race.cv, &race.mu);
    race.blocks[id] = mine;
    race.count[id] = n;
    pthread_cond_broadcast(&race.cv);
    while (race.blocks[id]) pthread_cond_wait(&race.cv, &race.mu);   /* freed: this thread's inbox fills */
    pthread_mutex_unlock(&race.mu);
    sleep_ms(5 + (int)(round % 4) * 10);   /* idle for 0-3 passes, then wake into one */
    atomic_fetch_add(&race_rounds, 1);
  }
  free(mine);
  return NULL;
}

static void* race_freer(void* arg) {
  (void)arg;
  pthread_mutex_lock(&race.mu);
  for (;;) {
    int id = -1;
    for (int k = 0; k < RACE_OWNERS; k++)
      if (race.blocks[k]) id = k;
    if (id < 0) {
      if (race.done) break;
      pthread_cond_wait(&race.cv, &race.mu);
      continue;
    }
    void** bl = race.blocks[id];
    for (int i = 0; i < race.count[id]; i++) {
      uint64_t* b = bl[i];
      uint64_t want = ((uint64_t)id << 56) | (uint64_t)i, seen = b[RACE_SIZE / 8 - 1];
      if ((seen & ~((uint64_t)0xfffff << 20)) != want || b[0] != seen) atomic_fetch_add(&race_bad, 1);
      free(b);
    }
    race.blocks[id] = NULL;
    pthread_cond_broadcast(&race.cv);
  }
  pthread_mutex_unlock(&race.mu);
  return NULL;
}

static int child_race(void) {
  uint64_t base = committed();
  void* early = malloc(64);
  free(early);
  sleep_ms(1100);   /* the background thread may start from the next slow path */
  free(malloc(64));
  pthread_t f, o[RACE_OWNERS];
  if (pthread_create(&f, NULL, race_freer, NULL) != 0) return 2;
  for (long k = 0; k < RACE_OWNERS; k++)
    if (pthread_create(&o[k], NULL, race_owner, (void*)k) != 0) return 2;
  for (int k = 0; k < RACE_OWNERS; k++) pthread_join(o[k], NULL);
  pthread_mutex_lock(&race.mu);
  race.done = true;
  pthread_cond_broadcast(&race.cv);
  pthread_mutex_unlock(&race.mu);
  pthread_join(f, NULL);
  sleep_ms(200);   /* every block is free: what stays committed after 13 passes was lost on the way */
  uint64_t now = committed();
  harness_say("rounds %ld bad %ld kept %llu KiB\n", atomic_load(&race_rounds), atomic_load(&race_bad),
              (unsigned long long)(now > base ? now - base : 0) >> 10);
  return 0;
}

static volatile pid_t handled_on;
static void on_usr1(int sig) {
  (void)sig;
  handled_on = (pid_t)syscall(SYS_gettid);
}

/* The thread's tid, found by its name; 0 if there is none. */
static pid_t decay_tid(void) {
  DIR* d = opendir("/proc/self/task");
  if (!d) return 0;
  pid_t found = 0;
  struct dirent* e;
  while ((e = readdir(d)) != NULL) {
    char path[300], comm[32] = {0};
    snprintf(path, sizeof path, "/proc/self/task/%s/comm", e->d_name);
    FILE* f = fopen(path, "r");
    if (!f) continue;
    if (fgets(comm, sizeof comm, f) && strncmp(comm, "hakmem-decay", 12) == 0) found = atoi(e->d_name);
    fclose(f);
  }
  closedir(d);
  return found;
}

/* Child: every signal is blocked in the thread, and a signal sent to the
 * process runs its handler on the program's thread. */
static int child_signals(void) {
  peak_then_free();
  sleep_ms(300);
  pid_t tid = decay_tid();
  if (!tid) {
    harness_say("no hakmem-decay thread\n");
    return 1;
  }
  char path[64], line[256];
  snprintf(path, sizeof path, "/proc/self/task/%d/status", (int)tid);
  FILE* f = fopen(path, "r");
  unsigned long long blk = 0;
  while (f && fgets(line, sizeof line, f))
    if (strncmp(line, "SigBlk:", 7) == 0) blk = strtoull(line + 7, NULL, 16);
  if (f) fclose(f);
  signal(SIGUSR1, on_usr1);
  for (int i = 0; i < 50; i++) {
    handled_on = 0;
    kill(getpid(), SIGUSR1);
    for (int w = 0; w < 1000 && !handled_on; w++) sleep_ms(1);
    if (handled_on != getpid()) {
      harness_say("SIGUSR1 ran on thread %d\n", (int)handled_on);
      return 1;
    }
  }
  /* Signals 1-31 but SIGKILL and SIGSTOP, which no mask holds. */
  unsigned long long want = 0x7fffffffull & ~((1ull << (SIGKILL - 1)) | (1ull << (SIGSTOP - 1)));
  harness_say("sigblk %llx\n", blk);
  return (blk & want) == want ? 0 : 1;
}

/* Child: a seccomp filter (one that allows everything: the allocator
 * cannot read a filter's rules, so any filter counts) keeps the thread off. */
static int child_seccomp(void) {
  struct sock_filter allow[] = {BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW)};
  struct sock_fprog prog = {1, allow};
  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 || prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) != 0) {
    harness_say("cannot install a seccomp filter: %s\n", strerror(errno));
    return 2;
  }
  return child_idle();
}

/* Child: the thread started in this process; a forked child has none, and
 * starts its own once it is a second old. */
static int child_fork(void) {
  peak_then_free();
  sleep_ms(300);
  if (!decay_tid()) return 1;
  for (int i = 0; i < N; i += PIN_EVERY) free(blk[i]);
  pid_t pid = fork();
  if (pid == 0) {
    if (decay_tid()) _exit(3);   /* fork copies only the calling thread */
    child_idle();
    _exit(decay_tid() ? 0 : 4);
  }
  int st;
  waitpid(pid, &st, 0);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 100;
}

static int rerun(const char* mode, const char* env1, char* out, size_t cap) {
  char* envp[] = {"HAKMEM_DRAIN_MS=100", "HAKMEM_STATS=1", (char*)env1, NULL};
  return rerun_self(mode, envp, out, cap);
}

static unsigned long long kib_after(const char* out, const char* what) {
  const char* p = strstr(out, what);
  return p ? strtoull(p + strlen(what), NULL, 10) : ~0ull;
}

TEST(an_idle_process_gives_its_freed_pages_back) {
  static char out[16384];
  CHECK_EQ(rerun("idle", NULL, out, sizeof out), 0);
  unsigned long long freed = kib_after(out, "after free "), idle = kib_after(out, "after idle ");
  harness_say("  background on: %llu KiB kept after the frees, %llu KiB after 6 idle intervals\n", freed, idle);
  CHECK(freed >= 32 * 1024);          /* the dirty pages were kept at first */
  CHECK(idle <= 8 * 1024);            /* and went back while the program slept (the pins: 64 KiB) */
  CHECK(strstr(out, "background: idle memory goes back every drain interval") != NULL);
  /* The decay thread gave it back: its calls are counted as its own, and
   * none of the bytes as the program's (whose thread slept). */
  unsigned long long dcalls = kib_after(out, "decay calls while idle "), ret = kib_after(out, "returned while idle ");
  harness_say("  the decay thread's calls while idle %llu, bytes the program's threads gave back %llu KiB\n", dcalls, ret);
  CHECK(dcalls >= 1 && dcalls != ~0ull);
  CHECK_EQ(ret, 0);

  CHECK_EQ(rerun("idle", "HAKMEM_BACKGROUND=0", out, sizeof out), 0);
  idle = kib_after(out, "after idle ");
  harness_say("  HAKMEM_BACKGROUND=0: %llu KiB after 6 idle intervals\n", idle);
  CHECK(idle >= 32 * 1024);           /* without the thread nothing runs the decay pass */
  CHECK(strstr(out, "background: off: HAKMEM_BACKGROUND=0") != NULL);
  /* This thread's malloc_trim gave the kept pages back: the program's bytes,
   * and no decay thread made a call. */
  unsigned long long trim = kib_after(out, "trim returned "), all = kib_after(out, "decay calls in all ");
  harness_say("  HAKMEM_BACKGROUND=0: malloc_trim gave back %llu KiB, decay calls %llu\n", trim, all);
  CHECK(trim >= 32 * 1024 && trim != ~0ull);
  CHECK_EQ(all, 0);
}

/* Before: the 64 MiB stayed committed while the thread that made it
 * waited (a server's main thread between requests, its helper having
 * freed what it built), however long it waited. */
TEST(an_idle_thread_gets_back_what_another_thread_freed) {
  static char out[16384];
  CHECK_EQ(rerun("remote", NULL, out, sizeof out), 0);
  unsigned long long freed = kib_after(out, "after free "), idle = kib_after(out, "after idle ");
  harness_say("  freed by another thread: %llu KiB committed after the frees, %llu KiB after 6 idle intervals\n",
              freed, idle);
  CHECK(freed >= 32 * 1024);          /* in the owner's inbox, its slabs still full */
  CHECK(idle <= 8 * 1024);

  CHECK_EQ(rerun("remote", "HAKMEM_BACKGROUND=0", out, sizeof out), 0);
  idle = kib_after(out, "after idle ");
  harness_say("  HAKMEM_BACKGROUND=0: %llu KiB after 6 idle intervals\n", idle);
  CHECK(idle >= 32 * 1024);
}

TEST(the_idle_pass_and_waking_owners_never_share_a_block) {
  static char out[16384];
  char* envp[] = {"HAKMEM_DRAIN_MS=5", "HAKMEM_STATS=1", NULL};
  CHECK_EQ(rerun_self("race", envp, out, sizeof out), 0);
  unsigned long long rounds = kib_after(out, "rounds "), bad = kib_after(out, " bad ");
  harness_say("  %llu rounds of %d blocks freed by another thread, owners idle 5-35 ms: %llu blocks changed under the freer\n",
              rounds, RACE_BLOCKS, bad);
  unsigned long long kept = kib_after(out, " kept ");
  harness_say("  %llu KiB committed 200 ms after the last free\n", kept);
  CHECK(rounds >= 3 && rounds != ~0ull);
  CHECK_EQ(bad, 0);
  CHECK(kept <= 2048);   /* a round needs 1.4 MiB at its peak; the rest goes back */
}

TEST(the_thread_blocks_every_signal) {
  static char out[16384];
  int rc = rerun("signals", NULL, out, sizeof out);
  if (rc) harness_say("%s", out);
  CHECK_EQ(rc, 0);
}

TEST(a_seccomp_filter_keeps_the_thread_off) {
  static char out[16384];
  int rc = rerun("seccomp", NULL, out, sizeof out);
  if (rc == 2) SKIP("this kernel refuses seccomp filters: %.200s", out);
  CHECK_EQ(rc, 0);
  CHECK(strstr(out, "background: off: a seccomp filter governs the process") != NULL);
  CHECK(kib_after(out, "after idle ") >= 32 * 1024);
}

TEST(a_forked_child_starts_its_own_thread) {
  static char out[16384];
  int rc = rerun("fork", NULL, out, sizeof out);
  if (rc) harness_say("%s", out);
  CHECK_EQ(rc, 0);
  CHECK(kib_after(out, "after idle ") <= 8 * 1024);
}

int main(int argc, char** argv) {
  if (argc > 1) {
    if (!strcmp(argv[1], "idle")) return child_idle();
    if (!strcmp(argv[1], "remote")) return child_remote();
    if (!strcmp(argv[1], "race")) return child_race();
    if (!strcmp(argv[1], "signals")) return child_signals();
    if (!strcmp(argv[1], "seccomp")) return child_seccomp();
    if (!strcmp(argv[1], "fork")) return child_fork();
    return 99;
  }
  RUN(an_idle_process_gives_its_freed_pages_back);
  RUN(an_idle_thread_gets_back_what_another_thread_freed);
  RUN(the_idle_pass_and_waking_owners_never_share_a_block);
  RUN(the_thread_blocks_every_signal);
  RUN(a_seccomp_filter_keeps_the_thread_off);
  RUN(a_forked_child_starts_its_own_thread);
  return harness_done();
}
