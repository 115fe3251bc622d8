/* learn_workload.c — the workloads of the learner proof (bench/learn.py).
 *
 *   learn_workload MODE SECONDS [SEED] [KEY=VALUE ...]
 *
 * Linked against glibc only: the allocator under test comes by LD_PRELOAD.
 * Four modes whose best static policies differ:
 *
 *   burst         one thread; bursts of N 64-byte blocks (N drawn from
 *                 [n_min, n_max], default 2500..4000) allocated, written, then
 *                 freed, over and over. Deeper than the default cache of the
 *                 64-byte class (1024 blocks), every burst refills and
 *                 drains; a cache of 4096 blocks serves it from the thread
 *                 cache and costs 256 KiB. Wants: a deep cache for one class.
 *   idle-threads  `threads` threads (default 32); each wakes every 50..250 ms,
 *                 picks 3 of 8 size classes (2 .. 48 KiB), allocates a
 *                 quarter to twice `kib` KiB (default 256) of each, touches
 *                 and frees it (twice), and sleeps again. The amount varies
 *                 as a request's would: the larger ones overflow a cache and
 *                 run the allocator's slow path, which is also where a new
 *                 policy is taken up (a thread that never leaves its cache
 *                 never sees one). Every thread holds little live,
 *                 but default caches park up to 1 MiB per medium class in
 *                 every sleeping thread. Wants: small caches, a short drain.
 *   phases        a cycle every `period_ms` (default 400), run by `workers`
 *                 threads in turn (default 2, a pool where successive jobs
 *                 land on different threads): a churn of 16..64 KiB blocks
 *                 up to `live_mib` MiB live (default 96), `rounds` (6)
 *                 replacements of the live set, all freed, then idle until
 *                 the next cycle. Each cycle either finds its memory in the
 *                 shared warm pools or faults it in again from the OS; what
 *                 the last worker's cache kept, it cannot use. Wants: a warm
 *                 pool that holds a whole phase, caches no deeper than usual.
 *   spikes        one thread; every `spike_ms` (default 2000) a spike of
 *                 `spike_mib` MiB (default 64) in 1..8 KiB blocks, allocated,
 *                 written, held `hold_ms` (100), freed, then idle. What the
 *                 allocator keeps of a spike (up to 1 MiB of blocks per class
 *                 in the thread cache, 1 MiB of empty slabs per class in the
 *                 warm pools, up to 32 MiB of freed pages below them) stays
 *                 resident through the idle time, and at a
 *                 price per GiB that costs more than faulting it in again at
 *                 the next spike. Wants: shallow caches and empty warm pools,
 *                 the other side of phases.
 *
 * Every 0.25 s the main thread prints one JSON line on stdout:
 *   {"t": seconds since start, "ops": cumulative operations (mallocs + frees),
 *    "busy": cumulative CPU seconds of the working threads while working}
 * and at the end one summary line with "done": true. Throughput over a
 * window is d(ops)/d(busy): ops per CPU-second of work, whatever the idle
 * time around it (busy is CLOCK_THREAD_CPUTIME_ID, so time another
 * process takes from this one on a shared machine is not counted), plus
 * all the CPU of threads the allocator starts in the process (hakmem's
 * decay thread): a policy that gives memory back there pays for it too.
 * Runs are deterministic for a seed (the sequence of sizes and counts).
 * Every block is written at least once per 4 KiB, so resident memory is real.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define USAGE "usage: learn_workload burst|idle-threads|phases|spikes SECONDS [SEED] [KEY=VALUE ...]\n" \
              "  burst: n_min=2500 n_max=4000 size=64\n" \
              "  idle-threads: threads=32 kib=256 sleep_min_ms=50 sleep_max_ms=250\n" \
              "  phases: live_mib=96 rounds=6 period_ms=400 min_kib=16 max_kib=64 workers=2\n" \
              "  spikes: spike_mib=64 spike_ms=2000 hold_ms=100\n"

/* ---- time, random numbers, counters ------------------------------------------- */
static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec / 1e9;
}

static double cpu_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void sleep_s(double s) {
  if (s <= 0) return;
  struct timespec ts = {(time_t)s, (long)((s - (time_t)s) * 1e9)};
  while (nanosleep(&ts, &ts) && errno == EINTR) {}
}

