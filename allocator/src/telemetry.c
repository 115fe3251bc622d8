/* telemetry.c — the shared-memory file: counters out, policy snapshots in.
 *
 * DEPENDENCIES: this file uses options.c (the HAKMEM_TELEMETRY* options,
 * hk_policy_set/bounds, and _hk_policy_observe to mirror the policy in
 * force); options.c never calls back here by name. Every OS call goes
 * through prim.h.
 *
 * When the telemetry directory exists (HAKMEM_SHM_DIR, default
 * /dev/shm/hakmem; HAKMEM_TELEMETRY=0 turns this off) and a reader holds
 * its lease, the process maps one file <dir>/<pid>-<starttime>, laid out as
 * schemas/shm_layout.json says (shm_layout.h): a header, a ring of records
 * of every counter, and the policy area where hakmem-learnd writes
 * snapshots.
 *
 * Nothing here runs on the fast path. The slow path calls _hk_tel_tick with
 * the coarse clock it already read: every HAKMEM_TELEMETRY_MS (default 100)
 * one thread writes a record, and on every call it compares the snapshot
 * version word with the last one it examined (one load).
 *
 * TRUST (DESIGN.md "Shared memory"; the reader's side is learner/hakmem).
 * The directory is shared by every user, so nothing in it may crash, hang
 * or steer this process:
 *  - the directory is opened without following a link and accepted only
 *    when owned by root or our effective user and, if others may write it,
 *    sticky (no other user can then remove or replace our file);
 *  - a file is made only while a reader holds the lease (lease_held;
 *    learner/hakmem/lease.py CONTRACT), so without learnd nothing piles up;
 *  - the file's blocks are reserved (fallocate) before the mapping is
 *    written: a full filesystem means no telemetry, never SIGBUS; and no
 *    file is made that RLIMIT_FSIZE would not let it grow to (fallocate
 *    past the limit raises SIGXFSZ, which kills);
 *  - at exit the name is removed only if it still leads to our file in our
 *    directory (both compared by device and inode);
 *  - every way this fails is counted (tel_failures) and the last reason is
 *    printed by the HAKMEM_STATS table (_hk_tel_describe), except "no
 *    directory" and "no lease", which are how a machine without learnd is.
 *
 * SYNCHRONIZATION
 *  1. tel.lock (try-lock) makes one thread at a time make the file, write
 *     records and examine snapshots; a thread that finds it taken moves on.
 *  2. Records are seqlocked: seq odd while a slot is written, even after
 *     (release); ring_head is stored with release after the record.
 *  3. Snapshots: the writer fills slot[v % 2], then stores v with release.
 *     We load v with acquire, copy the slot, and load v again: a changed
 *     word means the copy may be torn, so it is examined again later. A copy
 *     whose slot version, checksum or bounds are wrong is rejected whole and
 *     counted; the policy in force stays.
 *  4. in_force is written by write_in_force, the policy observer, which
 *     options.c calls under the policy lock for every policy installed;
 *     checksum last, and readers retry on a checksum mismatch.
 *  5. The file is made on a tick (under tel.lock): the first try one epoch
 *     after start (see _hk_tel_start), then, while it cannot be made (no
 *     directory, no lease, a failure), again after 1 s, 2 s, ... 16 s, so a
 *     service started before learnd is picked up.
 *  6. tel.why (the outcome of the last try, with its argument) is one
 *     atomic word: stored with release under tel.lock after tel.path, read
 *     with acquire by the stats printer, which takes no lock.
 *  7. Fork: the child unmaps the parent's file (without removing it) and
 *     waits an epoch like a new process before it makes its own, so a child
 *     that ends early (with _exit, which runs no destructor) leaves nothing.
 */
#define _GNU_SOURCE
#include <sys/stat.h>

#include "internal.h"
#include "prim.h"
#include "shm_layout.h"
#include "trace.h"

_Static_assert(HK_SHM_NUM_CLASSES == HK_NUM_CLASSES, "layout and allocator agree on classes");

