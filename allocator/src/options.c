/* options.c — the options table and the live policy.
 *
 * Start-up values come from HAKMEM_* environment variables, read once at
 * initialization (never on the fast path; never under secure execution, see
 * _hk_env_get); they seed the live policy, which
 * is what hk_policy_set and the learner's snapshots (telemetry.c) change at
 * run time. The knobs, their bounds and defaults are generated from
 * schemas/shm_layout.json (hakmem_knobs.h: the lists; knobs.h: the rules);
 * this file applies them knob by knob, so a new knob needs no line here.
 *
 * DEPENDENCIES: options.c knows nothing of telemetry. telemetry.c depends on
 * this file (it reads the options, installs snapshots with hk_policy_set and
 * mirrors the policy in force): it registers an observer with
 * _hk_policy_observe, which install() calls under policy_lock.
 *
 * SYNCHRONIZATION
 *  1. policy_lock guards `live` and the observer. The version word is
 *     published with release order after `live` is complete; a thread that
 *     sees a new version (on its slow path only) takes the lock to copy its
 *     caps, so it never reads a policy half-written.
 *  2. The observer runs under policy_lock for each policy installed, in
 *     order, so what it mirrors is never older than the policy in force.
 */
#define _GNU_SOURCE
#include <stdlib.h>

#include "internal.h"
#include "knobs.h"
#include "prim.h"

extern char** environ;

bool _hk_check_mode;
static bool opt_stats;

static hk_lock_t policy_lock;
static hk_policy_t live;
static _Atomic uint64_t live_version;
static hk_policy_observer_t observer;   /* telemetry.c's in_force mirror, or NULL */

void _hk_policy_lock(void) { _hk_lock(&policy_lock); }
void _hk_policy_unlock(void) { _hk_unlock(&policy_lock); }
void _hk_policy_reinit_lock(void) { _hk_lock_reinit(&policy_lock); }

/* ---- the options table ---------------------------------------------------
 * name (env var), default, bounds, unit. The knobs come first, one option
 * each (hakmem_knobs.h); a per-class knob given here applies to every class,
 * fitted into that class's own bounds. -1 = "per-class default". */
typedef struct hk_option_s {
  const char* env;
  long long   value;      /* after parsing */
  long long   min, max;
  const char* unit;
  const char* desc;
} hk_option_t;

#define HK_X_OPT(name, NAME, bounds, env, unit, min, max, def, desc) OPT_##NAME,
enum { HK_CLASS_KNOBS(HK_X_OPT) HK_PROC_KNOBS(HK_X_OPT)
       OPT_STATS, OPT_CHECK, OPT_TELEMETRY, OPT_TELEMETRY_MS, OPT_BACKGROUND, OPT_COUNT };
#undef HK_X_OPT

