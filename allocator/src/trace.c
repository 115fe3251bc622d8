/* trace.c — allocation capture: events into per-thread buffers, buffers into
 * TraceChunks (proto/trace.proto, packed by protobuf-c into a buffer of
 * ours: packing never allocates), chunks appended to one file.
 *
 * MODES
 *   FULL     HAKMEM_TRACE=PATH from start ("%p" in PATH becomes the pid, so
 *            children that exec with the same environment write files of
 *            their own; without it a second process finds PATH taken and
 *            captures nothing). HAKMEM_TRACE_MAX_BYTES bounds the file.
 *   SAMPLED  and HAKMEM_TRACE_SAMPLE=BYTES: the check-in countdown (alloc.c)
 *            draws with a mean of BYTES and the allocation it stops at is
 *            picked; a picked object's realloc and free are recorded and no
 *            other call is. Picked addresses live in a bounded open-address
 *            set (SET_SLOTS); a pick that finds no room is not taken.
 *   LIVE     a request through the telemetry file (telemetry.c): the file is
 *            made by us in the telemetry directory, never at a path someone
 *            else names, and bounded in seconds and bytes.
 *
 * NEVER IN THE PROGRAM'S WAY: buffers and the packing area are mapped from
 * the OS (prim.c); a chunk that cannot be written (disk full, RLIMIT_FSIZE
 * as it is at that chunk: the program may lower it) is dropped and counted,
 * the file cut back so no half chunk stays; a path that exists already (a
 * file, a link) is not opened, nor is a file made where RLIMIT_FSIZE leaves
 * no room for its header: capture stays off and the reason is printed by
 * HAKMEM_STATS. A forked child stops capturing (it would share the parent's
 * file offset); its own exec starts afresh.
 *
 * LOCKS: a buffer's lock is taken by its thread for each event and by the
 * thread that ends a capture to flush it; w.lock (the file) is taken under a
 * buffer lock, never the other way round.
 */
#define _GNU_SOURCE
#include "trace.h"

#include "prim.h"
#include "shm_layout.h"
#include "trace.pb-c.h"

#define CHUNK_EVENTS 2048u
#define SET_SLOTS    (1u << 16)   /* sampled objects live at once, at most ~3/4 of it */
#define SET_PROBES   64u
#define PACK_CAP     (CHUNK_EVENTS * 48u + 4096u)  /* worst case of one chunk, framed */
#define HEADER_CAP   4096u   /* a header chunk's size, at most */

static const char magic[8] = {'H', 'K', 'T', 'R', 'A', 'C', 'E', '1'};

bool _hk_trace_on;
uint32_t _hk_trace_sample_bytes;
__thread hk_trace_tls_t _hk_trace_tls __attribute__((tls_model("initial-exec")));

typedef struct hk_tbuf_s {
  hk_lock_t lock;
  uint32_t n;          /* events held */
  uint32_t thread;     /* the thread's number in capture `gen`; 0: none yet */
  uint32_t in_use;     /* owned by a live thread */
  uint32_t _pad;
  uint64_t gen;        /* the capture its events belong to */
  struct hk_tbuf_s* next;
  Hakmem__Trace__V1__Op op[CHUNK_EVENTS];
  uint32_t align[CHUNK_EVENTS];
  uint64_t size[CHUNK_EVENTS];
  uint64_t addr[CHUNK_EVENTS];
  uint64_t old[CHUNK_EVENTS];
  uint64_t t[CHUNK_EVENTS];    /* ns since capture start; deltas when packed */
} hk_tbuf_t;

enum { CAP_OFF = 0, CAP_RUNNING, CAP_DONE };
enum { WHY_OFF = 0, WHY_ON, WHY_EXISTS, WHY_OPEN, WHY_WRITE, WHY_TOO_LONG, WHY_NOMEM, WHY_FSIZE };

