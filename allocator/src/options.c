/* options.c — the options table and the live policy.
 *
 * Start-up values come from HAKMEM_* environment variables, read once at
 * initialization (never on the fast path); they seed the live policy, which
 * is what hk_policy_set and the learner's snapshots (telemetry.c) change at
 * run time.
 *
 * SYNCHRONIZATION
 *  1. policy_lock guards `live`. The version word is published with release
 *     order after `live` is complete; a thread that sees a new version (on its
 *     slow path only) takes the lock to copy its caps, so it never reads a
 *     policy half-written.
 */
#define _GNU_SOURCE
#include <stdlib.h>

#include "internal.h"
#include "prim.h"

extern char** environ;

bool _hk_check_mode;
static bool opt_stats;

static hk_lock_t policy_lock;
static hk_policy_t live;
static _Atomic uint64_t live_version;

void _hk_policy_lock(void) { _hk_lock(&policy_lock); }
void _hk_policy_unlock(void) { _hk_unlock(&policy_lock); }
void _hk_policy_reinit_lock(void) { _hk_lock_reinit(&policy_lock); }

/* ---- the options table ---------------------------------------------------
 * name (env var), default, bounds, unit. Per-class knobs given here apply to
 * every class, clamped to that class's own bound. -1 = "per-class default". */
typedef struct hk_option_s {
  const char* env;
  long long   value;      /* after parsing */
  long long   min, max;
  const char* unit;
  const char* desc;
} hk_option_t;

enum { OPT_TCACHE_CAP, OPT_TCACHE_BATCH, OPT_WARM_SLABS, OPT_DRAIN_MS, OPT_STATS, OPT_CHECK,
       OPT_TELEMETRY, OPT_TELEMETRY_MS, OPT_COUNT };

static hk_option_t options[OPT_COUNT] = {
  [OPT_TCACHE_CAP]   = {"HAKMEM_TCACHE_CAP",   -1, 0, 4096,    "blocks", "thread-cache capacity, every class (default: by size)"},
  [OPT_TCACHE_BATCH] = {"HAKMEM_TCACHE_BATCH", -1, 1, 1024,    "blocks", "blocks per refill/drain, every class (default: cap/2)"},
  [OPT_WARM_SLABS]   = {"HAKMEM_WARM_SLABS",   -1, 0, 1024,    "slabs",  "empty slabs kept per class (default: 1 MiB worth)"},
  [OPT_DRAIN_MS]     = {"HAKMEM_DRAIN_MS",   1000, 0, 3600000, "ms",     "idle thread-cache drain interval, 0 = never"},
  [OPT_STATS]        = {"HAKMEM_STATS",         0, 0, 1,       "bool",   "print the per-class table at exit"},
  [OPT_CHECK]        = {"HAKMEM_CHECK",         0, 0, 1,       "bool",   "stricter checks: no thread cache, exact double-free detection, freed-block canaries"},
  [OPT_TELEMETRY]    = {"HAKMEM_TELEMETRY",     1, 0, 1,       "bool",   "publish counters to HAKMEM_SHM_DIR while a reader holds its lease"},
  [OPT_TELEMETRY_MS] = {"HAKMEM_TELEMETRY_MS", 100, 10, 60000, "ms",     "minimum interval between telemetry records"},
};

const char* _hk_env_get(const char* name) {
  if (!environ) return NULL;
  size_t n = strlen(name);
  for (char** e = environ; *e; e++)
    if (strncmp(*e, name, n) == 0 && (*e)[n] == '=') return *e + n + 1;
  return NULL;
}

/* Strict decimal parse: the whole string, no sign, no overflow. */
static bool parse_uint(const char* s, long long* out) {
  if (!s || !*s) return false;
  long long v = 0;
  for (; *s; s++) {
    if (*s < '0' || *s > '9') return false;
    if (v > (1LL << 50)) return false;
    v = v * 10 + (*s - '0');
  }
  *out = v;
  return true;
}

static bool env_missing;
bool _hk_options_env_missing(void) { return env_missing; }

