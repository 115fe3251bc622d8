/* hakmem-replay — replays an allocation trace (proto/trace.proto) through
 * the real allocator, linked in statically, under a fixed policy, and
 * reports what it cost: time, peak resident memory, page faults, OS calls
 * and the allocator's counters.
 *
 * Each run is a fresh process (the parent execs itself with --run-fd), so
 * every run starts from the same allocator state. A run:
 *   1. maps the trace and checks it whole (framing, columns, ops, layout
 *      version) before anything is timed; a problem is one line naming the
 *      byte offset, or with --partial the valid chunks before it are used;
 *   2. orders every event by time (frees before allocations at equal times,
 *      trace.proto "OBJECT IDENTITY") and renames reused addresses into
 *      unique objects;
 *   3. installs the policy, then starts one thread per trace thread behind a
 *      barrier; each runs its own events in the order of step 2. A thread
 *      that frees an object another thread allocates waits until that
 *      allocation has happened (a short spin, then yielding), so cross-thread
 *      frees stay cross-thread without serializing anything else. Every wait
 *      is for an event earlier in that one order, so no two threads can wait
 *      for each other, whatever order the file's chunks come in. New objects
 *      are written (their first bytes and a byte per 4 KiB page), as the
 *      program wrote them at least once;
 *   4. measures from the barrier to the last thread's end.
 * Events run back to back, except across the trace's idle gaps (--pace
 * idle, the default): a thread whose next event comes 1 ms or more after
 * its previous one waits until that much time has passed since the replay
 * began, so what an allocator does with time (idle drains, warm pools that
 * decay, caches parked in a sleeping thread) happens in the replay too.
 * --pace none runs everything back to back. No event may come later than the
 * trace lasted (its footer's duration; without one, the time its file was
 * being written), so a hostile trace cannot make a replay wait for ever.
 *
 * A replay dies with the process that started it (PR_SET_PDEATHSIG), as do
 * its runs: the Python side starts it in a session of its own, where
 * nothing else would end it.
 *
 * Everything the replay itself needs (events, objects, the address map)
 * lives in memory from mmap, not from the allocator under test. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <linux/futex.h>
#include <malloc.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "hakmem.h"
#include "internal.h"   /* _hk_background_start_now: below, "the background thread" */
#include "prim.h"       /* _hk_os_bound_slow_paths: run_once */
#include "shm_layout.h"
#include "trace.pb-c.h"

#define MAGIC "HKTRACE1"
#define MAX_CHUNK (64u << 20)
#define MAX_THREADS 4096
#define MAX_REPEAT 100

enum { OP_MALLOC = 1, OP_CALLOC, OP_REALLOC, OP_FREE, OP_ALIGNED, OP_THREAD_EXIT };

static const char* trace_path;    /* the TRACE argument, or trace_label */
static const char* policy_path;   /* --policy's, or policy_label */
static const char* gate_path;
/* --trace-fd, --policy-fd, --gate-fd: descriptors the caller passed open
 * (learnd's private copies, with no name anybody could rename over), read
 * from offset 0 and never reopened; the runs inherit them across exec. */
static int trace_fd = -1, policy_fd = -1, gate_fd = -1;
static const char *trace_fd_arg, *policy_fd_arg, *gate_fd_arg;
static char trace_label[32], policy_label[32], gate_what[PATH_MAX + 16];   /* their names in messages */
static const volatile uint8_t* gate;   /* --gate: its first byte nonzero while the watched program runs */
static uint32_t* gate_word;             /* the 4 bytes from it: the futex learnd wakes at the opening */
static bool partial, touch_pages = true, json_out, pace_idle = true;
static bool nice_group;          /* --nice-group */
static int group_nice = -1;      /* the session's scheduling group's niceness where --nice set it (nice_own_group) */
static char stuck_arg[32];       /* --stuck-after as given, for the runs */
#define GAP_NS 1000000u   /* --pace idle: a gap this long in a thread's events is kept */
/* --gate: the held thread that looks sleeps on the gate's first word, and
 * learnd wakes it as it opens the gate (screen.Gate); a gate nobody wakes
 * (a file written by hand) is seen open within this long ... */
#define GATE_LOOK_NS 100000000L
#define GATE_MAX_HOLD_NS 2000000000ull        /* ... and a hold ends after this long, whatever the gate says */
static int repeat = 1;
/* A trace lasts its footer's duration, and no longer than its file was
 * being written (from its header's start to the file's last change): no
 * event, and so no idle wait, may come later than that, give or take. */
#define DURATION_SLACK_NS 1000000000ull    /* the footer's time is read after the last event's */
#define WRITTEN_SLACK_NS  60000000000ull   /* the wall clock may have been stepped meanwhile */
static double file_end_unix;               /* the trace file's last change, or now if earlier */

/* ---- errors ------------------------------------------------------------------ */
static void die(int code, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("hakmem-replay: error: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  exit(code);
}

static void* map_zero(size_t bytes) {
  if (bytes == 0) bytes = 1;
  void* p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) die(1, "%s: %zu bytes for the replay's tables: %s", trace_path, bytes, strerror(errno));
  return p;
}

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* ---- the trace ---------------------------------------------------------------- */
typedef struct {
  uint64_t t;        /* ns since capture start */
  uint64_t size;
  uint64_t addr, old;
  int64_t  obj;      /* object this event makes (allocations), or -1 */
  int64_t  old_obj;  /* object it consumes (free, realloc), or -1 */
  uint32_t align;
  uint32_t thread;
  uint8_t  op;
} event_t;

typedef struct {
  uint32_t layout_version, mode, threads;
  uint64_t events, objects, unmatched_frees, valid_bytes, file_bytes;
  int partial, has_footer;
  uint64_t duration_ns;   /* the footer's */
  char cut_reason[256];
  char exe[256];
} trace_info_t;

static event_t* ev;
static uint64_t nev;
static trace_info_t info;

static const char* mode_name(uint32_t m) {
  return m == HAKMEM__TRACE__V1__MODE__FULL      ? "full"
       : m == HAKMEM__TRACE__V1__MODE__SAMPLED ? "sampled"
       : m == HAKMEM__TRACE__V1__MODE__LIVE    ? "live"
                                               : "unspecified";
}

/* One varint at p (at most 10 bytes, not past end); 0 on a bad one. */
static int get_varint(const uint8_t* p, const uint8_t* end, uint64_t* out) {
  uint64_t v = 0;
  for (int i = 0; i < 10 && p + i < end; i++) {
    v |= (uint64_t)(p[i] & 0x7f) << (7 * i);
    if (!(p[i] & 0x80)) { *out = v; return i + 1; }
  }
  return 0;
}

/* How long a trace that started at start_unix can have been written for:
 * up to the file's last change, plus the slack. */
static uint64_t written_ns(double start_unix) {
  double span = file_end_unix - start_unix;
  if (!(span > 0)) span = 0;   /* NaN, or a start after the file's last change */
  if (span > 1.8e10) return UINT64_MAX;
  return (uint64_t)(span * 1e9) + WRITTEN_SLACK_NS;
}

/* Whether the chunk's events all come within written (see written_ns) and
 * limit (the footer's duration, once known); says why not. Times restart
 * from the capture's start in every chunk, so each chunk is summed alone. */
static bool times_ok(const Hakmem__Trace__V1__TraceChunk* c, uint64_t written, uint64_t limit, double start_unix,
                     char* why, size_t whylen) {
  uint64_t t = 0;
  for (size_t i = 0; i < c->n_dt_ns; i++) {
    if (__builtin_add_overflow(t, c->dt_ns[i], &t)) {
      snprintf(why, whylen, "event times overflow 64 bits of nanoseconds");
      return false;
    }
  }
  /* Within a chunk times only grow: its last event is its latest. */
  if (t > written) {
    snprintf(why, whylen, "an event at %.3f s, later than the file was being written (%.3f s from its header's"
             " start to its last change)", (double)t * 1e-9, file_end_unix - start_unix);
    return false;
  }
  if (t > limit) {
    snprintf(why, whylen, "an event at %.3f s, past the trace's duration of %.3f s (its footer)", (double)t * 1e-9,
             (double)(limit - DURATION_SLACK_NS) * 1e-9);
    return false;
  }
  return true;
}

/* Calls fn for every valid chunk. Returns the bytes that were valid; on a
 * problem, fills why (and stops there). limit: events later than this are
 * a problem (the footer's duration and slack; UINT64_MAX before the
 * footer is known). */
typedef void (*chunk_fn)(const Hakmem__Trace__V1__TraceChunk* c, void* arg);

