/* test_trace.c — capture (allocator/src/trace.c, proto/trace.proto).
 *
 * Each test runs this program again as a child with HAKMEM_TRACE* set and
 * a workload named in argv[1], then decodes the file it wrote with the
 * protobuf-c code generated from proto/trace.proto. Workloads use sizes no
 * library call uses (4321, 777, ...), so counts of them are exact.
 *
 * Tests:
 *   full_counts      every call of each kind, exactly: malloc, calloc,
 *                    realloc (one event, moved or in place), aligned, free,
 *                    huge; threads numbered, THREAD_EXIT once each; header
 *                    and footer agree with the chunks
 *   time_order       across threads, each free of an address is stamped
 *                    before the allocation that reuses it
 *   sampled          only picked objects, and every free and realloc of each
 *   hostile_path     a symbolic link or file already at the path is not
 *                    followed or touched; capture off, the reason printed
 *   disk_full        RLIMIT_FSIZE below the trace: the program runs to the
 *                    end (no SIGXFSZ), chunks dropped and counted, the file
 *                    still well framed with its footer
 *   fsize_lowered    the same when the program lowers RLIMIT_FSIZE itself
 *                    while the capture runs (the limit is read again for
 *                    every chunk)
 *   max_bytes        HAKMEM_TRACE_MAX_BYTES ends the capture with its footer
 *                    (end_reason limit_bytes) before the file passes it
 *   exec_image       with %p, an image that execs leaves its file (no footer)
 *                    and the new one, same pid, writes PATH.1 in full
 *   fork_child       a forked child writes nothing into the parent's file
 *   resident         when a capture ends, the threads' event buffers go back
 *                    to the OS: 32 threads' worth (80 KiB each) leaves the
 *                    process's resident set
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <malloc.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "hakmem.h"
#include "harness.h"
#include "trace.pb-c.h"

static char self[4096];
static char dir[] = "/tmp/hk-test-trace-XXXXXX";

/* ---- workloads (children) ------------------------------------------------------ */
#define N_MALLOC 3000
#define N_CALLOC 200
#define N_REALLOC 100
#define N_ALIGNED 50
#define N_HUGE 3
#define N_THREADS 3
#define N_THREAD_OPS 500

static void* handoff[N_THREAD_OPS];

static void* thread_allocs(void* arg) {
  for (int i = 0; i < N_THREAD_OPS; i++) handoff[i] = malloc(4321);   /* freed by main */
  return NULL;
}

static void workload_full(void) {
  static void* keep[N_MALLOC];
  for (int i = 0; i < N_MALLOC; i++) keep[i] = malloc(777);
  for (int i = 0; i < N_MALLOC; i++) free(keep[i]);
  for (int i = 0; i < N_CALLOC; i++) keep[i] = calloc(7, 111);   /* 777 bytes */
  for (int i = 0; i < N_CALLOC; i++) free(keep[i]);
  for (int i = 0; i < N_REALLOC; i++) {
    char* p = malloc(333);
    p = realloc(p, 5555);        /* moves */
    p = realloc(p, 5001);        /* fits: stays */
    free(p);
  }
  for (int i = 0; i < N_ALIGNED; i++) {
    void* p;
    if (posix_memalign(&p, 256, 999) != 0) _exit(3);
    free(p);
    free(aligned_alloc(4096, 8888));
  }
  for (int i = 0; i < N_HUGE; i++) free(malloc(3u << 20));
  for (int t = 0; t < N_THREADS; t++) {
    pthread_t th;
    pthread_create(&th, NULL, thread_allocs, NULL);
    pthread_join(th, NULL);
    /* Freed here, then allocated again by the next thread: addresses reused
     * across threads, which the time-stamping rule must order. */
    for (int i = 0; i < N_THREAD_OPS; i++) free(handoff[i]);
  }
}

static void workload_sampled(void) {
  enum { N = 60000 };
  static void* keep[N];
  for (int i = 0; i < N; i++) keep[i] = malloc(777);
  for (int i = 0; i < N; i += 2) keep[i] = realloc(keep[i], 1999);
  for (int i = 0; i < N; i++) free(keep[i]);
}

