/* loader.c — hakmem-bpf: loads hakmem.bpf.c, keeps its pid set, and sends
 * learnd one KernelSample (proto/hakmem.proto) per interval over ZeroMQ.
 *
 *   hakmem-bpf --connect ipc:///run/hakmem/kernel.sock [--interval-ms 250]
 *   hakmem-bpf --check       load and attach, then exit 0 (can this machine?)
 *
 * learnd starts it as a child (learner/hakmem/kernel.py) and talks to it on
 * its stdin, one command a line:
 *   pids P1 P2 ...   the set to count, replacing the last one (a pid that
 *                    leaves it loses its counts)
 * End of stdin (learnd gone) and SIGTERM/SIGINT end it cleanly: the kernel
 * detaches every program when the skeleton is destroyed, so nothing is left
 * counting. Nothing else is read: it never trusts more than MAX_PIDS pids.
 *
 * Failures are one line `hakmem-bpf: error: <why>` and an exit status learnd
 * tells apart: 3 not permitted, 4 no BTF, 5 no tracefs, 2 usage, 1 other.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <bpf/bpf.h>
#include <bpf/libbpf.h>
#include <zmq.h>

#include "hakmem.pb-c.h"
#include "hakmem.skel.h"
#include "hakmem_kernel.h"

#define MAX_PIDS 4096 /* the BPF maps' bound (hakmem.bpf.c) */

enum { EX_OTHER = 1, EX_USAGE = 2, EX_PERM = 3, EX_NOBTF = 4, EX_NOTRACEFS = 5 };

static volatile sig_atomic_t stop;
static int verbose;

static void on_signal(int sig) { (void)sig; stop = 1; }

static void die(int code, const char *fmt, ...)
{
	va_list ap;
	fputs("hakmem-bpf: error: ", stderr);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
	exit(code);
}

static int libbpf_log(enum libbpf_print_level level, const char *fmt, va_list ap)
{
	/* libbpf's own messages are many lines; the one line that matters is ours. */
	(void)level;
	if (!verbose)
		return 0;
	return vfprintf(stderr, fmt, ap);
}

static double mono_now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void usage(FILE *f)
{
	fprintf(f, "usage: hakmem-bpf --connect ENDPOINT [--interval-ms MS] [-v]\n"
		   "       hakmem-bpf --check\n"
		   "Counts page faults and mmap/munmap/madvise/mremap/brk calls (and their time)\n"
		   "of the pids given on stdin ('pids P1 P2 ...' lines) and sends a KernelSample\n"
		   "to ENDPOINT (ZeroMQ PUSH) every interval. Started by hakmem-learnd.\n"
		   "Exit status: 3 not permitted, 4 no kernel BTF, 5 tracefs not mounted.\n");
}

/* ---- the pid set ------------------------------------------------------------- */
static uint32_t set[MAX_PIDS];
static size_t nset;

/* Where the kernel cannot time faults (no kprobe on handle_mm_fault), the
 * fault tracepoint is left off: it would run for every fault of every process
 * on the machine (1.4% of large_churn's CPU, bench/bpf_overhead.py) to count
 * what /proc/PID/stat already counts. Then each
 * pid's k_faults is its minflt + majflt since it joined the set, read here
 * once per sample: `base` at joining, `last` so a pid that is gone keeps its
 * count rather than going back to 0 (struct fault_count). */
static int faults_from_proc;
struct fault_count {
	uint64_t base;   /* minflt + majflt when the pid joined, or NO_BASE */
	uint64_t last;   /* its count since then, at the last sample */
};
static struct fault_count counted[MAX_PIDS];   /* beside set[]: counted[i] is set[i]'s */
#define NO_BASE UINT64_MAX

/* minflt + majflt of a process, or -1 (gone, or a line we do not understand). */
static int64_t proc_faults(uint32_t pid)
{
	char path[64], buf[1024];
	snprintf(path, sizeof(path), "/proc/%u/stat", pid);
	int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
	if (fd < 0)
		return -1;
	ssize_t r = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (r <= 0)
		return -1;
	buf[r] = 0;
	/* The name in (...) may hold anything, ')' and spaces included: fields
	 * count from the last ')'. After it: state ppid pgrp session tty_nr tpgid
	 * flags minflt cminflt majflt. */
	char *p = strrchr(buf, ')');
	unsigned long long minflt, majflt;
	if (!p || sscanf(p + 1, " %*s %*s %*s %*s %*s %*s %*s %llu %*s %llu", &minflt, &majflt) != 2)
		return -1;
	return (int64_t)(minflt + majflt);
}

