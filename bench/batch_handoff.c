/* batch_handoff — one thread allocates small blocks, another frees them, in
 * batches: the producer fills a batch of BATCH blocks of SIZE bytes, writes
 * each, and queues the batch; the consumer takes whole batches and frees
 * every block. The queue holds at most DEPTH batches, so the producer runs
 * at most DEPTH * BATCH blocks ahead of the consumer. Every free is remote,
 * and every block the producer gets must come back from the other thread.
 * ops = blocks (each one malloc in the producer and one free in the
 * consumer).
 *
 * The pattern of "xmalloc-test" (Lever and Boreham's xmalloc benchmark),
 * written from its description: a producer and a consumer of small blocks. */
#include "common.h"
#include <pthread.h>

typedef struct {
  pthread_mutex_t lock;
  pthread_cond_t changed;
  void ***ring;          /* DEPTH batches */
  uint64_t head, tail;   /* batches queued, taken */
  int done;
} queue_t;

static queue_t q = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, 0, 0, 0};
static uint64_t blocks, batch, size, depth;
static pthread_barrier_t start;
static span_t span;

static void *producer(void *arg) {
  pthread_barrier_wait(&start);
  span_start(&span);
  for (uint64_t made = 0; made < blocks; made += batch) {
    void **b = xmalloc(batch * sizeof *b);
    for (uint64_t i = 0; i < batch; i++) {
      b[i] = xmalloc(size);
      touch(b[i], size);
    }
    pthread_mutex_lock(&q.lock);
    while (q.head - q.tail == depth) pthread_cond_wait(&q.changed, &q.lock);
    q.ring[q.head++ % depth] = b;
    pthread_cond_broadcast(&q.changed);
    pthread_mutex_unlock(&q.lock);
  }
  pthread_mutex_lock(&q.lock);
  q.done = 1;
  pthread_cond_broadcast(&q.changed);
  pthread_mutex_unlock(&q.lock);
  span_end(&span);
  return NULL;
}

static void *consumer(void *arg) {
  uint64_t sum = 0;
  pthread_barrier_wait(&start);
  span_start(&span);
  for (;;) {
    pthread_mutex_lock(&q.lock);
    while (q.head == q.tail && !q.done) pthread_cond_wait(&q.changed, &q.lock);
    if (q.head == q.tail) {
      pthread_mutex_unlock(&q.lock);
      break;
    }
    void **b = q.ring[q.tail++ % depth];
    pthread_cond_broadcast(&q.changed);
    pthread_mutex_unlock(&q.lock);
    for (uint64_t i = 0; i < batch; i++) {
      sum += *(unsigned char *)b[i];
      free(b[i]);
    }
    free(b);
  }
  span_end(&span);
  bench_escape((void *)(uintptr_t)sum);
  return NULL;
}

int main(int argc, char **argv) {
  bench_usage_line = "batch_handoff [BLOCKS=20000000] [BATCH=4096] [SIZE=64] [DEPTH=4]";
  blocks = arg_u64(argc, argv, 1, 20000000);
  batch = arg_u64(argc, argv, 2, 4096);
  size = arg_u64(argc, argv, 3, 64);
  depth = arg_u64(argc, argv, 4, 4);
  bench_require(batch > 0 && size > 0 && depth > 0 && blocks >= batch, "need BATCH, SIZE, DEPTH > 0 and BLOCKS >= BATCH");
  blocks -= blocks % batch;

  q.ring = xmalloc(depth * sizeof *q.ring);
  pthread_t tid[2];
  pthread_barrier_init(&start, NULL, 2);
  if (pthread_create(&tid[0], NULL, producer, NULL) || pthread_create(&tid[1], NULL, consumer, NULL)) {
    fprintf(stderr, "pthread_create failed\n");
    return 1;
  }
  pthread_join(tid[0], NULL);
  pthread_join(tid[1], NULL);
  free(q.ring);

  bench_report("batch_handoff", 2, blocks, span_seconds(&span),
               "\"batch\":%" PRIu64 ",\"size\":%" PRIu64 ",\"depth\":%" PRIu64
               ",\"op\":\"one block: a malloc in one thread, its free in the other\"",
               batch, size, depth);
  return 0;
}