static void workload_fork(void) {
  workload_full();
  pid_t c = fork();
  if (c == 0) {
    for (int i = 0; i < 5000; i++) free(malloc(777));
    exit(0);   /* runs the destructors: the child must write no footer either */
  }
  int st;
  waitpid(c, &st, 0);
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) _exit(4);
}

/* 32 threads each record 2000 events (their buffers hold 2048: none is
 * flushed) and wait; then this thread records until its own buffer fills,
 * which passes HAKMEM_TRACE_MAX_BYTES and ends the capture. VmRSS before and
 * after goes to TEST_RSS_OUT. */
#define N_RES_THREADS 32
static pthread_barrier_t res_filled, res_done;

static void* thread_fill(void* arg) {
  for (int i = 0; i < 1000; i++) free(malloc(777));
  pthread_barrier_wait(&res_filled);
  pthread_barrier_wait(&res_done);
  return NULL;
}

static long vm_rss_kib(void) {
  char buf[4096];
  int fd = open("/proc/self/status", O_RDONLY);
  ssize_t n = fd >= 0 ? read(fd, buf, sizeof buf - 1) : -1;
  if (fd >= 0) close(fd);
  if (n <= 0) return -1;
  buf[n] = 0;
  char* at = strstr(buf, "VmRSS:");
  return at ? strtol(at + 6, NULL, 10) : -1;
}

static void workload_resident(void) {
  pthread_t th[N_RES_THREADS];
  pthread_barrier_init(&res_filled, NULL, N_RES_THREADS + 1);
  pthread_barrier_init(&res_done, NULL, N_RES_THREADS + 1);
  for (int t = 0; t < N_RES_THREADS; t++)
    if (pthread_create(&th[t], NULL, thread_fill, NULL)) _exit(6);
  pthread_barrier_wait(&res_filled);
  long before = vm_rss_kib();
  for (int i = 0; i < 1100; i++) free(malloc(777));   /* 2200 events: a chunk, then the end */
  long after = vm_rss_kib();
  pthread_barrier_wait(&res_done);
  for (int t = 0; t < N_RES_THREADS; t++) pthread_join(th[t], NULL);
  const char* out = getenv("TEST_RSS_OUT");
  if (out) {
    FILE* f = fopen(out, "w");
    if (f) {
      fprintf(f, "%ld %ld\n", before, after);
      fclose(f);
    }
  }
}

#define FSIZE_LOWERED 24576

