/* larson — the classic server simulation (Larson & Krishnan, "Memory
 * allocation for long-running server applications", ISMM 1998).
 *
 * THREADS lanes; each lane owns an array of CHUNKS objects (allocated by
 * the main thread before the clock starts). A lane's thread repeatedly
 * frees a random object of the array and allocates a new one of random size
 * in [MIN, MAX]; after ROUNDS such steps it hands the whole array to a
 * thread it creates and exits. So most objects are freed by a thread other
 * than the one that allocated them, and threads come and go all the time:
 * remote frees plus thread-cache setup and teardown.
 *
 * Runs for SECONDS (fractions allowed); ops = steps done, each one free +
 * one malloc. seconds = start to the last lane's thread stopping. */
#include "common.h"
#include <pthread.h>
#include <stdatomic.h>

typedef struct {
  void **objs;
  rng_t rng;
  uint64_t ops;     /* steps done by the lane's threads so far */
  uint64_t threads; /* threads the lane has run so far */
} lane_t;

static uint64_t min, max, chunks, rounds;
static atomic_int stop;
static pthread_attr_t detached;
/* Lanes still running, guarded by done_mu; main waits on done_cv. */
static pthread_mutex_t done_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t done_cv = PTHREAD_COND_INITIALIZER;
static uint64_t lanes_running;

static void *lane_thread(void *arg) {
  lane_t *l = arg;
  uint64_t n = 0;
  for (; n < rounds && !atomic_load_explicit(&stop, memory_order_relaxed); n++) {
    void **slot = &l->objs[rng_below(&l->rng, chunks)];
    free(*slot);
    size_t sz = rng_range(&l->rng, min, max);
    *slot = xmalloc(sz);
    touch(*slot, sz);
  }
  l->ops += n;
  l->threads++;
  /* The lane belongs to exactly one thread at a time: after creating the
   * successor (pthread_create orders our writes before its start) this
   * thread must not touch l again. */
  if (!atomic_load_explicit(&stop, memory_order_relaxed)) {
    pthread_t t;
    if (pthread_create(&t, &detached, lane_thread, l)) {
      fprintf(stderr, "larson: pthread_create failed\n");
      exit(1);
    }
    return NULL;
  }
  pthread_mutex_lock(&done_mu);
  if (--lanes_running == 0) pthread_cond_signal(&done_cv);
  pthread_mutex_unlock(&done_mu);
  return NULL;
}

int main(int argc, char **argv) {
  bench_usage_line =
      "larson [THREADS=2] [SECONDS=3] [MIN=16] [MAX=1024] [CHUNKS=1000] [ROUNDS=10000] [SEED=42]";
  uint64_t threads = arg_u64(argc, argv, 1, 2);
  double seconds = arg_double(argc, argv, 2, 3.0);
  min = arg_u64(argc, argv, 3, 16);
  max = arg_u64(argc, argv, 4, 1024);
  chunks = arg_u64(argc, argv, 5, 1000);
  rounds = arg_u64(argc, argv, 6, 10000);
  uint64_t seed = arg_u64(argc, argv, 7, 42);
  bench_require(threads > 0 && threads <= 1024 && chunks > 0 && rounds > 0 && min > 0 && min <= max,
                "need 1 <= THREADS <= 1024, CHUNKS > 0, ROUNDS > 0, 0 < MIN <= MAX");

  lane_t *lanes = calloc(threads, sizeof *lanes);
  for (uint64_t i = 0; i < threads; i++) {
    lanes[i].rng = rng_seed(seed + i * 0x1000193);
    lanes[i].objs = xmalloc(chunks * sizeof(void *));
    for (uint64_t c = 0; c < chunks; c++) {
      size_t sz = rng_range(&lanes[i].rng, min, max);
      lanes[i].objs[c] = xmalloc(sz);
      touch(lanes[i].objs[c], sz);
    }
  }
  pthread_attr_init(&detached);
  pthread_attr_setdetachstate(&detached, PTHREAD_CREATE_DETACHED);
  lanes_running = threads;

  double t0 = bench_now();
  for (uint64_t i = 0; i < threads; i++) {
    pthread_t t;
    if (pthread_create(&t, &detached, lane_thread, &lanes[i])) {
      fprintf(stderr, "larson: pthread_create failed\n");
      return 1;
    }
  }
  struct timespec nap = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
  while (nanosleep(&nap, &nap) && errno == EINTR) {}
  atomic_store_explicit(&stop, 1, memory_order_relaxed);
  pthread_mutex_lock(&done_mu);
  while (lanes_running) pthread_cond_wait(&done_cv, &done_mu);
  pthread_mutex_unlock(&done_mu);
  double t1 = bench_now();

  uint64_t ops = 0, generations = 0;
  for (uint64_t i = 0; i < threads; i++) {
    ops += lanes[i].ops;
    generations += lanes[i].threads;
    for (uint64_t c = 0; c < chunks; c++) free(lanes[i].objs[c]);
    free(lanes[i].objs);
  }
  free(lanes);
  bench_report("larson", (int)threads, ops, t1 - t0,
               "\"run_seconds\":%g,\"min\":%" PRIu64 ",\"max\":%" PRIu64 ",\"chunks\":%" PRIu64
               ",\"rounds\":%" PRIu64 ",\"seed\":%" PRIu64 ",\"threads_created\":%" PRIu64
               ",\"op\":\"one free and one malloc\"",
               seconds, min, max, chunks, rounds, seed, generations);
  return 0;
}
