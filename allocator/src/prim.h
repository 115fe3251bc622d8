/* prim.h — every OS call the allocator makes, behind one small interface.
 *
 * Convention: a call that can fail returns 0 on success or an errno value;
 * a query returns its answer. Addresses and lengths are multiples of the OS
 * page size. No other file calls the OS (or reads the CPU's clock) itself. Each call is counted in the
 * process counters (mmap_calls, munmap_calls, madvise_calls), so the cost
 * the allocator imposes on the kernel is visible. None of these allocate.
 */
#ifndef HK_PRIM_H
#define HK_PRIM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Maps len bytes aligned to `align` (a power of two >= the page size).
 * With `reserve`, the kernel does not account the memory up front
 * (MAP_NORESERVE: address space for segments, committed page by page as
 * slabs are used); without it, the kernel's overcommit policy judges the
 * whole length at once, so an absurd request fails as it does in glibc.
 * When the slack needed for the alignment does not fit (ENOMEM: RLIMIT_AS
 * counts every mapping), an exact-size aligned mapping is tried instead.
 * *out is NULL on failure. */
int _hk_os_map_aligned(size_t len, size_t align, bool reserve, void** out);
int _hk_os_unmap(void* p, size_t len);
/* Gives the pages back; they read as zero when touched again. */
int _hk_os_decommit(void* p, size_t len);
/* Grows a mapping in place (never moves it). */
int _hk_os_grow_in_place(void* p, size_t old_len, size_t new_len);
/* Moves the pages of [p, p+len) to dst, replacing what was mapped there
 * (mremap: page tables move, no copy). */
int _hk_os_move(void* p, size_t len, void* dst);
/* After a move that failed: true when [p, p+len) is mapped (it still was,
 * or fresh zero pages now fill the hole the failed call left), false when
 * it is a hole that could not be filled. */
bool _hk_os_refill(void* p, size_t len);
/* Shrinks a mapping in place. */
int _hk_os_shrink(void* p, size_t old_len, size_t new_len);
/* Maps len bytes of file fd shared (the telemetry file), and unmaps it. */
int _hk_os_map_file(int fd, size_t len, void** out);
int _hk_os_unmap_file(void* p, size_t len);

/* ---- the telemetry directory and its files (telemetry.c says what is
 * checked and why). Nothing here follows a symbolic link in the last
 * component or blocks on a FIFO. */
typedef struct hk_file_info_s {
  uint64_t dev, ino;
  uint32_t uid;     /* owner */
  uint32_t mode;    /* st_mode: type and permission bits */
  uint32_t nlink;   /* names it has (a hard link made by someone else: > 1) */
} hk_file_info_t;
/* Opens a directory (O_RDONLY|O_DIRECTORY|O_NOFOLLOW) and describes it:
 * a symbolic link fails with ELOOP or ENOTDIR. */
int _hk_os_open_dir(const char* path, int* fd, hk_file_info_t* info);
/* Opens dfd/name read-only without following a link or waiting for a
 * FIFO's writer (O_NONBLOCK), and describes what it opened. */
int _hk_os_open_read_at(int dfd, const char* name, int* fd, hk_file_info_t* info);
/* Whether another open file description holds a write lock on some byte
 * of fd (F_OFD_GETLK with F_RDLCK; no lock is taken). */
int _hk_os_write_locked(int fd, bool* locked);
/* Creates dfd/name, mode 0600, failing with EEXIST when any file (or a
 * link) is there already, and describes it. */
int _hk_os_create_at(int dfd, const char* name, int* fd, hk_file_info_t* info);
/* Describes dfd/name itself (a link is described, not followed). */
int _hk_os_stat_at(int dfd, const char* name, hk_file_info_t* info);
int _hk_os_unlink_at(int dfd, const char* name);
/* Allocates the blocks of [0, len) of fd now (fallocate, mode 0), so that
 * writing them through a mapping can never fail: ENOSPC when the
 * filesystem is full, EOPNOTSUPP where it cannot reserve (no fallback that
 * writes zeros: a filesystem that cannot promise the blocks gets no file). */
int _hk_os_reserve_file(int fd, size_t len);
void _hk_os_close(int fd);
uint32_t _hk_os_euid(void);
/* Monotonic clock in nanoseconds (vDSO, no syscall). */
uint64_t _hk_os_now_ns(void);
/* Coarse monotonic clock (a few ms resolution, cheapest to read). */
uint64_t _hk_os_now_coarse_ns(void);
/* Current thread's kernel id. */
uint32_t _hk_os_tid(void);
/* Writes all of buf to fd, retrying short writes; never allocates. To a
 * regular file, only what fits under RLIMIT_FSIZE (a write at the limit
 * raises SIGXFSZ, which kills): the rest is dropped. */