static int child_main(const char* what) {
  if (!strcmp(what, "exec")) {   /* a wrapper: allocates, then becomes the real program */
    for (int i = 0; i < 100; i++) free(malloc(4444));
    execl(self, self, "full", (char*)NULL);
    return 5;
  }
  if (!strcmp(what, "full")) workload_full();
  else if (!strcmp(what, "sampled")) workload_sampled();
  else if (!strcmp(what, "fork")) workload_fork();
  else if (!strcmp(what, "resident")) workload_resident();
  else if (!strcmp(what, "lowered")) {   /* the capture began (header written) with no limit */
    struct rlimit rl = {FSIZE_LOWERED, FSIZE_LOWERED};
    if (setrlimit(RLIMIT_FSIZE, &rl) != 0) return 3;
    workload_full();
  } else return 2;
  const char* st = getenv("TEST_STATS_OUT");
  if (st) {
    int fd = open(st, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    hk_stats_print(fd);
    close(fd);
  }
  return 0;
}

/* Runs a workload in a child with HAKMEM_TRACE=trace (and extra "K=V"s);
 * returns its wait status. */
static int run_child(const char* what, const char* trace, const char* extra1, const char* extra2,
                     rlim_t fsize) {
  pid_t pid = fork();
  if (pid == 0) {
    if (fsize) {
      struct rlimit rl = {fsize, fsize};
      setrlimit(RLIMIT_FSIZE, &rl);
    }
    setenv("HAKMEM_TRACE", trace, 1);
    if (extra1) putenv((char*)extra1);
    if (extra2) putenv((char*)extra2);
    execl(self, self, what, (char*)NULL);
    _exit(127);
  }
  int st = 0;
  waitpid(pid, &st, 0);
  return st;
}

/* ---- decoding (the parent) ------------------------------------------------------ */
typedef struct ev_s {
  int op;
  uint32_t thread, align;
  uint64_t size, addr, old, t;
} ev_t;

typedef struct decoded_s {
  int ok;                 /* magic, framing, seq, columns all right */
  int has_header, has_footer;
  Hakmem__Trace__V1__Header hdr;   /* copied scalars only */
  char argv0[64];
  uint64_t f_events, f_dropped, f_chunks;
  uint32_t f_threads;
  char f_reason[32];
  uint64_t chunks;
  ev_t* ev;
  size_t n;
} decoded_t;

static uint8_t* slurp(const char* path, size_t* len) {
  int fd = open(path, O_RDONLY);
  if (fd < 0) return NULL;
  struct stat sb;
  fstat(fd, &sb);
  uint8_t* b = malloc((size_t)sb.st_size + 1);
  size_t got = 0;
  while (got < (size_t)sb.st_size) {
    ssize_t r = read(fd, b + got, (size_t)sb.st_size - got);
    if (r <= 0) break;
    got += (size_t)r;
  }
  close(fd);
  *len = got;
  return b;
}

static void decode(const char* path, decoded_t* d) {
  memset(d, 0, sizeof *d);
  size_t len, cap = 1024;
  uint8_t* b = slurp(path, &len);
  if (!b || len < 8 || memcmp(b, "HKTRACE1", 8) != 0) { free(b); return; }
  d->ev = malloc(cap * sizeof *d->ev);
  size_t i = 8;
  d->ok = 1;
  while (i < len) {
    uint64_t n = 0;
    int shift = 0;
    while (i < len && (b[i] & 0x80)) { n |= (uint64_t)(b[i++] & 0x7f) << shift; shift += 7; }
    if (i >= len) { d->ok = 0; break; }
    n |= (uint64_t)b[i++] << shift;
    if (i + n > len) { d->ok = 0; break; }
    Hakmem__Trace__V1__TraceChunk* c = hakmem__trace__v1__trace_chunk__unpack(NULL, n, b + i);
    i += n;
    if (!c || c->seq != d->chunks || d->has_footer) { d->ok = 0; break; }
    d->chunks++;
    if (c->header) {
      d->has_header = 1;
      d->hdr = *c->header;
      snprintf(d->argv0, sizeof d->argv0, "%s", c->header->argv0);
      d->hdr.argv0 = d->hdr.exe = d->hdr.build_id = d->hdr.hakmem_version = NULL;
      d->hdr.n_class_size = c->header->n_class_size;
      d->hdr.class_size = NULL;
    }
    if (c->footer) {
      d->has_footer = 1;
      d->f_events = c->footer->events;
      d->f_dropped = c->footer->dropped;
      d->f_chunks = c->footer->chunks;
      d->f_threads = c->footer->threads;
      snprintf(d->f_reason, sizeof d->f_reason, "%s", c->footer->end_reason);
    }
    size_t m = c->n_op;
    if (c->n_size != m || c->n_align != m || c->n_addr != m || c->n_old_addr != m || c->n_dt_ns != m)
      d->ok = 0;
    uint64_t t = 0;
    for (size_t k = 0; k < m && d->ok; k++) {
      if (d->n == cap) { cap *= 2; d->ev = realloc(d->ev, cap * sizeof *d->ev); }
      t += c->dt_ns[k];
      d->ev[d->n++] = (ev_t){c->op[k], c->thread, c->align[k], c->size[k], c->addr[k], c->old_addr[k], t};
    }
    hakmem__trace__v1__trace_chunk__free_unpacked(c, NULL);
  }
  free(b);
}

static size_t count(const decoded_t* d, int op, uint64_t size) {
  size_t k = 0;
  for (size_t i = 0; i < d->n; i++) k += d->ev[i].op == op && (size == (uint64_t)-1 || d->ev[i].size == size);
  return k;
}

static int by_time(const void* a, const void* b) {
  const ev_t *x = a, *y = b;
  return x->t < y->t ? -1 : x->t > y->t;
}

/* ---- tests ------------------------------------------------------------------------ */
static char path_full[600];
static decoded_t full;

TEST(full_counts) {
  snprintf(path_full, sizeof path_full, "%s/full-%%p.trace", dir);
  int st = run_child("full", path_full, NULL, NULL, 0);
  CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  /* %p became the child's pid: find the one file. */
  char found[600] = "";
  DIR* dd = opendir(dir);
  for (struct dirent* de; dd && (de = readdir(dd));)
    if (!strncmp(de->d_name, "full-", 5) && strcmp(de->d_name, "full-disk.trace") && strchr(de->d_name, '.'))
      snprintf(found, sizeof found, "%s/%s", dir, de->d_name);
  if (dd) closedir(dd);
  CHECK(found[0]);
  snprintf(path_full, sizeof path_full, "%s", found);
  struct stat sb;
  CHECK(stat(found, &sb) == 0 && (sb.st_mode & 0777) == 0600);
  decode(found, &full);
  decoded_t* d = &full;
  CHECK(d->ok);
  CHECK(d->has_header);
  CHECK(d->has_footer);
  CHECK_EQ(d->hdr.format, 1);
  CHECK_EQ(d->hdr.mode, HAKMEM__TRACE__V1__MODE__FULL);
  CHECK(d->hdr.layout_version >= 4);
  CHECK_EQ(d->hdr.n_class_size, hk_class_size(1) ? 61 : 0);
  CHECK(strstr(d->argv0, "test_trace") != NULL);
  CHECK_EQ(d->f_events, d->n);
  CHECK_EQ(d->f_dropped, 0);
  CHECK_EQ(d->f_chunks, d->chunks - 1);
  CHECK(!strcmp(d->f_reason, "exit"));
  CHECK_EQ(count(d, HAKMEM__TRACE__V1__OP__MALLOC, 777), N_MALLOC);
  CHECK_EQ(count(d, HAKMEM__TRACE__V1__OP__CALLOC, 777), N_CALLOC);
  CHECK_EQ(count(d, HAKMEM__TRACE__V1__OP__MALLOC, 333), N_REALLOC);
  CHECK_EQ(count(d, HAKMEM__TRACE__V1__OP__REALLOC, 5555), N_REALLOC);
  CHECK_EQ(count(d, HAKMEM__TRACE__V1__OP__REALLOC, 5001), N_REALLOC);
  CHECK_EQ(count(d, HAKMEM__TRACE__V1__OP__ALIGNED, 999), N_ALIGNED);
  CHECK_EQ(count(d, HAKMEM__TRACE__V1__OP__ALIGNED, 8888), N_ALIGNED);
  CHECK_EQ(count(d, HAKMEM__TRACE__V1__OP__MALLOC, 3u << 20), N_HUGE);
  CHECK_EQ(count(d, HAKMEM__TRACE__V1__OP__MALLOC, 4321), N_THREADS * N_THREAD_OPS);
  CHECK_EQ(count(d, HAKMEM__TRACE__V1__OP__THREAD_EXIT, -1), N_THREADS);
  /* realloc: moved (old != new) then in place (old == new), old of the
   * first is the malloc(333) before it; aligned carries its alignment. */
  size_t moved = 0, inplace = 0, al = 0;
  for (size_t i = 0; i < d->n; i++) {
    const ev_t* e = &d->ev[i];
    if (e->op == HAKMEM__TRACE__V1__OP__REALLOC) {
      moved += e->size == 5555 && e->old != e->addr && e->old != 0;
      inplace += e->size == 5001 && e->old == e->addr;
    }
    if (e->op == HAKMEM__TRACE__V1__OP__ALIGNED)
      al += (e->size == 999 && e->align == 256 && e->addr % 256 == 0) ||
            (e->size == 8888 && e->align == 4096 && e->addr % 4096 == 0);
  }
  CHECK_EQ(moved, N_REALLOC);
  CHECK_EQ(inplace, N_REALLOC);
  CHECK_EQ(al, 2 * N_ALIGNED);
  /* Every free of a recorded 777/4321-byte block is there: a free per
   * allocation of a workload address. */
  size_t frees = count(d, HAKMEM__TRACE__V1__OP__FREE, -1);
  CHECK(frees >= N_MALLOC + N_CALLOC + N_REALLOC + 2 * N_ALIGNED + N_HUGE + N_THREADS * N_THREAD_OPS);
  /* Threads: main is 1, the workers 2..N+1, each with one THREAD_EXIT. */
  uint32_t maxt = 0;
  for (size_t i = 0; i < d->n; i++) if (d->ev[i].thread > maxt) maxt = d->ev[i].thread;
  CHECK(maxt >= N_THREADS + 1);
  CHECK_EQ(d->f_threads, maxt);
  for (size_t i = 0; i < d->n; i++)
    if (d->ev[i].op == HAKMEM__TRACE__V1__OP__THREAD_EXIT) CHECK(d->ev[i].thread >= 2);
}

TEST(time_order) {
  decoded_t* d = &full;
  CHECK(d->n > 0);
  ev_t* e = malloc(d->n * sizeof *e);
  memcpy(e, d->ev, d->n * sizeof *e);
  qsort(e, d->n, sizeof *e, by_time);   /* ties: either order, both are fine */
  /* Replay liveness by address: an allocation must never find its address
   * live (its free would then come later in time), a free must find it
   * live unless it was allocated before capture began. */
  size_t cap = 1 << 20, bad = 0, reused = 0;
  uint64_t* live = calloc(cap, sizeof *live);   /* open addressing, addr | 1 live */
  for (size_t i = 0; i < d->n; i++) {
    uint64_t a = e[i].addr;
    int op = e[i].op;
    if (op == HAKMEM__TRACE__V1__OP__THREAD_EXIT || a == 0) continue;
    if (op == HAKMEM__TRACE__V1__OP__REALLOC && e[i].old != a) {
      uint64_t h = (e[i].old >> 4) & (cap - 1);
      while (live[h] && (live[h] & ~1ull) != e[i].old) h = (h + 1) & (cap - 1);
      if (live[h]) live[h] &= ~1ull;
    }
    uint64_t h = (a >> 4) & (cap - 1);
    while (live[h] && (live[h] & ~1ull) != a) h = (h + 1) & (cap - 1);
    if (op == HAKMEM__TRACE__V1__OP__FREE) {
      if (live[h]) live[h] = a;   /* not live */
      continue;
    }
    if (op == HAKMEM__TRACE__V1__OP__REALLOC && e[i].old == a) continue;
    if (live[h] & 1) bad++;
    if (live[h]) reused++;
    live[h] = a | 1;
  }
  CHECK_EQ(bad, 0);
  CHECK(reused > 0);   /* addresses were reused, across threads among them */
  free(live);
  free(e);
}

TEST(sampled) {
  char p[512], stats[512];
  snprintf(p, sizeof p, "%s/sampled.trace", dir);
  snprintf(stats, sizeof stats, "TEST_STATS_OUT=%s/sampled.stats", dir);
  int st = run_child("sampled", p, "HAKMEM_TRACE_SAMPLE=65536", stats, 0);
  CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  decoded_t d;
  decode(p, &d);
  CHECK(d.ok && d.has_header && d.has_footer);
  CHECK_EQ(d.hdr.mode, HAKMEM__TRACE__V1__MODE__SAMPLED);
  CHECK_EQ(d.hdr.sample_bytes, 65536);
  /* 60000 x 784-byte blocks, a pick per ~64 KiB: about 720, and far from all. */
  size_t picks = count(&d, HAKMEM__TRACE__V1__OP__MALLOC, 777);
  CHECK(picks > 200 && picks < 3000);
  /* Each picked object's realloc (for the even ones) and free is there,
   * and no event names an object that was not picked. */
  size_t frees = count(&d, HAKMEM__TRACE__V1__OP__FREE, -1);
  size_t reallocs = count(&d, HAKMEM__TRACE__V1__OP__REALLOC, 1999);
  size_t other_allocs = count(&d, HAKMEM__TRACE__V1__OP__MALLOC, -1) - picks;
  CHECK_EQ(frees, picks + other_allocs);
  CHECK(reallocs > picks / 4 && reallocs < picks);
  /* every realloc and free follows a live sampled address */
  size_t orphans = 0;
  for (size_t i = 0; i < d.n; i++) {
    const ev_t* e = &d.ev[i];
    uint64_t want = e->op == HAKMEM__TRACE__V1__OP__REALLOC ? e->old : e->addr;
    if (e->op != HAKMEM__TRACE__V1__OP__FREE && e->op != HAKMEM__TRACE__V1__OP__REALLOC) continue;
    int seen = 0;
    for (size_t j = i; j-- > 0;) {
      if (d.ev[j].addr == want && d.ev[j].thread == e->thread) { seen = d.ev[j].op != HAKMEM__TRACE__V1__OP__FREE; break; }
    }
    orphans += !seen;
  }
  CHECK_EQ(orphans, 0);
}

TEST(hostile_path) {
  char link[512], target[512], statsf[512], stats[600];
  snprintf(link, sizeof link, "%s/hostile.trace", dir);
  snprintf(target, sizeof target, "%s/victim", dir);
  snprintf(statsf, sizeof statsf, "%s/hostile.stats", dir);
  snprintf(stats, sizeof stats, "TEST_STATS_OUT=%s", statsf);
  int fd = open(target, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  CHECK(write(fd, "keep", 4) == 4);
  close(fd);
  CHECK(symlink(target, link) == 0);
  int st = run_child("full", link, stats, NULL, 0);
  CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  struct stat sb;
  CHECK(lstat(link, &sb) == 0 && S_ISLNK(sb.st_mode));
  CHECK(stat(target, &sb) == 0 && sb.st_size == 4);
  size_t len;
  char* s = (char*)slurp(statsf, &len);
  CHECK(s != NULL);
  if (s) {
    s[len] = 0;
    CHECK(strstr(s, "trace: off:") != NULL && strstr(s, "exists") != NULL);
    free(s);
  }
  /* a plain file there is left as it was, too */
  unlink(link);
  rename(target, link);
  st = run_child("full", link, NULL, NULL, 0);
  CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  CHECK(stat(link, &sb) == 0 && sb.st_size == 4);
}

/* The HAKMEM_STATS table in statsf says the full capture dropped chunks. */
static void says_dropped(const char* statsf) {
  size_t len;
  char* s = (char*)slurp(statsf, &len);
  CHECK(s != NULL);
  if (s) {
    s[len] = 0;
    char* at = strstr(s, "trace: full");
    CHECK(at != NULL);
    if (at) CHECK(strstr(at, " 0 dropped") == NULL && strstr(at, "dropped") != NULL);
    free(s);
  }
}

TEST(disk_full) {
  char p[512], stats[600], statsf[512];
  snprintf(p, sizeof p, "%s/full-disk.trace", dir);
  snprintf(statsf, sizeof statsf, "%s/disk.stats", dir);
  snprintf(stats, sizeof stats, "TEST_STATS_OUT=%s", statsf);
  int st = run_child("full", p, stats, NULL, 24576);
  CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);   /* no SIGXFSZ, no stall */
  decoded_t d;
  decode(p, &d);
  CHECK(d.ok && d.has_header);
  struct stat sb;
  CHECK(stat(p, &sb) == 0 && sb.st_size <= 24576);
  if (d.has_footer) {
    CHECK(d.f_dropped > 0);
    CHECK_EQ(d.f_events, d.n);
    CHECK(d.f_events + d.f_dropped >= full.f_events - 200);
  }
  says_dropped(statsf);
}

TEST(fsize_lowered) {
  char p[512], stats[600], statsf[512];
  snprintf(p, sizeof p, "%s/lowered.trace", dir);
  snprintf(statsf, sizeof statsf, "%s/lowered.stats", dir);
  snprintf(stats, sizeof stats, "TEST_STATS_OUT=%s", statsf);
  int st = run_child("lowered", p, stats, NULL, 0);
  CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);   /* before: killed by SIGXFSZ (25) */
  if (WIFSIGNALED(st)) fprintf(stderr, "fsize_lowered: the child died of signal %d\n", WTERMSIG(st));
  decoded_t d;
  decode(p, &d);
  CHECK(d.ok && d.has_header);
  struct stat sb;
  CHECK(stat(p, &sb) == 0 && sb.st_size <= FSIZE_LOWERED);
  says_dropped(statsf);
}