static struct {
  hk_lock_t lock;              /* the file and everything below it */
  hk_lock_t list_lock;         /* bufs */
  hk_tbuf_t* bufs;
  int state;                   /* CAP_* */
  int fd;
  unsigned mode;               /* proto Mode */
  unsigned why;                /* WHY_*: for the stats line */
  int err;
  uint64_t gen;
  uint64_t start_ns;
  uint64_t start_wall_ns;
  uint64_t limit_ns;           /* 0: none */
  uint64_t limit_bytes;        /* 0: none */
  uint32_t limit_seconds;
  uint64_t fsize_limit;        /* WHY_FSIZE: RLIMIT_FSIZE as it was */
  uint64_t off;                /* bytes in the file */
  uint64_t seq;                /* next chunk number */
  _Atomic uint32_t threads;
  _Atomic uint64_t events;     /* written */
  _Atomic uint64_t dropped;    /* lost: their chunk could not be written */
  _Atomic uint64_t late;       /* after the thread's THREAD_EXIT (other TLS destructors) */
  _Atomic uint64_t sample_full;/* picks not taken: the set was full */
  _Atomic int stop;            /* the bound was reached: end at the next chance */
  const char* end_reason;
  uint32_t live_state;         /* telemetry header: 0 none, 1 recording, 2 done */
  uint8_t* pack;
  _Atomic uint64_t* set;
  char path[600];
} w HK_SPARSE_BSS;

/* ---- the sampled set: addresses, 0 empty, 1 removed ------------------------------- */
static uint32_t set_hash(uint64_t a) { return (uint32_t)((a >> 4) * 0x9e3779b97f4a7c15ull >> 40) & (SET_SLOTS - 1); }

static bool set_insert(uint64_t a) {
  uint32_t h = set_hash(a);
  for (uint32_t i = 0; i < SET_PROBES; i++) {
    _Atomic uint64_t* s = &w.set[(h + i) & (SET_SLOTS - 1)];
    uint64_t v = hk_load_relaxed(s);
    if ((v == 0 || v == 1) &&
        atomic_compare_exchange_strong_explicit(s, &v, a, memory_order_relaxed, memory_order_relaxed))
      return true;
  }
  hk_add_relaxed(&w.sample_full, 1);
  return false;
}

/* A correct program never frees an address while another thread makes it,
 * so the one slot holding a is ours to clear. */
static bool set_remove(uint64_t a) {
  uint32_t h = set_hash(a);
  for (uint32_t i = 0; i < SET_PROBES; i++) {
    _Atomic uint64_t* s = &w.set[(h + i) & (SET_SLOTS - 1)];
    uint64_t v = hk_load_relaxed(s);
    if (v == a) { hk_store_relaxed(s, 1); return true; }
    if (v == 0) return false;
  }
  return false;
}

/* ---- writing -------------------------------------------------------------------- */
static size_t put_varint(uint8_t* p, uint64_t v) {
  size_t n = 0;
  while (v >= 0x80) { p[n++] = (uint8_t)(v | 0x80); v >>= 7; }
  p[n++] = (uint8_t)v;
  return n;
}

/* Packs and appends one chunk (w.lock held); false: not written. `last`
 * (the footer) may go past limit_bytes. */
static bool write_chunk(Hakmem__Trace__V1__TraceChunk* c, bool last) {
  size_t len = hakmem__trace__v1__trace_chunk__get_packed_size(c);
  if (len + 10 > PACK_CAP) return false;
  uint8_t pre[10];
  size_t k = put_varint(pre, len);
  uint8_t* out = w.pack + 10 - k;
  memcpy(out, pre, k);
  hakmem__trace__v1__trace_chunk__pack(c, w.pack + 10);
  size_t total = k + len;
  if (!last && w.limit_bytes && w.off + total > w.limit_bytes) {
    if (!w.end_reason) w.end_reason = "limit_bytes";
    hk_store_relaxed(&w.stop, 1);
    return false;
  }
  int err = _hk_os_append(w.fd, out, total, w.off);   /* EFBIG past RLIMIT_FSIZE: dropped */
  if (err) {
    if (err == EIO) {   /* could not cut back: nothing more can be framed */
      w.why = WHY_WRITE;
      w.err = err;
      w.end_reason = "error: write";
      hk_store_relaxed(&w.stop, 1);
    }
    return false;
  }
  w.off += total;
  w.seq++;
  return true;
}