static void options_read(void) {
  env_missing = environ == NULL;
  /* One pass over the environment (every process pays for it at start),
   * the first value of a name winning as with getenv. */
  const char* found[OPT_COUNT] = {0};
  for (char** e = environ; e && *e; e++) {
    if (strncmp(*e, "HAKMEM_", 7) != 0) continue;
    for (int i = 0; i < OPT_COUNT; i++) {
      size_t n = strlen(options[i].env);
      if (!found[i] && strncmp(*e, options[i].env, n) == 0 && (*e)[n] == '=') found[i] = *e + n + 1;
    }
  }
  for (int i = 0; i < OPT_COUNT; i++) {
    hk_option_t* o = &options[i];
    const char* s = found[i];
    if (!s) continue;
    long long v;
    if (!parse_uint(s, &v) || v < o->min || v > o->max) {
      char buf[160];
      _hk_fmt(buf, sizeof buf, "%s=%s is not a whole number in [%lu, %lu]; keeping the default",
              o->env, s, (uint64_t)o->min, (uint64_t)o->max);
      _hk_warn("bad option", buf);
      continue;
    }
    o->value = v;
  }
  _hk_check_mode = options[OPT_CHECK].value != 0;
  opt_stats = options[OPT_STATS].value != 0;
}

bool _hk_stats_at_exit(void) { return opt_stats; }
bool _hk_tel_enabled(void) { return options[OPT_TELEMETRY].value != 0; }
uint32_t _hk_tel_epoch_ms(void) { return (uint32_t)options[OPT_TELEMETRY_MS].value; }

/* ---- per-class bounds and defaults ---------------------------------------- */
static uint32_t clamp_u32(uint64_t v, uint32_t lo, uint32_t hi) {
  return v < lo ? lo : v > hi ? hi : (uint32_t)v;
}

static void bounds_of(unsigned cls, hk_policy_bounds_t* b) {
  uint64_t size = cls ? _hk_class[cls].size : 16;
  uint64_t slab = cls ? ((uint64_t)_hk_class[cls].slab_pages << HK_PAGE_SHIFT) : HK_PAGE_SIZE;
  b->cap_min = 0;
  b->cap_max = clamp_u32(((uint64_t)8 << 20) / size, 1, 4096);
  b->batch_min = 1;
  b->batch_max = 1024;
  b->warm_min = 0;
  b->warm_max = clamp_u32(((uint64_t)64 << 20) / slab, 1, 1024);
  b->drain_ms_min = 0;
  b->drain_ms_max = 3600000;
}

void _hk_policy_default(hk_policy_t* p) {
  memset(p, 0, sizeof *p);
  for (unsigned cls = 1; cls < HK_NUM_CLASSES; cls++) {
    hk_policy_bounds_t b;
    bounds_of(cls, &b);
    uint64_t size = _hk_class[cls].size;
    uint64_t slab = (uint64_t)_hk_class[cls].slab_pages << HK_PAGE_SHIFT;
    /* Small classes: up to 64 KiB cached per class; medium: up to 1 MiB (at
     * most 256 blocks), deep enough that churn of 8..32 KiB objects rarely
     * reaches the class lock. Classes a thread stops using drain after one
     * drain interval, so only classes in use keep memory parked. */
    uint32_t cap = size <= HK_SMALL_MAX ? clamp_u32((64u << 10) / size, 16, 1024)
                                        : clamp_u32((1024u << 10) / size, 1, 256);
    if (options[OPT_TCACHE_CAP].value >= 0)
      cap = clamp_u32((uint64_t)options[OPT_TCACHE_CAP].value, 0, b.cap_max);
    uint32_t batch = cap / 2 ? cap / 2 : 1;
    if (batch > 256) batch = 256;
    if (options[OPT_TCACHE_BATCH].value >= 0)
      batch = clamp_u32((uint64_t)options[OPT_TCACHE_BATCH].value, 1, cap ? cap : 1);
    /* 1 MiB of empty slabs per class; pools nobody draws from shrink by
     * half every drain interval (slab.c:_hk_warm_decay). */
    uint32_t warm = clamp_u32((1024u << 10) / slab, 1, b.warm_max);
    if (options[OPT_WARM_SLABS].value >= 0)
      warm = clamp_u32((uint64_t)options[OPT_WARM_SLABS].value, 0, b.warm_max);
    p->tcache_cap[cls] = cap;
    p->tcache_batch[cls] = batch;
    p->warm_slabs[cls] = warm;
  }
  p->drain_ms = (uint32_t)options[OPT_DRAIN_MS].value;
}