static int in_list(const uint32_t *v, size_t n, uint32_t pid)
{
	for (size_t i = 0; i < n; i++)
		if (v[i] == pid)
			return 1;
	return 0;
}

/* "pids 1 2 3": the new set replaces the old one in the maps. */
static void apply_pids(struct hakmem_bpf *skel, char *line)
{
	uint32_t next[MAX_PIDS];
	size_t n = 0;
	char *save = NULL, *tok = strtok_r(line + 4, " \t\r\n", &save);
	int fd_pids = bpf_map__fd(skel->maps.pids), fd_counts = bpf_map__fd(skel->maps.counts);

	for (; tok && n < MAX_PIDS; tok = strtok_r(NULL, " \t\r\n", &save)) {
		char *end;
		unsigned long v = strtoul(tok, &end, 10);
		if (*end || v == 0 || v > UINT32_MAX)
			continue;   /* not a pid: ignored, as learnd never sends one */
		if (!in_list(next, n, (uint32_t)v))
			next[n++] = (uint32_t)v;
	}
	for (size_t i = 0; i < nset; i++) {
		if (in_list(next, n, set[i]))
			continue;
		bpf_map_delete_elem(fd_pids, &set[i]);
		bpf_map_delete_elem(fd_counts, &set[i]);
	}
	static struct fault_count next_counted[MAX_PIDS];
	for (size_t i = 0; i < n; i++) {
		uint8_t one = 1;
		if (bpf_map_update_elem(fd_pids, &next[i], &one, BPF_ANY) && verbose)
			fprintf(stderr, "hakmem-bpf: pid %u: %s\n", next[i], strerror(errno));
		size_t j = 0;
		while (j < nset && set[j] != next[i])
			j++;
		if (j < nset) {
			next_counted[i] = counted[j];
		} else {
			int64_t f = faults_from_proc ? proc_faults(next[i]) : -1;
			next_counted[i].base = f >= 0 ? (uint64_t)f : NO_BASE;   /* read at its first sample */
			next_counted[i].last = 0;
		}
	}
	memcpy(set, next, n * sizeof(next[0]));
	memcpy(counted, next_counted, n * sizeof(next_counted[0]));
	nset = n;
}

/* ---- one sample ----------------------------------------------------------------- */
static int send_sample(void *sock, struct hakmem_bpf *skel, uint64_t seq, const char *note)
{
	static uint64_t values[MAX_PIDS][HK_KERN_N];
	static Hakmem__V1__KernelProc procs[MAX_PIDS];
	static Hakmem__V1__KernelProc *pp[MAX_PIDS];
	int ncpu = libbpf_num_possible_cpus();
	int fd = bpf_map__fd(skel->maps.counts);
	struct { uint64_t v[HK_KERN_N]; } *percpu;
	Hakmem__V1__KernelSample msg = HAKMEM__V1__KERNEL_SAMPLE__INIT;
	size_t n = 0;

	if (ncpu <= 0)
		return -1;
	percpu = calloc((size_t)ncpu, sizeof(*percpu));
	if (!percpu)
		return -1;
	for (size_t i = 0; i < nset; i++) {
		uint32_t pid = set[i];
		memset(values[n], 0, sizeof(values[n]));
		if (bpf_map_lookup_elem(fd, &pid, percpu) == 0)
			for (int c = 0; c < ncpu; c++)
				for (int k = 0; k < HK_KERN_N; k++)
					values[n][k] += percpu[c].v[k];
		if (faults_from_proc) {
			struct fault_count *fc = &counted[i];
			int64_t f = proc_faults(pid);
			if (f >= 0 && fc->base == NO_BASE)
				fc->base = (uint64_t)f;
			if (f >= 0 && (uint64_t)f >= fc->base + fc->last)
				fc->last = (uint64_t)f - fc->base;
			values[n][HK_KERN_K_FAULTS] = fc->last;
		}
		hakmem__v1__kernel_proc__init(&procs[n]);
		procs[n].pid = pid;
		procs[n].n_values = HK_KERN_N;
		procs[n].values = values[n];
		pp[n] = &procs[n];
		n++;
	}
	free(percpu);
	msg.seq = seq;
	msg.mono = mono_now();
	msg.loader_pid = (uint32_t)getpid();
	msg.counters = HK_KERN_N;
	msg.n_procs = n;
	msg.procs = pp;
	msg.note = (char *)(note ? note : "");
	size_t len = hakmem__v1__kernel_sample__get_packed_size(&msg);
	uint8_t *buf = malloc(len ? len : 1);
	if (!buf)
		return -1;
	hakmem__v1__kernel_sample__pack(&msg, buf);
	/* Never block on learnd: a sample it is not reading is dropped (HWM). */
	int rc = zmq_send(sock, buf, len, ZMQ_DONTWAIT);
	free(buf);
	return rc < 0 ? -1 : 0;
}

