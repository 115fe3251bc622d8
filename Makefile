# hakmem — one entry point for build and test. `make help` lists the targets.
# Quiet unless V=1; every output goes under build/.

BUILD   ?= build
CC      ?= cc
CXX     ?= c++
V       ?= 0
Q       := $(if $(filter 1,$(V)),,@)

SRC_DIR := allocator/src
INC_DIR := allocator/include
TST_DIR := allocator/tests

SRCS    := $(sort $(wildcard $(SRC_DIR)/*.c))
HDRS    := $(wildcard $(SRC_DIR)/*.h) $(wildcard $(INC_DIR)/*.h)

# Flags the allocator needs to be correct, not just fast: it must not let the
# compiler turn its own code into calls to malloc/memset of itself, must keep
# internals out of the dynamic symbol table, and must use initial-exec TLS so
# that reaching the thread cache never calls __tls_get_addr (which allocates).
ALLOC_CFLAGS := -std=gnu11 -fPIC -fvisibility=hidden -ftls-model=initial-exec \
  -fno-builtin-malloc -fno-builtin-free -fno-builtin-calloc -fno-builtin-realloc \
  -fno-stack-protector -fno-plt -Wall -Wextra -Wshadow -Wstrict-prototypes \
  -Wno-unused-parameter -I$(INC_DIR) -I$(SRC_DIR) -pthread
RELEASE_CFLAGS := -O2 -g -DNDEBUG
# The debug build tells memcheck where blocks are when valgrind's headers
# are there (make deps installs them); see internal.h "valgrind". Expanded
# late (=, not :=) so `make test` sees the headers deps just installed, and
# recorded in a stamp so objects rebuild when the answer changes.
DEBUG_CFLAGS    = -O1 -g -DHK_DEBUG=1 -fno-omit-frame-pointer \
  $(if $(wildcard /usr/include/valgrind/memcheck.h),-DHK_VALGRIND=1)
# The shared library takes protobuf-c from its archive, its symbols hidden
# (--exclude-libs): every preloaded process would otherwise load and
# relocate one more library at start (4-5 page faults of the ~85 a small
# process takes), and a program's own protobuf-c could be a different one.
LDLIBS_SO      := -pthread -Wl,--exclude-libs,ALL -l:libprotobuf-c.a

REL_OBJS := $(SRCS:$(SRC_DIR)/%.c=$(BUILD)/obj/%.o)
DBG_OBJS := $(SRCS:$(SRC_DIR)/%.c=$(BUILD)/debug/obj/%.o)
# Capture (trace.c) packs TraceChunks with protobuf-c code generated from
# proto/trace.proto, compiled into the library like its own sources.
ALLOC_CFLAGS += -I$(BUILD)/proto
REL_OBJS += $(BUILD)/obj/trace.pb-c.o
DBG_OBJS += $(BUILD)/debug/obj/trace.pb-c.o

TEST_SRCS := $(sort $(wildcard $(TST_DIR)/test_*.c))
TEST_CXX  := $(sort $(wildcard $(TST_DIR)/test_*.cc))
TEST_NAMES := $(TEST_SRCS:$(TST_DIR)/%.c=%) $(TEST_CXX:$(TST_DIR)/%.cc=%)
REL_TESTS := $(TEST_NAMES:%=$(BUILD)/tests/%)
DBG_TESTS := $(TEST_NAMES:%=$(BUILD)/debug/tests/%)
TEST_CFLAGS := -std=gnu11 -O1 -g -Wall -Wextra -Wno-unused-parameter -I$(INC_DIR) -I$(TST_DIR) -pthread \
  -fno-builtin-malloc -fno-builtin-free -fno-builtin-calloc -fno-builtin-realloc
# test_trace.c decodes traces with the generated protobuf-c code.
TEST_CFLAGS += -I$(BUILD)/proto
TEST_CXXFLAGS := -std=gnu++17 -O1 -g -Wall -Wextra -I$(INC_DIR) -I$(TST_DIR) -pthread

# The Python side (learner/: the hakmem package and CLI) lives in .venv.
VENV    := .venv
PY      := $(VENV)/bin/python
PYTHON3 ?= python3
PROTOS  := $(sort $(wildcard proto/*.proto))
PB_PY   := $(PROTOS:proto/%.proto=learner/hakmem/_pb/%_pb2.py)

.PHONY: all lib debug tests test clean help venv layout

all: lib debug venv ## build libhakmem.so/.a (release), build/debug/ (asserts, -O1) and the Python package in .venv

venv: $(VENV)/.installed ## the hakmem Python package and its dependencies in .venv

$(VENV)/.installed: pyproject.toml setup.py $(PB_PY)
	@$(if $(Q),echo "  VENV    $(VENV) (pip install -e .[test,bench,fleet])")
	$(Q)test -x $(PY) || $(PYTHON3) -m venv $(VENV)
	$(Q)$(PY) -m pip install -q --disable-pip-version-check -e '.[test,bench,fleet]'
	$(Q)touch $@

# proto/ is the one definition of every message learnd, the CLI, exported
# policy files and traces exchange; both sides are generated, never
# committed: Python into the package, C (protobuf-c) into $(BUILD)/proto/.
learner/hakmem/_pb/%_pb2.py: proto/%.proto
	@mkdir -p $(@D)
	@$(if $(Q),echo "  PROTOC  $@")
	$(Q)protoc -Iproto --python_out=$(@D) $<
	$(Q)touch $(@D)/__init__.py

$(BUILD)/proto/%.pb-c.c $(BUILD)/proto/%.pb-c.h: proto/%.proto
	@mkdir -p $(@D)
	@$(if $(Q),echo "  PROTOC-C $@")
	$(Q)protoc-c -Iproto --c_out=$(@D) $<

layout: ## regenerate the shared-memory layout's C and Python sides from schemas/shm_layout.json
	$(Q)$(PYTHON3) tools/gen_layout.py

lib: $(BUILD)/libhakmem.so $(BUILD)/libhakmem.a ## release build only

debug: $(BUILD)/debug/libhakmem.so $(BUILD)/debug/libhakmem.a ## debug/check build only

$(BUILD)/obj/%.o: $(SRC_DIR)/%.c $(HDRS) Makefile
	@mkdir -p $(@D)
	@$(if $(Q),echo "  CC      $@")
	$(Q)$(CC) $(ALLOC_CFLAGS) $(RELEASE_CFLAGS) -c $< -o $@

$(BUILD)/obj/trace.o $(BUILD)/debug/obj/trace.o: $(BUILD)/proto/trace.pb-c.h

$(BUILD)/obj/trace.pb-c.o: $(BUILD)/proto/trace.pb-c.c $(BUILD)/proto/trace.pb-c.h
	@mkdir -p $(@D)
	@$(if $(Q),echo "  CC      $@")
	$(Q)$(CC) $(ALLOC_CFLAGS) $(RELEASE_CFLAGS) -Wno-shadow -c $< -o $@

$(BUILD)/debug/obj/trace.pb-c.o: $(BUILD)/proto/trace.pb-c.c $(BUILD)/proto/trace.pb-c.h $(BUILD)/debug/cflags.stamp
	@mkdir -p $(@D)
	@$(if $(Q),echo "  CC      $@")
	$(Q)$(CC) $(ALLOC_CFLAGS) $(DEBUG_CFLAGS) -Wno-shadow -c $< -o $@

$(BUILD)/debug/cflags.stamp: FORCE
	@mkdir -p $(@D)
	@echo '$(DEBUG_CFLAGS)' | cmp -s - $@ || echo '$(DEBUG_CFLAGS)' > $@

.PHONY: FORCE
FORCE:

$(BUILD)/debug/obj/%.o: $(SRC_DIR)/%.c $(HDRS) Makefile $(BUILD)/debug/cflags.stamp
	@mkdir -p $(@D)
	@$(if $(Q),echo "  CC      $@")
	$(Q)$(CC) $(ALLOC_CFLAGS) $(DEBUG_CFLAGS) -c $< -o $@

$(BUILD)/libhakmem.so: $(REL_OBJS)
	@$(if $(Q),echo "  LD      $@")
	$(Q)$(CC) -shared -Wl,-z,now -Wl,-Bsymbolic-functions -Wl,-soname,$(HK_SONAME) -o $@ $^ $(LDLIBS_SO)

$(BUILD)/debug/libhakmem.so: $(DBG_OBJS)
	@$(if $(Q),echo "  LD      $@")
	$(Q)$(CC) -shared -Wl,-z,now -Wl,-Bsymbolic-functions -Wl,-soname,$(HK_SONAME) -o $@ $^ $(LDLIBS_SO)

$(BUILD)/libhakmem.a: $(REL_OBJS)
	@$(if $(Q),echo "  AR      $@")
	$(Q)rm -f $@ && ar rcs $@ $^

$(BUILD)/debug/libhakmem.a: $(DBG_OBJS)
	@$(if $(Q),echo "  AR      $@")
	$(Q)rm -f $@ && ar rcs $@ $^

# Tests link the static library, so malloc/free in the test binary are
# hakmem's without any preload, and hk_* calls resolve directly.
$(BUILD)/tests/%: $(TST_DIR)/%.c $(TST_DIR)/harness.h $(TST_DIR)/testutil.h $(BUILD)/libhakmem.a
	@mkdir -p $(@D)
	@$(if $(Q),echo "  TEST    $@")
	$(Q)$(CC) $(TEST_CFLAGS) $< -o $@ $(BUILD)/libhakmem.a -lprotobuf-c -pthread

$(BUILD)/debug/tests/%: $(TST_DIR)/%.c $(TST_DIR)/harness.h $(TST_DIR)/testutil.h $(BUILD)/debug/libhakmem.a
	@mkdir -p $(@D)
	@$(if $(Q),echo "  TEST    $@")
	$(Q)$(CC) $(TEST_CFLAGS) $< -o $@ $(BUILD)/debug/libhakmem.a -lprotobuf-c -pthread

$(BUILD)/tests/%: $(TST_DIR)/%.cc $(TST_DIR)/harness.h $(TST_DIR)/testutil.h $(BUILD)/libhakmem.a
	@mkdir -p $(@D)
	@$(if $(Q),echo "  TEST    $@")
	$(Q)$(CXX) $(TEST_CXXFLAGS) $< -o $@ $(BUILD)/libhakmem.a -lprotobuf-c -pthread

$(BUILD)/debug/tests/%: $(TST_DIR)/%.cc $(TST_DIR)/harness.h $(TST_DIR)/testutil.h $(BUILD)/debug/libhakmem.a
	@mkdir -p $(@D)
	@$(if $(Q),echo "  TEST    $@")
	$(Q)$(CXX) $(TEST_CXXFLAGS) $< -o $@ $(BUILD)/debug/libhakmem.a -lprotobuf-c -pthread

$(BUILD)/debug/tests/vgcheck_bugs: $(TST_DIR)/vgcheck_bugs.c $(BUILD)/debug/libhakmem.a
	@mkdir -p $(@D)
	@$(if $(Q),echo "  TEST    $@")
	$(Q)$(CC) $(TEST_CFLAGS) $< -o $@ $(BUILD)/debug/libhakmem.a -lprotobuf-c -pthread

# The telemetry tests' workload is an ordinary program: hakmem comes by preload.
$(BUILD)/learner/workload: learner/tests/workload.c
	@mkdir -p $(@D)
	@$(if $(Q),echo "  CC      $@")
	$(Q)$(CC) -std=gnu11 -O1 -g -Wall -Wextra -pthread $< -o $@

# ---- hakmem-bpf (bpf/, issue 16): the kernel's side of each program's cost ----
# CO-RE: vmlinux.h is dumped from this kernel's BTF at build time, the BPF
# object compiled against it, its libbpf skeleton generated, the loader linked
# with it. Without BTF the build says so and goes on without hakmem-bpf
# (learnd then measures with /proc). bpftool, clang, libbpf: `make deps`.
BPFTOOL   ?= $(or $(shell command -v bpftool 2>/dev/null),/usr/sbin/bpftool)
BPF_CLANG ?= clang
BPF_ARCH  := $(patsubst x86_64,x86,$(patsubst aarch64,arm64,$(shell uname -m)))
KERNEL_BTF ?= /sys/kernel/btf/vmlinux

.PHONY: bpf
ifneq ($(wildcard $(KERNEL_BTF)),)
bpf: $(BUILD)/hakmem-bpf ## hakmem-bpf, the BPF loader learnd starts (needs the kernel's BTF)
else
bpf:
	@echo "  SKIP    $(BUILD)/hakmem-bpf: no kernel BTF at $(KERNEL_BTF); learnd will use /proc"
endif

$(BUILD)/bpf/vmlinux.h:
	@mkdir -p $(@D)
	@$(if $(Q),echo "  BTF     $@")
	$(Q)$(BPFTOOL) btf dump file $(KERNEL_BTF) format c > $@.tmp && mv $@.tmp $@

$(BUILD)/bpf/hakmem.bpf.o: bpf/hakmem.bpf.c bpf/hakmem_kernel.h $(BUILD)/bpf/vmlinux.h
	@$(if $(Q),echo "  BPF     $@")
	$(Q)$(BPF_CLANG) -g -O2 -target bpf -D__TARGET_ARCH_$(BPF_ARCH) -I$(BUILD)/bpf -Ibpf -c $< -o $@

$(BUILD)/bpf/hakmem.skel.h: $(BUILD)/bpf/hakmem.bpf.o
	@$(if $(Q),echo "  SKEL    $@")
	$(Q)$(BPFTOOL) gen skeleton $< name hakmem_bpf > $@.tmp && mv $@.tmp $@

$(BUILD)/hakmem-bpf: bpf/loader.c bpf/hakmem_kernel.h $(BUILD)/bpf/hakmem.skel.h $(BUILD)/proto/hakmem.pb-c.c $(BUILD)/proto/hakmem.pb-c.h
	@$(if $(Q),echo "  LD      $@")
	$(Q)$(CC) -std=gnu11 -O2 -g -Wall -Wextra -I$(BUILD)/bpf -I$(BUILD)/proto -Ibpf $< $(BUILD)/proto/hakmem.pb-c.c \
	  -o $@ -lbpf -lelf -lz -lzmq -lprotobuf-c

# A program that does known numbers of mmap/munmap/madvise/mremap/brk calls
# and first touches (learner/tests/test_bpf.py).
$(BUILD)/learner/kernel_ops: learner/tests/kernel_ops.c
	@mkdir -p $(@D)
	@$(if $(Q),echo "  CC      $@")
	$(Q)$(CC) -std=gnu11 -O1 -g -Wall -Wextra $< -o $@

# A workload that reports exactly what it did (test_counters.py).
$(BUILD)/learner/counted: learner/tests/counted.c
	@mkdir -p $(@D)
	@$(if $(Q),echo "  CC      $@")
	$(Q)$(CC) -std=gnu11 -O1 -g -Wall -Wextra -pthread $< -o $@

# The replayer (replay/): the real allocator linked in, so every block it
# replays is hakmem's, under the policy it is given (README "Replay").
$(BUILD)/hakmem-replay: replay/hakmem-replay.c $(BUILD)/libhakmem.a $(BUILD)/proto/trace.pb-c.h $(INC_DIR)/hakmem.h
	@mkdir -p $(@D)
	@$(if $(Q),echo "  CC      $@")
	$(Q)$(CC) -std=gnu11 -O2 -g -Wall -Wextra -Wno-unused-parameter -I$(INC_DIR) -I$(SRC_DIR) -I$(BUILD)/proto \
	  -pthread $< -o $@ $(BUILD)/libhakmem.a -lprotobuf-c

.PHONY: replay
replay: $(BUILD)/hakmem-replay ## build the trace replayer (build/hakmem-replay)

tests: all $(REL_TESTS) $(DBG_TESTS) $(BUILD)/debug/tests/vgcheck_bugs $(BUILD)/learner/workload $(BUILD)/learner/counted bench-build bpf $(BUILD)/learner/kernel_ops $(BUILD)/hakmem-replay ## build the C/C++ test programs, the workloads and the benchmarks

test: deps tests ## install what tests need, build, run every test (C, stress, real programs, memcheck)
	$(Q)$(PYTHON3) tools/mutate.py --check
	$(Q)BUILD=$(BUILD) $(TST_DIR)/run.sh

.PHONY: mutate
mutate: venv ## apply each curated bug (tools/mutants.toml) to a copy of the tree, run the tests that cover it; fails if one survives
	$(Q)$(PYTHON3) tools/mutate.py $(MUTATE_ARGS)

.PHONY: demo demo-redis demo-synthetic
# make demo: sqlite3 under a memory budget, tuned by learnd (tools/demo_sqlite.py,
# issue 39): the real program where learnd finds room; make demo-redis: redis-server
# under redis-benchmark, where it finds none and says so (tools/demo_redis.py).
# Every target that starts learnd builds the replayer and hakmem-bpf first:
# without them learnd screens nothing and reads the kernel's side from /proc,
# so a fresh clone would show a learnd that no installed one is.
demo: deps lib venv replay bpf ## sqlite3 preloaded under a 160 MiB budget, learnd tuning it for 2 minutes; what it changed, measured (DEMO_S=120)
	$(Q)$(PY) tools/demo_sqlite.py --build $(BUILD) $(if $(DEMO_S),--seconds $(DEMO_S))

demo-redis: deps lib venv replay bpf ## redis-server preloaded under redis-benchmark, learnd tuning it for a minute; what it changed, measured (DEMO_S=60)
	$(Q)tools/install-deps.sh redis
	$(Q)$(PY) tools/demo_redis.py --build $(BUILD) $(if $(DEMO_S),--seconds $(DEMO_S))

demo-synthetic: deps lib venv replay bpf $(BUILD)/learner/workload ## build, run python3 and sqlite3 preloaded, then hakmem-learnd tuning a preloaded workload, and show the learned policy
	$(Q)tools/demo.sh $(BUILD)

.PHONY: deps
deps: ## install the Debian packages the build and tests need (root, once)
	$(Q)tools/install-deps.sh

include bench/bench.mk
include bench/learn.mk
include tools/install.mk

clean: ## remove build/ (and .venv with `make clean-all`)
	$(Q)rm -rf $(BUILD)

.PHONY: clean-all
clean-all: clean
	$(Q)rm -rf $(VENV)

help: ## list the targets
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-zA-Z_-]+):.*## /  \1\t/' | expand -t 14
