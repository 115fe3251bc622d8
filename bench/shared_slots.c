/* shared_slots — objects handed between threads through a shared table.
 * Each step takes whatever object sits in a random slot of the table (an
 * atomic exchange with NULL); a taken object is checked (its maker wrote
 * its size and a pattern into it) and freed, or, one time in four, kept
 * and put back into another empty slot, so objects live across several
 * owners. An empty slot gets a fresh object of a random size. Sizes are
 * mostly small with a tail up to 64 KiB; every object is written whole.
 * ops = steps over all threads (each one malloc or one free, or a move).
 *
 * The pattern of mimalloc-bench's "mstress", written from its description:
 * objects that migrate between threads and are freed far from their
 * allocating thread, with the allocator's memory reused across them. */
#include "common.h"
#include <pthread.h>

static _Atomic(void *) *table;
static uint64_t nslots, steps, seed;
static pthread_barrier_t start;
static span_t span;
static _Atomic uint64_t bad;

typedef struct {
  uint64_t size;
  uint64_t check;
} obj_hdr_t;

static size_t pick_size(rng_t *r) {
  uint64_t x = rng_next(r);
  if ((x & 0x3f) == 0) return 1024 + (size_t)((x >> 8) % (63 * 1024));
  return sizeof(obj_hdr_t) + 1 + (size_t)((x >> 8) % 495);
}

static void *make(rng_t *r) {
  size_t n = pick_size(r);
  obj_hdr_t *o = xmalloc(n);
  o->size = n;
  o->check = n * 0x9E3779B97F4A7C15ull;
  memset(o + 1, (int)(n & 0xff), n - sizeof *o);
  return o;
}

static void check(obj_hdr_t *o) {
  unsigned char *tail = (unsigned char *)o + o->size - 1;
  if (o->check != o->size * 0x9E3779B97F4A7C15ull || *tail != (unsigned char)(o->size & 0xff))
    atomic_fetch_add(&bad, 1);
}

static void *worker(void *arg) {
  uint64_t id = (uint64_t)(uintptr_t)arg;
  rng_t r = rng_seed(seed + id * 0x1000193);
  pthread_barrier_wait(&start);
  span_start(&span);
  for (uint64_t i = 0; i < steps; i++) {
    _Atomic(void *) *slot = &table[rng_below(&r, nslots)];
    obj_hdr_t *o = atomic_exchange_explicit(slot, NULL, memory_order_acq_rel);
    if (!o) {
      void *fresh = make(&r);
      void *expect = NULL;
      if (!atomic_compare_exchange_strong_explicit(slot, &expect, fresh, memory_order_acq_rel,
                                                   memory_order_relaxed))
        free(fresh);   /* another thread filled it meanwhile */
      continue;
    }
    check(o);
    if (rng_below(&r, 4) == 0) {
      /* Move it on: into another slot if that one is empty, else free. */
      void *expect = NULL;
      if (atomic_compare_exchange_strong_explicit(&table[rng_below(&r, nslots)], &expect, o,
                                                  memory_order_acq_rel, memory_order_relaxed))
        continue;
    }
    free(o);
  }
  span_end(&span);
  return NULL;
}

int main(int argc, char **argv) {
  bench_usage_line = "shared_slots [THREADS=2] [STEPS=2000000 per thread] [SLOTS=5000] [SEED=42]";
  uint64_t threads = arg_u64(argc, argv, 1, 2);
  steps = arg_u64(argc, argv, 2, 2000000);
  nslots = arg_u64(argc, argv, 3, 5000);
  seed = arg_u64(argc, argv, 4, 42);
  bench_require(threads > 0 && threads <= 1024 && nslots > 0, "need 1 <= THREADS <= 1024 and SLOTS > 0");

  table = calloc(nslots, sizeof *table);
  pthread_t tid[threads];
  pthread_barrier_init(&start, NULL, (unsigned)threads);
  for (uint64_t i = 0; i < threads; i++)
    if (pthread_create(&tid[i], NULL, worker, (void *)(uintptr_t)i)) {
      fprintf(stderr, "pthread_create failed\n");
      return 1;
    }
  for (uint64_t i = 0; i < threads; i++) pthread_join(tid[i], NULL);
  for (uint64_t i = 0; i < nslots; i++) {
    obj_hdr_t *o = atomic_load(&table[i]);
    if (o) {
      check(o);
      free(o);
    }
  }
  free((void *)table);
  if (atomic_load(&bad)) {
    fprintf(stderr, "shared_slots: %" PRIu64 " objects came back corrupted\n", atomic_load(&bad));
    return 1;
  }
  bench_report("shared_slots", (int)threads, threads * steps, span_seconds(&span),
               "\"steps_per_thread\":%" PRIu64 ",\"slots\":%" PRIu64 ",\"seed\":%" PRIu64
               ",\"op\":\"one step: a malloc, a free or a move\"",
               steps, nslots, seed);
  return 0;
}