static bool policy_valid(const hk_policy_t* p) {
  if (p->drain_ms > 3600000) return false;
  for (unsigned cls = 1; cls < HK_NUM_CLASSES; cls++) {
    hk_policy_bounds_t b;
    bounds_of(cls, &b);
    uint32_t cap = p->tcache_cap[cls], batch = p->tcache_batch[cls], warm = p->warm_slabs[cls];
    if (cap < b.cap_min || cap > b.cap_max) return false;
    if (batch < b.batch_min || batch > b.batch_max || batch > (cap ? cap : 1)) return false;
    if (warm < b.warm_min || warm > b.warm_max) return false;
  }
  return true;
}

static void install(const hk_policy_t* p) {
  live = *p;
  for (unsigned cls = 0; cls < HK_NUM_CLASSES; cls++)
    hk_store_relaxed(&_hk_warm_limit[cls], cls ? p->warm_slabs[cls] : 0);
  uint64_t v = hk_load_relaxed(&live_version) + 1;
  live.version = v;
  hk_store_release(&live_version, v);
  _hk_tel_write_in_force(&live);
}

/* Writes the policy in force into a telemetry file just created. */
void _hk_policy_publish_in_force(void) {
  _hk_lock(&policy_lock);
  _hk_tel_write_in_force(&live);
  _hk_unlock(&policy_lock);
}

void _hk_options_init(void) {
  options_read();
  hk_policy_t p;
  _hk_policy_default(&p);
  _hk_lock(&policy_lock);
  install(&p);
  _hk_unlock(&policy_lock);
}

uint64_t _hk_policy_current_version(void) { return hk_load_acquire(&live_version); }

uint32_t _hk_drain_ms(void) { return live.drain_ms; }

void _hk_tcache_apply_policy(hk_tcache_t* tc) {
  _hk_lock(&policy_lock);
  for (unsigned cls = 1; cls < HK_NUM_CLASSES; cls++) {
    tc->bin[cls].cap = _hk_check_mode ? 0 : live.tcache_cap[cls];
    tc->bin[cls].batch = live.tcache_batch[cls];
  }
  tc->policy_version = live.version;
  _hk_unlock(&policy_lock);
  /* A lowered capacity takes effect now, not at the next overflow. */
  for (unsigned cls = 1; cls < HK_NUM_CLASSES; cls++)
    if (tc->bin[cls].count > tc->bin[cls].cap)
      _hk_drain(tc, cls, tc->bin[cls].count - tc->bin[cls].cap);
}

/* ---- public ------------------------------------------------------------------ */
HK_EXPORT void hk_policy_get(hk_policy_t* out) {
  if (!out) return;
  if (!_hk_initialized) _hk_init();
  _hk_lock(&policy_lock);
  *out = live;
  _hk_unlock(&policy_lock);
}

HK_EXPORT void hk_policy_bounds(unsigned cls, hk_policy_bounds_t* out) {
  if (!out) return;
  if (!_hk_initialized) _hk_init();
  bounds_of(cls < HK_NUM_CLASSES ? cls : HK_NUM_CLASSES - 1, out);
}

HK_EXPORT uint64_t hk_policy_set(const hk_policy_t* p) {
  if (!_hk_initialized) _hk_init();
  if (!p || !policy_valid(p)) {
    hk_add_relaxed(&_hk_proc.policies_rejected, 1);
    return 0;
  }
  _hk_lock(&policy_lock);
  install(p);
  uint64_t v = live.version;
  _hk_unlock(&policy_lock);
  return v;
}

HK_EXPORT uint64_t hk_policy_version(void) {
  if (!_hk_initialized) _hk_init();
  return hk_load_acquire(&live_version);
}

/* Lists every option and its value (malloc_stats / HAKMEM_STATS). */
void _hk_options_print(int fd) {
  char buf[256];
  for (int i = 0; i < OPT_COUNT; i++) {
    const hk_option_t* o = &options[i];
    size_t n;
    if (o->value < 0)
      n = _hk_fmt(buf, sizeof buf, "  %s=default  (%s; %s)\n", o->env, o->unit, o->desc);
    else
      n = _hk_fmt(buf, sizeof buf, "  %s=%lu  (%s; %s)\n", o->env, (uint64_t)o->value, o->unit, o->desc);
    _hk_os_write(fd, buf, n);
  }
}