static uint64_t rng(uint64_t* s) {   /* xorshift64 */
  *s ^= *s << 13; *s ^= *s >> 7; *s ^= *s << 17;
  return *s;
}

static uint64_t seed_of(uint64_t seed, uint64_t k) {
  uint64_t s = (seed + 1) * 0x9e3779b97f4a7c15ull ^ (k + 1) * 0xbf58476d1ce4e5b9ull;
  return s ? s : 1;
}

/* One per worker, alone on its cache lines: the main thread only reads. */
typedef struct {
  _Alignas(128) _Atomic uint64_t ops;
  _Atomic uint64_t busy_ns;
  char pad[128 - 16];
} counter_t;

#define MAX_THREADS 256
static counter_t counters[MAX_THREADS];
static int nworkers = 1;
static double t_start, t_end;
static _Atomic int stop;

static void account(counter_t* c, uint64_t ops, double busy) {
  atomic_store_explicit(&c->ops, atomic_load_explicit(&c->ops, memory_order_relaxed) + ops, memory_order_relaxed);
  atomic_store_explicit(&c->busy_ns,
                        atomic_load_explicit(&c->busy_ns, memory_order_relaxed) + (uint64_t)(busy * 1e9),
                        memory_order_relaxed);
}

static void* xmalloc(size_t n) {
  void* p = malloc(n);
  if (!p) {
    fprintf(stderr, "learn_workload: malloc(%zu) failed\n", n);
    exit(1);
  }
  return p;
}

/* Writes one byte in every 4 KiB of the block (and its last byte). */
static void touch(void* p, size_t n, uint64_t v) {
  char* c = p;
  for (size_t i = 0; i < n; i += 4096) c[i] = (char)v;
  c[n - 1] = (char)v;
}

/* ---- parameters ------------------------------------------------------------- */
static struct {
  uint64_t seed;
  long n_min, n_max, size;                       /* burst */
  long threads, kib, sleep_min_ms, sleep_max_ms; /* idle-threads */
  long live_mib, rounds, period_ms, min_kib, max_kib, workers; /* phases */
  long spike_mib, spike_ms, hold_ms;             /* spikes */
} P = {42, 2500, 4000, 64, 32, 256, 50, 250, 96, 6, 400, 16, 64, 2, 64, 2000, 100};

static int set_param(const char* kv) {
  const char* eq = strchr(kv, '=');
  if (!eq) return -1;
  char* end;
  errno = 0;
  long v = strtol(eq + 1, &end, 0);
  if (errno || end == eq + 1 || *end || v < 0) return -1;
  size_t k = (size_t)(eq - kv);
#define KEY(name) if (k == strlen(#name) && !strncmp(kv, #name, k)) { P.name = v; return 0; }
  KEY(n_min) KEY(n_max) KEY(size) KEY(threads) KEY(kib) KEY(sleep_min_ms) KEY(sleep_max_ms)
  KEY(live_mib) KEY(rounds) KEY(period_ms) KEY(min_kib) KEY(max_kib) KEY(workers)
  KEY(spike_mib) KEY(spike_ms) KEY(hold_ms)
#undef KEY
  return -1;
}

/* ---- burst -------------------------------------------------------------------- */
static void* burst_main(void* arg) {
  (void)arg;
  counter_t* c = &counters[0];
  uint64_t s = seed_of(P.seed, 0);
  size_t cap = (size_t)P.n_max;
  void** v = xmalloc(cap * sizeof *v);
  const size_t size = (size_t)P.size;
  while (!atomic_load_explicit(&stop, memory_order_relaxed)) {
    double c0 = cpu_now();
    uint64_t ops = 0;
    for (int rep = 0; rep < 8; rep++) {
      size_t n = (size_t)P.n_min + rng(&s) % (size_t)(P.n_max - P.n_min + 1);
      for (size_t i = 0; i < n; i++) {
        v[i] = malloc(size);
        if (!v[i]) { fprintf(stderr, "learn_workload: malloc failed\n"); exit(1); }
        *(uint64_t*)v[i] = i;
      }
      for (size_t i = 0; i < n; i++) free(v[i]);
      ops += 2 * n;
    }
    account(c, ops, cpu_now() - c0);
  }
  free(v);
  return NULL;
}

/* ---- idle-threads --------------------------------------------------------------- */
static const size_t idle_sizes[8] = {2048, 4096, 6144, 8192, 16384, 24576, 32768, 49152};