enum { TEL_OFF = 0, TEL_ON = 1, TEL_PENDING = 2 };
enum { REJ_NONE = 0, REJ_SLOT_VERSION = 1, REJ_CHECKSUM = 2, REJ_BOUNDS = 3 };
/* Why telemetry is (not) on: the outcome of the last try. The ones from
 * WHY_DIR_LINK on are failures, counted in tel_failures; the argument (a
 * uid or an errno) is kept with it. */
enum {
  WHY_DISABLED = 0,     /* HAKMEM_TELEMETRY=0 (or never started) */
  WHY_ON,               /* the file is made (and removed at exit) */
  WHY_WAITING,          /* not tried yet: the first try is one epoch after start */
  WHY_NO_DIR,           /* the directory does not exist (no learnd) */
  WHY_NO_LEASE,         /* nobody holds learnd.lock */
  WHY_LEASE_UNTRUSTED,  /* learnd.lock is not a regular file of root or ours with one name (arg: owner) */
  WHY_DIR_LINK,         /* the directory is a symbolic link or not a directory */
  WHY_DIR_OWNER,        /* the directory belongs to another user (arg: owner) */
  WHY_DIR_MODE,         /* others may write it and it is not sticky */
  WHY_NAME_TAKEN,       /* our name exists and is not our file (arg: owner) */
  WHY_NO_SPACE,         /* the filesystem cannot hold the file's blocks */
  WHY_FSIZE,            /* RLIMIT_FSIZE is below the file's size (arg: the limit, bytes) */
  WHY_ERROR,            /* another error (arg: errno) */
};
#define WHY_FIRST_FAILURE WHY_DIR_LINK

#define LEASE_NAME "learnd.lock"   /* learner/hakmem/lease.py NAME */
#define RETRY_FIRST_NS 1000000000ull
#define RETRY_MAX_NS   16000000000ull

bool _hk_tel_on;   /* read on the slow path: a file is mapped or pending */

static struct {
  int state;                  /* TEL_* */
  hk_lock_t lock;
  hk_shm_header_t* hdr;       /* the mapping */
  hk_shm_record_t* ring;
  hk_shm_policy_area_t* pol;
  size_t len;
  uint64_t epoch_ns;
  uint64_t next_ns;           /* next record due (coarse clock) */
  uint64_t last_seen;         /* snapshot version examined last */
  uint64_t retry_ns;          /* PENDING: wait before the try after the next */
  _Atomic uint64_t why;       /* WHY_* << 32 | its argument (point 6) */
  uint64_t dir_dev, dir_ino;  /* the directory the file was made in */
  uint64_t file_dev, file_ino;
  char dir[512];
  char name[64];              /* <pid>-<starttime> */
  char path[600];
  hk_shm_record_t prev;       /* last record written, for monotonic counters */
  hk_stats_t st;              /* scratch (8 KiB: off the thread stacks) */
} tel HK_SPARSE_BSS;          /* 17 KiB nobody touches with telemetry off */

static void set_why(unsigned why, uint32_t arg) {
  hk_store_release(&tel.why, (uint64_t)why << 32 | arg);
}

/* ---- policy slots ------------------------------------------------------------ */
/* FNV-1a 64 over the version and the slot after the checksum field. */
static uint64_t slot_checksum(const hk_shm_policy_slot_t* s) {
  uint64_t h = 0xcbf29ce484222325ull;
  uint64_t v = s->version;
  for (int i = 0; i < 8; i++) { h ^= (uint8_t)(v >> (8 * i)); h *= 0x100000001b3ull; }
  const uint8_t* p = (const uint8_t*)s + offsetof(hk_shm_policy_slot_t, checksum) + sizeof s->checksum;
  const uint8_t* end = (const uint8_t*)(s + 1);
  for (; p < end; p++) { h ^= *p; h *= 0x100000001b3ull; }
  return h;
}

/* The knobs between hk_policy_t and a policy slot, field by field from the
 * one list (hakmem_knobs.h); class 0 stays 0 in both directions. */
