/* counted.c — a workload that says exactly what it did, for test_counters.py.
 *
 *   counted THREADS
 *
 * Run with hakmem preloaded and telemetry on. Until a line arrives on stdin
 * it churns 64-byte blocks (slow paths, so the telemetry file gets made);
 * then THREADS threads allocate blocks of four sizes that nothing else in
 * the process uses (2.5 KiB, 20 KiB, 320 KiB and a huge 3 MiB + 12345 B),
 * free most of them, hand some to the next thread to free, and leave some
 * live until exit. The threads are joined, and one JSON line on stdout says
 * what was done per size: blocks allocated, blocks freed, blocks still live,
 * and the number of threads. The process then exits, so the ring's last
 * record (and the HAKMEM_STATS=1 table) is taken after every thread has
 * been joined: there the counters must equal this report exactly.
 *
 * stdin is read with read(2) and the report is the only stdio output, so
 * glibc's buffers come from other size classes than the measured ones.
 */
#define _GNU_SOURCE
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const size_t SIZES[] = {2560, 20480, 327680, 3 * 1024 * 1024 + 12345};
#define NS 4
#define MAXT 16
#define PER 240   /* blocks per size per thread (huge: PER / 40) */

typedef struct {
  int id;
  long allocs[NS], frees[NS], live[NS];
  void* handoff[NS][PER];
  int nhand[NS];
} worker_t;

static worker_t W[MAXT];
static int nthreads;
static pthread_barrier_t handed;

static void* worker(void* arg) {
  worker_t* w = arg;
  void* b[PER];
  for (int k = 0; k < NS; k++) {
    int n = k == NS - 1 ? PER / 40 + w->id % 3 : PER - 17 * w->id % 50;
    for (int i = 0; i < n; i++) {
      b[i] = malloc(SIZES[k]);
      if (!b[i]) { perror("malloc"); exit(3); }
      memset(b[i], i, 64);
    }
    w->allocs[k] += n;
    for (int i = 0; i < n; i++) {
      if (i % 6 == 3) {
        w->live[k]++;                   /* live until exit */
      } else if (i % 6 == 0) {
        w->handoff[k][w->nhand[k]++] = b[i];   /* the next thread frees it */
      } else {
        free(b[i]);
        w->frees[k]++;
      }
    }
  }
  pthread_barrier_wait(&handed);
  worker_t* prev = &W[(w->id + nthreads - 1) % nthreads];
  for (int k = 0; k < NS; k++)
    for (int i = 0; i < prev->nhand[k]; i++) {
      free(prev->handoff[k][i]);
      w->frees[k]++;
    }
  return NULL;
}

static void churn(void) {
  void* p[512];
  for (int i = 0; i < 512; i++) p[i] = malloc(64);
  for (int i = 0; i < 512; i++) free(p[i]);
}

int main(int argc, char** argv) {
  nthreads = argc > 1 ? atoi(argv[1]) : 4;
  if (nthreads < 1 || nthreads > MAXT) return 2;
  for (;;) {   /* slow paths until told to go */
    churn();
    struct pollfd pf = {0, POLLIN, 0};
    if (poll(&pf, 1, 1) > 0) break;
  }
  char line[64];
  if (read(0, line, sizeof line) <= 0) return 2;
  pthread_barrier_init(&handed, NULL, (unsigned)nthreads);
  pthread_t th[MAXT];
  for (int i = 0; i < nthreads; i++) {
    W[i].id = i;
    if (pthread_create(&th[i], NULL, worker, &W[i]) != 0) return 3;
  }
  for (int i = 0; i < nthreads; i++) pthread_join(th[i], NULL);
  printf("{\"threads\": %d, \"sizes\": [", nthreads);
  for (int k = 0; k < NS; k++) {
    long a = 0, f = 0, l = 0;
    for (int i = 0; i < nthreads; i++) {
      a += W[i].allocs[k];
      f += W[i].frees[k];
      l += W[i].live[k];
    }
    printf("%s{\"size\": %zu, \"allocs\": %ld, \"frees\": %ld, \"live\": %ld}", k ? ", " : "", SIZES[k], a, f, l);
  }
  printf("]}\n");
  fflush(stdout);
  return 0;
}
