-- hakmem-bpf's figures (issue 16): the kernel's side of each window's cost,
-- per second, named as schemas/shm_layout.json's kernel_counters (a test
-- checks that every one of them has its column here), and k_bpf: 1 when
-- hakmem-bpf measured the window, 0 when /proc/<pid>/stat did (then the
-- k_* columns are 0; merged rows hold the share measured with hakmem-bpf).
ALTER TABLE windows ADD COLUMN k_faults REAL NOT NULL DEFAULT 0;
ALTER TABLE windows ADD COLUMN k_mmap REAL NOT NULL DEFAULT 0;
ALTER TABLE windows ADD COLUMN k_munmap REAL NOT NULL DEFAULT 0;
ALTER TABLE windows ADD COLUMN k_madvise REAL NOT NULL DEFAULT 0;
ALTER TABLE windows ADD COLUMN k_mremap REAL NOT NULL DEFAULT 0;
ALTER TABLE windows ADD COLUMN k_brk REAL NOT NULL DEFAULT 0;
ALTER TABLE windows ADD COLUMN k_os_ns REAL NOT NULL DEFAULT 0;
ALTER TABLE windows ADD COLUMN k_bpf REAL NOT NULL DEFAULT 0;
ALTER TABLE windows ADD COLUMN k_fault_ns REAL NOT NULL DEFAULT 0;
