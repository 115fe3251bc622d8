/* hakmem.h — the few calls hakmem adds to the standard allocation API.
 *
 * Everything else (malloc, free, posix_memalign, malloc_usable_size, ...) is
 * the standard C/glibc API: link with -lhakmem or LD_PRELOAD=libhakmem.so.
 *
 * The counter lists (hakmem_counters.h, generated from the one definition
 * in schemas/shm_layout.json) generate the C structs here, the
 * HAKMEM_STATS=1 table and the shared-memory layout, so a counter is added
 * in one place only.
 */
#ifndef HAKMEM_H
#define HAKMEM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define HK_API __attribute__((visibility("default")))

/* Size classes: classes 1..HK_NUM_CLASSES-1 have the sizes returned by
 * hk_class_size() (16 B .. 1 MiB, four per doubling). Class 0 stands for
 * "huge": objects above 1 MiB, each in a mapping of its own; in
 * hk_stats_t.cls[0] only allocs, frees and live_bytes are used. */
#define HK_NUM_CLASSES 61

/* The counter lists, HK_CLASS_COUNTERS(X) and HK_PROC_COUNTERS(X), each
 * entry X(name, description), are generated from schemas/shm_layout.json. */
#include "hakmem_counters.h"

typedef struct hk_class_stats_s {
  uint64_t size; /* block size of the class in bytes */
#define HK_X_FIELD(name, desc) uint64_t name;
  HK_CLASS_COUNTERS(HK_X_FIELD)
} hk_class_stats_t;

typedef struct hk_stats_s {
  uint32_t struct_size;   /* sizeof(hk_stats_t), for forward compatibility */
  uint32_t num_classes;   /* HK_NUM_CLASSES */
  HK_PROC_COUNTERS(HK_X_FIELD)
#undef HK_X_FIELD
  hk_class_stats_t cls[HK_NUM_CLASSES];
} hk_stats_t;

/* Fills *out with a snapshot of all counters. The calling thread's counts
 * are exact; another thread's are as it last published them, on its last
 * slow path or check-in (at most 32768 allocations of a class ago, and
 * exact once it has ended). Returns 0, or EINVAL. */
HK_API int hk_stats_get(hk_stats_t* out);

/* Writes the per-class table (as HAKMEM_STATS=1 does at exit) to fd. */
HK_API void hk_stats_print(int fd);

/* The size of class cls, 0 for class 0 or an out-of-range class. */
HK_API size_t hk_class_size(unsigned cls);

/* The class a request of `size` bytes is served from, 0 if it is "huge"
 * (served by its own mapping). */
HK_API unsigned hk_size_class(size_t size);

/* ---- The runtime policy -----------------------------------------------------
 * The knobs, HK_CLASS_KNOBS(X) (an array over the classes each) and
 * HK_PROC_KNOBS(X) (one value each), are generated with their descriptions,
 * units and bounds from schemas/shm_layout.json; today:
 * tcache_cap:   blocks a thread may cache per class; over it, a drain.
 * tcache_batch: blocks moved per refill or drain.
 * warm_slabs:   empty slabs a class keeps for reuse before returning them;
 *               fewer in all than the default also keep fewer freed pages.
 * drain_ms:     after this many ms an active thread returns the part of its
 *               caches it did not use since the previous interval.
 * Every value is validated against hk_policy_bounds(); hk_policy_set rejects
 * a policy with any value out of bounds as a whole.
 */
#include "hakmem_knobs.h"

typedef struct hk_policy_s {
  uint64_t version;                     /* set by hk_policy_set */
#define HK_X_FIELD(name, NAME, bounds, env, unit, min, max, def, desc) uint32_t name[HK_NUM_CLASSES];
  HK_CLASS_KNOBS(HK_X_FIELD)
#undef HK_X_FIELD
#define HK_X_FIELD(name, NAME, bounds, env, unit, min, max, def, desc) uint32_t name;
  HK_PROC_KNOBS(HK_X_FIELD)
#undef HK_X_FIELD
} hk_policy_t;

/* Per knob, <bounds>_min and <bounds>_max: cap, batch, warm, drain_ms.
 * cap_max and warm_max depend on the class; batch <= cap as well. */
typedef struct hk_policy_bounds_s {
#define HK_X_FIELD(name, NAME, bounds, env, unit, min, max, def, desc) uint32_t bounds##_min, bounds##_max;
  HK_CLASS_KNOBS(HK_X_FIELD)
  HK_PROC_KNOBS(HK_X_FIELD)
#undef HK_X_FIELD
} hk_policy_bounds_t;

/* Copies the policy in force. */
HK_API void hk_policy_get(hk_policy_t* out);
/* Bounds for class cls (cap_max and warm_max depend on the block size). */
HK_API void hk_policy_bounds(unsigned cls, hk_policy_bounds_t* out);
/* Validates and installs p with a new version; each thread takes it up on
 * its next slow path or check-in (within 32768 allocations of a class).
 * Returns the new version, or 0 (and counts a rejection) if any value is
 * out of bounds. */
HK_API uint64_t hk_policy_set(const hk_policy_t* p);
/* The version of the policy in force (starts at 1). */
HK_API uint64_t hk_policy_version(void);

/* Returns the calling thread's cached blocks to their slabs. */
HK_API void hk_thread_flush(void);

#ifdef __cplusplus
}
#endif
#endif /* HAKMEM_H */