static void* idle_main(void* arg) {
  int me = (int)(intptr_t)arg;
  counter_t* c = &counters[me];
  uint64_t s = seed_of(P.seed, (uint64_t)me + 1);
  size_t per_class_max = 0;
  for (int k = 0; k < 8; k++) {
    size_t n = ((size_t)P.kib << 11) / idle_sizes[k];
    if (n > per_class_max) per_class_max = n;
  }
  if (per_class_max > 4096) per_class_max = 4096;
  void** v = xmalloc(3 * per_class_max * sizeof *v);
  /* Staggered start so the threads do not all wake together. */
  sleep_s((double)(rng(&s) % 100) / 1000.0);
  while (!atomic_load_explicit(&stop, memory_order_relaxed)) {
    int pick[3];
    for (int j = 0; j < 3; j++) {
      int k;
      do {
        k = (int)(rng(&s) % 8);
      } while ((j > 0 && k == pick[0]) || (j > 1 && k == pick[1]));
      pick[j] = k;
    }
    size_t amount[3];   /* in quarters of `kib`: 1..8 */
    for (int j = 0; j < 3; j++) amount[j] = 1 + rng(&s) % 8;
    double c0 = cpu_now();
    uint64_t ops = 0;
    for (int rep = 0; rep < 2; rep++) {
      size_t m = 0;
      for (int j = 0; j < 3; j++) {
        size_t size = idle_sizes[pick[j]];
        size_t n = ((size_t)P.kib << 10) * amount[j] / 4 / size;
        if (n > per_class_max) n = per_class_max;
        for (size_t i = 0; i < n; i++) {
          v[m] = xmalloc(size);
          touch(v[m], size, m);
          m++;
        }
      }
      /* Freed in an order mixed between classes, as a request finishing would. */
      for (size_t i = 0; i < m; i += 2) free(v[i]);
      for (size_t i = 1; i < m; i += 2) free(v[i]);
      ops += 2 * m;
    }
    account(c, ops, cpu_now() - c0);
    long span = P.sleep_max_ms - P.sleep_min_ms + 1;
    sleep_s((double)(P.sleep_min_ms + (long)(rng(&s) % (uint64_t)(span > 0 ? span : 1))) / 1000.0);
  }
  free(v);
  return NULL;
}

/* ---- phases ---------------------------------------------------------------------
 * Cycle k runs on worker k % workers (a pool where successive jobs land on
 * different threads): what one worker's cache keeps, the next cannot use;
 * what goes back to the (shared) warm pools, it can. */
static pthread_mutex_t turn_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t turn_cond = PTHREAD_COND_INITIALIZER;
static uint64_t turn;            /* the cycle to run next (guarded by turn_lock) */
static double turn_at;           /* when it may start */

static void* phases_main(void* arg) {
  int me = (int)(intptr_t)arg;
  counter_t* c = &counters[me];
  const size_t live_max = (size_t)P.live_mib << 20;
  const size_t lo = (size_t)P.min_kib << 10, hi = (size_t)P.max_kib << 10;
  const size_t slots = live_max / lo + 1;
  void** v = xmalloc(slots * sizeof *v);
  double period = P.period_ms / 1000.0;
  for (;;) {
    pthread_mutex_lock(&turn_lock);
    while (!atomic_load(&stop) && turn % (uint64_t)nworkers != (uint64_t)me) pthread_cond_wait(&turn_cond, &turn_lock);
    uint64_t k = turn;
    double at = turn_at;
    pthread_mutex_unlock(&turn_lock);
    while (!atomic_load_explicit(&stop, memory_order_relaxed) && now() < at)
      sleep_s(at - now() < 0.05 ? at - now() : 0.05);
    if (atomic_load(&stop)) break;
    uint64_t s = seed_of(P.seed, k + 1);   /* each cycle the same for a seed, whoever runs it */
    double c0 = cpu_now();
    uint64_t ops = 0;
    size_t n = 0, live = 0;
    /* Ramp up to the live target... */
    while (live < live_max && n < slots) {
      size_t size = lo + (rng(&s) % (hi - lo + 1) & ~(size_t)15);
      v[n] = xmalloc(size);
      touch(v[n], size, n);
      live += size;
      n++;
      ops++;
    }
    /* ... replace the live set `rounds` times, one random block at a time ... */
    for (size_t r = 0; r < (size_t)P.rounds * n; r++) {
      size_t i = rng(&s) % n;
      free(v[i]);
      size_t size = lo + (rng(&s) % (hi - lo + 1) & ~(size_t)15);
      v[i] = xmalloc(size);
      touch(v[i], size, r);
      ops += 2;
    }
    /* ... and free everything. */
    for (size_t i = 0; i < n; i++) free(v[i]);
    ops += n;
    account(c, ops, cpu_now() - c0);
    pthread_mutex_lock(&turn_lock);
    double t = now();
    turn_at = at + period > t ? at + period : t;   /* a cycle that overran: the next at once */
    turn = k + 1;
    pthread_cond_broadcast(&turn_cond);
    pthread_mutex_unlock(&turn_lock);
  }
  free(v);
  return NULL;
}

