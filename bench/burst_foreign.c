/* burst_foreign — bursts of allocations freed in LIFO or FIFO order, part
 * of each burst by another thread. Each thread repeatedly allocates a burst
 * of BURST blocks (sizes 1..MAX bytes, most small), writes them, then frees
 * them: odd bursts newest first (LIFO), even bursts oldest first (FIFO).
 * FOREIGN percent of each burst is not freed by its maker: it goes, in one
 * batch, to the next thread's inbox, and that thread frees it at the start
 * of its next burst. FOREIGN=0 is the purely thread-local pattern.
 * ops = blocks allocated (each also freed once), over all threads.
 *
 * The pattern of the SmartHeap benchmarks (sh6bench: per-thread LIFO/FIFO
 * bursts; sh8bench: the same with blocks freed by another thread), written
 * from their description. */
#include "common.h"
#include <pthread.h>
#include <sched.h>

/* A thread's inbox: batches of foreign blocks, handed over under a mutex
 * once per burst (the benchmark's own synchronisation must stay far below
 * the allocator's cost: one lock per burst of hundreds of blocks). */
typedef struct batch_s {
  struct batch_s *next;
  uint64_t n;
  void *blk[];
} batch_t;

typedef struct {
  _Alignas(64) pthread_mutex_t lock;
  batch_t *head;
} inbox_t;

static inbox_t *inbox;
static uint64_t threads, iters, burst, foreign_pct, max_size, seed;
static pthread_barrier_t start;
static span_t span;

static size_t pick_size(rng_t *r) {
  uint64_t x = rng_next(r);
  if ((x & 7) == 0) return 1 + (size_t)((x >> 3) % max_size);   /* 1 in 8: anywhere up to MAX */
  uint64_t small = max_size < 128 ? max_size : 128;
  return 1 + (size_t)((x >> 3) % small);
}

static void drain(inbox_t *in) {
  pthread_mutex_lock(&in->lock);
  batch_t *b = in->head;
  in->head = NULL;
  pthread_mutex_unlock(&in->lock);
  while (b) {
    batch_t *next = b->next;
    for (uint64_t i = 0; i < b->n; i++) free(b->blk[i]);
    free(b);
    b = next;
  }
}

static void *worker(void *arg) {
  uint64_t id = (uint64_t)(uintptr_t)arg;
  rng_t r = rng_seed(seed + id * 0x1000193);
  void **blk = xmalloc(burst * sizeof *blk);
  inbox_t *mine = &inbox[id], *next = &inbox[(id + 1) % threads];
  uint64_t nforeign = threads > 1 ? burst * foreign_pct / 100 : 0;
  pthread_barrier_wait(&start);
  span_start(&span);
  for (uint64_t it = 0; it < iters; it++) {
    drain(mine);
    for (uint64_t i = 0; i < burst; i++) {
      size_t n = pick_size(&r);
      blk[i] = xmalloc(n);
      touch(blk[i], n);
    }
    /* The foreign share is spread over the burst (every k-th block), so a
     * remote free lands among the owner's own frees, not in one run. */
    batch_t *b = NULL;
    uint64_t k = nforeign ? burst / nforeign : 0;
    if (nforeign) {
      b = xmalloc(sizeof *b + nforeign * sizeof(void *));
      b->n = 0;
      for (uint64_t i = 0; i < burst && b->n < nforeign; i += k) {
        b->blk[b->n++] = blk[i];
        blk[i] = NULL;
      }
    }
    if (it & 1) {
      for (uint64_t i = burst; i-- > 0;) free(blk[i]);
    } else {
      for (uint64_t i = 0; i < burst; i++) free(blk[i]);
    }
    if (b) {
      pthread_mutex_lock(&next->lock);
      b->next = next->head;
      next->head = b;
      pthread_mutex_unlock(&next->lock);
    }
  }
  span_end(&span);
  free(blk);
  return NULL;
}

int main(int argc, char **argv) {
  bench_usage_line = "burst_foreign [THREADS=2] [ITERS=20000] [BURST=500] [FOREIGN=25 percent] [MAX=1000 bytes] [SEED=42]";
  threads = arg_u64(argc, argv, 1, 2);
  iters = arg_u64(argc, argv, 2, 20000);
  burst = arg_u64(argc, argv, 3, 500);
  foreign_pct = arg_u64(argc, argv, 4, 25);
  max_size = arg_u64(argc, argv, 5, 1000);
  seed = arg_u64(argc, argv, 6, 42);
  bench_require(threads > 0 && threads <= 1024 && burst > 0 && foreign_pct <= 100 && max_size > 0,
                "need 1 <= THREADS <= 1024, BURST > 0, FOREIGN <= 100 and MAX > 0");

  inbox = aligned_alloc(64, threads * sizeof *inbox);
  for (uint64_t i = 0; i < threads; i++) {
    pthread_mutex_init(&inbox[i].lock, NULL);
    inbox[i].head = NULL;
  }
  pthread_t tid[threads];
  pthread_barrier_init(&start, NULL, (unsigned)threads);
  for (uint64_t i = 0; i < threads; i++)
    if (pthread_create(&tid[i], NULL, worker, (void *)(uintptr_t)i)) {
      fprintf(stderr, "pthread_create failed\n");
      return 1;
    }
  for (uint64_t i = 0; i < threads; i++) pthread_join(tid[i], NULL);
  for (uint64_t i = 0; i < threads; i++) drain(&inbox[i]);
  free(inbox);

  bench_report("burst_foreign", (int)threads, threads * iters * burst, span_seconds(&span),
               "\"iters\":%" PRIu64 ",\"burst\":%" PRIu64 ",\"foreign_pct\":%" PRIu64 ",\"max\":%" PRIu64
               ",\"seed\":%" PRIu64 ",\"op\":\"one malloc and its free\"",
               iters, burst, foreign_pct, max_size, seed);
  return 0;
}