/* ---- load and attach -------------------------------------------------------------- */
static int tracefs_mounted(void)
{
	return access("/sys/kernel/tracing/events/syscalls", F_OK) == 0 ||
	       access("/sys/kernel/debug/tracing/events/syscalls", F_OK) == 0;
}

static struct bpf_link *links[32];
static size_t nlinks;

static struct hakmem_bpf *load(char *note, size_t note_len)
{
	struct hakmem_bpf *skel;
	int err;

	if (access("/sys/kernel/btf/vmlinux", R_OK) != 0)
		die(EX_NOBTF, "no kernel BTF (/sys/kernel/btf/vmlinux): the CO-RE program cannot be relocated here");
	skel = hakmem_bpf__open();
	if (!skel)
		die(EX_OTHER, "cannot open the BPF object: %s", strerror(errno));
	err = hakmem_bpf__load(skel);
	if (err) {
		int e = -err;
		hakmem_bpf__destroy(skel);
		if (e == EPERM || e == EACCES)
			die(EX_PERM, "not permitted to load BPF programs (needs root, or CAP_BPF with CAP_PERFMON)");
		die(EX_OTHER, "cannot load the BPF programs: %s", strerror(e));
	}
	if (!tracefs_mounted()) {
		hakmem_bpf__destroy(skel);
		die(EX_NOTRACEFS, "tracefs is not mounted at /sys/kernel/tracing (mount -t tracefs nodev /sys/kernel/tracing)");
	}
	note[0] = 0;
	/* Two passes: the fault tracepoint is attached last, and only where the
	 * kprobe pair that times faults attached (see faults_from_proc). */
	int timed = 0;
	struct bpf_program *prog;
	for (int pass = 0; pass < 2; pass++) {
		bpf_object__for_each_program(prog, skel->obj) {
			const char *name = bpf_program__name(prog);
			int is_count = strcmp(name, "hk_fault") == 0;
			if (is_count != (pass == 1))
				continue;
			if (is_count && timed < 2) {
				faults_from_proc = 1;
				continue;
			}
			struct bpf_link *link = bpf_program__attach(prog);
			if (!link) {
				int e = errno;
				size_t used = strlen(note);
				if (is_count) {
					/* Not x86: no exceptions:page_fault_user. /proc counts them. */
					faults_from_proc = 1;
					snprintf(note + used, note_len - used, "%spage faults counted from /proc (no fault tracepoint: %s)",
						 used ? "; " : "", strerror(e));
					continue;
				}
				if (strncmp(name, "hk_fault_", 9) == 0) {
					/* No kprobes here: faults are counted, not timed. */
					if (!strstr(note, "fault time"))
						snprintf(note + used, note_len - used,
							 "%sfault time not measured (no kprobe on handle_mm_fault: %s); "
							 "page faults counted from /proc",
							 used ? "; " : "", strerror(e));
					continue;
				}
				hakmem_bpf__destroy(skel);
				if (e == EPERM || e == EACCES)
					die(EX_PERM, "not permitted to attach BPF programs (needs root, or CAP_BPF with CAP_PERFMON)");
				die(EX_OTHER, "cannot attach %s: %s", name, strerror(e));
			}
			if (strncmp(name, "hk_fault_", 9) == 0)
				timed++;
			if (nlinks < sizeof(links) / sizeof(links[0]))
				links[nlinks++] = link;
		}
	}
	return skel;
}