/* A buffer's events as one chunk (its lock and w.lock held), then empty. */
static void flush_buf(hk_tbuf_t* b) {
  uint32_t n = b->n;
  if (n == 0) return;
  b->n = 0;
  if (w.state != CAP_RUNNING || b->gen != w.gen) return;
  uint64_t prev = 0;
  for (uint32_t i = 0; i < n; i++) {   /* event 0 from the start, then deltas */
    uint64_t t = b->t[i];
    b->t[i] = t >= prev ? t - prev : 0;
    prev = t;
  }
  Hakmem__Trace__V1__TraceChunk c = HAKMEM__TRACE__V1__TRACE_CHUNK__INIT;
  c.thread = b->thread;
  c.seq = w.seq;
  c.n_op = c.n_size = c.n_align = c.n_addr = c.n_old_addr = c.n_dt_ns = n;
  c.op = b->op;
  c.size = b->size;
  c.align = b->align;
  c.addr = b->addr;
  c.old_addr = b->old;
  c.dt_ns = b->t;
  if (write_chunk(&c, false)) hk_add_relaxed(&w.events, n);
  else if (!w.end_reason || w.end_reason[0] == 'e') hk_add_relaxed(&w.dropped, n);
}

static void write_header(void) {   /* w.lock held */
  static char exe[256], build_id[48], argv0[256];
  static uint32_t class_size[HK_NUM_CLASSES];
  _hk_os_exe_path(exe, sizeof exe);
  _hk_os_build_id(build_id, sizeof build_id);
  size_t a = _hk_os_read_small("/proc/self/cmdline", argv0, sizeof argv0 - 1);
  argv0[a] = 0;   /* the first argument ends at its NUL */
  for (unsigned c = 1; c < HK_NUM_CLASSES; c++) class_size[c] = _hk_class[c].size;
  Hakmem__Trace__V1__Header h = HAKMEM__TRACE__V1__HEADER__INIT;
  h.format = 1;
  h.layout_version = HK_SHM_LAYOUT_VERSION;
  h.hakmem_version = (char*)HK_VERSION_STRING;
  h.exe = exe;
  h.build_id = build_id;
  h.argv0 = argv0;
  h.pid = _hk_os_pid();
  h.start_unix = (double)w.start_wall_ns / 1e9;
  h.mode = (Hakmem__Trace__V1__Mode)w.mode;
  h.sample_bytes = _hk_trace_sample_bytes;
  h.limit_seconds = w.limit_seconds;
  h.limit_bytes = w.limit_bytes;
  h.n_class_size = HK_NUM_CLASSES;
  h.class_size = class_size;
  Hakmem__Trace__V1__TraceChunk c = HAKMEM__TRACE__V1__TRACE_CHUNK__INIT;
  c.header = &h;
  c.seq = 0;
  write_chunk(&c, true);   /* lost, the file says nothing: readers refuse it */
}

static bool map_areas(void) {
  void* p;
  if (!w.pack) {
    if (_hk_os_map_aligned(PACK_CAP, HK_OS_PAGE, false, &p) != 0) return false;
    w.pack = p;
  }
  if (_hk_trace_sample_bytes && !w.set) {
    if (_hk_os_map_aligned(SET_SLOTS * sizeof(uint64_t), HK_OS_PAGE, false, &p) != 0) return false;
    w.set = p;
  }
  return true;
}

/* Starts a capture into fd (w.lock held). */
static void begin(int fd, unsigned mode) {
  w.fd = fd;
  w.mode = mode;
  w.gen++;
  w.off = 0;
  w.seq = 0;
  hk_store_relaxed(&w.threads, 0);
  hk_store_relaxed(&w.events, 0);
  hk_store_relaxed(&w.dropped, 0);
  hk_store_relaxed(&w.stop, 0);
  w.end_reason = NULL;
  w.start_ns = _hk_os_now_ns();
  w.start_wall_ns = _hk_os_wall_ns();
  w.limit_ns = w.limit_seconds ? w.start_ns + (uint64_t)w.limit_seconds * 1000000000ull : 0;
  int err = _hk_os_append(fd, magic, sizeof magic, 0);
  if (err) {
    w.why = err == EFBIG ? WHY_FSIZE : WHY_WRITE;
    _hk_os_close(fd);
    w.fd = -1;
    return;
  }
  w.off = sizeof magic;
  w.state = CAP_RUNNING;
  w.why = WHY_ON;
  write_header();
  __atomic_store_n(&_hk_trace_on, true, __ATOMIC_RELEASE);
}

