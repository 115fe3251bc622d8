/* startup — process start-up and exit cost: spawns PROCS short-lived
 * processes (startup_child, found next to this binary; the environment,
 * LD_PRELOAD included, is inherited) one after another, each making ALLOCS
 * allocations, and waits for each before starting the next. An allocator
 * that does much work at initialization or exit pays it PROCS times.
 * ops = processes; ops_per_sec = processes per second. */
#include "common.h"
#include <libgen.h>
#include <limits.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

int main(int argc, char **argv) {
  bench_usage_line = "startup [PROCS=1000] [ALLOCS=3000]";
  uint64_t procs = arg_u64(argc, argv, 1, 1000);
  uint64_t allocs = arg_u64(argc, argv, 2, 3000);
  bench_require(procs > 0 && allocs > 0, "need PROCS > 0 and ALLOCS > 0");

  /* /proc/self/exe is argv[0] resolved, whatever the current directory. */
  char self[PATH_MAX], child[PATH_MAX + 32];
  ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
  if (len < 0) {
    perror("startup: readlink /proc/self/exe");
    return 1;
  }
  self[len] = 0;
  snprintf(child, sizeof child, "%s/startup_child", dirname(self));
  if (access(child, X_OK)) {
    fprintf(stderr, "startup: %s not found or not executable\n", child);
    return 1;
  }

  char allocs_arg[32], seed_arg[32];
  snprintf(allocs_arg, sizeof allocs_arg, "%" PRIu64, allocs);
  char *child_argv[] = {child, allocs_arg, seed_arg, NULL};

  double t0 = bench_now();
  for (uint64_t i = 0; i < procs; i++) {
    snprintf(seed_arg, sizeof seed_arg, "%" PRIu64, i);
    pid_t pid;
    int rc = posix_spawn(&pid, child, NULL, NULL, child_argv, environ);
    if (rc) {
      fprintf(stderr, "startup: posix_spawn %s: %s\n", child, strerror(rc));
      return 1;
    }
    /* A child's ru_maxrss includes our own (small) high-water mark,
     * carried over at its exec; see common.h:bench_peak_rss_kb. */
    int status;
    struct rusage ru;
    while (wait4(pid, &status, 0, &ru) < 0)
      if (errno != EINTR) {
        perror("startup: wait4");
        return 1;
      }
    if (!WIFEXITED(status) || WEXITSTATUS(status)) {
      fprintf(stderr, "startup: child %" PRIu64 " %s %d\n", i,
              WIFEXITED(status) ? "exited with status" : "killed by signal",
              WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
      return 1;
    }
    if (ru.ru_maxrss > bench_children_peak_kb) bench_children_peak_kb = ru.ru_maxrss;
  }
  double t1 = bench_now();

  bench_report("startup", 1, procs, t1 - t0,
               "\"procs\":%" PRIu64 ",\"allocs_per_process\":%" PRIu64
               ",\"op\":\"one process spawned, run and reaped\"",
               procs, allocs);
  return 0;
}