/* ---- spikes ---------------------------------------------------------------------
 * One thread: every spike_ms a spike of spike_mib MiB in 1..8 KiB blocks,
 * allocated, written, held hold_ms, freed; idle until the next. */
static void* spikes_main(void* arg) {
  (void)arg;
  counter_t* c = &counters[0];
  const size_t total = (size_t)P.spike_mib << 20;
  const size_t slots = total / 1024 + 1;
  void** v = xmalloc(slots * sizeof *v);
  double at = now();
  for (uint64_t k = 0; !atomic_load_explicit(&stop, memory_order_relaxed); k++) {
    uint64_t s = seed_of(P.seed, k + 1);
    double c0 = cpu_now();
    size_t n = 0, live = 0;
    while (live < total && n < slots) {
      size_t size = 1024 + (rng(&s) % 7169 & ~(size_t)15);
      v[n] = xmalloc(size);
      touch(v[n], size, n);
      live += size;
      n++;
    }
    double busy = cpu_now() - c0;
    sleep_s(P.hold_ms / 1000.0);
    c0 = cpu_now();
    for (size_t i = 0; i < n; i++) free(v[i]);
    account(c, 2 * n, busy + cpu_now() - c0);
    at += P.spike_ms / 1000.0;
    while (!atomic_load_explicit(&stop, memory_order_relaxed) && now() < at)
      sleep_s(at - now() < 0.05 ? at - now() : 0.05);
    if (now() > at) at = now();   /* a spike that overran: the next at once */
  }
  free(v);
  return NULL;
}

/* ---- main ------------------------------------------------------------------------- */
static pthread_t tid[MAX_THREADS];
static _Atomic int started;

