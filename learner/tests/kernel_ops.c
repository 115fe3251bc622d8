/* kernel_ops.c — known numbers of the calls and faults hakmem-bpf counts
 * (learner/tests/test_bpf.py).
 *
 *   kernel_ops N
 * prints "ready PID", waits for a line on stdin, then N times: mmap 4 fresh
 * anonymous pages, touch each (4 first-touch faults), madvise(DONTNEED) them,
 * mremap to 8 pages, munmap; then brk: one query and N moves. Prints the
 * exact counts ("done mmap=N munmap=N madvise=N mremap=N brk=N+1 touches=4N")
 * and waits for stdin to close before exiting, so its counts can be read
 * while it lives. No stdio buffering and no malloc after "ready": nothing of
 * its own adds a call it did not report. */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

static void say(const char *s, size_t n)
{
	while (n) {
		ssize_t w = write(1, s, n);
		if (w <= 0)
			_exit(1);
		s += w;
		n -= (size_t)w;
	}
}

static int wait_line(void)
{
	char c;
	for (;;) {
		ssize_t r = read(0, &c, 1);
		if (r <= 0)
			return -1;
		if (c == '\n')
			return 0;
	}
}

int main(int argc, char **argv)
{
	long n = argc > 1 ? atol(argv[1]) : 100;
	long page = sysconf(_SC_PAGESIZE);
	char buf[160];
	int len;

	if (n < 1 || n > 1000000) {
		fprintf(stderr, "kernel_ops: error: N must be 1..1000000\n");
		return 2;
	}
	len = snprintf(buf, sizeof(buf), "ready %d\n", (int)getpid());
	say(buf, (size_t)len);
	if (wait_line() < 0)
		return 1;
	for (long i = 0; i < n; i++) {
		volatile char *p = mmap(NULL, 4 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		if (p == MAP_FAILED)
			return 1;
		for (int k = 0; k < 4; k++)
			p[k * page] = 1;
		if (madvise((void *)p, 4 * page, MADV_DONTNEED))
			return 1;
		void *q = mremap((void *)p, 4 * page, 8 * page, MREMAP_MAYMOVE);
		if (q == MAP_FAILED)
			return 1;
		if (munmap(q, 8 * page))
			return 1;
	}
	uintptr_t base = (uintptr_t)syscall(SYS_brk, 0);
	for (long i = 0; i < n; i++)
		syscall(SYS_brk, base + (uintptr_t)((i % 2) ? 0 : page));
	len = snprintf(buf, sizeof(buf), "done mmap=%ld munmap=%ld madvise=%ld mremap=%ld brk=%ld touches=%ld\n",
		       n, n, n, n, n + 1, 4 * n);
	say(buf, (size_t)len);
	wait_line();
	return 0;
}