TEST(max_bytes) {
  char p[512];
  snprintf(p, sizeof p, "%s/max.trace", dir);
  int st = run_child("full", p, "HAKMEM_TRACE_MAX_BYTES=40000", NULL, 0);
  CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  decoded_t d;
  decode(p, &d);
  CHECK(d.ok && d.has_header && d.has_footer);
  CHECK(!strcmp(d.f_reason, "limit_bytes"));
  CHECK_EQ(d.hdr.limit_bytes, 40000);
  CHECK_EQ(d.f_dropped, 0);          /* past the bound is not lost, it is not asked for */
  CHECK_EQ(d.f_events, d.n);
  CHECK(d.n > 0 && d.n < full.n);
  struct stat sb;
  CHECK(stat(p, &sb) == 0 && sb.st_size <= 40000 + 256);   /* the footer may pass it */
}

TEST(exec_image) {
  char p[512], first[600], second[600];
  snprintf(p, sizeof p, "%s/exec-%%p.trace", dir);
  pid_t pid = fork();
  if (pid == 0) {
    setenv("HAKMEM_TRACE", p, 1);
    execl(self, self, "exec", (char*)NULL);
    _exit(127);
  }
  int st = 0;
  waitpid(pid, &st, 0);
  CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  snprintf(first, sizeof first, "%s/exec-%d.trace", dir, (int)pid);
  snprintf(second, sizeof second, "%s/exec-%d.trace.1", dir, (int)pid);
  decoded_t a, b;
  decode(first, &a);     /* the wrapper's: exec ran no destructor, no footer */
  CHECK(a.ok && a.has_header && !a.has_footer);
  decode(second, &b);    /* the program it became: whole */
  CHECK(b.ok && b.has_header && b.has_footer);
  CHECK_EQ(b.hdr.pid, pid);
  CHECK_EQ(count(&b, HAKMEM__TRACE__V1__OP__MALLOC, 777), N_MALLOC);
  CHECK_EQ(count(&b, HAKMEM__TRACE__V1__OP__MALLOC, 4444), 0);
}

