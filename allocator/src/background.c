/* background.c — giving memory back while the program makes no call.
 *
 * The decay pass (slab.c: _hk_warm_decay: warm pools, dirty pages, the
 * huge cache) runs on an allocating thread's slow path once per drain
 * interval. A program that frees a peak and then idles makes no call, so
 * without this what it freed stayed resident until its next burst: a
 * process that freed 200 MiB of 1 KiB blocks and slept held 136 MiB for as
 * long as it slept (glibc: all 200). The users of jemalloc ask for this
 * most of all (its decay, too, runs only on allocation activity unless its
 * background threads are enabled). One thread per process sleeps a drain
 * interval (BG_TICK_MS at most), looks at the telemetry file and runs the
 * same pass; with allocating threads about, the pass
 * is theirs and this one finds it done (_hk_warm_decay runs once per
 * interval whoever calls it).
 *
 * A thread in someone else's program is a change to it, so it starts only
 * where that is safe, lazily, once:
 *  - after the process has run for a second (a program that unshares a user
 *    namespace, which a multi-threaded process cannot, does so at start;
 *    short commands never get one);
 *  - from the end of a slow path (maybe_gc), where this thread's cache is
 *    consistent, so the mallocs pthread_create makes are ordinary calls;
 *  - never under a seccomp filter (a filter may kill the process for the
 *    clone), under secure execution, or with HAKMEM_BACKGROUND=0;
 *  - with every signal blocked, so signals stay the program's.
 * A failed start is not retried; HAKMEM_STATS says why there is none. A
 * forked child has no thread and may start its own (fork keeps only the
 * calling thread). The thread takes only the locks the pass takes, in the
 * pass's order, so fork_prepare and exit wait for it as for any thread.
 */
#include "internal.h"
#include "prim.h"

enum { BG_NONE, BG_STARTING, BG_RUNNING, BG_OFF };

static _Atomic int state;
static _Atomic uint64_t born_ns;      /* initialization, or the fork that made this process */
static _Atomic uint64_t passes;
static const char* off_why;
static int start_err;

#define BG_MIN_AGE_NS 1000000000ull
/* The coarse clock moves in jiffies: a pass due after exactly one interval
 * could look a tick early and wait a whole interval more. */
#define BG_SLACK_MS 10u
/* The longest sleep: learnd's window. The thread also looks at the
 * telemetry file (a record, a policy snapshot, a capture's time bound),
 * which otherwise only an allocating thread's slow path does: a policy
 * learnd wrote while the program idled waited for its next burst, so
 * learnd could neither measure a policy while the program idles (the time
 * a memory policy is for) nor switch one in an A/B trial, and a capture
 * asked for 6 s ran until the next allocation. */
#define BG_TICK_MS 1000u

static void* bg_main(void* arg) {
  (void)arg;
  _hk_os_mark_decay_thread();
  for (;;) {
    uint32_t ms = _hk_drain_ms();
    _hk_os_sleep_ms((ms == 0 || ms > BG_TICK_MS ? BG_TICK_MS : ms) + BG_SLACK_MS);
    uint64_t now = _hk_os_now_coarse_ns();
    if (_hk_tel_on) _hk_tel_tick(now);    /* first: a new policy's drain counts for this pass */
    ms = _hk_drain_ms();        /* the interval in force now, not when the sleep began */
    if (ms == 0) continue;      /* "never" */
    if (_hk_warm_decay(now, (uint64_t)ms * 1000000u)) hk_add_relaxed(&passes, 1);
  }
  return NULL;
}

static void turn_off(const char* why) {
  off_why = why;
  hk_store_relaxed(&state, BG_OFF);
}

void _hk_background_maybe_start(uint64_t now_ns) {
  if (HK_LIKELY(hk_load_relaxed(&state) != BG_NONE)) return;
  if (now_ns - hk_load_relaxed(&born_ns) < BG_MIN_AGE_NS) return;
  int expect = BG_NONE;
  if (!atomic_compare_exchange_strong_explicit(&state, &expect, BG_STARTING, memory_order_relaxed,
                                               memory_order_relaxed))
    return;
  if (!_hk_background_allowed()) return turn_off("HAKMEM_BACKGROUND=0");
  if (_hk_os_secure()) return turn_off("secure execution");
  if (_hk_os_seccomp_filtered()) return turn_off("a seccomp filter governs the process");
  int err = _hk_os_start_daemon_thread(bg_main, "hakmem-decay");
  if (err) {
    start_err = err;
    return turn_off("the thread could not be started");
  }
  hk_store_relaxed(&state, BG_RUNNING);
}

void _hk_background_born(void) { hk_store_relaxed(&born_ns, _hk_os_now_coarse_ns()); }

/* The replayer, for a trace captured from a live process (hakmem-replay.c
 * "the background thread"): that process was past its first second and its
 * thread gave memory back through every idle gap, so the replay's must from
 * its first one, not only in the part of the replay after its own first
 * second. Same checks as any start. */
void _hk_background_start_now(void) {
  hk_store_relaxed(&born_ns, 0);
  _hk_background_maybe_start(_hk_os_now_coarse_ns());
}

void _hk_background_after_fork_child(void) {
  hk_store_relaxed(&state, BG_NONE);
  _hk_background_born();
  hk_store_relaxed(&passes, 0);
}

size_t _hk_background_describe(char* buf, size_t cap) {
  switch (hk_load_relaxed(&state)) {
    case BG_RUNNING:
      return _hk_fmt(buf, cap, "  background: idle memory goes back every drain interval (%lu passes)\n",
                     hk_load_relaxed(&passes));
    case BG_OFF:
      return start_err ? _hk_fmt(buf, cap, "  background: off: %s (error %lu)\n", off_why, (uint64_t)start_err)
                       : _hk_fmt(buf, cap, "  background: off: %s\n", off_why);
    default:
      return _hk_fmt(buf, cap, "  background: not started (the process is young or made no slow call)\n");
  }
}
