# bench/learn.mk — the learner proof; included by the top Makefile.
#
# bench/learn_workload.c -> $(BUILD)/bench/learn_workload, linked against
# glibc only (hakmem comes by LD_PRELOAD, as for every benchmark), then
# bench/learn.py runs the default policy, a grid of static policies,
# hakmem-learnd's miss-driven learner, and hakmem-learnd cold and warm on
# four workloads; results in bench/results/learn.{json,md,png}. learnd
# screens with build/hakmem-replay and reads the kernel's side with
# build/hakmem-bpf: both are built first (a fresh clone has neither).

PY              ?= $(if $(wildcard .venv/bin/python),.venv/bin/python,python3)
LEARN_WORKLOAD  := $(BUILD)/bench/learn_workload
LEARN_ARGS      ?=

.PHONY: bench-learn bench-learn-quick

$(LEARN_WORKLOAD): bench/learn_workload.c bench/learn.mk
	@mkdir -p $(@D)
	@$(if $(Q),echo "  BENCH   $@")
	$(Q)$(CC) -std=gnu11 -O2 -g -pthread -Wall -Wextra $< -o $@

bench-learn: deps lib venv replay bpf $(LEARN_WORKLOAD) ## run the learner proof: default, best static, miss-driven, learnd cold and warm on four workloads (about 20 minutes; LEARN_ARGS=...)
	$(Q)BUILD=$(BUILD) $(PY) bench/learn.py $(LEARN_ARGS)

bench-learn-quick: deps lib venv replay bpf $(LEARN_WORKLOAD) ## the learner proof with short runs and a small grid (about 3 minutes)
	$(Q)BUILD=$(BUILD) $(PY) bench/learn.py --quick $(LEARN_ARGS)

# bench/learn_real.py: nine Debian programs (redis, PostgreSQL, python3,
# perl, sqlite3, git, gcc, jq, MariaDB) under workloads with waves, growth, deletes
# and idle time; static policies against the default, interleaved, and
# hakmem-learnd cold and warm; results in bench/results/learn_real.{json,md}.
LEARN_REAL_ARGS ?=

.PHONY: bench-learn-real bench-learn-real-quick

bench-learn-real: deps lib venv replay bpf ## real programs: the room for a policy and learnd cold and warm on nine Debian programs, 2-minute runs, 3 rounds, as root (about 7 hours; LEARN_REAL_ARGS=--only redis,python3)
	$(Q)BUILD=$(BUILD) $(PY) bench/learn_real.py --learnd $(LEARN_REAL_ARGS)

bench-learn-real-quick: deps lib venv replay bpf ## the real-program study with 20-s runs and no learnd (about an hour)
	$(Q)BUILD=$(BUILD) $(PY) bench/learn_real.py --seconds 20 $(LEARN_REAL_ARGS)