static uint64_t walk(const uint8_t* base, uint64_t size, uint64_t limit, chunk_fn fn, void* arg, char* why,
                     size_t whylen, int* footer_seen) {
  why[0] = 0;
  *footer_seen = 0;
  if (size < 8 || memcmp(base, MAGIC, 8) != 0) {
    snprintf(why, whylen, "not a hakmem trace (no HKTRACE1 magic)");
    return 0;
  }
  uint64_t off = 8, seq = 0, written = UINT64_MAX;
  double start_unix = 0;
  while (off < size) {
    uint64_t len;
    int vl = get_varint(base + off, base + size, &len);
    if (vl == 0) {
      snprintf(why, whylen, off + 10 > size ? "cut short in a chunk's length" : "bad chunk length");
      return off;
    }
    if (len > MAX_CHUNK) { snprintf(why, whylen, "chunk of %" PRIu64 " bytes (more than any writer makes)", len); return off; }
    if (len > size - off - (uint64_t)vl) {
      snprintf(why, whylen, "cut short: a chunk of %" PRIu64 " bytes, %" PRIu64 " left", len, size - off - vl);
      return off;
    }
    Hakmem__Trace__V1__TraceChunk* c =
        hakmem__trace__v1__trace_chunk__unpack(NULL, (size_t)len, base + off + vl);
    if (!c) { snprintf(why, whylen, "corrupt chunk"); return off; }
    size_t n = c->n_op;
    const char* bad = NULL;
    if (*footer_seen) bad = "data after the footer";
    else if (c->n_size != n || c->n_align != n || c->n_addr != n || c->n_old_addr != n || c->n_dt_ns != n)
      bad = "columns of different lengths";
    else if (seq == 0 && !c->header) bad = "first chunk has no header";
    else if (seq > 0 && c->header) bad = "a second header";
    else if (c->seq != seq) bad = "chunks out of order";
    else if (n && (c->thread == 0 || c->thread > MAX_THREADS)) bad = "thread number out of range";
    for (size_t i = 0; !bad && i < n; i++)
      if ((int)c->op[i] < OP_MALLOC || (int)c->op[i] > OP_THREAD_EXIT) bad = "unknown operation";
    if (!bad && seq == 0 && c->header->layout_version != HK_SHM_LAYOUT_VERSION) {
      snprintf(why, whylen, "trace from layout version %u, this replayer is layout %u",
               c->header->layout_version, HK_SHM_LAYOUT_VERSION);
      hakmem__trace__v1__trace_chunk__free_unpacked(c, NULL);
      return UINT64_MAX;   /* refused whatever --partial says */
    }
    if (!bad && c->header) {
      start_unix = c->header->start_unix;
      written = written_ns(start_unix);
    }
    if (bad) snprintf(why, whylen, "%s", bad);
    else if (c->footer && c->footer->duration_ns > written)
      snprintf(why, whylen, "a duration of %.3f s in the footer, longer than the file was being written (%.3f s"
               " from its header's start to its last change)", (double)c->footer->duration_ns * 1e-9,
               file_end_unix - start_unix);
    else times_ok(c, written, limit, start_unix, why, whylen);
    if (why[0]) {
      hakmem__trace__v1__trace_chunk__free_unpacked(c, NULL);
      return off;
    }
    if (c->footer) *footer_seen = 1;
    fn(c, arg);
    hakmem__trace__v1__trace_chunk__free_unpacked(c, NULL);
    off += (uint64_t)vl + len;
    seq++;
  }
  if (!*footer_seen) snprintf(why, whylen, "cut short: no footer");
  return off;
}

static void count_chunk(const Hakmem__Trace__V1__TraceChunk* c, void* arg) {
  if (c->header) {
    info.layout_version = c->header->layout_version;
    info.mode = (uint32_t)c->header->mode;
    snprintf(info.exe, sizeof info.exe, "%s", c->header->exe ? c->header->exe : "");
  }
  if (c->footer) info.duration_ns = c->footer->duration_ns;
  *(uint64_t*)arg += c->n_op;
  for (size_t i = 0; i < c->n_op; i++)
    if (c->thread > info.threads) info.threads = c->thread;
}

static void fill_chunk(const Hakmem__Trace__V1__TraceChunk* c, void* arg) {
  uint64_t* k = arg;
  uint64_t t = 0;
  for (size_t i = 0; i < c->n_op && *k < nev; i++) {
    t += c->dt_ns[i];
    event_t* e = &ev[(*k)++];
    e->t = t;
    e->op = (uint8_t)c->op[i];
    e->size = c->size[i];
    e->align = c->align[i];
    e->addr = c->addr[i];
    e->old = c->old_addr[i];
    e->thread = c->thread;
    e->obj = e->old_obj = -1;
  }
}

/* A problem at byte `at`: the end, or with --partial where the replay stops. */
static void cut_at(const char* why, uint64_t at) {
  if (!partial || at <= 8) die(1, "%s: %s at byte %" PRIu64 "%s", trace_path, why, at,
                               partial ? "" : " (--partial replays the chunks before it)");
  info.partial = 1;
  snprintf(info.cut_reason, sizeof info.cut_reason, "%s at byte %" PRIu64, why, at);
}

static void load_trace(void) {
  int fd = trace_fd;
  if (fd < 0 && (fd = open(trace_path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC)) < 0)
    die(1, "%s: %s", trace_path, strerror(errno));
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) die(1, "%s: not a regular file", trace_path);
  info.file_bytes = (uint64_t)st.st_size;
  struct timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  if (st.st_mtim.tv_sec < now.tv_sec || (st.st_mtim.tv_sec == now.tv_sec && st.st_mtim.tv_nsec < now.tv_nsec))
    now = st.st_mtim;
  file_end_unix = (double)now.tv_sec + (double)now.tv_nsec * 1e-9;
  const uint8_t* base = (const uint8_t*)"";
  if (st.st_size > 0) {
    base = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (base == MAP_FAILED) die(1, "%s: %s", trace_path, strerror(errno));
  }
  if (fd != trace_fd) close(fd);
  char why[200];
  int footer;
  uint64_t count = 0;
  uint64_t valid = walk(base, info.file_bytes, UINT64_MAX, count_chunk, &count, why, sizeof why, &footer);
  if (valid == UINT64_MAX) die(1, "%s: %s", trace_path, why);
  if (why[0]) cut_at(why, valid);
  nev = count;
  ev = map_zero(nev * sizeof *ev);
  /* The footer's duration is known now: the second pass holds every event
   * to it, and stops at the first chunk that comes later. */
  uint64_t limit = UINT64_MAX, k = 0;
  if (footer) limit = info.duration_ns > UINT64_MAX - DURATION_SLACK_NS ? UINT64_MAX
                                                                         : info.duration_ns + DURATION_SLACK_NS;
  uint64_t filled = walk(base, valid, limit, fill_chunk, &k, why, sizeof why, &footer);
  if (filled < valid) {   /* not the end of what was valid: an event past the footer's duration */
    cut_at(why, filled);
    valid = filled;
  }
  info.valid_bytes = valid;
  info.has_footer = footer;
  nev = k;
  info.events = nev;
  if (st.st_size > 0) munmap((void*)base, (size_t)st.st_size);
}

/* ---- objects: addresses renamed by time order ----------------------------------- */
static uint64_t* order;      /* event indices by (time, kind, file order): the replay's one order */

static int kind_of(uint8_t op) {   /* frees first at equal times, then reallocs, then the rest */
  return op == OP_FREE ? 0 : op == OP_REALLOC ? 1 : op == OP_THREAD_EXIT ? 3 : 2;
}

static int by_time(const void* a, const void* b) {
  const event_t *x = &ev[*(const uint64_t*)a], *y = &ev[*(const uint64_t*)b];
  if (x->t != y->t) return x->t < y->t ? -1 : 1;
  int kx = kind_of(x->op), ky = kind_of(y->op);
  if (kx != ky) return kx - ky;
  return *(const uint64_t*)a < *(const uint64_t*)b ? -1 : 1;
}

/* Address -> live object: linear probing, deletion by backward shift. */
typedef struct { uint64_t addr; int64_t obj; } slot_t;
static slot_t* map;
static uint64_t map_mask;

static uint64_t hash(uint64_t a) { a ^= a >> 33; a *= 0xff51afd7ed558ccdull; a ^= a >> 33; return a; }

static void map_put(uint64_t addr, int64_t obj) {
  uint64_t i = hash(addr) & map_mask;
  while (map[i].addr && map[i].addr != addr) i = (i + 1) & map_mask;
  map[i].addr = addr;
  map[i].obj = obj;
}