/* A buffer's event arrays, flushed, go back to the OS (the header page,
 * with the lock and the list link, stays): a capture ends with up to 80 KiB
 * written per thread that took part, and a 32-thread program (bench-learn's
 * idle-threads) kept 2.5 MiB more resident after learnd's screening capture
 * than without one, which learnd then priced against every policy it
 * tried. The next capture faults back what it writes. b->lock held. */
static void decommit_events(hk_tbuf_t* b) {
  uintptr_t from = ((uintptr_t)&b->op[0] + HK_OS_PAGE - 1) & ~(uintptr_t)(HK_OS_PAGE - 1);
  uintptr_t end = ((uintptr_t)b + sizeof(hk_tbuf_t) + HK_OS_PAGE - 1) & ~(uintptr_t)(HK_OS_PAGE - 1);
  if (end > from) _hk_os_decommit((void*)from, end - from);
}

/* Ends the capture: every buffer's events, then the footer. */
static void finish(const char* reason) {
  _hk_lock(&w.lock);
  if (w.state != CAP_RUNNING) { _hk_unlock(&w.lock); return; }
  __atomic_store_n(&_hk_trace_on, false, __ATOMIC_RELEASE);
  _hk_unlock(&w.lock);
  _hk_lock(&w.list_lock);
  for (hk_tbuf_t* b = w.bufs; b; b = b->next) {
    _hk_lock(&b->lock);
    _hk_lock(&w.lock);
    flush_buf(b);
    _hk_unlock(&w.lock);
    decommit_events(b);
    _hk_unlock(&b->lock);
  }
  _hk_unlock(&w.list_lock);
  _hk_lock(&w.lock);
  if (w.state == CAP_RUNNING) {
    if (!w.end_reason) w.end_reason = reason;
    Hakmem__Trace__V1__Footer f = HAKMEM__TRACE__V1__FOOTER__INIT;
    f.events = hk_load_relaxed(&w.events);
    f.dropped = hk_load_relaxed(&w.dropped);
    f.chunks = w.seq;
    f.threads = hk_load_relaxed(&w.threads);
    f.duration_ns = _hk_os_now_ns() - w.start_ns;
    f.end_reason = (char*)w.end_reason;
    Hakmem__Trace__V1__TraceChunk c = HAKMEM__TRACE__V1__TRACE_CHUNK__INIT;
    c.footer = &f;
    c.seq = w.seq;
    write_chunk(&c, true);
    _hk_os_close(w.fd);
    w.fd = -1;
    w.state = CAP_DONE;
    if (w.mode == HAKMEM__TRACE__V1__MODE__LIVE) w.live_state = 2;
  }
  _hk_unlock(&w.lock);
}

static void maybe_stop(void) {
  if (HK_UNLIKELY(hk_load_relaxed(&w.stop))) finish(w.end_reason ? w.end_reason : "stopped");
}

/* ---- recording ------------------------------------------------------------------ */
static hk_tbuf_t* buf_get(void) {
  hk_trace_tls_t* t = &_hk_trace_tls;
  if (t->buf) return t->buf;
  _hk_lock(&w.list_lock);
  hk_tbuf_t* b = w.bufs;
  while (b && b->in_use) b = b->next;
  if (!b) {
    void* p;
    size_t len = (sizeof(hk_tbuf_t) + HK_OS_PAGE - 1) & ~(size_t)(HK_OS_PAGE - 1);
    if (_hk_os_map_aligned(len, HK_OS_PAGE, false, &p) == 0) {
      b = p;
      b->next = w.bufs;
      w.bufs = b;
    }
  }
  if (b) {
    b->in_use = 1;
    _hk_lock(&b->lock);
    b->thread = 0;   /* a new thread gets a number of its own */
    _hk_unlock(&b->lock);
  }
  _hk_unlock(&w.list_lock);
  t->buf = b;
  return b;
}

