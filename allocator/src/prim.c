/* prim.c — OS calls (see prim.h for the convention): mappings, clocks,
 * the process's identity, the telemetry directory's files, and the wait of
 * a contended lock. No other file includes a system header for a call. */
#define _GNU_SOURCE
#include "prim.h"

#include <elf.h>
#include <errno.h>
#include <fcntl.h>
#include <link.h>
#include <sched.h>
#include <signal.h>
#include <string.h>
#include <sys/auxv.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

/* Ticks this thread spent in the kernel on the allocator's behalf: the
 * memory calls below and the faults of fresh pages (slab.c take_blocks).
 * learnd prices that time from the process's OS calls and faults, so the
 * slow paths leave it out of slow_ns (slab.c), or it would count twice. */
__thread uint64_t _hk_kernel_ticks __attribute__((tls_model("initial-exec")));

/* Set on the decay thread (background.c). Its memory calls run beside the
 * program, whose threads wait on none of them, so learnd prices them apart:
 * they are counted in decay_syscalls, and the bytes they give back are left
 * out of returned_bytes, which prices the kernel's work per page given back
 * by the program's own threads (warm=0 madvises a burst's slabs one by one
 * as they empty, on the thread that frees; drain=100 gives the same pages
 * back from this thread a moment later). */
static __thread bool decay_thread __attribute__((tls_model("initial-exec")));

void _hk_os_mark_decay_thread(void) { decay_thread = true; }

static inline void count_call(_Atomic uint64_t* calls) {
  hk_add_relaxed(calls, 1);
  if (decay_thread) hk_add_relaxed(&_hk_proc.decay_syscalls, 1);
}

static inline void count_returned(size_t len) {
  if (!decay_thread) hk_add_relaxed(&_hk_proc.returned_bytes, len);
}

#define KERNEL_TIMED(call) ({                                  \
    uint64_t k0_ = _hk_os_ticks();                             \
    __typeof__(call) r_ = (call);                              \
    _hk_kernel_ticks += _hk_os_ticks_since(k0_);               \
    r_; })

uint64_t _hk_slow_bound_ticks;

/* 100 us: a quiet replay's slow paths run far below it (bench-learn's burst
 * trace under cap=4, alone: 348,937 of 349,050 under 0.5 us, all but 5
 * under 111 us, those under 0.45 ms), and a turn lost to another process
 * lasts 1.8 ms or more. Ticks per us measured against the monotonic clock
 * over 5 ms of sleep: asleep, both clocks run alike, preempted or not. */
void _hk_os_bound_slow_paths(void) {
  uint64_t a = _hk_os_now_ns(), t0 = _hk_os_ticks();
  _hk_os_sleep_ms(5);
  uint64_t t1 = _hk_os_ticks(), ns = _hk_os_now_ns() - a;
  uint64_t per_us = ns > 0 && t1 > t0 ? (t1 - t0) * 1000 / ns : 3000;   /* ~3 GHz, unmeasured */
  _hk_slow_bound_ticks = 100 * (per_us ? per_us : 1);
}

static int map_raw(size_t len, bool reserve, void** out) {
  count_call(&_hk_proc.mmap_calls);
  void* p = KERNEL_TIMED(mmap(NULL, len, PROT_READ | PROT_WRITE,
                              MAP_PRIVATE | MAP_ANONYMOUS | (reserve ? MAP_NORESERVE : 0), -1, 0));
  if (p == MAP_FAILED) { *out = NULL; return errno ? errno : ENOMEM; }
  *out = p;
  return 0;
}

int _hk_os_unmap(void* p, size_t len) {
  if (len == 0) return 0;
  count_call(&_hk_proc.munmap_calls);
  count_returned(len);
  return KERNEL_TIMED(munmap(p, len)) == 0 ? 0 : errno;
}

#ifndef MAP_FIXED_NOREPLACE
#define MAP_FIXED_NOREPLACE 0x100000   /* Linux 4.17; older kernels take it as a hint */
#endif

/* len bytes at exactly `at`, never replacing a mapping there; ENOMEM when
 * the kernel put them elsewhere (a kernel without MAP_FIXED_NOREPLACE). */