TEST(fork_child) {
  char p[512];
  snprintf(p, sizeof p, "%s/fork.trace", dir);
  int st = run_child("fork", p, NULL, NULL, 0);
  CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  decoded_t d;
  decode(p, &d);
  CHECK(d.ok && d.has_header && d.has_footer);   /* one footer, seqs contiguous */
  CHECK_EQ(count(&d, HAKMEM__TRACE__V1__OP__MALLOC, 777), N_MALLOC);   /* none of the child's */
}

TEST(resident) {
  char p[512], rss[600], env[700];
  snprintf(p, sizeof p, "%s/resident.trace", dir);
  snprintf(rss, sizeof rss, "%s/resident.rss", dir);
  snprintf(env, sizeof env, "TEST_RSS_OUT=%s", rss);
  /* Past the header, before the first chunk: the first flush ends it. */
  int st = run_child("resident", p, "HAKMEM_TRACE_MAX_BYTES=2000", env, 0);
  CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  decoded_t d;
  decode(p, &d);
  CHECK(d.ok && d.has_header && d.has_footer);
  CHECK(!strcmp(d.f_reason, "limit_bytes"));
  long before = -1, after = -1;
  FILE* f = fopen(rss, "r");
  CHECK(f != NULL);
  if (f) {
    CHECK(fscanf(f, "%ld %ld", &before, &after) == 2);
    fclose(f);
  }
  /* 32 buffers of 2000 events each had 78 KiB written; what goes back is
   * every page past a buffer's first. Half of that is the bound. */
  CHECK(before > 0 && after > 0);
  CHECK(before - after >= N_RES_THREADS * 36);
  if (before - after < N_RES_THREADS * 36)
    fprintf(stderr, "resident: VmRSS %ld KiB before the capture ended, %ld after\n", before, after);
}

int main(int argc, char** argv) {
  if (readlink("/proc/self/exe", self, sizeof self - 1) <= 0) return 1;
  if (argc > 1) return child_main(argv[1]);
  if (!mkdtemp(dir)) return 1;
  RUN(full_counts);
  RUN(time_order);
  RUN(sampled);
  RUN(hostile_path);
  RUN(disk_full);
  RUN(fsize_lowered);
  RUN(max_bytes);
  RUN(exec_image);
  RUN(fork_child);
  RUN(resident);
  /* Removed even after a failure: the mutation runs fail on purpose, and
   * every one left a directory of traces in /tmp. */
  if (getenv("HAKMEM_TEST_KEEP")) {
    fprintf(stderr, "test_trace: kept %s\n", dir);
  } else {
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    (void)!system(cmd);
    if (harness_failed) fprintf(stderr, "test_trace: HAKMEM_TEST_KEEP=1 keeps the traces for a look\n");
  }
  return harness_done();
}