static void record(unsigned op, uint64_t size, uint32_t align, uint64_t addr, uint64_t old) {
  hk_trace_tls_t* t = &_hk_trace_tls;
  if (t->dead) { hk_add_relaxed(&w.late, 1); return; }
  hk_tbuf_t* b = buf_get();
  if (!b) { hk_add_relaxed(&w.dropped, 1); return; }
  _hk_lock(&b->lock);
  /* finish() clears _hk_trace_on before it flushes: nothing lands after. */
  if (w.state == CAP_RUNNING && __atomic_load_n(&_hk_trace_on, __ATOMIC_ACQUIRE)) {
    uint64_t now = _hk_os_now_ns();
    if (b->gen != w.gen) { b->gen = w.gen; b->n = 0; b->thread = 0; }
    if (b->thread == 0) b->thread = hk_add_relaxed(&w.threads, 1) + 1;
    uint32_t i = b->n++;
    b->op[i] = (Hakmem__Trace__V1__Op)op;
    b->size[i] = size;
    b->align[i] = align;
    b->addr[i] = addr;
    b->old[i] = old;
    b->t[i] = now - w.start_ns;
    if (b->n == CHUNK_EVENTS) {
      _hk_lock(&w.lock);
      flush_buf(b);
      _hk_unlock(&w.lock);
    }
    if (w.limit_ns && now >= w.limit_ns && !hk_load_relaxed(&w.stop)) {
      w.end_reason = "limit_seconds";
      hk_store_relaxed(&w.stop, 1);
    }
  }
  _hk_unlock(&b->lock);
  maybe_stop();
}

void _hk_trace_alloc(unsigned op, size_t n, size_t align, void* p) {
  hk_trace_tls_t* t = &_hk_trace_tls;
  bool picked = t->picked;
  t->picked = 0;
  if (t->quiet) return;
  if (_hk_trace_sample_bytes) {
    /* Huge blocks (a mapping each) are rare and each past any sane mean. */
    if (!p || !(picked || n > HK_MAX_CLASS_SIZE) || !set_insert((uint64_t)p)) return;
  }
  record(op, n, (uint32_t)align, (uint64_t)p, 0);
}

void _hk_trace_free(void* p) {
  if (_hk_trace_tls.quiet) return;
  if (_hk_trace_sample_bytes && !set_remove((uint64_t)p)) return;
  record(HK_OP_FREE, 0, 0, (uint64_t)p, 0);
}

bool _hk_trace_realloc_wanted(void* old) {
  return !_hk_trace_sample_bytes || set_remove((uint64_t)old);
}

void _hk_trace_realloc(void* old, void* p, size_t n) {
  if (_hk_trace_sample_bytes) set_insert((uint64_t)p);
  record(HK_OP_REALLOC, n, 0, (uint64_t)p, (uint64_t)old);
}

/* ---- thread exit, fork, process exit ----------------------------------------------- */
void _hk_trace_thread_exit(hk_tcache_t* tc) {
  hk_trace_tls_t* t = &_hk_trace_tls;
  if (t->trapped) {   /* thread.c zeroes the bins next; give them back whole first */
    for (unsigned cls = 1; cls < HK_NUM_CLASSES; cls++) {
      hk_bin_t* bin = &tc->bin[cls];
      bin->limit = _hk_div[cls].limit;
      if (t->trapped == HK_TRAP_ALL) {
        bin->left = t->left[cls];
        if (bin->left > 0) tc->cold[cls].mark += (uint64_t)bin->left;
      }
    }
    t->trapped = HK_TRAP_NONE;
  }
  hk_tbuf_t* b = t->buf;
  if (!b) { t->dead = 1; return; }
  _hk_lock(&b->lock);
  if (w.state == CAP_RUNNING && b->gen == w.gen && b->thread != 0) {
    uint32_t i = b->n++;
    b->op[i] = HAKMEM__TRACE__V1__OP__THREAD_EXIT;
    b->size[i] = b->addr[i] = b->old[i] = 0;
    b->align[i] = 0;
    b->t[i] = _hk_os_now_ns() - w.start_ns;
  }
  _hk_lock(&w.lock);
  flush_buf(b);
  _hk_unlock(&w.lock);
  b->in_use = 0;
  _hk_unlock(&b->lock);
  t->buf = NULL;
  t->dead = 1;
}

