/* init.c — start-up, fork and exit.
 *
 * Initialization happens on the first allocation, which may come from the
 * dynamic loader or libc's own start-up before any constructor ran, so it
 * uses nothing that allocates: static tables, mmap, and our own environment
 * walk. pthread_atfork (which may allocate) is registered from a constructor,
 * when malloc already works.
 *
 * SYNCHRONIZATION
 *  1. init_lock serializes the one-time initialization; _hk_initialized is
 *     published with release order and read with acquire on the slow path.
 *  2. Fork: the parent takes every allocator lock in a fixed order (init,
 *     policy, registry, classes, segments, huge) before fork and releases them after;
 *     the child re-initializes them and keeps only its own thread cache.
 */
#define _GNU_SOURCE
#include <pthread.h>

#include "internal.h"
#include "prim.h"
#include "trace.h"

hk_proc_counters_t _hk_proc;
int _hk_initialized;

static hk_lock_t init_lock;

/* ---- fork ------------------------------------------------------------------- */
static void fork_prepare(void) {
  _hk_lock(&init_lock);   /* a fork during initialization waits for it */
  _hk_policy_lock();
  _hk_registry_lock();
  _hk_central_lock_all();
  _hk_segment_lock();
  _hk_huge_lock();
  _hk_trace_lock_all();
}

static void fork_parent(void) {
  _hk_trace_unlock_all();
  _hk_huge_unlock();
  _hk_segment_unlock();
  _hk_central_unlock_all();
  _hk_registry_unlock();
  _hk_policy_unlock();
  _hk_unlock(&init_lock);
}

static void fork_child(void) {
  _hk_lock_reinit(&init_lock);
  _hk_huge_reinit_lock();
  _hk_segment_reinit_lock();
  _hk_central_reinit_locks();
  _hk_thread_after_fork_child();
  _hk_policy_reinit_lock();
  _hk_tel_after_fork_child();
  _hk_trace_after_fork_child();
  _hk_background_after_fork_child();
}

/* ---- start and exit --------------------------------------------------------- */
void _hk_init(void) {
  _hk_lock(&init_lock);
  if (!__atomic_load_n(&_hk_initialized, __ATOMIC_ACQUIRE)) {
    _hk_classes_init();
    _hk_stats_clock_start();
    _hk_options_init();
    _hk_thread_init();
    _hk_background_born();
    __atomic_store_n(&_hk_initialized, 1, __ATOMIC_RELEASE);
    /* A capture from start sees what other libraries' constructors
     * allocate before ours runs, when the environment is there to say so. */
    if (!_hk_options_env_missing()) _hk_trace_start();
  }
  _hk_unlock(&init_lock);
}

/* Programs may close stderr before exit (coreutils does, in an atexit
 * handler); the exit-time table goes to a copy of it taken at start. */
static int stats_fd = -1;

__attribute__((constructor(101))) static void hk_constructor(void) {
  if (!_hk_initialized) _hk_init();
  /* Initialized from inside the loader, before the environment was set up:
   * read the options now, before main. */
  if (_hk_options_env_missing()) _hk_options_init();
  pthread_atfork(fork_prepare, fork_parent, fork_child);
  if (_hk_stats_at_exit()) stats_fd = _hk_os_dup_cloexec(2, 64);
  _hk_tel_start();
  _hk_trace_start();
}

/* The exit-time table and the telemetry file's last record come from one
 * snapshot, so a reader's totals equal the printed ones. */
__attribute__((destructor(101))) static void hk_destructor(void) {
  static hk_stats_t st HK_SPARSE_BSS;
  _hk_trace_exit();   /* the footer, before the table that counts it */
  if (!_hk_stats_at_exit() && (!_hk_tel_on || _hk_tel_exit_unmapped())) return;
  hk_stats_get(&st);
  _hk_tel_exit(&st);
  if (_hk_stats_at_exit()) _hk_stats_print_snapshot(stats_fd >= 0 ? stats_fd : 2, &st);
}