int main(int argc, char **argv)
{
	static const struct option opts[] = {
		{"connect", required_argument, 0, 'c'}, {"interval-ms", required_argument, 0, 'i'},
		{"check", no_argument, 0, 'k'}, {"verbose", no_argument, 0, 'v'},
		{"help", no_argument, 0, 'h'}, {0, 0, 0, 0}};
	const char *endpoint = NULL;
	long interval_ms = 250;
	int check = 0, o;

	opterr = 0;   /* one line of our own, not getopt's and a usage page */
	while ((o = getopt_long(argc, argv, "c:i:kvh", opts, NULL)) != -1) {
		switch (o) {
		case 'c': endpoint = optarg; break;
		case 'i': {
			char *end;
			interval_ms = strtol(optarg, &end, 10);
			if (*end || interval_ms < 10 || interval_ms > 60000)
				die(EX_USAGE, "--interval-ms must be 10..60000, got '%s'", optarg);
			break;
		}
		case 'k': check = 1; break;
		case 'v': verbose = 1; break;
		case 'h': usage(stdout); return 0;
		default: die(EX_USAGE, "unknown option or missing value: '%s' (see --help)", argv[optind - 1]);
		}
	}
	if (optind < argc)
		die(EX_USAGE, "unexpected argument '%s' (see --help)", argv[optind]);
	if (!check && !endpoint)
		die(EX_USAGE, "--connect ENDPOINT is needed (see --help)");

	libbpf_set_print(libbpf_log);
	char note[256];
	struct hakmem_bpf *skel = load(note, sizeof(note));
	if (check) {
		for (size_t i = 0; i < nlinks; i++)
			bpf_link__destroy(links[i]);
		hakmem_bpf__destroy(skel);
		printf("hakmem-bpf: ok%s%s\n", note[0] ? ": " : "", note);
		return 0;
	}

	struct sigaction sa = {0};
	sa.sa_handler = on_signal;
	sigaction(SIGTERM, &sa, NULL);
	sigaction(SIGINT, &sa, NULL);
	signal(SIGPIPE, SIG_IGN);

	void *ctx = zmq_ctx_new();
	void *sock = ctx ? zmq_socket(ctx, ZMQ_PUSH) : NULL;
	int hwm = 16, linger = 0;
	if (!sock)
		die(EX_OTHER, "zmq: %s", zmq_strerror(zmq_errno()));
	zmq_setsockopt(sock, ZMQ_SNDHWM, &hwm, sizeof(hwm));
	zmq_setsockopt(sock, ZMQ_LINGER, &linger, sizeof(linger));
	if (zmq_connect(sock, endpoint) != 0)
		die(EX_USAGE, "cannot connect to %s: %s", endpoint, zmq_strerror(zmq_errno()));

	uint64_t seq = 0;
	send_sample(sock, skel, seq++, note);
	double next = mono_now() + interval_ms / 1000.0;
	char line[65536];
	size_t have = 0;
	int in_open = 1;
	fcntl(0, F_SETFL, fcntl(0, F_GETFL) | O_NONBLOCK);
	while (!stop && in_open) {
		zmq_pollitem_t item = {NULL, 0, ZMQ_POLLIN, 0};
		double wait = next - mono_now();
		long ms = wait > 0 ? (long)(wait * 1000) + 1 : 0;
		int rc = zmq_poll(&item, 1, ms);
		if (rc < 0 && zmq_errno() != EINTR)
			break;
		if (rc > 0 && (item.revents & (ZMQ_POLLIN | ZMQ_POLLERR))) {
			ssize_t r = read(0, line + have, sizeof(line) - 1 - have);
			if (r == 0) {
				in_open = 0;   /* learnd is gone: so are we */
			} else if (r > 0) {
				have += (size_t)r;
				line[have] = 0;
				char *nl;
				while ((nl = memchr(line, '\n', have))) {
					*nl = 0;
					if (strncmp(line, "pids", 4) == 0 && (line[4] == ' ' || line[4] == 0))
						apply_pids(skel, line);
					size_t used = (size_t)(nl - line) + 1;
					memmove(line, nl + 1, have - used);
					have -= used;
				}
				if (have == sizeof(line) - 1)
					have = 0;   /* a line longer than any learnd sends: dropped */
			} else if (errno != EAGAIN && errno != EINTR) {
				in_open = 0;
			}
		}
		if (mono_now() >= next) {
			send_sample(sock, skel, seq++, note);
			next += interval_ms / 1000.0;
			if (next < mono_now())
				next = mono_now() + interval_ms / 1000.0;
		}
	}
	zmq_close(sock);
	zmq_ctx_term(ctx);
	for (size_t i = 0; i < nlinks; i++)
		bpf_link__destroy(links[i]);
	hakmem_bpf__destroy(skel);
	return 0;
}