static int map_at(void* at, size_t len, bool reserve, void** out) {
  count_call(&_hk_proc.mmap_calls);
  void* p = KERNEL_TIMED(mmap(at, len, PROT_READ | PROT_WRITE,
                              MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE | (reserve ? MAP_NORESERVE : 0),
                              -1, 0));
  *out = NULL;
  if (p == MAP_FAILED) return errno ? errno : ENOMEM;
  if (p != at) { _hk_os_unmap(p, len); return ENOMEM; }
  *out = p;
  return 0;
}

/* The slack did not fit (RLIMIT_AS counts it, MAP_NORESERVE or not): an
 * exact-size mapping, kept when it happens to be aligned; else the same
 * length at the aligned address just below it. The kernel places mappings
 * top-down at the top of the highest gap that fits, so below is where free
 * address space usually is. Three or four calls, on this path only. */
static int map_aligned_exact(size_t len, size_t align, bool reserve, void** out) {
  void* p;
  int err = map_raw(len, reserve, &p);
  if (err) return err;
  if (((uintptr_t)p & (align - 1)) == 0) { *out = p; return 0; }
  uintptr_t below = (uintptr_t)p & ~(uintptr_t)(align - 1);
  _hk_os_unmap(p, len);
  /* Whatever stops it there (EEXIST: something is mapped below), the
   * caller hears what it would have: no room. */
  if (below == 0 || map_at((void*)below, len, reserve, out) != 0) return ENOMEM;
  return 0;
}

int _hk_os_map_aligned(size_t len, size_t align, bool reserve, void** out) {
  *out = NULL;
  if (align < HK_OS_PAGE) align = HK_OS_PAGE;
  if (len > SIZE_MAX - align) return ENOMEM;
  /* Map with slack and cut both ends off: one mmap and at most two munmaps.
   * (Trying an exact-size mapping first rarely pays: the kernel hands out
   * page-aligned addresses, so a 4 MiB boundary is hit 1 time in 1024.) */
  void* p;
  int err;
  if (align == HK_OS_PAGE) return map_raw(len, reserve, out);
  err = map_raw(len + align, reserve, &p);
  if (err == ENOMEM) return map_aligned_exact(len, align, reserve, out);
  if (err) return err;
  uintptr_t a = ((uintptr_t)p + align - 1) & ~(uintptr_t)(align - 1);
  size_t head = a - (uintptr_t)p;
  size_t tail = align - head;
  if (head) _hk_os_unmap(p, head);
  if (tail) _hk_os_unmap((void*)(a + len), tail);
  *out = (void*)a;
  return 0;
}

int _hk_os_map_file(int fd, size_t len, void** out) {
  count_call(&_hk_proc.mmap_calls);
  void* p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) { *out = NULL; return errno ? errno : ENOMEM; }
  *out = p;
  return 0;
}

int _hk_os_unmap_file(void* p, size_t len) { return _hk_os_unmap(p, len); }

int _hk_os_decommit(void* p, size_t len) {
  if (len == 0) return 0;
  count_call(&_hk_proc.madvise_calls);
  count_returned(len);
  return KERNEL_TIMED(madvise(p, len, MADV_DONTNEED)) == 0 ? 0 : errno;
}

int _hk_os_grow_in_place(void* p, size_t old_len, size_t new_len) {
  count_call(&_hk_proc.mmap_calls);
  void* q = KERNEL_TIMED(mremap(p, old_len, new_len, 0));
  return q == MAP_FAILED ? errno : 0;
}

int _hk_os_move(void* p, size_t len, void* dst) {
  count_call(&_hk_proc.mmap_calls);
  void* q = KERNEL_TIMED(mremap(p, len, len, MREMAP_MAYMOVE | MREMAP_FIXED, dst));
  return q == MAP_FAILED ? errno : 0;
}

bool _hk_os_refill(void* p, size_t len) {
  count_call(&_hk_proc.mmap_calls);
  void* q = KERNEL_TIMED(mmap(p, len, PROT_READ | PROT_WRITE,
                              MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0));
  if (q == p) return true;                        /* the hole, filled */
  if (q == MAP_FAILED) return errno == EEXIST;    /* still mapped */
  _hk_os_unmap(q, len);   /* a kernel before 4.17 took the flag for a hint: p is taken */
  return true;
}

