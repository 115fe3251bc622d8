/* test_snapshot.c — policy snapshots rewritten while the allocator copies them.
 *
 * The writer's protocol (telemetry.c "SYNCHRONIZATION" 3): fill slot[v % 2],
 * then store the version word v. The allocator loads the word, copies the
 * slot, and loads the word again: a changed word means the writer may have
 * been rewriting that very slot (for v + 2) during the copy, and the copy is
 * dropped, to be looked at later. Without that second look a torn copy is
 * checked and rejected (a checksum or slot version that does not match), so
 * a writer that follows the protocol would see valid snapshots counted as
 * rejected, and a torn copy that happened to checksum would be applied.
 *
 * Here a writer thread follows the protocol, alternating two valid policies
 * whose bytes differ all along the slot, while the main thread's every malloc
 * and free is a slow path that looks at the word (a thread-cache capacity of
 * 0). The writer publishes in bursts of 1 to 256 versions back to back, so
 * that what the allocator copies during a burst is rewritten under it, then
 * waits for the allocator to look at the last one, which it copies whole and
 * applies. The two threads run on different CPUs where there are two (on one
 * they take turns and nothing tears). Over a second or two of this, every
 * snapshot examined must be applied: none rejected, and many applied.
 * Without the second look at the word a run rejects hundreds of torn copies
 * (about 800 here, quiet or beside two busy loops); the earlier writer, which
 * waited every second version, tore 58 to 537 copies in 262,144 versions
 * here and, once in CI, never in a whole run.
 *
 * The process under test is this program re-executed with telemetry on
 * (HAKMEM_SHM_DIR, read at start); the parent makes the directory and holds
 * its lease (learner/hakmem/lease.py CONTRACT: an OFD write lock on
 * learnd.lock), as learnd would.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "hakmem.h"
#include "harness.h"
#include "testutil.h"
#include "../src/shm_layout.h"

#define K (1u << 18)   /* versions the writer may publish */

static hk_shm_header_t* hdr;
static hk_shm_policy_area_t* pol;
static hk_shm_policy_slot_t image[2];   /* the two policies, version and checksum left 0 */
static uint64_t* checksums;             /* of version V0 + i with image[(i >> 1) & 1] */
static atomic_int stop;
static atomic_ulong published;
#define V0 1000

/* The two threads on different CPUs where this process may use two: on one
 * CPU they take turns, and a copy is never rewritten under the reader. */
static int cpu_pair[2] = {-1, -1};
static void pick_cpus(void) {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) != 0) return;
  int n = 0;
  for (int c = 0; c < CPU_SETSIZE && n < 2; c++)
    if (CPU_ISSET(c, &set)) cpu_pair[n++] = c;
  if (n < 2) cpu_pair[0] = cpu_pair[1] = -1;
}
static void pin(pthread_t t, int cpu) {
  if (cpu < 0) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  pthread_setaffinity_np(t, sizeof set, &set);
}

static uint64_t slot_checksum(const hk_shm_policy_slot_t* s, uint64_t v) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (int i = 0; i < 8; i++) { h ^= (uint8_t)(v >> (8 * i)); h *= 0x100000001b3ull; }
  const uint8_t* p = (const uint8_t*)&s->drain_ms;
  const uint8_t* end = (const uint8_t*)(s + 1);
  for (; p < end; p++) { h ^= *p; h *= 0x100000001b3ull; }
  return h;
}

static void* writer(void* arg) {
  (void)arg;
  _Atomic uint64_t* word = (_Atomic uint64_t*)&pol->version;
  _Atomic uint64_t* seen = (_Atomic uint64_t*)&hdr->seen_version;
  uint32_t i = 0;
  while (i < K && !atomic_load(&stop)) {
    /* A burst of versions back to back: whatever the allocator copies now
     * is rewritten under it... */
    uint32_t burst = 1 + (uint32_t)(mix64(i) & 255);
    uint64_t v = 0;
    for (uint32_t b = 0; b < burst && i < K; b++, i++) {
      v = V0 + i;
      volatile hk_shm_policy_slot_t* s = &pol->slot[v & 1];
      const hk_shm_policy_slot_t* img = &image[(i >> 1) & 1];
      s->version = v;
      memcpy((void*)&s->drain_ms, &img->drain_ms, sizeof *img - offsetof(hk_shm_policy_slot_t, drain_ms));
      s->checksum = checksums[i];
      atomic_store_explicit(word, v, memory_order_release);
    }
    atomic_store(&published, i);
    /* ...then a pause until it has looked at the last one, which it copies
     * whole and applies. */
    for (int spin = 0; spin < 50000 && atomic_load_explicit(seen, memory_order_acquire) < v; spin++)
      __asm__ volatile("pause");
  }
  return NULL;
}