static int64_t map_take(uint64_t addr) {
  uint64_t i = hash(addr) & map_mask;
  while (map[i].addr && map[i].addr != addr) i = (i + 1) & map_mask;
  if (!map[i].addr) return -1;
  int64_t obj = map[i].obj;
  uint64_t j = i;
  for (;;) {   /* backward-shift deletion keeps every probe chain whole */
    map[i].addr = 0;
    for (;;) {
      j = (j + 1) & map_mask;
      if (!map[j].addr) return obj;
      uint64_t home = hash(map[j].addr) & map_mask;
      if (i <= j ? (i < home && home <= j) : (i < home || home <= j)) continue;
      break;
    }
    map[i] = map[j];
    i = j;
  }
}

static void rename_objects(void) {
  order = map_zero(nev * sizeof *order);
  for (uint64_t i = 0; i < nev; i++) order[i] = i;
  qsort(order, nev, sizeof *order, by_time);
  uint64_t cap = 16;
  while (cap < 2 * nev + 16) cap <<= 1;
  map = map_zero(cap * sizeof *map);
  map_mask = cap - 1;
  int64_t next = 0;
  for (uint64_t k = 0; k < nev; k++) {
    event_t* e = &ev[order[k]];
    switch (e->op) {
      case OP_FREE:
        if (!e->addr) break;
        e->old_obj = map_take(e->addr);
        if (e->old_obj < 0) info.unmatched_frees++;
        break;
      case OP_REALLOC:
        if (!e->addr) break;   /* failed: the old block stays as it was */
        if (e->old) {
          e->old_obj = map_take(e->old);
          if (e->old_obj < 0) info.unmatched_frees++;
        }
        e->obj = next++;
        map_put(e->addr, e->obj);
        break;
      case OP_MALLOC: case OP_CALLOC: case OP_ALIGNED:
        if (!e->addr) break;
        if (map_take(e->addr) >= 0) info.unmatched_frees++;   /* its free was never seen */
        e->obj = next++;
        map_put(e->addr, e->obj);
        break;
    }
  }
  info.objects = (uint64_t)next;
  munmap(map, cap * sizeof *map);
}

/* ---- the replay ------------------------------------------------------------------ */
static _Atomic(void*)* objs;
static uint64_t** thread_events;   /* per trace thread: event indices, in `order` */
static uint64_t* thread_nev;
static pthread_barrier_t start_bar;
static uint64_t replay_t0;   /* CLOCK_MONOTONIC when the barrier opened */
static _Atomic uint64_t idle_ns;
static _Atomic uint64_t held_ns;
static _Atomic uint32_t holding;        /* replay threads waiting at the gate now */
static _Atomic uint64_t ops_done;
static _Atomic uint32_t threads_done;   /* replay threads at their end: the RSS sampler's stop */
static _Atomic int stuck;

static void touch(void* p, uint64_t n) {
  if (!touch_pages || !p || n == 0) return;
  uint8_t* b = p;
  memset(b, 0xa5, n < 64 ? n : 64);
  for (uint64_t o = 4096; o < n; o += 4096) b[o] = 1;
  b[n - 1] = 2;
}

/* --gate: learnd screens policies on a live program's trace while that
 * program runs, and an intermittent program's bursts took up to five times
 * their CPU time while screening ran beside them; learnd holds the replays
 * through the bursts and the time around them (screen.Gate). Between two events
 * (never inside an allocator call: the policy's slow-path time is not the
 * wait's) a replay thread waits while the gate's byte says the program is
 * running. The gate is learnd's file; a hold is bounded here all the same,
 * so a gate nobody opens slows a replay down and never stops it.
 *
 * One held thread of the process looks at the byte, sleeping on the gate's
 * word in between (learnd wakes it at the opening; else it looks every
 * GATE_LOOK_NS); the others sleep on a private futex until it sees the gate
 * open, or their hold's bound passes. Each thread polling on its own, a replay of a
 * 64-thread trace held at a closed gate took 303 ms of CPU and 120,000
 * context switches in 4 s (perf stat, nice 19 on one CPU), and learnd holds
 * 9 replays at once on one CPU: about 0.7 of the CPU the program's own
 * threads wanted back, woken a thousand times a second each. Now the same
 * replay held takes about 10 ms of CPU a second, most of it this look and
 * the RSS sampler's. The look was a 5-ms sleep, and the others woke every
 * 0.5 s: beside MariaDB, 9 processes waking every 5 ms on its CPU (as 9
 * held replays' lookers did) cost it 4% of its transactions (README). */