int _hk_os_shrink(void* p, size_t old_len, size_t new_len) {
  if (new_len >= old_len) return 0;
  return _hk_os_unmap((char*)p + new_len, old_len - new_len);
}

uint64_t _hk_os_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

uint64_t _hk_os_now_coarse_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

uint32_t _hk_os_tid(void) { return (uint32_t)syscall(SYS_gettid); }

/* How much of want bytes fd can take before RLIMIT_FSIZE: all of them but
 * for a regular file, whose size is limited. Where it would be written is
 * looked up for each write, since another writer may append meanwhile. */
static size_t fsize_room(int fd, size_t want) {
  uint64_t limit = _hk_os_fsize_limit();
  struct stat sb;
  if (limit == UINT64_MAX || fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) return want;
  int fl = fcntl(fd, F_GETFL);
  off_t at = fl >= 0 && (fl & O_APPEND) ? sb.st_size : lseek(fd, 0, SEEK_CUR);
  if (at < 0 || (uint64_t)at >= limit) return 0;
  return limit - (uint64_t)at < want ? (size_t)(limit - (uint64_t)at) : want;
}

void _hk_os_write(int fd, const char* buf, size_t len) {
  while (len > 0) {
    size_t room = fsize_room(fd, len);
    if (room == 0) return;
    ssize_t w = write(fd, buf, room);
    if (w < 0) { if (errno == EINTR) continue; return; }
    buf += w;
    len -= (size_t)w;
  }
}

/* ---- the telemetry directory and its files ------------------------------------ */
static void describe(const struct stat* sb, hk_file_info_t* info) {
  info->dev = (uint64_t)sb->st_dev;
  info->ino = (uint64_t)sb->st_ino;
  info->uid = (uint32_t)sb->st_uid;
  info->mode = (uint32_t)sb->st_mode;
  info->nlink = (uint32_t)sb->st_nlink;
}

/* Opens with flags and describes the result; closes it when fstat fails. */
static int open_described(int dfd, const char* name, int flags, int* fd, hk_file_info_t* info) {
  int f;
  do f = dfd >= 0 ? openat(dfd, name, flags) : open(name, flags);
  while (f < 0 && errno == EINTR);
  if (f < 0) { *fd = -1; return errno; }
  struct stat sb;
  if (fstat(f, &sb) != 0) { int err = errno; close(f); *fd = -1; return err; }
  describe(&sb, info);
  *fd = f;
  return 0;
}

int _hk_os_open_dir(const char* path, int* fd, hk_file_info_t* info) {
  return open_described(-1, path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC, fd, info);
}

int _hk_os_open_read_at(int dfd, const char* name, int* fd, hk_file_info_t* info) {
  return open_described(dfd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, fd, info);
}

int _hk_os_write_locked(int fd, bool* locked) {
  /* OFD commands want l_pid 0; F_RDLCK conflicts only with write locks. */
  struct flock fl;
  memset(&fl, 0, sizeof fl);
  fl.l_type = F_RDLCK;
  fl.l_whence = SEEK_SET;
  *locked = false;
  if (fcntl(fd, F_OFD_GETLK, &fl) != 0) return errno;
  *locked = fl.l_type == F_WRLCK;
  return 0;
}

