/* hakmem.h — the few calls hakmem adds to the standard allocation API.
 *
 * Everything else (malloc, free, posix_memalign, malloc_usable_size, ...) is
 * the standard C/glibc API: link with -lhakmem or LD_PRELOAD=libhakmem.so.
 *
 * The counter lists below are the single definition of what the allocator
 * counts. They generate the C structs here, the HAKMEM_STATS=1 table and
 * (later) the shared-memory layout, so a field is added in one place only.
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

/* Per size class, cumulative unless marked "gauge".
 * X(name, description) */
#define HK_CLASS_COUNTERS(X)                                                        \
  X(allocs,         "blocks handed out")                                            \
  X(hits,           "allocations served by the thread cache (derived: allocs - refills)") \
  X(frees,          "blocks freed (derived: allocs - live)")                        \
  X(local_frees,    "frees returned to a slab the freeing thread refilled from (derived)") \
  X(refills,        "thread-cache refills (slow path)")                             \
  X(refill_blocks,  "blocks moved into thread caches by refills")                   \
  X(drains,         "thread-cache drains (cache over capacity or idle)")            \
  X(drain_blocks,   "blocks moved out of thread caches by drains")                  \
  X(remote_frees,   "drained blocks whose slab was last refilled by another thread")\
  X(lost_blocks,    "blocks stranded in caches of threads gone without cleanup")   \
  X(slabs_from_warm,"slabs taken from the warm pool")                               \
  X(slabs_from_os,  "slabs carved from fresh or returned memory")                   \
  X(slabs_to_warm,  "empty slabs parked in the warm pool")                          \
  X(slabs_to_os,    "empty slabs returned to the OS (madvise)")                     \
  X(live_bytes,     "gauge: bytes in blocks handed out and not yet freed")          \
  X(cached_bytes,   "gauge: bytes in blocks parked in thread caches")               \
  X(slow_ns,        "nanoseconds spent in refill/drain slow paths")

/* Per process. */
#define HK_PROC_COUNTERS(X)                                                         \
  X(mmap_calls,        "mmap calls")                                                \
  X(munmap_calls,      "munmap calls")                                              \
  X(madvise_calls,     "madvise calls")                                             \
  X(committed_bytes,   "gauge: bytes mapped for slabs and huge objects, not returned")          \
  X(threads,           "gauge: threads with a live thread cache")                   \
  X(threads_total,     "threads that ever had a thread cache")                      \
  X(huge_allocs,       "allocations above the largest class (own mapping)")         \
  X(huge_cache_hits,   "huge allocations served from the huge cache")               \
  X(policy_version,    "gauge: version of the policy in force")                     \
  X(policies_rejected, "policies rejected by validation")

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

/* Fills *out with a snapshot of all counters (other threads' most recent
 * fast-path counts may lag by a few operations). Returns 0, or EINVAL. */
HK_API int hk_stats_get(hk_stats_t* out);

/* Writes the per-class table (as HAKMEM_STATS=1 does at exit) to fd. */
HK_API void hk_stats_print(int fd);

/* The size of class cls, 0 for class 0 or an out-of-range class. */
HK_API size_t hk_class_size(unsigned cls);

/* The class a request of `size` bytes is served from, 0 if it is "huge"
 * (served by its own mapping). */
HK_API unsigned hk_size_class(size_t size);

/* ---- The runtime policy: the three knobs ----------------------------------
 * tcache_cap:   blocks a thread may cache per class; over it, a drain.
 * tcache_batch: blocks moved per refill or drain.
 * warm_slabs:   empty slabs a class keeps for reuse before returning them.
 * drain_ms:     after this many ms an active thread returns the part of its
 *               caches it did not use since the previous interval.
 * Every value is validated against hk_policy_bounds(); hk_policy_set rejects
 * a policy with any value out of bounds as a whole.
 */
typedef struct hk_policy_s {
  uint64_t version;                     /* set by hk_policy_set */
  uint32_t tcache_cap[HK_NUM_CLASSES];
  uint32_t tcache_batch[HK_NUM_CLASSES];
  uint32_t warm_slabs[HK_NUM_CLASSES];
  uint32_t drain_ms;
} hk_policy_t;

typedef struct hk_policy_bounds_s {
  uint32_t cap_min, cap_max;       /* per class; cap_max depends on size */
  uint32_t batch_min, batch_max;   /* batch <= cap as well */
  uint32_t warm_min, warm_max;
  uint32_t drain_ms_min, drain_ms_max;
} hk_policy_bounds_t;

/* Copies the policy in force. */
HK_API void hk_policy_get(hk_policy_t* out);
/* Bounds for class cls (cap_max and warm_max depend on the block size). */
HK_API void hk_policy_bounds(unsigned cls, hk_policy_bounds_t* out);
/* Validates and installs p with a new version; threads pick it up on their
 * next slow path. Returns the new version, or 0 (and counts a rejection)
 * if any value is out of bounds. */
HK_API uint64_t hk_policy_set(const hk_policy_t* p);
/* The version of the policy in force (starts at 1). */
HK_API uint64_t hk_policy_version(void);

/* Returns the calling thread's cached blocks to their slabs. */
HK_API void hk_thread_flush(void);

#ifdef __cplusplus
}
#endif
#endif /* HAKMEM_H */
