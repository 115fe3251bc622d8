/* trace.h — allocation capture (trace.c; the format is proto/trace.proto).
 *
 * alloc.c's slow paths call the recorders; nothing on a fast path does.
 * While a capture is on, alloc.c keeps each thread's bins "trapped"
 * (block-start limit 0, and outside SAMPLED a countdown far below zero) so
 * that every call reaches a slow path; the real countdowns are kept here
 * per thread and put back around the real work, which honours the policy.
 */
#ifndef HK_TRACE_H
#define HK_TRACE_H

#include "internal.h"

/* Set while a capture takes events (read on slow paths and by realloc). */
extern bool _hk_trace_on;
/* SAMPLED: mean bytes between picks (0 otherwise); alloc.c's check-in
 * countdown draws from it instead of its own mean. */
extern uint32_t _hk_trace_sample_bytes;

enum { HK_TRAP_NONE = 0, HK_TRAP_FREE = 1, HK_TRAP_ALL = 2 };

typedef struct hk_trace_tls_s {
  uint8_t trapped;    /* HK_TRAP_*: how this thread's bins are trapped */
  uint8_t picked;     /* SAMPLED: the check-in countdown ran out for this call */
  uint8_t quiet;      /* inside a recorded realloc: its inner calls are not events */
  uint8_t dead;       /* the thread's exit was recorded: later calls are not */
  int64_t direct_left;/* SAMPLED: bytes before the next pick among classes
                         served without a thread cache (capacity 0) */
  int32_t left[HK_NUM_CLASSES];   /* the real countdowns (HK_TRAP_ALL) */
  struct hk_tbuf_s* buf;          /* this thread's event buffer */
} hk_trace_tls_t;

extern __thread hk_trace_tls_t _hk_trace_tls __attribute__((tls_model("initial-exec")));

/* The trap wanted now for a thread in state `active`. */
HK_INLINE unsigned _hk_trace_trap_wanted(bool active) {
  if (!_hk_trace_on || !active || _hk_trace_tls.dead) return HK_TRAP_NONE;
  return _hk_trace_sample_bytes ? HK_TRAP_FREE : HK_TRAP_ALL;
}

/* Recorders (op: proto Op values). Allocations after the block is had,
 * frees before it is given back (proto "time-stamping rule"). */
enum { HK_OP_MALLOC = 1, HK_OP_CALLOC = 2, HK_OP_REALLOC = 3, HK_OP_FREE = 4,
       HK_OP_ALIGNED = 5, HK_OP_THREAD_EXIT = 6 };
void _hk_trace_alloc(unsigned op, size_t n, size_t align, void* p);
void _hk_trace_free(void* p);
/* SAMPLED: whether old is a picked object (then record it). */
bool _hk_trace_realloc_wanted(void* old);
void _hk_trace_realloc(void* old, void* p, size_t n);

void _hk_trace_start(void);                 /* HAKMEM_TRACE*, at start */
void _hk_trace_exit(void);                  /* footer at process exit */
void _hk_trace_thread_exit(hk_tcache_t* tc);/* THREAD_EXIT; untraps */
void _hk_trace_after_fork_child(void);      /* the child stops */
void _hk_trace_lock_all(void);              /* fork: no chunk half-written */
void _hk_trace_unlock_all(void);
/* A live request (telemetry.c, tel.lock held): dfd is the telemetry
 * directory; name the file to create there. 0, or an errno (EBUSY: a
 * capture is already on). */
int  _hk_trace_live_start(int dfd, const char* name, uint32_t seconds, uint64_t max_bytes);
/* Live capture state for the telemetry header: 0 none, 1 recording, 2 done. */
uint32_t _hk_trace_live_state(void);
/* Checks the live bound of time (telemetry tick). */
void _hk_trace_poll(uint64_t now_ns);
/* The stats table's line. */
size_t _hk_trace_describe(char* buf, size_t cap);

#endif /* HK_TRACE_H */