static _Atomic int gate_polling;        /* a thread of this process is the one looking */
static _Atomic uint32_t gate_gen;       /* bumped when it stops looking: the others look again */
static uint64_t gate_hold(void) {
  uint64_t t0 = now_ns(), t = t0;
  atomic_fetch_add(&holding, 1);
  while (*gate && t - t0 < GATE_MAX_HOLD_NS) {
    int none = 0;
    if (atomic_compare_exchange_strong(&gate_polling, &none, 1)) {
      while (*gate && t - t0 < GATE_MAX_HOLD_NS) {
        /* Shared (not private): learnd's FUTEX_WAKE comes from its own
         * mapping of the gate. Waits only while the word is what was read,
         * so an opening between the read and the wait is not slept through. */
        uint32_t w = __atomic_load_n(gate_word, __ATOMIC_SEQ_CST);
        if (!*gate) break;
        uint64_t left = GATE_MAX_HOLD_NS - (t - t0);
        struct timespec ts = {0, left < (uint64_t)GATE_LOOK_NS ? (long)left : GATE_LOOK_NS};
        syscall(SYS_futex, gate_word, FUTEX_WAIT, w, &ts, NULL, 0);
        t = now_ns();
      }
      atomic_store(&gate_polling, 0);
      atomic_fetch_add(&gate_gen, 1);
      syscall(SYS_futex, (uint32_t*)&gate_gen, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
      break;
    }
    /* Read before the byte: a poller that sees the gate open after this
     * has bumped the generation, and the wait below returns at once. */
    uint32_t gen = atomic_load(&gate_gen);
    if (!*gate) break;
    uint64_t left = GATE_MAX_HOLD_NS - (t - t0);
    struct timespec ts = {(time_t)(left / 1000000000u), (long)(left % 1000000000u)};
    syscall(SYS_futex, (uint32_t*)&gate_gen, FUTEX_WAIT_PRIVATE, gen, &ts, NULL, 0);
    t = now_ns();
  }
  atomic_fetch_sub(&holding, 1);
  return t - t0;
}

static void open_gate(void) {
  int fd = gate_fd;
  if (fd < 0 && (fd = open(gate_path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC)) < 0)
    die(2, "%s: %s", gate_what, strerror(errno));
  struct stat st;
  if (fstat(fd, &st) != 0) die(2, "%s: %s", gate_what, strerror(errno));
  if (!S_ISREG(st.st_mode) || st.st_size < 1) die(2, "%s: not a regular file of at least one byte", gate_what);
  void* m = mmap(NULL, 4, PROT_READ, MAP_SHARED, fd, 0);    /* a page: past a 1-byte file's end, zeros */
  if (m == MAP_FAILED) die(2, "%s: %s", gate_what, strerror(errno));
  if (fd != gate_fd) close(fd);
  gate = m;
  gate_word = m;
}

/* A thread that frees or reallocates another thread's object waits until
 * that thread has made it. It spun and yielded for as long as that took:
 * behind a thread held at the gate, sleeping through one of the trace's
 * idle gaps, or starved at nice 19 beside learnd's other replays: a thread
 * that waited 1.5 s so took 1.51 s of CPU (test_replayer). So a waiter
 * spins briefly, then sleeps on obj_gen, which a thread that makes an
 * object bumps and wakes while anyone waits. (learnd's replays of MariaDB's
 * 70-thread traces took 22-30 us of CPU per traced event before and after
 * this: there the spinning was not where their CPU went; README.) */
#define OBJ_SPIN_YIELDS 16
#define OBJ_WAIT_NS 100000000L            /* a sleeping waiter looks again at least this often */
/* A waiter gives the replay up as stuck once no thread has made an object
 * for this long (--stuck-after): a thread that does, however slowly, is
 * progress. Counted from the wait's start, a replay starved beside a busy
 * program (its group niced to 19, nice_own_group) was given up in learnd's
 * screening of MariaDB: "a thread waited over a minute". */
static uint64_t stuck_ns = 60000000000ull;
static _Atomic uint32_t obj_gen, obj_waiters;

/* Every object's making goes through here. Sequentially
 * consistent with wait_obj's steps: either the maker sees the waiter and
 * wakes it, or the waiter sees the object before it sleeps. */
static void put_obj(int64_t id, void* p) {
  atomic_store(&objs[id], p);
  if (p && atomic_load(&obj_waiters)) {
    atomic_fetch_add(&obj_gen, 1);
    syscall(SYS_futex, (uint32_t*)&obj_gen, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
  }
}

/* The object's block, once its allocating thread has made it. */
static void* wait_obj(int64_t id) {
  void* p;
  unsigned spins = 0, yields = 0;
  while (!(p = atomic_load_explicit(&objs[id], memory_order_acquire))) {
    if (++spins < 64) { __builtin_ia32_pause(); continue; }
    spins = 0;
    if (atomic_load_explicit(&stuck, memory_order_relaxed)) return NULL;
    if (++yields <= OBJ_SPIN_YIELDS) { sched_yield(); continue; }
    uint64_t t0 = now_ns();
    atomic_fetch_add(&obj_waiters, 1);
    uint32_t seen = atomic_load(&obj_gen);
    for (;;) {
      uint32_t gen = atomic_load(&obj_gen);
      if ((p = atomic_load(&objs[id])) != NULL) break;
      uint64_t now = now_ns();
      if (gen != seen) seen = gen, t0 = now;    /* while anyone waits, every object made bumps obj_gen */
      if (atomic_load_explicit(&stuck, memory_order_relaxed) || now - t0 > stuck_ns) {
        atomic_store(&stuck, 1);
        break;
      }
      struct timespec ts = {0, OBJ_WAIT_NS};
      syscall(SYS_futex, (uint32_t*)&obj_gen, FUTEX_WAIT_PRIVATE, gen, &ts, NULL, 0);
    }
    atomic_fetch_sub(&obj_waiters, 1);
    return p;
  }
  return p;
}

static void* replay_thread(void* arg) {
  uint64_t t = (uint64_t)(uintptr_t)arg;
  uint64_t* list = thread_events[t];
  uint64_t n = thread_nev[t], done = 0, prev_t = 0, slept = 0, held = 0;
  pthread_barrier_wait(&start_bar);
  for (uint64_t k = 0; k < n; k++) {
    event_t* e = &ev[list[k]];
    void* p = NULL;
    if (gate && *gate) held += gate_hold();
    if (pace_idle && e->t - prev_t >= GAP_NS && e->t > prev_t) {
      /* Only at a gap does the clock get read: the replay keeps the
       * trace's idle time, not its busy time (nor the gate's holds). */
      uint64_t target = replay_t0 + held + e->t, now = now_ns();
      if (target > now) {
        struct timespec ts = {(time_t)((target - now) / 1000000000u), (long)((target - now) % 1000000000u)};
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {}
        slept += target - now;
      }
    }
    prev_t = e->t;
    switch (e->op) {
      case OP_MALLOC:
        if (e->obj < 0) continue;
        p = malloc(e->size);
        break;
      case OP_CALLOC:
        if (e->obj < 0) continue;
        p = calloc(1, e->size);
        break;
      case OP_ALIGNED:
        if (e->obj < 0) continue;
        if (posix_memalign(&p, e->align >= sizeof(void*) && !(e->align & (e->align - 1)) ? e->align : 16,
                           e->size) != 0)
          p = NULL;
        break;
      case OP_REALLOC: {
        if (e->obj < 0) continue;
        void* q = e->old_obj >= 0 ? wait_obj(e->old_obj) : NULL;
        if (e->old_obj >= 0 && !q) goto out;
        if (e->old_obj >= 0) atomic_store_explicit(&objs[e->old_obj], NULL, memory_order_relaxed);
        p = realloc(q, e->size);
        if (p) touch(p, e->size < 64 ? e->size : 64);
        put_obj(e->obj, p ? p : (void*)1);
        done++;
        continue;
      }
      case OP_FREE: {
        if (e->old_obj < 0) continue;
        void* q = wait_obj(e->old_obj);
        if (!q) goto out;
        atomic_store_explicit(&objs[e->old_obj], NULL, memory_order_relaxed);
        if (q != (void*)1) free(q);
        done++;
        continue;
      }
      case OP_THREAD_EXIT:
        goto out;
    }
    if (p) touch(p, e->size);
    /* A failed allocation still "exists" for its free to find: (void*)1. */
    put_obj(e->obj, p ? p : (void*)1);
    done++;
  }
out:
  atomic_fetch_add(&ops_done, done);
  atomic_fetch_add(&idle_ns, slept);
  atomic_fetch_add(&held_ns, held);
  atomic_fetch_add_explicit(&threads_done, 1, memory_order_release);
  return NULL;
}

/* ---- the policy ------------------------------------------------------------------- */
static const char* skip_ws(const char* s) {
  while (*s == ' ' || *s == '\t' || *s == '\n' || *s == '\r') s++;
  return s;
}

static const char* parse_num(const char* s, uint64_t* v, const char* key) {
  s = skip_ws(s);
  char* end;
  errno = 0;
  if (*s == '-') die(2, "%s: %s: negative value", policy_path, key);
  unsigned long long x = strtoull(s, &end, 10);
  if (end == s || errno) die(2, "%s: %s: expected a number", policy_path, key);
  if (*end == '.') {   /* 12.0 from a JSON writer: whole numbers only */
    char* e2;
    double d = strtod(s, &e2);
    if (d != (double)(unsigned long long)d) die(2, "%s: %s: %g is not a whole number", policy_path, key, d);
    end = e2;
  }
  *v = x;
  return end;
}

/* {"drain_ms": N, "tcache_cap": N or [per class], ...}: a per-class value
 * given once applies to every class, fitted into that class's bounds; an
 * array is taken as it is (index = class; class 0 ignored). */
static void load_policy(hk_policy_t* p) {
  hk_policy_get(p);
  if (!policy_path) return;
  int fd = policy_fd;
  if (fd < 0 && (fd = open(policy_path, O_RDONLY | O_CLOEXEC | O_NONBLOCK)) < 0)
    die(2, "%s: %s", policy_path, strerror(errno));
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size > (1 << 20))
    die(2, "%s: not a regular file of at most 1 MiB", policy_path);
  char* text = map_zero((size_t)st.st_size + 1);
  /* From offset 0, whatever the descriptor's offset: every run reads it. */
  if (pread(fd, text, (size_t)st.st_size, 0) != st.st_size) die(2, "%s: short read", policy_path);
  if (fd != policy_fd) close(fd);
  const char* s = skip_ws(text);
  if (*s++ != '{') die(2, "%s: expected a JSON object", policy_path);
  for (s = skip_ws(s); *s != '}';) {
    if (*s != '"') die(2, "%s: expected a knob name", policy_path);
    const char* k0 = ++s;
    while (*s && *s != '"') s++;
    if (!*s) die(2, "%s: unterminated name", policy_path);
    char key[64];
    snprintf(key, sizeof key, "%.*s", (int)(s - k0), k0);
    s = skip_ws(s + 1);
    if (*s++ != ':') die(2, "%s: expected ':' after \"%s\"", policy_path, key);
    s = skip_ws(s);
    bool known = false;
#define PROC_KNOB(name, NAME, bounds, env, unit, min, max, def, desc)       \
    if (!strcmp(key, #name)) {                                               \
      uint64_t v;                                                            \
      s = parse_num(s, &v, key);                                             \
      p->name = (uint32_t)(v > UINT32_MAX ? UINT32_MAX : v);                 \
      known = true;                                                          \
    }
    HK_PROC_KNOBS(PROC_KNOB)
#undef PROC_KNOB
#define CLASS_KNOB(name, NAME, bounds, env, unit, min, max, def, desc)      \
    if (!strcmp(key, #name)) {                                               \
      known = true;                                                          \
      if (*s == '[') {                                                       \
        s++;                                                                 \
        for (unsigned c = 0;; c++) {                                         \
          s = skip_ws(s);                                                    \
          if (*s == ']') { s++; break; }                                     \
          uint64_t v;                                                        \
          s = parse_num(s, &v, key);                                         \
          if (c >= HK_NUM_CLASSES) die(2, "%s: %s: more than %d classes", policy_path, key, HK_NUM_CLASSES); \
          if (c > 0) p->name[c] = (uint32_t)(v > UINT32_MAX ? UINT32_MAX : v); \
          s = skip_ws(s);                                                    \
          if (*s == ',') s++;                                                \
        }                                                                    \
      } else {                                                               \
        uint64_t v;                                                          \
        s = parse_num(s, &v, key);                                           \
        for (unsigned c = 1; c < HK_NUM_CLASSES; c++) {                      \
          hk_policy_bounds_t b;                                              \
          hk_policy_bounds(c, &b);                                           \
          uint64_t x = v < b.bounds##_min ? b.bounds##_min : v > b.bounds##_max ? b.bounds##_max : v; \
          p->name[c] = (uint32_t)x;                                          \
        }                                                                    \
      }                                                                      \
    }
    HK_CLASS_KNOBS(CLASS_KNOB)
#undef CLASS_KNOB
    if (!known) die(2, "%s: unknown knob \"%s\"", policy_path, key);
    s = skip_ws(s);
    if (*s == ',') s = skip_ws(s + 1);
    else if (*s != '}') die(2, "%s: expected ',' or '}' after \"%s\"", policy_path, key);
  }
  /* A scalar batch may exceed a class's clamped cap: fit it under. */
  for (unsigned c = 1; c < HK_NUM_CLASSES; c++)
    if (p->tcache_batch[c] > p->tcache_cap[c] && p->tcache_cap[c] > 0) p->tcache_batch[c] = p->tcache_cap[c];
}

/* ---- one run (a child process) ---------------------------------------------------- */
typedef struct {
  trace_info_t info;
  hk_policy_t policy;
  double wall_s, cpu_s, user_s, idle_s;   /* user_s: cpu_s less the kernel's part */
  double held_s;                          /* --gate: thread-seconds held */
  uint64_t peak_rss, base_rss, minflt, majflt, ops;
  uint64_t mean_rss;      /* resident memory above base_rss, averaged over the replay's wall time */
  uint64_t proc[64];
  uint64_t cls[64];       /* class counters summed over classes */
} run_t;

#define X_COUNT(name, desc) +1
enum { N_PROC = 0 HK_PROC_COUNTERS(X_COUNT), N_CLS = 0 HK_CLASS_COUNTERS(X_COUNT) };
#undef X_COUNT
_Static_assert(N_PROC <= 64 && N_CLS <= 64, "counter arrays fit");

#define RSS_SAMPLE_NS 10000000L

/* Resident bytes now (/proc/self/statm's second field), 0 if unreadable. */
static uint64_t statm_rss(void) {
  char buf[256];
  int fd = open("/proc/self/statm", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0) return 0;
  buf[n] = 0;
  unsigned long long size = 0, res = 0;
  if (sscanf(buf, "%llu %llu", &size, &res) != 2) return 0;
  return (uint64_t)res * (uint64_t)sysconf(_SC_PAGESIZE);
}

static uint64_t status_kb(const char* field) {
  char buf[4096];
  int fd = open("/proc/self/status", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0) return 0;
  buf[n] = 0;
  const char* p = strstr(buf, field);
  return p ? strtoull(p + strlen(field), NULL, 10) : 0;
}

static double cpu_seconds(const struct rusage* r) {
  return (double)r->ru_utime.tv_sec + r->ru_utime.tv_usec * 1e-6 + (double)r->ru_stime.tv_sec +
         r->ru_stime.tv_usec * 1e-6;
}

static void stats_flat(const hk_stats_t* s, uint64_t* proc, uint64_t* cls) {
  unsigned i = 0;
#define X_P(name, desc) proc[i++] = s->name;
  HK_PROC_COUNTERS(X_P)
#undef X_P
  memset(cls, 0, N_CLS * sizeof *cls);
  for (unsigned c = 0; c < HK_NUM_CLASSES; c++) {
    unsigned j = 0;
#define X_C(name, desc) cls[j++] += s->cls[c].name;
    HK_CLASS_COUNTERS(X_C)
#undef X_C
  }
}

static int run_once(int out_fd) {
  /* A slow path counts at most a bound that a turn lost to another process
   * passes: learnd runs replays side by side on one CPU (prim.h). */
  _hk_os_bound_slow_paths();
  /* Loading decodes the whole trace and touches its arrays: as much work
   * as a burst of the replay's, so it waits for the gate too. */
  if (gate_path || gate_fd >= 0) open_gate();
  if (gate && *gate) (void)gate_hold();
  load_trace();
  rename_objects();
  hk_policy_t pol;
  load_policy(&pol);
  if (policy_path && hk_policy_set(&pol) == 0)
    die(2, "%s: the allocator rejects this policy (a value out of its bounds)", policy_path);
  /* The background thread. The allocator starts it a second after the
   * process does, and from then on it gives memory back in the program's
   * idle gaps. A live capture (learnd's screening, `hakmem trace record`)
   * comes from a process past that second, so its replay starts the thread
   * at once: else its first second kept through every idle gap what the
   * program gave back. bench-learn's phases (a 400-ms cycle), a 2-s live
   * capture under cap=4 drain=100: 60,000 faults replayed against the
   * program's 122,000 in 2 s, which ranked the policy 13% cheaper than the
   * default where it cost the program 56% more. A trace from a process's
   * start (HAKMEM_TRACE) keeps the allocator's own rule. */
  if (info.mode == HAKMEM__TRACE__V1__MODE__LIVE) _hk_background_start_now();
  uint32_t nt = info.threads;
  thread_nev = map_zero((nt + 1) * sizeof *thread_nev);
  thread_events = map_zero((nt + 1) * sizeof *thread_events);
  for (uint64_t i = 0; i < nev; i++) thread_nev[ev[i].thread]++;
  for (uint32_t t = 1; t <= nt; t++) thread_events[t] = map_zero(thread_nev[t] * sizeof(uint64_t));
  uint64_t* fill = map_zero((nt + 1) * sizeof *fill);
  for (uint64_t k = 0; k < nev; k++) {
    uint64_t i = order[k];
    thread_events[ev[i].thread][fill[ev[i].thread]++] = i;
  }
  munmap(order, nev * sizeof *order);   /* as much as the lists: not the replay's memory */
  objs = map_zero(info.objects * sizeof *objs);

  run_t r;
  memset(&r, 0, sizeof r);
  uint32_t active = 0;
  for (uint32_t t = 1; t <= nt; t++) active += thread_nev[t] > 0;
  pthread_t* tid = map_zero((nt + 1) * sizeof *tid);
  pthread_barrier_init(&start_bar, NULL, active + 1);
  hk_stats_t s0, s1;
  for (uint32_t t = 1; t <= nt; t++)
    if (thread_nev[t] && pthread_create(&tid[t], NULL, replay_thread, (void*)(uintptr_t)t) != 0)
      die(1, "%s: cannot start replay thread %u", trace_path, t);
  /* The high-water mark from here on: what loading took is not the replay's. */
  int cr = open("/proc/self/clear_refs", O_WRONLY | O_CLOEXEC);
  if (cr >= 0) { (void)!write(cr, "5", 1); close(cr); }
  r.base_rss = status_kb("VmRSS:") * 1024;
  hk_stats_get(&s0);
  struct rusage u0, u1;
  getrusage(RUSAGE_SELF, &u0);
  uint64_t t0 = now_ns();
  replay_t0 = t0;
  pthread_barrier_wait(&start_bar);
  /* Resident memory every RSS_SAMPLE_NS while the threads replay: a live
   * program's cost prices its mean resident memory (learnd's windows), and
   * memory parked through idle gaps shows only in the mean. */
  double rss_sum = 0;
  uint64_t rss_n = 0;
  while (atomic_load_explicit(&threads_done, memory_order_acquire) < active) {
    struct timespec ts = {0, RSS_SAMPLE_NS};
    nanosleep(&ts, NULL);
    /* Memory while a thread is held is the wait's, not the trace's. Only
     * then: the gate also closes while the replay sleeps through one of the
     * trace's own idle gaps, and leaving those out weighed a spike's memory
     * over the idle floor that follows it. bench-learn's spikes (a 64 MiB
     * burst every 2 s), an 8-s live capture, a gate closed 0.9 s in every 2:
     * mean RSS under cap=4 drain=100 9.4 MiB ungated, 16.2 gated; under
     * cap=4 warm=0 3.9 and 6.3; the gap between the two, which decides
     * their order, 5.5 MiB against 9.9 (live beside each other: 6.6). */
    if (atomic_load_explicit(&holding, memory_order_relaxed)) {
      /* Nothing to sample until the gate opens: this waits for it as the
       * held threads do (learnd's wake ends it), not every RSS_SAMPLE_NS. */
      uint32_t w = __atomic_load_n(gate_word, __ATOMIC_SEQ_CST);
      struct timespec look = {0, GATE_LOOK_NS};
      if (*gate) syscall(SYS_futex, gate_word, FUTEX_WAIT, w, &look, NULL, 0);
      continue;
    }
    rss_sum += (double)statm_rss();
    rss_n++;
  }
  for (uint32_t t = 1; t <= nt; t++)
    if (thread_nev[t]) pthread_join(tid[t], NULL);
  uint64_t t1 = now_ns();
  double mean = rss_n ? rss_sum / (double)rss_n : (double)statm_rss();
  r.mean_rss = mean > (double)r.base_rss ? (uint64_t)(mean - (double)r.base_rss) : 0;
  getrusage(RUSAGE_SELF, &u1);
  hk_stats_get(&s1);
  if (atomic_load(&stuck))
    die(1, "%s: replay stuck: a thread waited for another thread's object while no thread made one for %.0f s "
        "(events out of time order?)", trace_path, (double)stuck_ns / 1e9);
  /* The replayed program's peak: above what loading the trace took (its
   * tables live in the same process and are the same for every policy). */
  uint64_t hwm = status_kb("VmHWM:") * 1024;
  r.peak_rss = hwm > r.base_rss ? hwm - r.base_rss : 0;
  r.wall_s = (double)(t1 - t0) * 1e-9;
  r.idle_s = (double)atomic_load(&idle_ns) * 1e-9;
  r.held_s = (double)atomic_load(&held_ns) * 1e-9;
  r.cpu_s = cpu_seconds(&u1) - cpu_seconds(&u0);
  r.user_s = (double)(u1.ru_utime.tv_sec - u0.ru_utime.tv_sec) + (u1.ru_utime.tv_usec - u0.ru_utime.tv_usec) * 1e-6;
  r.minflt = (uint64_t)(u1.ru_minflt - u0.ru_minflt);
  r.majflt = (uint64_t)(u1.ru_majflt - u0.ru_majflt);
  r.ops = atomic_load(&ops_done);
  uint64_t p0[64], c0[64];
  stats_flat(&s0, p0, c0);
  stats_flat(&s1, r.proc, r.cls);
  unsigned i = 0;
  /* Gauges are reported as they stand at the end; counters as what the
   * replay added. */
#define X_D(name, desc) if (strncmp(desc, "gauge", 5) != 0) r.proc[i] -= p0[i]; i++;
  HK_PROC_COUNTERS(X_D)
#undef X_D
  for (unsigned j = 0; j < N_CLS; j++) r.cls[j] -= c0[j];
  hk_policy_get(&r.policy);
  r.info = info;
  /* What is still live goes back after the measurement. */
  for (uint64_t k = 0; k < info.objects; k++) {
    void* p = atomic_load(&objs[k]);
    if (p && p != (void*)1) free(p);
  }
  const char* b = (const char*)&r;
  size_t left = sizeof r;
  while (left) {
    ssize_t w = write(out_fd, b, left);
    if (w <= 0) { if (errno == EINTR) continue; return 1; }
    b += w;
    left -= (size_t)w;
  }
  return 0;
}

/* ---- the parent: runs, medians, output ------------------------------------------- */
static int cmp_double(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return x < y ? -1 : x > y;
}

static double median(double* v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

static double spread(double* v, int n, double med) {   /* (max - min) / median */
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  return med > 0 ? (v[n - 1] - v[0]) / med : 0;
}

static void json_str(const char* s) {
  putchar('"');
  for (; *s; s++) {
    unsigned char ch = (unsigned char)*s;
    if (ch == '"' || ch == '\\') printf("\\%c", ch);
    else if (ch < 0x20) printf("\\u%04x", ch);
    else putchar(ch);
  }
  putchar('"');
}

static uint64_t os_calls(const run_t* r) {
  uint64_t sum = 0;
  unsigned i = 0;
#define X_O(name, desc) if (strstr(#name, "_calls")) sum += r->proc[i]; i++;
  HK_PROC_COUNTERS(X_O)
#undef X_O
  return sum;
}

static void print_policy(const hk_policy_t* p) {
  printf("{");
  bool first = true;
#define PK(name, NAME, bounds, env, unit, min, max, def, desc) \
  printf("%s\"%s\": %u", first ? "" : ", ", #name, p->name); first = false;
  HK_PROC_KNOBS(PK)
#undef PK
#define CK(name, NAME, bounds, env, unit, min, max, def, desc)   \
  printf("%s\"%s\": [", first ? "" : ", ", #name); first = false; \
  for (unsigned c = 0; c < HK_NUM_CLASSES; c++) printf("%s%u", c ? ", " : "", p->name[c]); \
  printf("]");
  HK_CLASS_KNOBS(CK)
#undef CK
  printf("}");
}

static void print_json(run_t* runs, int n) {
  const trace_info_t* t = &runs[0].info;
  printf("{\"trace\": {\"path\": ");
  json_str(trace_path);
  printf(", \"mode\": \"%s\", \"layout_version\": %u, \"exe\": ", mode_name(t->mode), t->layout_version);
  json_str(t->exe);
  printf(", \"events\": %" PRIu64 ", \"threads\": %u, \"objects\": %" PRIu64 ", \"unmatched_frees\": %" PRIu64
         ", \"partial\": %s, \"valid_bytes\": %" PRIu64 ", \"file_bytes\": %" PRIu64 ", \"cut_reason\": ",
         t->events, t->threads, t->objects, t->unmatched_frees, t->partial ? "true" : "false", t->valid_bytes,
         t->file_bytes);
  if (t->cut_reason[0]) json_str(t->cut_reason); else printf("null");
  printf("},\n \"policy\": ");
  print_policy(&runs[0].policy);
  printf(",\n \"touch\": \"%s\", \"pace\": \"%s\", \"repeat\": %d, \"group_nice\": ", touch_pages ? "pages" : "none",
         pace_idle ? "idle" : "none", n);
  if (group_nice >= 0) printf("%d", group_nice); else printf("null");
  printf(",\n \"runs\": [");
  for (int k = 0; k < n; k++) {
    run_t* r = &runs[k];
    printf("%s\n  {\"wall_s\": %.9f, \"cpu_s\": %.6f, \"user_s\": %.6f, \"idle_s\": %.6f, \"held_s\": %.6f, \"peak_rss_bytes\": %" PRIu64
           ", \"mean_rss_bytes\": %" PRIu64 ", \"base_rss_bytes\": %" PRIu64 ", \"minflt\": %" PRIu64
           ", \"majflt\": %" PRIu64 ", \"ops\": %" PRIu64 ", \"os_calls\": {", k ? "," : "", r->wall_s, r->cpu_s,
           r->user_s, r->idle_s, r->held_s, r->peak_rss, r->mean_rss, r->base_rss, r->minflt, r->majflt, r->ops);
    unsigned i = 0;
    bool first = true;
#define X_OC(name, desc) if (strstr(#name, "_calls")) { printf("%s\"%.*s\": %" PRIu64, first ? "" : ", ", \
      (int)(strlen(#name) - 6), #name, r->proc[i]); first = false; } i++;
    HK_PROC_COUNTERS(X_OC)
#undef X_OC
    printf("}, \"counters\": {");
    i = 0;
    first = true;
#define X_PC(name, desc) printf("%s\"%s\": %" PRIu64, first ? "" : ", ", #name, r->proc[i++]); first = false;
    HK_PROC_COUNTERS(X_PC)
#undef X_PC
    i = 0;
#define X_CC(name, desc) printf(", \"%s\": %" PRIu64, #name, r->cls[i++]);
    HK_CLASS_COUNTERS(X_CC)
#undef X_CC
    printf("}}");
  }
  double w[MAX_REPEAT], c[MAX_REPEAT], rss[MAX_REPEAT], f[MAX_REPEAT], o[MAX_REPEAT];
  for (int k = 0; k < n; k++) {
    w[k] = runs[k].wall_s; c[k] = runs[k].cpu_s; rss[k] = (double)runs[k].peak_rss;
    f[k] = (double)runs[k].minflt; o[k] = (double)os_calls(&runs[k]);
  }
  double mw = median(w, n), mc = median(c, n), mr = median(rss, n), mf = median(f, n), mo = median(o, n);
  printf("],\n \"median\": {\"wall_s\": %.9f, \"cpu_s\": %.6f, \"peak_rss_bytes\": %.0f, \"minflt\": %.0f, \"os_calls\": %.0f},\n",
         mw, mc, mr, mf, mo);
  printf(" \"spread\": {\"wall_s\": %.6f, \"cpu_s\": %.6f, \"peak_rss_bytes\": %.6f, \"minflt\": %.6f}}\n",
         spread(w, n, mw), spread(c, n, mc), spread(rss, n, mr), spread(f, n, mf));
}

static void print_text(run_t* runs, int n) {
  const trace_info_t* t = &runs[0].info;
  printf("trace %s: %s, %" PRIu64 " events, %u threads, %" PRIu64 " objects, %" PRIu64 " unmatched frees%s%s\n",
         trace_path, mode_name(t->mode), t->events, t->threads, t->objects, t->unmatched_frees,
         t->partial ? "; partial: " : "", t->partial ? t->cut_reason : "");
  double w[MAX_REPEAT], rss[MAX_REPEAT];
  for (int k = 0; k < n; k++) {
    const run_t* r = &runs[k];
    printf("run %d: %.3f s wall (%.3f idle), %.3f s cpu, peak RSS %.1f MiB (mean %.1f, base %.1f), %" PRIu64
           " page faults, %" PRIu64 " OS calls, %" PRIu64 " ops\n", k + 1, r->wall_s, r->idle_s, r->cpu_s,
           r->peak_rss / 1048576.0, r->mean_rss / 1048576.0, r->base_rss / 1048576.0, r->minflt, os_calls(r), r->ops);
    w[k] = r->wall_s;
    rss[k] = (double)r->peak_rss;
  }
  double mw = median(w, n), mr = median(rss, n);
  if (n > 1)
    printf("median of %d: %.3f s (spread %.1f%%), peak RSS %.1f MiB (spread %.1f%%)\n", n, mw,
           100 * spread(w, n, mw), mr / 1048576.0, 100 * spread(rss, n, mr));
}

static void usage(FILE* f) {
  fprintf(f,
    "usage: hakmem-replay [--policy FILE | --policy-fd N] [--repeat N] [--partial] [--touch pages|none]\n"
    "                     [--pace idle|none] [--gate FILE | --gate-fd N] [--nice N] [--nice-group]\n"
    "                     [--cpus LIST] [--stuck-after S] [--json]\n"
    "                     TRACE | --trace-fd N\n"
    "\n"
    "Replays an allocation trace (HAKMEM_TRACE, `hakmem trace record`) through hakmem under a fixed\n"
    "policy and reports time, peak resident memory, page faults, OS calls and the allocator's counters.\n"
    "Threads run as recorded, each its own events in time order, and cross-thread frees stay\n"
    "cross-thread. Events run back to back but for the trace's idle gaps (see --pace), none later than\n"
    "the trace lasted. Each run is a fresh process, with no HAKMEM_* variable of the caller's\n"
    "environment (the policy is --policy's) and no telemetry; the replay and its runs die with the\n"
    "process that started them.\n"
    "\n"
    "  --policy FILE   knobs as JSON: {\"drain_ms\": N, \"tcache_cap\": N or [per class], \"tcache_batch\": ...,\n"
    "                  \"warm_slabs\": ...}; a single per-class value applies to every class, fitted into\n"
    "                  its bounds; absent knobs keep the default (default: the default policy)\n"
    "  --policy-fd N   the same from descriptor N, open and inherited (a regular file: a memfd counts),\n"
    "                  read from offset 0; named \"descriptor N\" in messages\n"
    "  --repeat N      N runs (1-%d), each in a fresh process; medians and spreads over them\n"
    "  --partial       replay the complete chunks before a cut or damaged one instead of refusing\n"
    "  --touch MODE    pages (default): write each new object's first bytes and a byte per 4 KiB page;\n"
    "                  none: no writes\n"
    "  --pace MODE     idle (default): a thread whose next event comes 1 ms or more after its last one\n"
    "                  waits until that much of the trace's time has passed, so idle drains and decay\n"
    "                  happen as they did; none: everything back to back\n"
    "  --gate FILE     a file whose first byte is nonzero while another program should not be disturbed\n"
    "                  (hakmem-learnd's screening: the traced program is running); between events each\n"
    "                  thread waits while it is, at most 2 s at a time, and the waits are kept out of the\n"
    "                  pacing, the mean resident memory and the slow-path time (held_s reports them)\n"
    "  --gate-fd N     the same from descriptor N, open and inherited, mapped read-only and shared\n"
    "  --nice N        run at niceness N (0-19), the runs too; set before anything else is done\n"
    "  --nice-group    with --nice, where this process leads a session of its own, its scheduling\n"
    "                  group (autogroup) too: the group then weighs as little as its tasks\n"
    "  --cpus LIST     run on these CPUs only (\"2-3,6\"), the runs too\n"
    "  --stuck-after S give the replay up as stuck (exit 1) once a thread has waited for another\n"
    "                  thread's object while no thread made one for S seconds (default 60)\n"
    "  --json          one JSON document on stdout\n"
    "  --trace-fd N    the trace from descriptor N instead of TRACE: open and inherited (a regular\n"
    "                  file: a memfd counts), read from offset 0 and never reopened by a name; named\n"
    "                  \"descriptor N\" in messages and in the JSON's \"path\"\n"
    "\n"
    "An event later than the trace's footer says it lasted (+1 s), or later than its file was being\n"
    "written (from its header's start to its last change, +60 s, which also bounds the footer's\n"
    "duration), is damage like any other.\n"
    "\n"
    "Exit status: 0 replayed; 1 the trace cannot be replayed (one line says why, with the byte offset);\n"
    "2 bad usage or policy, or a descriptor that is not an open regular file.\n", MAX_REPEAT);
}

/* N of --trace-fd N and the like. */
static int parse_fd(const char* opt, const char* s) {
  char* end;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (end == s || *end || errno || v < 0 || v > INT_MAX) die(2, "%s: expected a descriptor number, not '%s'", opt, s);
  return (int)v;
}

/* A descriptor passed for a file: said at once, before any run, if it is
 * not an open regular file (a pipe could not be read twice, nor mapped). */
static void check_fd(const char* opt, int fd) {
  struct stat st;
  if (fstat(fd, &st) != 0) die(2, "%s %d: %s", opt, fd, strerror(errno));
  if (!S_ISREG(st.st_mode)) die(2, "%s %d: not a regular file", opt, fd);
}

/* --cpus LIST: "0-3,6" into a CPU set; a CPU out of range or an empty
 * list is bad usage. */
static void parse_cpus(const char* s, cpu_set_t* set) {
  CPU_ZERO(set);
  const char* p = s;
  for (;;) {
    char* end;
    errno = 0;
    long lo = strtol(p, &end, 10), hi = lo;
    if (end == p || errno || lo < 0) break;
    p = end;
    if (*p == '-') {
      hi = strtol(++p, &end, 10);
      if (end == p || errno || hi < lo) break;
      p = end;
    }
    if (hi >= CPU_SETSIZE) break;
    for (long c = lo; c <= hi; c++) CPU_SET((int)c, set);
    if (*p == 0) return;
    if (*p++ != ',') break;
  }
  die(2, "--cpus: expected a list such as 0-3,6 (CPUs below %d), not '%s'", CPU_SETSIZE, s);
}

/* Where the kernel groups tasks by session (CONFIG_SCHED_AUTOGROUP, on
 * in Debian's kernels), a session's group weighs as much as any other
 * whatever its tasks' niceness: learnd starts each replay in a session of
 * its own, and one at nice 19 took half of a CPU from a program at nice 0
 * (2 busy loops on one CPU: 1.0 s each in 2 s). The group is niced too,
 * and only a group that is this replay's own (a session it leads), never
 * its caller's. The kernel lets an unprivileged caller change one group
 * per 100 ms on the whole machine (EAGAIN), so up to ten tries 100 ms
 * apart; a group already nicer stays as it is. The group's niceness, or
 * -1: no autogroup here, not this process's own, or refused. */
static int nice_own_group(int nice_to) {
  if (getsid(0) != getpid()) return -1;
  for (int tries = 0; tries < 10; tries++) {
    int fd = open("/proc/self/autogroup", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    char b[64];
    ssize_t n = read(fd, b, sizeof b - 1);
    close(fd);
    int now = 0;
    const char* at = n > 0 ? (b[n] = 0, strstr(b, " nice ")) : NULL;
    if (!at || sscanf(at, " nice %d", &now) != 1) return -1;
    if (now >= nice_to) return now;
    if ((fd = open("/proc/self/autogroup", O_WRONLY | O_CLOEXEC)) < 0) return -1;
    int len = snprintf(b, sizeof b, "%d", nice_to);
    ssize_t w = write(fd, b, (size_t)len);     /* the file takes no offset */
    int e = errno;
    close(fd);
    if (w == len) return nice_to;
    if (e != EAGAIN) return -1;
    struct timespec ts = {0, 100 * 1000 * 1000};
    nanosleep(&ts, NULL);
  }
  return -1;
}

int main(int argc, char** argv) {
  int run_fd = -1;
  int nice_to = -1;
  const char* cpus_arg = NULL;
  for (int i = 1; i < argc; i++) {
    const char* a = argv[i];
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) { usage(stdout); return 0; }
    else if (!strcmp(a, "--json")) json_out = true;
    else if (!strcmp(a, "--partial")) partial = true;
    else if (!strcmp(a, "--policy") && i + 1 < argc) policy_path = argv[++i];
    else if (!strcmp(a, "--touch") && i + 1 < argc) {
      const char* m = argv[++i];
      if (!strcmp(m, "pages")) touch_pages = true;
      else if (!strcmp(m, "none")) touch_pages = false;
      else die(2, "--touch: expected pages or none, not '%s'", m);
    } else if (!strcmp(a, "--pace") && i + 1 < argc) {
      const char* m = argv[++i];
      if (!strcmp(m, "idle")) pace_idle = true;
      else if (!strcmp(m, "none")) pace_idle = false;
      else die(2, "--pace: expected idle or none, not '%s'", m);
    } else if (!strcmp(a, "--gate") && i + 1 < argc) {
      gate_path = argv[++i];
    } else if (!strcmp(a, "--gate-fd") && i + 1 < argc) {
      gate_fd = parse_fd(a, gate_fd_arg = argv[++i]);
    } else if (!strcmp(a, "--policy-fd") && i + 1 < argc) {
      policy_fd = parse_fd(a, policy_fd_arg = argv[++i]);
    } else if (!strcmp(a, "--trace-fd") && i + 1 < argc) {
      trace_fd = parse_fd(a, trace_fd_arg = argv[++i]);
    } else if (!strcmp(a, "--repeat") && i + 1 < argc) {
      char* end;
      long v = strtol(argv[++i], &end, 10);
      if (*end || v < 1 || v > MAX_REPEAT) die(2, "--repeat: expected 1 to %d, not '%s'", MAX_REPEAT, argv[i]);
      repeat = (int)v;
    } else if (!strcmp(a, "--nice-group")) {
      nice_group = true;
    } else if (!strcmp(a, "--nice") && i + 1 < argc) {
      char* end;
      long v = strtol(argv[++i], &end, 10);
      if (*end || end == argv[i] || v < 0 || v > 19) die(2, "--nice: expected 0 to 19, not '%s'", argv[i]);
      nice_to = (int)v;
    } else if (!strcmp(a, "--cpus") && i + 1 < argc) {
      cpus_arg = argv[++i];
    } else if (!strcmp(a, "--stuck-after") && i + 1 < argc) {
      char* end;
      errno = 0;
      double v = strtod(argv[++i], &end);
      if (*end || end == argv[i] || errno || !(v >= 0.1 && v <= 86400))
        die(2, "--stuck-after: expected seconds from 0.1 to 86400, not '%s'", argv[i]);
      stuck_ns = (uint64_t)(v * 1e9);
      snprintf(stuck_arg, sizeof stuck_arg, "%.3f", v);
    } else if (!strcmp(a, "--run-fd") && i + 1 < argc) run_fd = atoi(argv[++i]);
    else if (a[0] == '-' && a[1]) die(2, "unknown option '%s' (see --help)", a);
    else if (!trace_path) trace_path = a;
    else die(2, "one trace at a time ('%s' and '%s')", trace_path, a);
  }
  /* learnd's errand, not the program's: the caller asks for a low
   * priority here, not in its own thread before the fork (a Python thread
   * niced to 19 that holds the GIL through a fork on busy CPUs stalled
   * learnd's loop for seconds). Set while this is the only thread; the runs
   * inherit both. */
  if (cpus_arg) {
    cpu_set_t set;
    parse_cpus(cpus_arg, &set);
    if (sched_setaffinity(0, sizeof set, &set) != 0) die(2, "--cpus %s: %s", cpus_arg, strerror(errno));
  }
  if (nice_to >= 0) {
    errno = 0;
    int now = getpriority(PRIO_PROCESS, 0);          /* never raised back: already nicer is nice enough */
    if ((errno != 0 || now < nice_to) && setpriority(PRIO_PROCESS, 0, nice_to) != 0)
      die(2, "--nice %d: %s", nice_to, strerror(errno));
    if (run_fd < 0 && nice_group) group_nice = nice_own_group(nice_to);
  }
  /* Dies with its parent (a run is set so by the replay before its exec,
   * which keeps it). The parent seen before the prctl is the one watched:
   * one gone in between was never watched, so the check. */
  if (run_fd < 0) {
    pid_t parent = getppid();
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent) return 1;
  }
  if (trace_path && trace_fd >= 0) die(2, "a TRACE path and --trace-fd %d: give one, not both", trace_fd);
  if (policy_path && policy_fd >= 0) die(2, "--policy and --policy-fd: give one, not both");
  if (gate_path && gate_fd >= 0) die(2, "--gate and --gate-fd: give one, not both");
  if (!trace_path && trace_fd < 0) die(2, "no trace given (see --help)");
  if (trace_fd >= 0) {
    check_fd("--trace-fd", trace_fd);
    snprintf(trace_label, sizeof trace_label, "descriptor %d", trace_fd);
    trace_path = trace_label;
  }
  if (policy_fd >= 0) {
    check_fd("--policy-fd", policy_fd);
    snprintf(policy_label, sizeof policy_label, "descriptor %d", policy_fd);
    policy_path = policy_label;
  }
  if (gate_fd >= 0) snprintf(gate_what, sizeof gate_what, "--gate-fd %d", gate_fd);
  else if (gate_path) snprintf(gate_what, sizeof gate_what, "--gate %s", gate_path);
  if (run_fd >= 0) return run_once(run_fd);
  if (gate_path || gate_fd >= 0) open_gate();   /* a bad gate is a usage error, said before any run */
  pid_t self = getpid();

  run_t* runs = map_zero((size_t)repeat * sizeof *runs);
  for (int k = 0; k < repeat; k++) {
    int pfd[2];
    if (pipe2(pfd, O_CLOEXEC) != 0) die(1, "pipe: %s", strerror(errno));
    pid_t pid = fork();
    if (pid < 0) die(1, "fork: %s", strerror(errno));
    if (pid == 0) {
      /* The run dies with the replay (the setting survives its exec). */
      if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != self) _exit(127);
      char fdbuf[16];
      snprintf(fdbuf, sizeof fdbuf, "%d", pfd[1]);
      fcntl(pfd[1], F_SETFD, 0);
      char* args[20];
      int n = 0;
      args[n++] = argv[0];
      args[n++] = "--run-fd";
      args[n++] = fdbuf;
      if (policy_fd >= 0) { args[n++] = "--policy-fd"; args[n++] = (char*)policy_fd_arg; }
      else if (policy_path) { args[n++] = "--policy"; args[n++] = (char*)policy_path; }
      if (partial) args[n++] = "--partial";
      if (!touch_pages) { args[n++] = "--touch"; args[n++] = "none"; }
      if (!pace_idle) { args[n++] = "--pace"; args[n++] = "none"; }
      if (stuck_arg[0]) { args[n++] = "--stuck-after"; args[n++] = stuck_arg; }
      if (gate_fd >= 0) { args[n++] = "--gate-fd"; args[n++] = (char*)gate_fd_arg; }
      else if (gate_path) { args[n++] = "--gate"; args[n++] = (char*)gate_path; }
      if (trace_fd >= 0) { args[n++] = "--trace-fd"; args[n++] = (char*)trace_fd_arg; }
      else args[n++] = (char*)trace_path;
      args[n] = NULL;
      /* A run is the policy it was given, nothing else: no HAKMEM_* from
       * the caller's environment (a knob there would change "default"; a
       * trace variable would capture the replay), and no telemetry, so
       * hakmem-learnd does not learn the replayer as a program. */
      extern char** environ;
      for (char** e = environ; e && *e;) {
        if (strncmp(*e, "HAKMEM_", 7) == 0) {
          char name[128];
          size_t len = strcspn(*e, "=");
          snprintf(name, sizeof name, "%.*s", (int)len, *e);
          unsetenv(name);
        } else {
          e++;
        }
      }
      setenv("HAKMEM_TELEMETRY", "0", 1);
      execv("/proc/self/exe", args);
      _exit(127);
    }
    close(pfd[1]);
    size_t got = 0;
    char* b = (char*)&runs[k];
    while (got < sizeof *runs) {
      ssize_t r = read(pfd[0], b + got, sizeof *runs - got);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) break;
      got += (size_t)r;
    }
    close(pfd[0]);
    int st;
    while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {}
    if (WIFEXITED(st) && WEXITSTATUS(st) != 0) return WEXITSTATUS(st);   /* it said why */
    if (!WIFEXITED(st)) die(1, "%s: run %d died of signal %d", trace_path, k + 1, WTERMSIG(st));
    if (got != sizeof *runs) die(1, "%s: run %d reported nothing", trace_path, k + 1);
  }
  if (json_out) print_json(runs, repeat);
  else print_text(runs, repeat);
  return 0;
}