/* The re-executed child: telemetry on, every call a slow path. */
static int child(void) {
  const char* dir = getenv("HAKMEM_SHM_DIR");
  if (!dir) return 2;
  char prefix[32], path[4096] = "";
  snprintf(prefix, sizeof prefix, "%d-", (int)getpid());
  double t0 = now_s();
  while (!path[0] && now_s() - t0 < 10) {   /* slow paths until the file is made */
    for (int i = 0; i < 100; i++) free(malloc(64));
    DIR* d = opendir(dir);
    if (!d) return 3;
    struct dirent* e;
    while ((e = readdir(d)))
      if (strncmp(e->d_name, prefix, strlen(prefix)) == 0) snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    closedir(d);
  }
  if (!path[0]) { harness_say("child: no telemetry file appeared in %s\n", dir); return 4; }
  int fd = open(path, O_RDWR);
  struct stat st;
  if (fd < 0 || fstat(fd, &st) != 0) return 5;
  void* m = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (m == MAP_FAILED) return 6;
  hdr = m;
  pol = (hk_shm_policy_area_t*)((char*)m + hdr->policy_offset);

  /* Two valid policies that differ in every warm pool and the interval. */
  for (int k = 0; k < 2; k++) {
    memset(&image[k], 0, sizeof image[k]);
    image[k].drain_ms = 1000 + (uint32_t)k;
    for (unsigned c = 1; c < HK_NUM_CLASSES; c++) {
      image[k].tcache_cap[c] = 0;     /* stays 0: every call a slow path */
      image[k].tcache_batch[c] = 1;
      image[k].warm_slabs[c] = 1 + (uint32_t)k;
    }
  }
  checksums = mmap(NULL, K * sizeof *checksums, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (checksums == MAP_FAILED) return 7;
  for (uint32_t i = 0; i < K; i++) checksums[i] = slot_checksum(&image[(i >> 1) & 1], V0 + i);

  hk_stats_t s0, s1;
  hk_stats_get(&s0);
  uint64_t rejected0 = hdr->rejected;
  pick_cpus();
  pin(pthread_self(), cpu_pair[0]);
  pthread_t w;
  if (pthread_create(&w, NULL, writer, NULL) != 0) return 8;
  pin(w, cpu_pair[1]);
  t0 = now_s();
  long calls = 0;
  while (now_s() - t0 < 1.5 && atomic_load(&published) < K) {
    for (int i = 0; i < 64; i++) free(malloc(48));
    calls += 128;
  }
  atomic_store(&stop, 1);
  pthread_join(w, NULL);
  for (int i = 0; i < 64; i++) free(malloc(48));   /* the last version looked at */
  hk_stats_get(&s1);
  uint64_t rejected = hdr->rejected - rejected0;
  uint64_t applied = s1.policy_version - s0.policy_version;
  harness_say("child: %lu snapshots published, policy version +%llu, %llu rejected (reason %u, counter +%llu), "
              "%ld slow-path calls, CPUs %d and %d\n", atomic_load(&published), (unsigned long long)applied,
              (unsigned long long)rejected, hdr->reject_reason,
              (unsigned long long)(s1.policies_rejected - s0.policies_rejected), calls, cpu_pair[0], cpu_pair[1]);
  harness_say(rejected == 0 && applied >= 1000 ? "child: ok\n" : "child: FAILED\n");
  return rejected == 0 && applied >= 1000 ? 0 : 1;
}

TEST(torn_snapshots_are_never_examined) {
  const char* base = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
  char dir[256];
  snprintf(dir, sizeof dir, "%s/hk-test-snapshot-XXXXXX", base);
  REQUIRE(mkdtemp(dir) != NULL);
  char lease[512];
  snprintf(lease, sizeof lease, "%s/learnd.lock", dir);
  int lfd = open(lease, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  REQUIRE(lfd >= 0);
  struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET};
  REQUIRE(fcntl(lfd, F_OFD_SETLK, &fl) == 0);
  fchmod(lfd, 0644);

  static char self[4096];
  ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
  REQUIRE(len > 0);
  self[len] = 0;
  char env_dir[300];
  snprintf(env_dir, sizeof env_dir, "HAKMEM_SHM_DIR=%s", dir);
  char* envp[] = {env_dir, (char*)"HAKMEM_TELEMETRY=1", (char*)"HAKMEM_TELEMETRY_MS=10",
                  (char*)"HAKMEM_TCACHE_CAP=0", NULL};
  int fds[2];
  REQUIRE(pipe(fds) == 0);
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    dup2(fds[1], 2);
    close(fds[0]);
    char* argv[] = {self, (char*)"child", NULL};
    execve(self, argv, envp);
    _exit(127);
  }
  close(fds[1]);
  char out[4096];
  size_t got = 0;
  ssize_t n;
  while (got + 1 < sizeof out && (n = read(fds[0], out + got, sizeof out - 1 - got)) > 0) got += (size_t)n;
  out[got] = 0;
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  harness_say("%s", out);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  CHECK(strstr(out, "child: ok") != NULL);
  close(lfd);
  /* The child's file went at its exit; the lease is ours to remove. */
  unlink(lease);
  DIR* d = opendir(dir);
  if (d) {
    struct dirent* e;
    char f[600];
    while ((e = readdir(d)))
      if (e->d_name[0] != '.') { snprintf(f, sizeof f, "%s/%s", dir, e->d_name); unlink(f); }
    closedir(d);
  }
  rmdir(dir);
}

int main(int argc, char** argv) {
  if (argc > 1 && strcmp(argv[1], "child") == 0) return child();
  RUN(torn_snapshots_are_never_examined);
  return harness_done();
}