void _hk_trace_lock_all(void) {
  _hk_lock(&w.list_lock);
  for (hk_tbuf_t* b = w.bufs; b; b = b->next) _hk_lock(&b->lock);
  _hk_lock(&w.lock);
}

void _hk_trace_unlock_all(void) {
  _hk_unlock(&w.lock);
  for (hk_tbuf_t* b = w.bufs; b; b = b->next) _hk_unlock(&b->lock);
  _hk_unlock(&w.list_lock);
}

void _hk_trace_after_fork_child(void) {
  /* The parent's events and file stay the parent's. */
  for (hk_tbuf_t* b = w.bufs; b; b = b->next) {
    b->n = 0;
    b->in_use = 0;
    _hk_lock_reinit(&b->lock);
  }
  _hk_trace_tls.buf = NULL;
  _hk_lock_reinit(&w.lock);
  _hk_lock_reinit(&w.list_lock);
  if (w.state == CAP_RUNNING) {
    _hk_os_close(w.fd);
    w.fd = -1;
    w.state = CAP_OFF;
    w.why = WHY_OFF;
  }
  __atomic_store_n(&_hk_trace_on, false, __ATOMIC_RELEASE);
  _hk_trace_sample_bytes = 0;
}

void _hk_trace_exit(void) { finish("exit"); }

/* Whether RLIMIT_FSIZE leaves room for the magic and a header: a file that
 * cannot hold them would be no trace, and writing past the limit raises
 * SIGXFSZ, so none is made. */
static bool room_for_header(void) {
  w.fsize_limit = _hk_os_fsize_limit();
  return w.fsize_limit >= sizeof magic + HEADER_CAP;
}

/* ---- start ---------------------------------------------------------------------- */
static uint64_t env_u64(const char* name) {
  const char* s = _hk_env_get(name);
  uint64_t v = 0;
  if (!s) return 0;
  for (; *s >= '0' && *s <= '9'; s++) v = v * 10 + (uint64_t)(*s - '0');
  return v;
}

void _hk_trace_start(void) {
  static bool tried;   /* from _hk_init, or the constructor when that was too early */
  if (tried) return;
  tried = true;
  const char* path = _hk_env_get("HAKMEM_TRACE");
  if (!path || !*path) return;
  /* "%p" -> pid */
  size_t o = 0;
  bool per_pid = false;
  for (const char* s = path; *s; s++) {
    if (o + 24 >= sizeof w.path) { w.why = WHY_TOO_LONG; return; }
    if (s[0] == '%' && s[1] == 'p') {
      per_pid = true;
      o += _hk_fmt(w.path + o, sizeof w.path - o, "%lu", (uint64_t)_hk_os_pid());
      s++;
    } else {
      w.path[o++] = *s;
    }
  }
  w.path[o] = 0;
  if (!room_for_header()) {
    w.why = WHY_FSIZE;
    _hk_warn("trace off", "RLIMIT_FSIZE leaves no room for HAKMEM_TRACE's header");
    return;
  }
  uint64_t sample = env_u64("HAKMEM_TRACE_SAMPLE");
  if (sample > (1u << 30)) sample = 1u << 30;
  _hk_trace_sample_bytes = (uint32_t)sample;
  w.limit_bytes = env_u64("HAKMEM_TRACE_MAX_BYTES");
  if (!map_areas()) { w.why = WHY_NOMEM; _hk_trace_sample_bytes = 0; return; }
  int fd;
  int err = _hk_os_create_path(w.path, &fd);
  /* After an exec the new image has the old one's pid, and finds its file
   * (left without a footer: exec runs no destructor): PATH.1, PATH.2, ...,
   * each made the same way, so nothing there is ever opened. */
  for (unsigned k = 1; err == EEXIST && per_pid && k < 16; k++) {
    if (k == 1) o = strlen(w.path);
    _hk_fmt(w.path + o, sizeof w.path - o, ".%u", k);
    err = _hk_os_create_path(w.path, &fd);
  }
  if (err) {
    w.why = err == EEXIST ? WHY_EXISTS : WHY_OPEN;
    w.err = err;
    _hk_trace_sample_bytes = 0;
    _hk_warn("trace off", err == EEXIST ? "HAKMEM_TRACE names a file or link that exists"
                                        : "HAKMEM_TRACE cannot be created");
    return;
  }
  _hk_lock(&w.lock);
  begin(fd, sample ? HAKMEM__TRACE__V1__MODE__SAMPLED : HAKMEM__TRACE__V1__MODE__FULL);
  _hk_unlock(&w.lock);
}