#define HK_X_PROC_COPY(name, NAME, bounds, env, unit, min, max, def, desc) dst->name = src->name;
#define HK_X_CLASS_COPY(name, NAME, bounds, env, unit, min, max, def, desc) dst->name[c] = src->name[c];
#define HK_X_SAME(name, NAME, bounds, env, unit, min, max, def, desc) \
  _Static_assert(sizeof(((hk_policy_t*)0)->name) == sizeof(((hk_shm_policy_slot_t*)0)->name), #name);
HK_CLASS_KNOBS(HK_X_SAME)
HK_PROC_KNOBS(HK_X_SAME)
#undef HK_X_SAME

static void slot_from_policy(hk_shm_policy_slot_t* dst, const hk_policy_t* src) {
  memset(dst, 0, sizeof *dst);
  dst->version = src->version;
  HK_PROC_KNOBS(HK_X_PROC_COPY)
  for (unsigned c = 1; c < HK_NUM_CLASSES; c++) { HK_CLASS_KNOBS(HK_X_CLASS_COPY) }
}

static void policy_from_slot(hk_policy_t* dst, const hk_shm_policy_slot_t* src) {
  memset(dst, 0, sizeof *dst);
  HK_PROC_KNOBS(HK_X_PROC_COPY)
  for (unsigned c = 1; c < HK_NUM_CLASSES; c++) { HK_CLASS_KNOBS(HK_X_CLASS_COPY) }
}
#undef HK_X_PROC_COPY
#undef HK_X_CLASS_COPY

/* Whether any class-0 entry of a slot is set (they must all be 0). */
static bool slot_class0_set(const hk_shm_policy_slot_t* s) {
#define HK_X_CLASS0(name, NAME, bounds, env, unit, min, max, def, desc) || s->name[0] != 0
  return false HK_CLASS_KNOBS(HK_X_CLASS0);
#undef HK_X_CLASS0
}

/* The policy observer (options.c, under the policy lock): mirrors each
 * policy installed into in_force (point 4). */
static void write_in_force(const hk_policy_t* p) {
  if (!tel.pol) return;
  hk_shm_policy_slot_t s;
  slot_from_policy(&s, p);
  s.checksum = slot_checksum(&s);
  volatile hk_shm_policy_slot_t* dst = &tel.pol->in_force;
  const size_t body = offsetof(hk_shm_policy_slot_t, checksum) + sizeof s.checksum;
  dst->checksum = 0;   /* readers see a mismatch until the copy is whole */
  atomic_thread_fence(memory_order_release);
  memcpy((void*)&dst->version, &s.version, sizeof s.version);
  memcpy((char*)dst + body, (char*)&s + body, sizeof s - body);
  atomic_thread_fence(memory_order_release);
  dst->checksum = s.checksum;
}

/* counted: whether hk_policy_set already counted it in policies_rejected */
static void reject(unsigned why, bool counted) {
  tel.hdr->reject_reason = why;
  hk_store_release((_Atomic uint64_t*)&tel.hdr->rejected, tel.hdr->rejected + 1);
  if (!counted) hk_add_relaxed(&_hk_proc.policies_rejected, 1);
}

/* Checks a copied snapshot and applies it; false when it was rejected. */
static bool apply_snapshot(const hk_shm_policy_slot_t* s, uint64_t v) {
  if (s->version != v) { reject(REJ_SLOT_VERSION, false); return false; }
  if (slot_checksum(s) != s->checksum) { reject(REJ_CHECKSUM, false); return false; }
  if (s->flags != 0 || slot_class0_set(s)) {
    reject(REJ_BOUNDS, false);
    return false;
  }
  hk_policy_t p;
  policy_from_slot(&p, s);
  /* hk_policy_set validates every value and counts its own rejections. */
  if (hk_policy_set(&p) == 0) { reject(REJ_BOUNDS, true); return false; }
  tel.hdr->reject_reason = REJ_NONE;
  hk_store_release((_Atomic uint64_t*)&tel.hdr->applied_version, v);
  return true;
}

/* Examines the published snapshot if it is new (tel.lock held). The
 * header's seen_version is stored last, so a reader that sees it also sees
 * the outcome (applied_version or the rejection). */
static void poll_policy(void) {
  _Atomic uint64_t* word = (_Atomic uint64_t*)&tel.pol->version;
  uint64_t v = hk_load_acquire(word);
  if (v == tel.last_seen) return;
  hk_shm_policy_slot_t s;
  memcpy(&s, (const void*)&tel.pol->slot[v & 1], sizeof s);
  atomic_thread_fence(memory_order_acquire);
  if (hk_load_relaxed(word) != v) return;    /* rewritten under us: later */
  tel.last_seen = v;
  apply_snapshot(&s, v);
  hk_store_release((_Atomic uint64_t*)&tel.hdr->seen_version, v);
}

/* ---- live capture requests (trace.c; learner/hakmem/cli/trace_record.py) ------------
 * A reader asks by writing the policy area's trace_request; we answer in the
 * header. The trace file is made by us, in the directory our file was made
 * in (checked again by device and inode), under a name of ours: whoever
 * writes the request chooses only the bounds, never a path. (tel.lock held) */
#define LIVE_DEFAULT_BYTES ((uint64_t)64 << 20)
#define LIVE_MAX_BYTES     ((uint64_t)1 << 30)
#define LIVE_MAX_SECONDS   86400u

static int live_start(uint64_t req, uint32_t secs, uint64_t max_bytes) {
  if (secs == 0 || secs > LIVE_MAX_SECONDS || max_bytes > LIVE_MAX_BYTES) return EINVAL;
  if (max_bytes == 0) max_bytes = LIVE_DEFAULT_BYTES;
  int dfd;
  hk_file_info_t d;
  int err = _hk_os_open_dir(tel.dir, &dfd, &d);
  if (err) return err;
  if (d.dev != tel.dir_dev || d.ino != tel.dir_ino) { _hk_os_close(dfd); return ESTALE; }
  char name[96];
  _hk_fmt(name, sizeof name, "%s.trace-%lu", tel.name, req);
  err = _hk_trace_live_start(dfd, name, secs, max_bytes);
  _hk_os_close(dfd);
  return err;
}

static void poll_trace(void) {
  hk_shm_header_t* h = tel.hdr;
  uint64_t req = hk_load_acquire((_Atomic uint64_t*)&tel.pol->trace_request);
  if (req != h->trace_seen) {
    uint32_t secs = tel.pol->trace_seconds;
    uint64_t max_bytes = tel.pol->trace_max_bytes;
    int err = live_start(req, secs, max_bytes);
    h->trace_error = (uint32_t)err;
    h->trace_state = err ? 3 : 1;
    hk_store_release((_Atomic uint64_t*)&h->trace_seen, req);
  } else if (h->trace_state == 1 && _hk_trace_live_state() == 2) {
    hk_store_release((_Atomic uint32_t*)&h->trace_state, 2);
  }
}

/* ---- records ----------------------------------------------------------------- */
/* Counters are cumulative; a snapshot taken while threads publish can read a
 * derived counter (hits, frees) a few blocks low, so each one is kept at
 * least at its previous value. Gauges are written as read. */
#define IS_GAUGE(desc) (desc[0] == 'g' && desc[1] == 'a' && desc[2] == 'u' && desc[3] == 'g')
#define MONO(dst, prev, val, desc) \
  ((dst) = (!IS_GAUGE(desc) && (val) < (prev)) ? (prev) : (val))

static void write_record(const hk_stats_t* st, uint64_t now_ns) {   /* tel.lock held */
  _Atomic uint64_t* headp = (_Atomic uint64_t*)&tel.hdr->ring_head;
  uint64_t head = hk_load_relaxed(headp);
  hk_shm_record_t* r = &tel.ring[head % HK_SHM_RING_SLOTS];
  hk_shm_record_t* prev = &tel.prev;
  _Atomic uint64_t* seqp = (_Atomic uint64_t*)&r->seq;
  uint64_t seq = hk_load_relaxed(seqp);
  hk_store_relaxed(seqp, seq | 1);
  atomic_thread_fence(memory_order_release);
  prev->index = head;
  prev->time_ns = now_ns;
#define HK_X_PROC(name, desc) MONO(prev->proc.name, prev->proc.name, st->name, desc);
  HK_PROC_COUNTERS(HK_X_PROC)
#undef HK_X_PROC
  for (unsigned c = 0; c < HK_NUM_CLASSES; c++) {
    hk_shm_class_t* d = &prev->cls[c];
    const hk_class_stats_t* s = &st->cls[c];
#define HK_X_CLS(name, desc) MONO(d->name, d->name, s->name, desc);
    HK_CLASS_COUNTERS(HK_X_CLS)
#undef HK_X_CLS
  }
  memcpy((char*)r + offsetof(hk_shm_record_t, index), (char*)prev + offsetof(hk_shm_record_t, index),
         sizeof *r - offsetof(hk_shm_record_t, index));
  hk_store_release(seqp, (seq | 1) + 1);
  hk_store_release(headp, head + 1);
}

/* ---- creating the file --------------------------------------------------------- */
static void fill_header(hk_shm_header_t* h, uint32_t pid, uint64_t start_time) {
  h->layout_version = HK_SHM_LAYOUT_VERSION;
  h->header_size = HK_SHM_HEADER_SIZE;
  h->file_size = tel.len;
  h->pid = pid;
  h->uid = _hk_os_uid();
  h->start_time = start_time;
  h->created_ns = _hk_os_wall_ns();
  h->ring_offset = HK_SHM_HEADER_SIZE;
  h->ring_slots = HK_SHM_RING_SLOTS;
  h->record_size = sizeof(hk_shm_record_t);
  h->policy_offset = HK_SHM_HEADER_SIZE + (uint64_t)HK_SHM_RING_SLOTS * sizeof(hk_shm_record_t);
  h->policy_size = sizeof(hk_shm_policy_area_t);
  h->epoch_ms = (uint32_t)(tel.epoch_ns / 1000000u);
  h->num_classes = HK_NUM_CLASSES;
  hk_policy_bounds_t b;
  hk_policy_bounds(1, &b);
  h->batch_max = b.batch_max;
  h->drain_ms_max = b.drain_ms_max;
  h->retain_mib_max = b.retain_mib_max;
  for (unsigned c = 1; c < HK_NUM_CLASSES; c++) {
    hk_policy_bounds(c, &b);
    h->class_size[c] = _hk_class[c].size;
    h->cap_max[c] = b.cap_max;
    h->warm_max[c] = b.warm_max;
  }
  _hk_os_exe_path(h->exe, sizeof h->exe);
  _hk_os_build_id(h->build_id, sizeof h->build_id);
  memcpy(h->hakmem_version, HK_VERSION_STRING, sizeof HK_VERSION_STRING);
}

/* A try that did not make the file: why (counted when it is a failure). */
static bool not_made(unsigned why, uint32_t arg) {
  set_why(why, arg);
  if (why >= WHY_FIRST_FAILURE) hk_add_relaxed(&_hk_proc.tel_failures, 1);
  return false;
}

/* Whether a reader holds the directory's lease (learner/hakmem/lease.py
 * CONTRACT): learnd.lock is a regular file of root or of our effective
 * user, and another open file description holds a write lock on it. It is
 * opened without following a link and without waiting for a FIFO's writer;
 * we only test for the lock (F_OFD_GETLK), never take one. */
static bool lease_held(int dfd, uint32_t euid) {
  int fd;
  hk_file_info_t l;
  if (_hk_os_open_read_at(dfd, LEASE_NAME, &fd, &l) != 0) return not_made(WHY_NO_LEASE, 0);
  bool locked = false;
  /* One name only: where hard links to others' files are allowed
   * (fs.protected_hardlinks=0), a link to some locked file of root's is
   * not a lease. */
  bool trusted = S_ISREG(l.mode) && (l.uid == 0 || l.uid == euid) && l.nlink == 1;
  if (trusted && _hk_os_write_locked(fd, &locked) != 0) locked = false;
  _hk_os_close(fd);
  if (!trusted) return not_made(WHY_LEASE_UNTRUSTED, l.uid);
  if (!locked) return not_made(WHY_NO_LEASE, 0);
  return true;
}

/* Creates <dir>/<name> (dfd), replacing a file our own image left there
 * before an exec (same pid and start time, so the same name). */
static int create_named(int dfd, uint32_t euid, int* fd, hk_file_info_t* f) {
  int err = 0;
  for (int attempt = 0; attempt < 2; attempt++) {
    err = _hk_os_create_at(dfd, tel.name, fd, f);
    if (err != EEXIST) return err;
    hk_file_info_t old;
    if (_hk_os_stat_at(dfd, tel.name, &old) != 0) continue;   /* gone meanwhile */
    if (old.uid != euid || !S_ISREG(old.mode)) {
      f->uid = old.uid;
      return EEXIST;
    }
    if (_hk_os_unlink_at(dfd, tel.name) != 0) break;
  }
  f->uid = euid;
  return err;
}

/* The file's length: header, ring and policy area, in whole pages. */
static size_t file_len(void) {
  size_t len = HK_SHM_HEADER_SIZE + (size_t)HK_SHM_RING_SLOTS * sizeof(hk_shm_record_t) +
               sizeof(hk_shm_policy_area_t);
  return (len + HK_OS_PAGE - 1) & ~(size_t)(HK_OS_PAGE - 1);
}

/* Tries to make and map this process's file (tel.lock held); false leaves
 * it PENDING with the reason in tel.why. */
static bool create_file(void) {
  /* The directory first: without it (no learnd) a process pays one failed
   * open and nothing else. */
  int dfd;
  hk_file_info_t d;
  int err = _hk_os_open_dir(tel.dir, &dfd, &d);
  if (err == ENOENT) return not_made(WHY_NO_DIR, 0);
  if (err == ELOOP || err == ENOTDIR) return not_made(WHY_DIR_LINK, 0);
  if (err) return not_made(WHY_ERROR, (uint32_t)err);
  uint32_t euid = _hk_os_euid();
  bool ok = false;
  if (d.uid != 0 && d.uid != euid)
    not_made(WHY_DIR_OWNER, d.uid);
  else if ((d.mode & (S_IWGRP | S_IWOTH)) && !(d.mode & S_ISVTX))
    not_made(WHY_DIR_MODE, 0);
  else if (lease_held(dfd, euid))
    ok = true;
  if (!ok) { _hk_os_close(dfd); return false; }
  size_t len = file_len();
  /* Looked at on every try: the program may change its limit. */
  uint64_t fsize = _hk_os_fsize_limit();
  if (len > fsize) {
    _hk_os_close(dfd);
    return not_made(WHY_FSIZE, (uint32_t)fsize);   /* below len (about 1 MiB): 32 bits hold it */
  }

  uint32_t pid = _hk_os_pid();
  uint64_t start_time = _hk_os_start_time();
  _hk_fmt(tel.name, sizeof tel.name, "%lu-%lu", (uint64_t)pid, start_time);
  _hk_fmt(tel.path, sizeof tel.path, "%s/%s", tel.dir, tel.name);
  int fd;
  hk_file_info_t f;
  err = create_named(dfd, euid, &fd, &f);
  if (err) {
    _hk_os_close(dfd);
    if (err == EEXIST) return not_made(WHY_NAME_TAKEN, f.uid);
    return not_made(err == ENOSPC || err == EDQUOT ? WHY_NO_SPACE : WHY_ERROR, (uint32_t)err);
  }
  /* Every block the mapping will write is allocated now: a write through a
   * mapping to a block the filesystem cannot supply is SIGBUS, and any user
   * can fill /dev/shm. */
  void* map = NULL;
  err = _hk_os_reserve_file(fd, len);
  if (err == 0) err = _hk_os_map_file(fd, len, &map);
  _hk_os_close(fd);
  if (err) {
    _hk_os_unlink_at(dfd, tel.name);
    _hk_os_close(dfd);
    return not_made(err == ENOSPC || err == EDQUOT ? WHY_NO_SPACE : WHY_ERROR, (uint32_t)err);
  }
  _hk_os_close(dfd);
  tel.dir_dev = d.dev;
  tel.dir_ino = d.ino;
  tel.file_dev = f.dev;
  tel.file_ino = f.ino;
  tel.len = len;
  tel.hdr = map;
  tel.ring = (hk_shm_record_t*)((char*)map + HK_SHM_HEADER_SIZE);
  tel.pol = (hk_shm_policy_area_t*)((char*)map + HK_SHM_HEADER_SIZE +
                                    (size_t)HK_SHM_RING_SLOTS * sizeof(hk_shm_record_t));
  tel.last_seen = 0;
  fill_header(tel.hdr, pid, start_time);
  _hk_policy_observe(write_in_force);
  hk_store_release((_Atomic uint64_t*)&tel.hdr->magic, HK_SHM_MAGIC);
  set_why(WHY_ON, 0);
  return true;
}

/* Removes our file at exit, only if <dir> is still the directory it was
 * made in and the name still leads to it: the directory may have been
 * renamed and replaced meanwhile, and what is there now is not ours. */
static void remove_file(void) {
  int dfd;
  hk_file_info_t d, f;
  if (_hk_os_open_dir(tel.dir, &dfd, &d) != 0) return;
  if (d.dev == tel.dir_dev && d.ino == tel.dir_ino &&
      _hk_os_stat_at(dfd, tel.name, &f) == 0 && f.dev == tel.file_dev && f.ino == tel.file_ino)
    _hk_os_unlink_at(dfd, tel.name);
  _hk_os_close(dfd);
}

HK_INLINE bool tel_trylock(void) {
  int expect = 0;
  return atomic_compare_exchange_strong_explicit(&tel.lock.v, &expect, 1,
           memory_order_acquire, memory_order_relaxed);
}

/* ---- entry points ---------------------------------------------------------- */
/* PENDING from now: the first try one epoch from now, then RETRY_FIRST_NS. */
static void pend(uint64_t now_ns) {
  tel.next_ns = now_ns + tel.epoch_ns;
  tel.retry_ns = RETRY_FIRST_NS;
  tel.state = TEL_PENDING;
  set_why(WHY_WAITING, 0);
  _hk_tel_on = true;
}

void _hk_tel_start(void) {
  if (!_hk_tel_enabled()) return;
  const char* dir = _hk_env_get("HAKMEM_SHM_DIR");
  if (!dir || !*dir) dir = "/dev/shm/hakmem";
  if (strlen(dir) >= sizeof tel.dir) {
    _hk_warn("telemetry off", "HAKMEM_SHM_DIR is too long");
    not_made(WHY_ERROR, ENAMETOOLONG);
    return;
  }
  memcpy(tel.dir, dir, strlen(dir) + 1);
  tel.epoch_ns = (uint64_t)_hk_tel_epoch_ms() * 1000000u;
  /* The first try is at the first slow path one epoch after start: a
   * process that lives less than an epoch could not fill a window for a
   * reader anyway, and short processes by the thousand (shell pipelines,
   * git) skip the file's cost: about 170 us each, 15% of a process that
   * makes a few thousand allocations, measured on the startup benchmark. */
  pend(_hk_os_now_coarse_ns());
}

void _hk_tel_tick(uint64_t now_ns) {
  if (now_ns < tel.next_ns &&
      (tel.state != TEL_ON || hk_load_relaxed((_Atomic uint64_t*)&tel.pol->version) == tel.last_seen))
    return;
  if (!tel_trylock()) return;
  if (tel.state == TEL_PENDING && now_ns >= tel.next_ns) {
    if (create_file()) {
      tel.state = TEL_ON;   /* and a first record now */
    } else {
      tel.next_ns = now_ns + tel.retry_ns;
      tel.retry_ns = tel.retry_ns * 2 < RETRY_MAX_NS ? tel.retry_ns * 2 : RETRY_MAX_NS;
    }
  }
  if (tel.state == TEL_ON) {
    poll_policy();
    poll_trace();
    if (HK_UNLIKELY(_hk_trace_on)) _hk_trace_poll(now_ns);   /* a live capture's time bound */
    if (now_ns >= tel.next_ns) {
      tel.next_ns = now_ns + tel.epoch_ns;
      _hk_stats_collect(&tel.st);
      write_record(&tel.st, _hk_os_now_ns());
    }
  }
  _hk_unlock(&tel.lock);
}

/* At normal exit with no file mapped: telemetry ends here, and true says no
 * snapshot is needed for it. (Taking one costs a small process three page
 * faults of an 8 KiB buffer.) Under the lock, so no file appears after. */
bool _hk_tel_exit_unmapped(void) {
  _hk_lock(&tel.lock);
  bool unmapped = tel.state != TEL_ON;
  if (unmapped) {
    tel.state = TEL_OFF;
    _hk_tel_on = false;
  }
  _hk_unlock(&tel.lock);
  return unmapped;
}

/* At normal exit: one last record from the same snapshot the exit-time
 * table prints (st), then the file goes. */
void _hk_tel_exit(const hk_stats_t* st) {
  _hk_lock(&tel.lock);
  if (tel.state == TEL_ON) {
    if (tel.hdr->trace_state == 1 && _hk_trace_live_state() == 2)
      hk_store_release((_Atomic uint32_t*)&tel.hdr->trace_state, 2);
    write_record(st, _hk_os_now_ns());
    hk_store_release((_Atomic uint32_t*)&tel.hdr->state, 1);
    remove_file();
  }
  tel.state = TEL_OFF;
  _hk_tel_on = false;
  _hk_unlock(&tel.lock);
}

void _hk_tel_after_fork_child(void) {
  _hk_lock_reinit(&tel.lock);
  if (tel.state == TEL_OFF) return;
  if (tel.state == TEL_ON) {
    /* The parent's file stays the parent's. */
    _hk_os_unmap_file(tel.hdr, tel.len);
    tel.hdr = NULL;
    tel.ring = NULL;
    tel.pol = NULL;
  }
  pend(_hk_os_now_coarse_ns());
}

/* One line for the HAKMEM_STATS table: whether telemetry is on, and if
 * not, why (failures: the tel_failures counter of the snapshot printed). */
size_t _hk_tel_describe(char* buf, size_t cap, uint64_t failures) {
  uint64_t w = hk_load_acquire(&tel.why);
  unsigned why = (unsigned)(w >> 32);
  uint32_t arg = (uint32_t)w;
  const char* dir = tel.dir;
  size_t n;
  switch (why) {
    case WHY_DISABLED:
      return _hk_fmt(buf, cap, "  telemetry: off (HAKMEM_TELEMETRY=0)\n");
    case WHY_ON:
      return _hk_fmt(buf, cap, "  telemetry: on, %s\n", tel.path);
    case WHY_WAITING:
      n = _hk_fmt(buf, cap, "  telemetry: off: not tried yet (the first try is one epoch after start)"); break;
    case WHY_NO_DIR:
      n = _hk_fmt(buf, cap, "  telemetry: off: no directory %s (no learnd)", dir); break;
    case WHY_NO_LEASE:
      n = _hk_fmt(buf, cap, "  telemetry: off: no lease: nobody holds %s/" LEASE_NAME " (no learnd)", dir); break;
    case WHY_LEASE_UNTRUSTED:
      n = _hk_fmt(buf, cap, "  telemetry: off: no lease: %s/" LEASE_NAME " is not a regular file of root or"
                  " ours with one name (owner uid %u)", dir, arg); break;
    case WHY_DIR_LINK:
      n = _hk_fmt(buf, cap, "  telemetry: off: untrusted directory %s: a symbolic link or not a directory", dir); break;
    case WHY_DIR_OWNER:
      n = _hk_fmt(buf, cap, "  telemetry: off: untrusted directory %s: owned by uid %u", dir, arg); break;
    case WHY_DIR_MODE:
      n = _hk_fmt(buf, cap, "  telemetry: off: untrusted directory %s: others may write it and it is not sticky",
                  dir); break;
    case WHY_NAME_TAKEN:
      n = _hk_fmt(buf, cap, "  telemetry: off: name taken: %s is owned by uid %u", tel.path, arg); break;
    case WHY_NO_SPACE:
      n = _hk_fmt(buf, cap, "  telemetry: off: no space for the file's blocks in %s", dir); break;
    case WHY_FSIZE:
      n = _hk_fmt(buf, cap, "  telemetry: off: RLIMIT_FSIZE (%u bytes) is below the file's %lu bytes", arg,
                  (uint64_t)file_len()); break;
    default:
      n = _hk_fmt(buf, cap, "  telemetry: off: cannot make the file in %s (errno %u)", dir, arg); break;
  }
  if (failures) n += _hk_fmt(buf + n, cap - n, " (%lu failures)", failures);
  return n + _hk_fmt(buf + n, cap - n, "\n");
}
