/* workload.c — a program for the telemetry tests, run with libhakmem
 * preloaded (it is linked against glibc only, like any service).
 *
 *   workload burst SIZE N SECONDS   allocate N blocks of SIZE, free them, repeat
 *   workload mixed THREADS SECONDS  threads allocating 16..4096 B, half the
 *                                   frees handed to the next thread
 *   workload fork SECONDS           bursts in the parent, and in a child
 *                                   forked halfway that runs 1 s and exits
 *   workload forks N MS             bursts in the parent for 0.3 s, then N
 *                                   children one after the other, each making
 *                                   2000 allocations (for at least MS ms) and
 *                                   leaving with _exit; the JSON line carries
 *                                   the time the N forks took, in ms
 *   workload hot SIZE PARK SECONDS  park PARK blocks of SIZE in the thread
 *                                   cache (allocate, then free them), then
 *                                   allocate and free one block in a loop:
 *                                   every call is a cache hit
 *   workload idle BUSY SECONDS      bursts of 64 B blocks for BUSY seconds,
 *                                   then SECONDS with no call at all
 *
 * The last line on stdout is JSON: {"mode":..., "ops":..., "seconds":...}.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec / 1e9;
}

static uint64_t rng(uint64_t* s) {
  *s ^= *s << 13; *s ^= *s >> 7; *s ^= *s << 17;
  return *s;
}

static uint64_t burst(size_t size, size_t n, double seconds) {
  void** v = calloc(n, sizeof *v);
  uint64_t ops = 0;
  double end = now() + seconds;
  while (now() < end) {
    for (int rep = 0; rep < 20; rep++) {
      for (size_t i = 0; i < n; i++) {
        v[i] = malloc(size);
        if (!v[i]) { perror("malloc"); exit(1); }
        memset(v[i], (int)i, 8);
      }
      for (size_t i = 0; i < n; i++) free(v[i]);
      ops += 2 * n;
    }
  }
  free(v);
  return ops;
}

static uint64_t hot(size_t size, size_t park, double seconds) {
  void** v = calloc(park ? park : 1, sizeof *v);
  for (size_t i = 0; i < park; i++) if (!(v[i] = malloc(size))) { perror("malloc"); exit(1); }
  for (size_t i = 0; i < park; i++) free(v[i]);
  uint64_t ops = 0;
  double end = now() + seconds;
  do {
    for (int i = 0; i < 4096; i++) {
      void* volatile q = malloc(size);
      if (!q) { perror("malloc"); exit(1); }
      free(q);
    }
    ops += 2 * 4096;
  } while (now() < end);
  free(v);
  return ops;
}

#define MAXT 16
#define SLOTS 512
static _Atomic(void*) mailbox[MAXT][SLOTS];
static int nthreads;
static double mixed_end;
static _Atomic uint64_t total_ops;

static void* mixed_thread(void* arg) {
  int me = (int)(intptr_t)arg;
  uint64_t s = 0x9e3779b97f4a7c15ull * (uint64_t)(me + 1);
  void* local[SLOTS] = {0};
  uint64_t ops = 0;
  while (now() < mixed_end) {
    for (int k = 0; k < 1000; k++) {
      uint64_t r = rng(&s);
      unsigned i = r % SLOTS;
      if (local[i]) {
        if (r & (1u << 20)) {   /* hand it to the next thread */
          void* old = atomic_exchange(&mailbox[(me + 1) % nthreads][i], local[i]);
          free(old);
        } else {
          free(local[i]);
        }
        local[i] = NULL;
      } else {
        size_t n = 16 + (r >> 32) % 4081;
        local[i] = malloc(n);
        ((char*)local[i])[0] = 1;
        ((char*)local[i])[n - 1] = 2;
      }
      ops++;
      void* got = atomic_exchange(&mailbox[me][k % SLOTS], NULL);
      free(got);
    }
  }
  for (int i = 0; i < SLOTS; i++) free(local[i]);
  atomic_fetch_add(&total_ops, ops);
  return NULL;
}

