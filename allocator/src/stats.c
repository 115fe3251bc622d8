/* stats.c — collecting and printing the counters.
 *
 * Counters are kept where they are cheapest: blocks handed out per thread in
 * its own cache (plain stores, read here with relaxed loads), everything on
 * slow paths in the class's central counters (relaxed atomics). Gauges and
 * frees are derived here rather than counted on the fast path:
 *   blocks out of slabs = refill_blocks - drain_blocks - lost_blocks
 *   cached blocks       = sum of thread cache lengths
 *   live blocks         = blocks out of slabs - cached blocks
 *   frees               = allocs - live blocks
 *   hits                = allocs - refills
 *   local_frees         = frees - remote_frees
 * Slow-path time is kept in TSC ticks and converted with a rate measured
 * over the process's life (no clock call on the slow path).
 */
#define _GNU_SOURCE
#include "internal.h"
#include "trace.h"
#include "prim.h"

/* Written at every start: kept in .data, whose page the loader has already
 * made private, rather than in .bss after the class table (one page fault
 * fewer per process). */
static uint64_t tsc0 __attribute__((section(".data"))), ns0 __attribute__((section(".data")));

void _hk_stats_clock_start(void) {
  tsc0 = _hk_os_ticks();
  ns0 = _hk_os_now_ns();
}

static uint64_t ticks_to_ns(uint64_t t) {
  uint64_t dt = _hk_os_ticks() - tsc0, dn = _hk_os_now_ns() - ns0;
  if (dt == 0 || dn < 1000000) return t / 3;   /* ~3 GHz until measured */
  return (uint64_t)((double)t * (double)dn / (double)dt);
}

void _hk_stats_collect(hk_stats_t* out) {
  memset(out, 0, sizeof *out);
  out->struct_size = sizeof *out;
  out->num_classes = HK_NUM_CLASSES;
#define HK_X_COPY(name, desc) out->name = hk_load_relaxed(&_hk_proc.name);
  HK_PROC_COUNTERS(HK_X_COPY)
#undef HK_X_COPY
  out->policy_version = _hk_policy_current_version();   /* the live word itself */
  uint64_t tallocs[HK_NUM_CLASSES] = {0}, tcached[HK_NUM_CLASSES] = {0};
  _hk_registry_sum(tallocs, tcached);
  for (unsigned cls = 0; cls < HK_NUM_CLASSES; cls++) {
    hk_class_stats_t* s = &out->cls[cls];
    const hk_class_counters_t* c = &_hk_central[cls].c;
#define HK_X_COPY(name, desc) s->name = hk_load_relaxed(&c->name);
    HK_CLASS_COUNTERS(HK_X_COPY)
#undef HK_X_COPY
    s->size = cls ? _hk_class[cls].size : 0;
    s->slow_ns = ticks_to_ns(s->slow_ns);
    if (cls == 0) continue;   /* huge objects: counted directly in huge.c */
    s->allocs += tallocs[cls];
    uint64_t out_blocks = s->refill_blocks - s->drain_blocks - s->lost_blocks;
    uint64_t cached = tcached[cls] < out_blocks ? tcached[cls] : out_blocks;
    uint64_t live = out_blocks - cached;
    s->frees = s->allocs >= live ? s->allocs - live : 0;
    /* Each refill (and each cacheless allocation) serves one allocation
     * itself; every other allocation was a hit. */
    s->hits = s->allocs >= s->refills ? s->allocs - s->refills : 0;
    s->local_frees = s->frees >= s->remote_frees ? s->frees - s->remote_frees : 0;
    s->live_bytes = live * s->size;
    s->cached_bytes = cached * s->size;
  }
}

HK_EXPORT int hk_stats_get(hk_stats_t* out) {
  if (!out) return EINVAL;
  if (!_hk_initialized) _hk_init();
  _hk_stats_collect(out);
  return 0;
}

/* The stats struct is ~8 KiB: kept off small thread stacks, and not
 * allocated from ourselves while printing. */
static hk_stats_t print_buf HK_SPARSE_BSS;
static hk_lock_t print_lock;

HK_EXPORT void hk_stats_print(int fd) {
  _hk_lock(&print_lock);
  hk_stats_get(&print_buf);
  _hk_stats_print_snapshot(fd, &print_buf);
  _hk_unlock(&print_lock);
}

void _hk_stats_print_snapshot(int fd, const hk_stats_t* st) {
  char b[2048];   /* the telemetry and trace lines may each carry a 600-byte path */
  size_t n = _hk_fmt(b, sizeof b,
      "hakmem: stats (policy v%lu, %lu policies rejected)\n"
      "  os: mmap %lu  munmap %lu  madvise %lu  committed %lu KiB  threads %lu (ever %lu)\n"
      "  huge: %lu allocs (%lu from cache), %lu live bytes\n",
      st->policy_version, st->policies_rejected, st->mmap_calls, st->munmap_calls,
      st->madvise_calls, st->committed_bytes >> 10, st->threads, st->threads_total,
      st->huge_allocs, st->huge_cache_hits, st->cls[0].live_bytes);
  n += _hk_tel_describe(b + n, sizeof b - n, st->tel_failures);
  n += _hk_trace_describe(b + n, sizeof b - n);
  n += _hk_background_describe(b + n, sizeof b - n);
  _hk_os_write(fd, b, n);
  static const char* const names[] = {"class", "size", "allocs", "frees", "refills",
      "refill_blk", "drains", "drain_blk", "remote", "slab<warm", "slab<os", "slab>warm",
      "slab>os", "live_KiB", "cache_KiB", "slow_us"};
  static const int width[] = {5, 8, 12, 12, 10, 12, 10, 12, 10, 10, 9, 10, 9, 10, 10, 9};
  {
    char* p = b;
    *p++ = ' ';
    for (unsigned i = 0; i < sizeof names / sizeof names[0]; i++) {
      int k = (int)strlen(names[i]);
      for (int pad = width[i] - k; pad > 0; pad--) *p++ = ' ';
      memcpy(p, names[i], (size_t)k);
      p += k;
    }
    *p++ = '\n';
    _hk_os_write(fd, b, (size_t)(p - b));
  }
  for (unsigned c = 1; c < HK_NUM_CLASSES; c++) {
    const hk_class_stats_t* s = &st->cls[c];
    if (s->allocs == 0 && s->refills == 0) continue;
    char row[320];
    char* p = row;
    size_t left = sizeof row;
    uint64_t vals[] = {c, s->size, s->allocs, s->frees, s->refills, s->refill_blocks,
                       s->drains, s->drain_blocks, s->remote_frees, s->slabs_from_warm,
                       s->slabs_from_os, s->slabs_to_warm, s->slabs_to_os,
                       s->live_bytes >> 10, s->cached_bytes >> 10, s->slow_ns / 1000};
    *p++ = ' ';
    left--;
    for (unsigned i = 0; i < sizeof vals / sizeof vals[0]; i++) {
      char num[24];
      size_t k = _hk_fmt(num, sizeof num, "%lu", vals[i]);
      for (int pad = width[i] - (int)k; pad > 0 && left > 1; pad--) { *p++ = ' '; left--; }
      for (size_t j = 0; j < k && left > 1; j++) { *p++ = num[j]; left--; }
    }
    *p++ = '\n';
    _hk_os_write(fd, row, (size_t)(p - row));
  }
  _hk_options_print(fd);
}
