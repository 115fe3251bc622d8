/* prodcons — remote frees at full rate: THREADS/2 producer/consumer pairs,
 * each connected by a bounded single-producer/single-consumer ring of
 * pointers. Producers allocate (random size in [MIN, MAX]) and push;
 * consumers pop, read and free, so every free is a remote free.
 * ops = objects passed (each one malloc in a producer and one free in a
 * consumer); OPS is the total over all pairs. */
#include "common.h"
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>

#define RING 1024 /* slots, a power of two */
#define PUBLISH 32 /* objects per publication of the producer's index */
#define SPINS 64  /* busy polls before yielding the core */

/* head is written only by the producer, tail only by the consumer; each
 * sits on its own cache line so the two sides do not false-share. */
typedef struct {
  _Alignas(64) atomic_uint_fast64_t head;
  _Alignas(64) atomic_uint_fast64_t tail;
  _Alignas(64) void *slot[RING];
  uint64_t count; /* objects to pass */
  rng_t rng;      /* producer's */
  uint64_t sum;   /* consumer's: first bytes read, so the reads are real */
  int cpu[2];     /* producer's and consumer's CPU, -1: not pinned */
} pair_t;

static uint64_t min, max;
static pthread_barrier_t start;
static span_t span;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __asm__ volatile("pause");
#elif defined(__aarch64__)
  __asm__ volatile("yield");
#endif
}

/* Left to the scheduler, a pair sometimes shares one core (each side runs
 * a ring's worth, then yields: no remote traffic at all) and sometimes runs
 * on two, and the figure jumps 5-10x between runs. Pinning the two sides
 * to different CPUs measures the cross-core case every time. */
static void pin(int cpu) {
  if (cpu < 0) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

/* The n-th CPU this process may run on, cycling; -1 with fewer than two. */
static int nth_cpu(const cpu_set_t *allowed, uint64_t n) {
  int count = CPU_COUNT(allowed);
  if (count < 2) return -1;
  n %= (uint64_t)count;
  for (int c = 0; c < CPU_SETSIZE; c++)
    if (CPU_ISSET(c, allowed) && n-- == 0) return c;
  return -1;
}

/* Waits politely: a few polls, then give the core away (the machine this
 * runs on may have fewer cores than threads). */
static inline void backoff(unsigned *spins) {
  if (++*spins < SPINS) {
    cpu_relax();
  } else {
    *spins = 0;
    sched_yield();
  }
}

/* Both sides publish their index in batches (the producer every PUBLISH
 * objects or before it waits, the consumer when it has caught up with what
 * it saw), so the ring's cache lines move between cores once per batch, not
 * once per object: what is measured is the allocator's remote free, not
 * the ring. Neither side can wait on the other's unpublished work: the
 * producer publishes before waiting and PUBLISH < RING. */
static void *producer(void *arg) {
  pair_t *q = arg;
  uint64_t head = 0, tail = 0; /* tail: our last look at the consumer's */
  pin(q->cpu[0]);
  pthread_barrier_wait(&start);
  span_start(&span);
  for (uint64_t i = 0; i < q->count; i++) {
    size_t n = rng_range(&q->rng, min, max);
    void *p = xmalloc(n);
    touch(p, n);
    if (head - tail == RING) {
      atomic_store_explicit(&q->head, head, memory_order_release);
      unsigned spins = 0;
      while ((tail = atomic_load_explicit(&q->tail, memory_order_acquire)), head - tail == RING)
        backoff(&spins);
    }
    q->slot[head % RING] = p;
    if (++head % PUBLISH == 0) atomic_store_explicit(&q->head, head, memory_order_release);
  }
  atomic_store_explicit(&q->head, head, memory_order_release);
  span_end(&span);
  return NULL;
}

static void *consumer(void *arg) {
  pair_t *q = arg;
  uint64_t tail = 0, head = 0, sum = 0; /* head: our last look at the producer's */
  pin(q->cpu[1]);
  pthread_barrier_wait(&start);
  span_start(&span);
  for (uint64_t i = 0; i < q->count; i++) {
    if (tail == head) {
      atomic_store_explicit(&q->tail, tail, memory_order_release);
      unsigned spins = 0;
      while ((head = atomic_load_explicit(&q->head, memory_order_acquire)), tail == head)
        backoff(&spins);
    }
    unsigned char *p = q->slot[tail++ % RING];
    sum += p[0];
    free(p);
  }
  span_end(&span);
  q->sum = sum;
  return NULL;
}

int main(int argc, char **argv) {
  bench_usage_line = "prodcons THREADS(>=2) [OPS=4000000] [MIN=16] [MAX=1024] [SEED=42]";
  uint64_t threads = arg_u64(argc, argv, 1, 2);
  uint64_t ops = arg_u64(argc, argv, 2, 4000000);
  min = arg_u64(argc, argv, 3, 16);
  max = arg_u64(argc, argv, 4, 1024);
  uint64_t seed = arg_u64(argc, argv, 5, 42);
  bench_require(threads >= 2 && threads <= 1024 && min > 0 && min <= max,
                "need 2 <= THREADS <= 1024 (odd counts round down) and 0 < MIN <= MAX");
  uint64_t pairs = threads / 2;
  bench_require(ops >= pairs, "need OPS >= THREADS/2");

  pair_t *q = aligned_alloc(64, pairs * sizeof *q);
  pthread_t tid[2 * pairs];
  pthread_barrier_init(&start, NULL, (unsigned)(2 * pairs));
  cpu_set_t allowed;
  if (sched_getaffinity(0, sizeof allowed, &allowed)) CPU_ZERO(&allowed);
  for (uint64_t i = 0; i < pairs; i++) {
    memset(&q[i], 0, sizeof q[i]);
    q[i].cpu[0] = nth_cpu(&allowed, 2 * i);
    q[i].cpu[1] = nth_cpu(&allowed, 2 * i + 1);
    q[i].count = ops / pairs;
    q[i].rng = rng_seed(seed + i * 0x1000193);
    if (pthread_create(&tid[2 * i], NULL, producer, &q[i]) ||
        pthread_create(&tid[2 * i + 1], NULL, consumer, &q[i])) {
      fprintf(stderr, "prodcons: pthread_create failed\n");
      return 1;
    }
  }
  for (uint64_t i = 0; i < 2 * pairs; i++) pthread_join(tid[i], NULL);

  uint64_t done = 0, sum = 0;
  for (uint64_t i = 0; i < pairs; i++) {
    done += q[i].count;
    sum += q[i].sum;
  }
  int pinned = q[0].cpu[0] >= 0;
  free(q);
  bench_report("prodcons", (int)(2 * pairs), done, span_seconds(&span),
               "\"pairs\":%" PRIu64 ",\"min\":%" PRIu64 ",\"max\":%" PRIu64 ",\"seed\":%" PRIu64
               ",\"ring\":%d,\"pinned\":%s,\"checksum\":%" PRIu64
               ",\"op\":\"one object: malloc in a producer, free in a consumer\"",
               pairs, min, max, seed, RING, pinned ? "true" : "false", sum);
  return 0;
}
