// SPDX-License-Identifier: GPL-2.0
/* hakmem.bpf.c — the kernel's side of an allocator's cost, per process.
 *
 * Counts, for the processes (thread group ids) in `pids` only, what
 * schemas/shm_layout.json's kernel_counters lists (bpf/hakmem_kernel.h):
 * user page faults and mmap/munmap/madvise/mremap/brk calls with the time
 * spent in them. learnd fills `pids` through the loader (loader.c); a
 * process outside it costs one hash lookup per event and is never counted.
 *
 * CO-RE: built once against the running kernel's BTF (vmlinux.h dumped at
 * build time) and relocated by libbpf where it loads. Syscall tracepoints
 * (syscalls:sys_enter_* / sys_exit_*) are the stable ABI for the calls;
 * exceptions:page_fault_user for faults (x86), attached only where the
 * kprobe pair on handle_mm_fault times them too: it runs for every fault of
 * every process, so where it would only count, the loader reads the count
 * from /proc/PID/stat instead (loader.c, faults_from_proc).
 *
 * Every map is bounded: a pid set of MAX_PIDS, counters for as many, and the
 * in-flight call start times in an LRU keyed by thread, so a thread killed
 * inside a call leaves nothing behind for long.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>

#include "hakmem_kernel.h"

#define MAX_PIDS 4096
#define MAX_INFLIGHT 16384

char LICENSE[] SEC("license") = "GPL";

struct hk_kcounts {
	__u64 v[HK_KERN_N];
};

/* The pid set: tgid -> 1. Written by the loader only. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_PIDS);
	__type(key, __u32);
	__type(value, __u8);
} pids SEC(".maps");

/* Per tgid counters (cumulative); the loader deletes a pid's entry when the
 * pid leaves the set. Per-CPU so events need no atomics; the loader sums. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__uint(max_entries, MAX_PIDS);
	__type(key, __u32);
	__type(value, struct hk_kcounts);
} counts SEC(".maps");

/* Thread id -> entry time of the call it is in. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, MAX_INFLIGHT);
	__type(key, __u32);
	__type(value, __u64);
} inflight SEC(".maps");

/* Thread id -> entry time of the fault it is handling: a map of its own,
 * since a call (mmap with MAP_POPULATE, madvise(WILLNEED)) faults inside. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, MAX_INFLIGHT);
	__type(key, __u32);
	__type(value, __u64);
} fault_inflight SEC(".maps");

static __always_inline struct hk_kcounts *slot(__u32 tgid)
{
	struct hk_kcounts *c;

	if (!bpf_map_lookup_elem(&pids, &tgid))
		return 0;
	c = bpf_map_lookup_elem(&counts, &tgid);
	if (c)
		return c;
	{
		struct hk_kcounts zero = {};
		/* BPF_NOEXIST: a racing CPU's entry is kept; either way one exists. */
		bpf_map_update_elem(&counts, &tgid, &zero, BPF_NOEXIST);
	}
	return bpf_map_lookup_elem(&counts, &tgid);
}

static __always_inline int enter(int idx)
{
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tgid = id >> 32, tid = (__u32)id;
	struct hk_kcounts *c = slot(tgid);
	__u64 now;

	if (!c)
		return 0;
	if (idx >= 0 && idx < HK_KERN_N)
		c->v[idx]++;
	now = bpf_ktime_get_ns();
	bpf_map_update_elem(&inflight, &tid, &now, BPF_ANY);
	return 0;
}

static __always_inline int leave(void)
{
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tgid = id >> 32, tid = (__u32)id;
	__u64 *t0 = bpf_map_lookup_elem(&inflight, &tid);
	struct hk_kcounts *c;
	__u64 dt;

	if (!t0)
		return 0;
	dt = bpf_ktime_get_ns() - *t0;
	bpf_map_delete_elem(&inflight, &tid);
	c = slot(tgid);
	if (c)
		c->v[HK_KERN_K_OS_NS] += dt;
	return 0;
}

#define CALL(name, IDX)                                                   \
	SEC("tracepoint/syscalls/sys_enter_" #name)                       \
	int hk_enter_##name(void *ctx) { return enter(HK_KERN_##IDX); }   \
	SEC("tracepoint/syscalls/sys_exit_" #name)                        \
	int hk_exit_##name(void *ctx) { return leave(); }

CALL(mmap, K_MMAP)
CALL(munmap, K_MUNMAP)
CALL(madvise, K_MADVISE)
CALL(mremap, K_MREMAP)
CALL(brk, K_BRK)

/* Time in faults: handle_mm_fault, entry to exit (the exception's own entry
 * and return are not in it). A kprobe pair, not fentry/fexit: kernels that
 * refuse trampolines at load time would refuse the whole object, while a
 * kprobe that cannot attach (no kprobes) is left out alone. Then the loader
 * says so and k_fault_ns stays 0 (learnd prices the count instead). */
SEC("kprobe/handle_mm_fault")
int BPF_KPROBE(hk_fault_in)
{
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tgid = id >> 32, tid = (__u32)id;
	__u64 now;

	if (!bpf_map_lookup_elem(&pids, &tgid))
		return 0;
	now = bpf_ktime_get_ns();
	bpf_map_update_elem(&fault_inflight, &tid, &now, BPF_ANY);
	return 0;
}

SEC("kretprobe/handle_mm_fault")
int BPF_KRETPROBE(hk_fault_out)
{
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tgid = id >> 32, tid = (__u32)id;
	__u64 *t0 = bpf_map_lookup_elem(&fault_inflight, &tid);
	struct hk_kcounts *c;
	__u64 dt;

	if (!t0)
		return 0;
	dt = bpf_ktime_get_ns() - *t0;
	bpf_map_delete_elem(&fault_inflight, &tid);
	c = slot(tgid);
	if (c)
		c->v[HK_KERN_K_FAULT_NS] += dt;
	return 0;
}

SEC("tracepoint/exceptions/page_fault_user")
int hk_fault(void *ctx)
{
	__u32 tgid = bpf_get_current_pid_tgid() >> 32;
	struct hk_kcounts *c = slot(tgid);

	if (c)
		c->v[HK_KERN_K_FAULTS]++;
	return 0;
}