static uint64_t clock_ns(clockid_t id) {
  struct timespec ts;
  if (clock_gettime(id, &ts)) return 0;
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* CPU the process spent in threads it did not start: the allocator's own
 * (hakmem's decay thread gives memory back there, off the workers' clocks).
 * Work is priced per CPU second of the whole program, so a policy that moves
 * its madvise calls onto such a thread is not made to look free. */
static uint64_t others_ns(void) {
  uint64_t all = clock_ns(CLOCK_PROCESS_CPUTIME_ID), ours = clock_ns(CLOCK_THREAD_CPUTIME_ID);
  int n = atomic_load(&started);
  for (int i = 0; i < n; i++) {
    clockid_t id;
    if (!pthread_getcpuclockid(tid[i], &id)) ours += clock_ns(id);
  }
  return all > ours ? all - ours : 0;
}

/* Never less than last time (the threads' clocks are read apart), and
 * frozen before the workers are joined, whose clocks then go. */
static uint64_t others_seen;
static int others_frozen;
static uint64_t others_update(void) {
  if (!others_frozen) {
    uint64_t o = others_ns();
    if (o > others_seen) others_seen = o;
  }
  return others_seen;
}

static void report(double t, int done, const char* mode) {
  uint64_t ops = 0, busy = 0;
  for (int i = 0; i < nworkers; i++) {
    ops += atomic_load_explicit(&counters[i].ops, memory_order_relaxed);
    busy += atomic_load_explicit(&counters[i].busy_ns, memory_order_relaxed);
  }
  busy += others_update();
  if (done)
    printf("{\"done\": true, \"mode\": \"%s\", \"pid\": %d, \"seed\": %llu, \"threads\": %d, \"t\": %.4f, "
           "\"ops\": %llu, \"busy\": %.6f, \"ops_per_busy_s\": %.1f}\n",
           mode, (int)getpid(), (unsigned long long)P.seed, nworkers, t, (unsigned long long)ops, busy / 1e9,
           busy ? ops / (busy / 1e9) : 0.0);
  else
    printf("{\"t\": %.4f, \"ops\": %llu, \"busy\": %.6f}\n", t, (unsigned long long)ops, busy / 1e9);
  fflush(stdout);
}

int main(int argc, char** argv) {
  if (argc < 3 || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help")) {
    fputs(USAGE, argc < 3 && !(argc == 2 && (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help"))) ? stderr : stdout);
    return argc < 3 && !(argc == 2 && (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help"))) ? 2 : 0;
  }
  const char* mode = argv[1];
  char* end;
  double seconds = strtod(argv[2], &end);
  if (end == argv[2] || *end || !(seconds > 0)) {
    fprintf(stderr, "learn_workload: bad SECONDS '%s'\n" USAGE, argv[2]);
    return 2;
  }
  int argi = 3;
  if (argc > 3 && !strchr(argv[3], '=')) {
    P.seed = strtoull(argv[3], &end, 0);
    if (end == argv[3] || *end) {
      fprintf(stderr, "learn_workload: bad SEED '%s'\n" USAGE, argv[3]);
      return 2;
    }
    argi = 4;
  }
  for (; argi < argc; argi++)
    if (set_param(argv[argi])) {
      fprintf(stderr, "learn_workload: bad parameter '%s'\n" USAGE, argv[argi]);
      return 2;
    }
  void* (*fn)(void*);
  if (!strcmp(mode, "burst")) {
    fn = burst_main;
    nworkers = 1;
    if (P.n_min < 1 || P.n_max < P.n_min || P.size < 1) { fprintf(stderr, "learn_workload: need 1 <= n_min <= n_max, size >= 1\n"); return 2; }
  } else if (!strcmp(mode, "idle-threads")) {
    fn = idle_main;
    nworkers = (int)P.threads;
    if (nworkers < 1 || nworkers > MAX_THREADS || P.kib < 1 || P.sleep_max_ms < P.sleep_min_ms) {
      fprintf(stderr, "learn_workload: need 1 <= threads <= %d, kib >= 1, sleep_min_ms <= sleep_max_ms\n", MAX_THREADS);
      return 2;
    }
  } else if (!strcmp(mode, "phases")) {
    fn = phases_main;
    nworkers = (int)P.workers;
    if (P.live_mib < 1 || P.min_kib < 1 || P.max_kib < P.min_kib || P.period_ms < 1 || nworkers < 1 || nworkers > MAX_THREADS) {
      fprintf(stderr, "learn_workload: need live_mib >= 1, 1 <= min_kib <= max_kib, period_ms >= 1, 1 <= workers <= %d\n", MAX_THREADS);
      return 2;
    }
  } else if (!strcmp(mode, "spikes")) {
    fn = spikes_main;
    nworkers = 1;
    if (P.spike_mib < 1 || P.spike_ms < 1) {
      fprintf(stderr, "learn_workload: need spike_mib >= 1, spike_ms >= 1\n");
      return 2;
    }
  } else {
    fprintf(stderr, "learn_workload: unknown mode '%s'\n" USAGE, mode);
    return 2;
  }
  t_start = now();
  turn_at = t_start;
  t_end = t_start + seconds;
  for (int i = 0; i < nworkers; i++) {
    if (pthread_create(&tid[i], NULL, fn, (void*)(intptr_t)i)) {
      fprintf(stderr, "learn_workload: pthread_create failed\n");
      return 1;
    }
    atomic_store(&started, i + 1);
  }
  double next = t_start + 0.25;
  for (;;) {
    double t = now();
    if (t >= t_end) break;
    if (t >= next) {
      report(t - t_start, 0, mode);
      next += 0.25;
      if (next < t) next = t + 0.25;
    }
    double wait = (next < t_end ? next : t_end) - now();
    sleep_s(wait > 0 ? wait : 0);
  }
  atomic_store(&stop, 1);
  pthread_mutex_lock(&turn_lock);
  pthread_cond_broadcast(&turn_cond);
  pthread_mutex_unlock(&turn_lock);
  others_update();
  others_frozen = 1;
  for (int i = 0; i < nworkers; i++) pthread_join(tid[i], NULL);
  report(now() - t_start, 1, mode);
  return 0;
}