static hk_option_t options[OPT_COUNT] = {
#define HK_X_OPT(name, NAME, bounds, env, unit, min, max, def, desc) \
  [OPT_##NAME] = {env, def, min, max, unit, desc},
  HK_CLASS_KNOBS(HK_X_OPT)
  HK_PROC_KNOBS(HK_X_OPT)
#undef HK_X_OPT
  [OPT_STATS]        = {"HAKMEM_STATS",         0, 0, 1,       "bool",   "print the per-class table at exit"},
  [OPT_CHECK]        = {"HAKMEM_CHECK",         0, 0, 1,       "bool",   "stricter checks: no thread cache, exact double-free detection, freed-block canaries"},
  [OPT_TELEMETRY]    = {"HAKMEM_TELEMETRY",     1, 0, 1,       "bool",   "publish counters to HAKMEM_SHM_DIR while a reader holds its lease"},
  [OPT_TELEMETRY_MS] = {"HAKMEM_TELEMETRY_MS", 100, 10, 60000, "ms",     "minimum interval between telemetry records"},
  [OPT_BACKGROUND]   = {"HAKMEM_BACKGROUND",    1, 0, 1,       "bool",   "a thread gives idle memory back every drain interval while the program makes no call"},
};

/* A setuid, setgid or capability-raised program (AT_SECURE) runs with its
 * caller's environment and its owner's privileges: no HAKMEM_* variable is
 * read, as glibc reads no MALLOC_*, or a caller would choose where a trace
 * is created as root, or which telemetry directory the program trusts. This
 * and options_read are the only readers of the environment. */
const char* _hk_env_get(const char* name) {
  if (!environ || _hk_os_secure()) return NULL;
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
  for (char** e = _hk_os_secure() ? NULL : environ; e && *e; e++) {   /* see _hk_env_get */
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
bool _hk_background_allowed(void) { return options[OPT_BACKGROUND].value != 0; }

/* ---- per-class bounds and defaults ----------------------------------------
 * Each knob's rules are knobs.h's, for the class's block and slab size
 * (class 0, which has neither, gets the bounds of 16-byte blocks in one page). */
static uint32_t clamp_u32(uint64_t v, uint32_t lo, uint32_t hi) {
  return v < lo ? lo : v > hi ? hi : (uint32_t)v;
}

static uint64_t size_of(unsigned cls) { return cls ? _hk_class[cls].size : 16; }
static uint64_t slab_of(unsigned cls) {
  return cls ? ((uint64_t)_hk_class[cls].slab_pages << HK_PAGE_SHIFT) : HK_PAGE_SIZE;
}

static void bounds_of(unsigned cls, hk_policy_bounds_t* b) {
  uint64_t size = size_of(cls), slab = slab_of(cls);
  (void)size, (void)slab;
#define HK_X_BOUNDS(name, NAME, bounds, env, unit, min, max, def, desc) \
  b->bounds##_min = HK_KNOB_##NAME##_MIN;                            \
  b->bounds##_max = HK_KNOB_##NAME##_MAX(size, slab);
  HK_CLASS_KNOBS(HK_X_BOUNDS)
  HK_PROC_KNOBS(HK_X_BOUNDS)
#undef HK_X_BOUNDS
}

/* A knob's value: its default, or the option's value where one was given,
 * fitted into the class's bounds and what earlier knobs allow (the batch
 * no larger than the capacity). p holds the knobs before it. */
static uint32_t knob_fit(uint64_t v, uint32_t min, uint32_t max, uint32_t at_most) {
  return clamp_u32(v, min, max < at_most ? max : at_most);
}
#define HK_KNOB_VALUE(NAME, size, slab, p, cls) \
  knob_fit(options[OPT_##NAME].value >= 0 ? (uint64_t)options[OPT_##NAME].value \
                                          : HK_KNOB_##NAME##_DEFAULT(size, slab, p, cls), \
           HK_KNOB_##NAME##_MIN, HK_KNOB_##NAME##_MAX(size, slab), HK_KNOB_##NAME##_AT_MOST(p, cls))

void _hk_policy_default(hk_policy_t* p) {
  memset(p, 0, sizeof *p);
  /* Small classes cache up to 64 KiB, medium ones up to 1 MiB (at most 256
   * blocks), deep enough that churn of 8..32 KiB objects rarely reaches the
   * class lock. Classes a thread stops using drain after one drain
   * interval, so only classes in use keep memory parked; warm pools nobody
   * draws from shrink by half every interval (slab.c:_hk_warm_decay). */
  for (unsigned cls = 1; cls < HK_NUM_CLASSES; cls++) {
    uint64_t size = size_of(cls), slab = slab_of(cls);
    (void)size, (void)slab;
#define HK_X_DEFAULT(name, NAME, bounds, env, unit, min, max, def, desc) \
    p->name[cls] = HK_KNOB_VALUE(NAME, size, slab, p, cls);
    HK_CLASS_KNOBS(HK_X_DEFAULT)
#undef HK_X_DEFAULT
  }
  const unsigned cls = 0;
  const uint64_t size = 16, slab = HK_PAGE_SIZE;
  (void)cls, (void)size, (void)slab;
#define HK_X_DEFAULT(name, NAME, bounds, env, unit, min, max, def, desc) \
  p->name = HK_KNOB_VALUE(NAME, size, slab, p, cls);
  HK_PROC_KNOBS(HK_X_DEFAULT)
#undef HK_X_DEFAULT
}

static bool knob_ok(uint32_t v, uint32_t min, uint32_t max, uint32_t at_most) {
  return v >= min && v <= max && v <= at_most;
}

/* Whether every value is within its bounds (knobs.h); class 0 is not looked at. */
static bool policy_valid(const hk_policy_t* p) {
#define HK_X_VALID(name, NAME, bounds, env, unit, min, max, def, desc) \
  if (!knob_ok(p->name, HK_KNOB_##NAME##_MIN, HK_KNOB_##NAME##_MAX(size, slab), \
               HK_KNOB_##NAME##_AT_MOST(p, cls))) return false;
  {
    const unsigned cls = 0;
    const uint64_t size = 16, slab = HK_PAGE_SIZE;
    (void)cls, (void)size, (void)slab;
    HK_PROC_KNOBS(HK_X_VALID)
  }
#undef HK_X_VALID
#define HK_X_VALID(name, NAME, bounds, env, unit, min, max, def, desc) \
  if (!knob_ok(p->name[cls], HK_KNOB_##NAME##_MIN, HK_KNOB_##NAME##_MAX(size, slab), \
               HK_KNOB_##NAME##_AT_MOST(p, cls))) return false;
  for (unsigned cls = 1; cls < HK_NUM_CLASSES; cls++) {
    uint64_t size = size_of(cls), slab = slab_of(cls);
    (void)size, (void)slab;
    HK_CLASS_KNOBS(HK_X_VALID)
  }
#undef HK_X_VALID
  return true;
}

/* Pages of empty slabs a policy lets the classes keep (warm_slabs × slab). */
static uint64_t warm_pages(const hk_policy_t* p) {
  uint64_t n = 0;
  for (unsigned cls = 1; cls < HK_NUM_CLASSES; cls++) n += (uint64_t)p->warm_slabs[cls] * _hk_class[cls].slab_pages;
  return n;
}

/* The dirty pages (segment.c) are the warm pool of every size, so a policy
 * that keeps fewer empty slabs than the default keeps fewer of them too, in
 * proportion: one that keeps none keeps no freed pages resident at all
 * (otherwise warm=0 only moved up to 256 MiB from the class pools into the
 * dirty pages, and a program that idles between spikes could not be told
 * to keep nothing). A policy at or above the default leaves the cap as is. */
static uint32_t dirty_share_of(const hk_policy_t* p) {
  uint64_t def = 0;
  for (unsigned cls = 1; cls < HK_NUM_CLASSES; cls++) {
    uint64_t size = size_of(cls), slab = slab_of(cls);
    def += (uint64_t)knob_fit(HK_KNOB_WARM_SLABS_DEFAULT(size, slab, p, cls), HK_KNOB_WARM_SLABS_MIN,
                              HK_KNOB_WARM_SLABS_MAX(size, slab), UINT32_MAX) * _hk_class[cls].slab_pages;
  }
  uint64_t have = warm_pages(p);
  return def == 0 || have >= def ? HK_DIRTY_SHARE_ONE : (uint32_t)(have * HK_DIRTY_SHARE_ONE / def);
}

static void install(const hk_policy_t* p) {
  live = *p;
  for (unsigned cls = 0; cls < HK_NUM_CLASSES; cls++)
    hk_store_relaxed(&_hk_warm_limit[cls], cls ? p->warm_slabs[cls] : 0);
  _hk_segment_dirty_share(dirty_share_of(p));
  _hk_segment_retain(p->retain_mib);
  _hk_huge_retain(p->retain_mib);
  uint64_t v = hk_load_relaxed(&live_version) + 1;
  live.version = v;
  hk_store_release(&live_version, v);
  if (observer) observer(&live);
}

void _hk_policy_observe(hk_policy_observer_t fn) {
  _hk_lock(&policy_lock);
  observer = fn;
  if (fn) fn(&live);
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
    hk_bin_t* bin = &tc->bin[cls];
    uint32_t count = _hk_bin_count(bin);
    hk_bin_cold_t* cold = &tc->cold[cls];
    cold->cap = _hk_check_mode ? 0 : live.tcache_cap[cls];
    bin->room = (int32_t)cold->cap - (int32_t)count;   /* the count stays */
    cold->batch = live.tcache_batch[cls];
  }
  tc->policy_version = live.version;
  _hk_unlock(&policy_lock);
  /* A lowered capacity takes effect now, not at the next overflow. */
  for (unsigned cls = 1; cls < HK_NUM_CLASSES; cls++)
    if (tc->bin[cls].room < 0) _hk_drain(tc, cls, (uint32_t)-tc->bin[cls].room);
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
  _hk_threads_trap();        /* every thread takes it up at its next free, not at its next check-in */
  _hk_segment_fit_dirty();   /* a lowered share or retain takes effect now, not at the next decay */
  _hk_huge_fit();
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