int _hk_os_create_at(int dfd, const char* name, int* fd, hk_file_info_t* info) {
  int f;
  do f = openat(dfd, name, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  while (f < 0 && errno == EINTR);
  if (f < 0) { *fd = -1; return errno; }
  struct stat sb;
  /* 0600 whatever the umask: the owner reads it back after an exec. */
  if (fchmod(f, 0600) != 0 || fstat(f, &sb) != 0) {
    int err = errno;
    close(f);
    unlinkat(dfd, name, 0);
    *fd = -1;
    return err;
  }
  describe(&sb, info);
  *fd = f;
  return 0;
}

int _hk_os_stat_at(int dfd, const char* name, hk_file_info_t* info) {
  struct stat sb;
  if (fstatat(dfd, name, &sb, AT_SYMLINK_NOFOLLOW) != 0) return errno;
  describe(&sb, info);
  return 0;
}

int _hk_os_unlink_at(int dfd, const char* name) {
  return unlinkat(dfd, name, 0) == 0 ? 0 : errno;
}

int _hk_os_reserve_file(int fd, size_t len) {
  int err;
  do err = fallocate(fd, 0, 0, (off_t)len) == 0 ? 0 : errno;
  while (err == EINTR);
  return err;
}

void _hk_os_close(int fd) { if (fd >= 0) close(fd); }

uint32_t _hk_os_euid(void) { return (uint32_t)geteuid(); }

/* ---- the process --------------------------------------------------------------- */
uint32_t _hk_os_pid(void) { return (uint32_t)getpid(); }
uint32_t _hk_os_uid(void) { return (uint32_t)getuid(); }
bool _hk_os_secure(void) { return getauxval(AT_SECURE) != 0; }

uint64_t _hk_os_wall_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

bool _hk_os_thread_gone(uint32_t tid) {
  return syscall(SYS_tgkill, (pid_t)getpid(), (pid_t)tid, 0) != 0 && errno == ESRCH;
}

int _hk_os_dup_cloexec(int fd, int at_least) {
  return fcntl(fd, F_DUPFD_CLOEXEC, at_least);
}

void _hk_os_exe_path(char* out, size_t cap) {
  ssize_t n = readlink("/proc/self/exe", out, cap - 1);
  out[n > 0 ? n : 0] = 0;
}

/* Field 22 of /proc/self/stat, after the parenthesized command name. */
uint64_t _hk_os_start_time(void) {
  char buf[1024];
  int fd = open("/proc/self/stat", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0) return 0;
  buf[n] = 0;
  char* p = strrchr(buf, ')');
  if (!p) return 0;
  /* p+2 is field 3; skip to field 22 */
  p += 2;
  for (int field = 3; field < 22 && *p; p++)
    if (*p == ' ') field++;
  uint64_t v = 0;
  while (*p >= '0' && *p <= '9') v = v * 10 + (uint64_t)(*p++ - '0');
  return v;
}

/* The GNU build id of the main executable, from its program headers. */
void _hk_os_build_id(char* out, size_t cap) {
  out[0] = 0;
  const ElfW(Phdr)* ph = (const ElfW(Phdr)*)getauxval(AT_PHDR);
  size_t n = getauxval(AT_PHNUM);
  if (!ph || !n) return;
  uintptr_t bias = 0;
  for (size_t i = 0; i < n; i++)
    if (ph[i].p_type == PT_PHDR) bias = (uintptr_t)ph - ph[i].p_vaddr;
  for (size_t i = 0; i < n; i++) {
    if (ph[i].p_type != PT_NOTE) continue;
    const uint8_t* p = (const uint8_t*)(bias + ph[i].p_vaddr);
    const uint8_t* end = p + ph[i].p_memsz;
    while (p + sizeof(ElfW(Nhdr)) <= end) {
      const ElfW(Nhdr)* nh = (const ElfW(Nhdr)*)p;
      const uint8_t* name = p + sizeof *nh;
      const uint8_t* desc = name + ((nh->n_namesz + 3) & ~3u);
      if (nh->n_type == NT_GNU_BUILD_ID && nh->n_namesz == 4 && memcmp(name, "GNU", 4) == 0 &&
          desc + nh->n_descsz <= end) {
        static const char hex[] = "0123456789abcdef";
        size_t k = 0;
        for (size_t j = 0; j < nh->n_descsz && k + 2 < cap; j++) {
          out[k++] = hex[desc[j] >> 4];
          out[k++] = hex[desc[j] & 15];
        }
        out[k] = 0;
        return;
      }
      p = desc + ((nh->n_descsz + 3) & ~3u);
    }
  }
}


/* ---- locks ------------------------------------------------------------------------ */
void _hk_lock_slow(hk_lock_t* l) {
  for (unsigned spins = 0;; spins++) {
    if (hk_load_relaxed(&l->v) == 0) {
      int expect = 0;
      if (atomic_compare_exchange_weak_explicit(&l->v, &expect, 1,
            memory_order_acquire, memory_order_relaxed)) return;
    }
    if (spins < 64) __builtin_ia32_pause();
    else sched_yield();
  }
}

/* ---- trace files (trace.c) ------------------------------------------------------ */
int _hk_os_create_path(const char* path, int* fd) {
  int f;
  do f = open(path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  while (f < 0 && errno == EINTR);
  if (f < 0) { *fd = -1; return errno; }
  if (fchmod(f, 0600) != 0) { int err = errno; close(f); *fd = -1; return err; }
  *fd = f;
  return 0;
}

int _hk_os_create_wo_at(int dfd, const char* name, int* fd) {
  int f;
  do f = openat(dfd, name, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  while (f < 0 && errno == EINTR);
  if (f < 0) { *fd = -1; return errno; }
  if (fchmod(f, 0600) != 0) { int err = errno; close(f); unlinkat(dfd, name, 0); *fd = -1; return err; }
  *fd = f;
  return 0;
}

int _hk_os_append(int fd, const void* buf, size_t len, uint64_t off) {
  uint64_t limit = _hk_os_fsize_limit();
  if (off > limit || len > limit - off) return EFBIG;
  const char* b = buf;
  size_t left = len;
  while (left > 0) {
    ssize_t w = write(fd, b, left);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      int err = w < 0 ? errno : ENOSPC;
      /* Half a chunk would break the framing of every later one. */
      if (left != len && (ftruncate(fd, (off_t)off) != 0 || lseek(fd, (off_t)off, SEEK_SET) < 0))
        return EIO;
      return err;
    }
    b += w;
    left -= (size_t)w;
  }
  return 0;
}

uint64_t _hk_os_fsize_limit(void) {
  struct rlimit rl;
  if (getrlimit(RLIMIT_FSIZE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) return UINT64_MAX;
  return (uint64_t)rl.rlim_cur;
}

size_t _hk_os_read_small(const char* path, char* buf, size_t cap) {
  int f;
  do f = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  while (f < 0 && errno == EINTR);
  if (f < 0) return 0;
  ssize_t r;
  do r = read(f, buf, cap);
  while (r < 0 && errno == EINTR);
  close(f);
  return r > 0 ? (size_t)r : 0;
}

/* ---- the background thread (background.c) ------------------------------------ */
#include <pthread.h>
#include <sys/prctl.h>

void _hk_os_sleep_ms(uint32_t ms) {
  struct timespec ts = {(time_t)(ms / 1000u), (long)(ms % 1000u) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {}
}

/* "Seccomp: 2" in /proc/self/status: a filter whose rules we cannot read
 * decides whether a new thread's clone is allowed or kills the process. */
bool _hk_os_seccomp_filtered(void) {
  char buf[4096];
  size_t n = _hk_os_read_small("/proc/self/status", buf, sizeof buf - 1);
  buf[n] = 0;
  for (size_t i = 0; i + 9 < n; i++)
    if ((i == 0 || buf[i - 1] == '\n') && memcmp(buf + i, "Seccomp:", 8) == 0) {
      const char* p = buf + i + 8;
      while (*p == ' ' || *p == '\t') p++;
      return *p != '0';
    }
  return false;   /* a kernel without the line has no seccomp */
}

static void* (*daemon_fn)(void*);
static const char* daemon_name;

static void* daemon_start(void* arg) {
  prctl(PR_SET_NAME, (unsigned long)daemon_name, 0, 0, 0);
  return daemon_fn(arg);
}

int _hk_os_start_daemon_thread(void* (*fn)(void*), const char* name) {
  pthread_attr_t attr;
  int err = pthread_attr_init(&attr);
  if (err) return err;
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  pthread_attr_setstacksize(&attr, 64u << 10);
  /* Every signal blocked, so none meant for the program's own threads (a
   * sigwait loop, a handler that expects its threads) is delivered here. */
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  daemon_fn = fn;
  daemon_name = name;
  pthread_t t;
  err = pthread_create(&t, &attr, daemon_start, NULL);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  pthread_attr_destroy(&attr);
  return err;
}