void _hk_os_write(int fd, const char* buf, size_t len);
/* The CPU's time-stamp counter: slow-path time is kept in these ticks and
 * converted to ns over the process's life (stats.c), so the slow paths
 * read no clock. Inline: one instruction. */
static inline uint64_t _hk_os_ticks(void) { return __builtin_ia32_rdtsc(); }
/* Ticks from t0 to now; none if the counter went back (a migration
 * between CPUs whose counters disagree). */
static inline uint64_t _hk_os_ticks_since(uint64_t t0) {
  uint64_t d = _hk_os_ticks() - t0;
  return (int64_t)d > 0 ? d : 0;
}
/* The most one slow path counts, in ticks; 0 (programs): no bound. The
 * replayer sets it (_hk_os_bound_slow_paths, from hakmem-replay.c
 * run_once): learnd's screening runs 9 replays of an intermittent program
 * side by side on one CPU, and a slow path preempted by another replay, or
 * waiting for a decay thread preempted while it held the lock the slow path
 * wanted, counted that replay's turn on the wall clock (bench-learn's
 * spikes, one screening: cap=4 drain=100's slow paths took 62 ms against
 * cap=4 warm=0's 17, which live ran 19.4 ms of CPU a second against 25.0).
 * Without the kernel's part (priced apart), a slow path runs well under a
 * microsecond; a turn lost to another process lasts milliseconds. The
 * thread's CPU clock told them apart too, but as a system call (no vDSO for
 * a thread's clock) it made a replay of cap=4 four to five times slower. */
extern uint64_t _hk_slow_bound_ticks;
void _hk_os_bound_slow_paths(void);

/* ---- the process (telemetry.c's header, thread.c's registry, init.c) */
uint32_t _hk_os_pid(void);
uint32_t _hk_os_uid(void);                 /* real user id */
/* Secure execution (AT_SECURE: setuid, setgid, file capabilities): the
 * environment is the caller's, and the allocator reads nothing from it. */
bool _hk_os_secure(void);
/* CLOCK_REALTIME in nanoseconds. */
uint64_t _hk_os_wall_ns(void);
/* Whether the thread tid of this process no longer exists (tgkill with
 * signal 0 says ESRCH); false when it exists or the answer is unknown. */
bool _hk_os_thread_gone(uint32_t tid);
/* A close-on-exec duplicate of fd numbered at least at_least, or -1. */
int _hk_os_dup_cloexec(int fd, int at_least);
/* The executable's path (/proc/self/exe), NUL-terminated; empty if unknown. */
void _hk_os_exe_path(char* out, size_t cap);
/* The main executable's GNU build id in hex, from its program headers
 * (no file read); empty if it has none. */
void _hk_os_build_id(char* out, size_t cap);
/* This process's start time in clock ticks since boot (field 22 of
 * /proc/self/stat, the name of its telemetry file); 0 if unknown. */
uint64_t _hk_os_start_time(void);

/* ---- trace files (trace.c) */
/* Creates path for writing (O_EXCL|O_NOFOLLOW|O_CLOEXEC, mode 0600): an
 * existing file or link there is never opened. */
int _hk_os_create_path(const char* path, int* fd);
/* The same, as dfd/name. */
int _hk_os_create_wo_at(int dfd, const char* name, int* fd);
/* Writes all of buf at the file's end, which is at off; on failure cuts
 * the file back to off (so no half record stays) and returns the errno.
 * EFBIG, with nothing written, when off + len would pass RLIMIT_FSIZE as it
 * is now (the program may lower it at any time). */
int _hk_os_append(int fd, const void* buf, size_t len, uint64_t off);
/* RLIMIT_FSIZE (UINT64_MAX: none): writing past it raises SIGXFSZ, which
 * kills; every file the allocator grows is checked against it first. */
uint64_t _hk_os_fsize_limit(void);
/* Up to cap bytes of a small file (/proc/self/cmdline); 0 if unreadable. */
size_t _hk_os_read_small(const char* path, char* buf, size_t cap);
/* The background thread (background.c): a sleep that resumes after
 * signals; whether a seccomp filter governs the process; a detached thread
 * with a small stack, every signal blocked and a name; 0 or an errno. */
void _hk_os_sleep_ms(uint32_t ms);
bool _hk_os_seccomp_filtered(void);
int _hk_os_start_daemon_thread(void* (*fn)(void*), const char* name);
/* The calling thread is the decay thread: its memory calls are counted in
 * decay_syscalls and the bytes it gives back are not the program's
 * returned_bytes. */
void _hk_os_mark_decay_thread(void);

#endif /* HK_PRIM_H */