int _hk_trace_live_start(int dfd, const char* name, uint32_t seconds, uint64_t max_bytes) {
  _hk_lock(&w.lock);
  if (w.state == CAP_RUNNING) { _hk_unlock(&w.lock); return EBUSY; }
  _hk_trace_sample_bytes = 0;
  if (!room_for_header()) { _hk_unlock(&w.lock); return EFBIG; }
  if (!map_areas()) { _hk_unlock(&w.lock); return ENOMEM; }
  int fd;
  int err = _hk_os_create_wo_at(dfd, name, &fd);
  if (err) { _hk_unlock(&w.lock); return err; }
  _hk_fmt(w.path, sizeof w.path, "%s", name);
  w.limit_seconds = seconds;
  w.limit_bytes = max_bytes;
  begin(fd, HAKMEM__TRACE__V1__MODE__LIVE);
  w.live_state = w.state == CAP_RUNNING ? 1 : 2;
  _hk_unlock(&w.lock);
  return w.state == CAP_RUNNING ? 0 : EIO;
}

uint32_t _hk_trace_live_state(void) { return w.live_state; }

void _hk_trace_poll(uint64_t now_ns) {
  if (w.state != CAP_RUNNING) return;
  if (w.limit_ns && _hk_os_now_ns() >= w.limit_ns && !hk_load_relaxed(&w.stop)) {
    w.end_reason = "limit_seconds";
    hk_store_relaxed(&w.stop, 1);
  }
  maybe_stop();
}

size_t _hk_trace_describe(char* buf, size_t cap) {
  uint64_t ev = hk_load_relaxed(&w.events), dr = hk_load_relaxed(&w.dropped);
  uint64_t late = hk_load_relaxed(&w.late), full = hk_load_relaxed(&w.sample_full);
  static const char* const modes[] = {"?", "full", "sampled", "live"};
  switch (w.why) {
    case WHY_OFF: return 0;
    case WHY_EXISTS:
      return _hk_fmt(buf, cap, "  trace: off: %s exists (a file or link is never followed)\n", w.path);
    case WHY_OPEN:
      return _hk_fmt(buf, cap, "  trace: off: cannot create %s (errno %u)\n", w.path, (unsigned)w.err);
    case WHY_TOO_LONG: return _hk_fmt(buf, cap, "  trace: off: HAKMEM_TRACE is too long\n");
    case WHY_NOMEM: return _hk_fmt(buf, cap, "  trace: off: no memory for buffers\n");
    case WHY_FSIZE:
      return _hk_fmt(buf, cap, "  trace: off: RLIMIT_FSIZE (%lu bytes) leaves no room for %s's header\n",
                     w.fsize_limit, w.path);
    default:
      return _hk_fmt(buf, cap, "  trace: %s%s, %s: %lu events, %lu chunks, %lu dropped, %lu late,"
                     " %lu picks not taken\n", modes[w.mode & 3],
                     w.state == CAP_RUNNING ? "" : " (ended)", w.path, ev, w.seq, dr, late, full);
  }
}