static uint64_t mixed(int threads, double seconds) {
  pthread_t t[MAXT];
  nthreads = threads;
  mixed_end = now() + seconds;
  for (int i = 0; i < threads; i++) pthread_create(&t[i], NULL, mixed_thread, (void*)(intptr_t)i);
  for (int i = 0; i < threads; i++) pthread_join(t[i], NULL);
  for (int m = 0; m < MAXT; m++)
    for (int i = 0; i < SLOTS; i++) free(atomic_exchange(&mailbox[m][i], NULL));
  return atomic_load(&total_ops);
}

int main(int argc, char** argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (argc < 2) { fprintf(stderr, "usage: workload burst|hot|idle|mixed|fork|forks ...\n"); return 2; }
  const char* mode = argv[1];
  double t0 = now(), seconds;
  uint64_t ops;
  if (strcmp(mode, "burst") == 0 && argc == 5) {
    seconds = atof(argv[4]);
    ops = burst((size_t)atol(argv[2]), (size_t)atol(argv[3]), seconds);
  } else if (strcmp(mode, "idle") == 0 && argc == 4) {
    ops = burst(64, 2000, atof(argv[2]));
    printf("{\"mode\":\"idle-start\",\"pid\":%d}\n", getpid());
    struct timespec ts = {.tv_sec = (time_t)atof(argv[3]), .tv_nsec = 0};
    while (nanosleep(&ts, &ts) != 0) {}
    seconds = atof(argv[2]) + atof(argv[3]);
  } else if (strcmp(mode, "hot") == 0 && argc == 5) {
    seconds = atof(argv[4]);
    ops = hot((size_t)atol(argv[2]), (size_t)atol(argv[3]), seconds);
  } else if (strcmp(mode, "mixed") == 0 && argc == 4) {
    int threads = atoi(argv[2]);
    if (threads < 1 || threads > MAXT) { fprintf(stderr, "threads 1..%d\n", MAXT); return 2; }
    seconds = atof(argv[3]);
    ops = mixed(threads, seconds);
  } else if (strcmp(mode, "fork") == 0 && argc == 3) {
    seconds = atof(argv[2]);
    ops = burst(64, 2000, seconds / 2);
    pid_t pid = fork();
    if (pid == 0) {
      uint64_t c = burst(64, 2000, 1.0);
      printf("{\"mode\":\"fork-child\",\"pid\":%d,\"ops\":%llu}\n", getpid(), (unsigned long long)c);
      exit(0);
    }
    printf("{\"mode\":\"fork-parent\",\"child\":%d}\n", pid);
    ops += burst(64, 2000, seconds / 2);
    int st;
    waitpid(pid, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) { fprintf(stderr, "child failed\n"); return 1; }
  } else if (strcmp(mode, "forks") == 0 && argc == 4) {
    int n = atoi(argv[2]);
    double child_s = atof(argv[3]) / 1000;
    ops = burst(64, 2000, 0.3);
    double f0 = now();
    for (int i = 0; i < n; i++) {
      pid_t pid = fork();
      if (pid < 0) { perror("fork"); return 1; }
      if (pid == 0) {
        double end = now() + child_s;
        do {
          void* v[2000];
          for (int k = 0; k < 2000; k++) if (!(v[k] = malloc(64))) _exit(1);
          for (int k = 0; k < 2000; k++) free(v[k]);
        } while (now() < end);
        _exit(0);
      }
      int st;
      waitpid(pid, &st, 0);
      if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) { fprintf(stderr, "child failed\n"); return 1; }
    }
    printf("{\"mode\":\"forks\",\"children\":%d,\"fork_ms\":%.1f}\n", n, (now() - f0) * 1000);
    seconds = 0.3;
  } else {
    fprintf(stderr, "workload: bad arguments\n");
    return 2;
  }
  printf("{\"mode\":\"%s\",\"pid\":%d,\"ops\":%llu,\"seconds\":%.3f}\n", mode, getpid(),
         (unsigned long long)ops, now() - t0);
  return 0;
}
