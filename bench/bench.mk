# bench/bench.mk — the benchmark suite; included by the top Makefile.
#
# Every benchmark is one C file, bench/NAME.c -> $(BUILD)/bench/NAME, linked
# against glibc only: the allocator under test is swapped by LD_PRELOAD so
# that every allocator runs the same binary (see bench/run.py).

BENCH_SRCS   := $(sort $(wildcard bench/*.c))
BENCH_BINS   := $(BENCH_SRCS:bench/%.c=$(BUILD)/bench/%)
BENCH_CFLAGS := -std=gnu11 -O2 -g -pthread -Wall -Wextra -Wno-unused-parameter
PY           ?= $(if $(wildcard .venv/bin/python),.venv/bin/python,python3)
BENCH_ARGS   ?=
SERVICES_ARGS ?=
FLEET_ARGS   ?=

.PHONY: bench bench-build bench-smoke bench-services bench-fleet

bench-build: $(BENCH_BINS) ## build the benchmarks (build/bench/)

$(BUILD)/bench/%: bench/%.c bench/common.h bench/bench.mk
	@mkdir -p $(@D)
	@$(if $(Q),echo "  BENCH   $@")
	$(Q)$(CC) $(BENCH_CFLAGS) $< -o $@ -ldl

bench: lib venv bench-build ## compare hakmem with glibc, mimalloc, jemalloc, tcmalloc (BENCH_ARGS=--quick); tables in bench/results/
	$(Q)$(PY) bench/run.py $(BENCH_ARGS)

bench-services: lib venv ## hakmem against glibc and the peers inside PostgreSQL (pgbench) and redis (redis-benchmark), as root (SERVICES_ARGS=--quick)
	$(Q)$(PY) bench/services.py $(SERVICES_ARGS)

bench-fleet: venv ## the fleet database under 10, 100 and 1000 simulated learnd hosts: evaluations/s, pull latency, as root (FLEET_ARGS=--hosts 10,100)
	$(Q)$(PY) bench/fleet.py $(FLEET_ARGS)

bench-smoke: lib bench-build ## run every benchmark briefly under hakmem and check its result line
	$(Q)BUILD=$(BUILD) bench/smoke.sh $(BUILD)/libhakmem.so
