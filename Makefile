# StrideWeave: every target starts from a fresh machine and installs what is missing.
#   make test      C++ tests (ctest), the C++ example against the installed package, Python tests (pytest) and
#                  the type check of the stubs
#   make demo      the main job: examples/finetune_command_demo.py runs the fine-tuning command
#                  (python -m strideweave.finetune) on a small Qwen3-MoE whose experts, gradients and AdamW moments
#                  are 8x its budget, and checks the result against the same steps in RAM (PASS/FAIL).
#                  examples/finetune_moe.py, the engine-level example (about 2 minutes), runs with
#                  `.venv/bin/python examples/finetune_moe.py` and in make soak
#   make sanitize  C++ tests under ASan+UBSan and under TSan, then the Python suite under ASan+UBSan+LSan
#                  (sanitize-py: the extension built with SW_SANITIZE=address into build/sanitize-py, never the
#                  .venv's package, and pytest run with the ASan runtime preloaded; docs/reliability.md)
#   make bench     benchmarks (bench/*.py --quick; FULL=1 for full runs, and bench/peers.py: DeepSpeed beside
#                  StrideWeave, requirements-peers.txt and libaio-dev installed first) -> bench/results/
#   make soak      the main example trained for SOAK_SECONDS (default 600) while its RSS, open files and threads are
#                  sampled every second; fails if any grows after warm-up -> build/soak/ (docs/reliability.md, "Soak")
#   make fuzz      coverage-guided fuzzing of every entry point (FUZZ_SECONDS per target, default 45) ->
#                  build/fuzz/report.md; make fuzz-corpus keeps what it found in fuzz/corpus/
SHELL := /bin/bash
.ONESHELL:
.SHELLFLAGS := -eu -o pipefail -c

PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
JOBS ?= $(shell nproc)
APT_PACKAGES := libgtest-dev libopenblas-dev g++ nlohmann-json3-dev
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
CMAKE := $(VENV)/bin/cmake

.PHONY: test demo sanitize bench cpp-test cpp-example py-test typecheck install deps clean

deps: build/.apt-stamp $(VENV)/.stamp

build/.apt-stamp:
	missing=""
	for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done
	if [ -n "$$missing" ]; then
	  echo "installing Debian packages:$$missing"
	  $(SUDO) apt-get update -qq
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $$missing
	fi
	mkdir -p build && touch $@

$(VENV)/.stamp: requirements-dev.txt
	[ -x $(VPY) ] || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -r requirements-dev.txt
	touch $@

build/cpp/build.ninja: deps CMakeLists.txt
	$(CMAKE) -S . -B build/cpp -G Ninja -DCMAKE_MAKE_PROGRAM=$(abspath $(VENV)/bin/ninja) \
	  -DSW_BUILD_PYTHON=OFF -DSW_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=Release

cpp-test: build/cpp/build.ninja
	$(CMAKE) --build build/cpp -j $(JOBS)
	$(VENV)/bin/ctest --test-dir build/cpp --output-on-failure -j $(JOBS)

install: deps
	PATH=$(abspath $(VENV)/bin):$$PATH $(VPY) -m pip install -q --no-build-isolation .

py-test: install
	$(VPY) -m pytest -q tests

# The C++ package: the core installed with `cmake --install` into a build-local prefix, and examples/cpp built
# against it as a C++ user would build it (find_package(strideweave), nothing from the source tree), then run.
CPP_PREFIX := build/install

cpp-example: build/cpp/build.ninja
	$(CMAKE) --build build/cpp -j $(JOBS) --target strideweave_core
	rm -rf $(CPP_PREFIX)
	$(CMAKE) --install build/cpp --prefix $(CPP_PREFIX) --component cpp
	$(CMAKE) -S examples/cpp -B build/example -G Ninja -DCMAKE_MAKE_PROGRAM=$(abspath $(VENV)/bin/ninja) \
	  -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH=$(abspath $(CPP_PREFIX))
	$(CMAKE) --build build/example -j $(JOBS)
	build/example/tiled_matmul

# The shipped stubs (strideweave/_core.pyi, py.typed) as a type checker sees them: a typed user script passes, and a
# wrong call is reported (so the check can fail).
typecheck: install
	$(VPY) tests/typing/check.py

test: cpp-test cpp-example py-test typecheck

demo: install
	$(VPY) examples/finetune_command_demo.py

# Benchmark-only dependencies (PyTorch, matplotlib); make test never needs them.
$(VENV)/.bench-stamp: requirements-bench.txt $(VENV)/.stamp
	$(VPY) -m pip install -q -r requirements-bench.txt
	touch $@

# bench/peers.py, FULL=1 only: DeepSpeed (requirements-peers.txt) and libaio-dev (its async_io op, for ZeRO-Infinity's
# NVMe offload). deepspeed is an sdist whose setup.py imports torch: --no-build-isolation and --no-deps (its
# dependencies are pinned in the file) keep the CPU torch of requirements-bench.txt; the check after it fails the
# target if another torch came in.
PEERS_APT_PACKAGES := libaio-dev

# The same recipe as build/.apt-stamp, over the packages of bench/peers.py.
build/.peers-apt-stamp: build/.apt-stamp
	$(MAKE) --no-print-directory -B build/.apt-stamp APT_PACKAGES="$(PEERS_APT_PACKAGES)"
	touch $@

$(VENV)/.peers-stamp: requirements-peers.txt $(VENV)/.bench-stamp
	DS_BUILD_OPS=0 $(VPY) -m pip install -q --no-deps --no-build-isolation -r requirements-peers.txt
	$(VPY) -c "import torch, deepspeed; v = torch.__version__; assert v == '2.13.0+cpu', v"
	touch $@

bench: install $(VENV)/.bench-stamp $(if $(FULL),build/.peers-apt-stamp $(VENV)/.peers-stamp,)
	$(VPY) bench/run_all.py $(if $(FULL),--full,)

sanitize: deps
	for kind in address thread; do
	  $(CMAKE) -S . -B build/sanitize-$$kind -G Ninja -DCMAKE_MAKE_PROGRAM=$(abspath $(VENV)/bin/ninja) \
	    -DSW_BUILD_PYTHON=OFF -DSW_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSW_SANITIZE=$$kind
	  $(CMAKE) --build build/sanitize-$$kind -j $(JOBS)
	  ASAN_OPTIONS=halt_on_error=1:detect_leaks=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
	  TSAN_OPTIONS=halt_on_error=1:suppressions=$(abspath cpp/tests/tsan.supp) $(VENV)/bin/ctest --test-dir build/sanitize-$$kind --output-on-failure -j $(JOBS)
	done
	$(MAKE) sanitize-py

clean:
	rm -rf build

# The soak (tools/soak.py; docs/reliability.md, "Soak"): examples/finetune_moe.py --seconds $(SOAK_SECONDS) in a child
# process, sampled from /proc every second; samples, verdict and plot in build/soak/. matplotlib (the plot) comes
# from requirements-bench.txt, as for make bench.
SOAK_SECONDS ?= 600
.PHONY: soak

soak: install $(VENV)/.bench-stamp
	$(VPY) tools/soak.py --seconds $(SOAK_SECONDS) --out build/soak

# ---------------------------------------------------------------- coverage-guided fuzzing (docs/reliability.md)
# make fuzz: one fuzz target per entry point, run one after another for FUZZ_SECONDS each (default 45 s: about
# 3 minutes of fuzzing for the four targets, plus the first build): libFuzzer (clang-16, ASan+UBSan) on the C++
# targets fuzz/*_fuzz.cpp, atheris on the Python ones fuzz/py/*_fuzz.py. Each starts from its committed seed
# corpus fuzz/corpus/<target>/ and grows build/fuzz/corpus/<target>/; a crashing input lands in
# build/fuzz/artifacts/. Prints the table of executions, coverage and crashes and writes it to build/fuzz/report.md;
# fails when any target found a crash. make fuzz-corpus merges what a run found into the committed corpus
# (libFuzzer -merge=1 -use_counters=0: the fewest inputs that reach every edge reached, a few hundred in all).
FUZZ_APT_PACKAGES := clang-16 libclang-rt-16-dev
FUZZ_SECONDS ?= 45
FUZZ_CPP_TARGETS := layout_fuzz tiles_fuzz safetensors_fuzz
FUZZ_PY_TARGETS := extension_fuzz
FUZZ_FLAGS := -timeout=20 -rss_limit_mb=4096 -max_len=8192 -print_final_stats=1

.PHONY: fuzz fuzz-build fuzz-corpus

# The same recipe as build/.apt-stamp, over the fuzzing packages (clang-16 and its libFuzzer runtime).
build/.fuzz-apt-stamp: build/.apt-stamp
	$(MAKE) --no-print-directory -B build/.apt-stamp APT_PACKAGES="$(FUZZ_APT_PACKAGES)"
	touch $@

$(VENV)/.fuzz-stamp: requirements-fuzz.txt $(VENV)/.stamp
	$(VPY) -m pip install -q -r requirements-fuzz.txt
	touch $@

fuzz-build: deps build/.fuzz-apt-stamp
	CC=clang-16 CXX=clang++-16 $(CMAKE) -S . -B build/fuzz -G Ninja -DCMAKE_MAKE_PROGRAM=$(abspath $(VENV)/bin/ninja) \
	  -DSW_BUILD_PYTHON=OFF -DSW_BUILD_TESTS=OFF -DSW_INSTALL_CPP=OFF -DSW_BUILD_FUZZ=ON -DCMAKE_BUILD_TYPE=Fuzz \
	  -DCMAKE_CXX_SCAN_FOR_MODULES=OFF
	$(CMAKE) --build build/fuzz -j $(JOBS) --target $(FUZZ_CPP_TARGETS)

fuzz: fuzz-build install $(VENV)/.fuzz-stamp
	mkdir -p build/fuzz/artifacts
	status=0
	for t in $(FUZZ_CPP_TARGETS) $(FUZZ_PY_TARGETS); do
	  mkdir -p build/fuzz/corpus/$$t fuzz/corpus/$$t
	  case " $(FUZZ_PY_TARGETS) " in *" $$t "*) run="$(VPY) fuzz/py/$$t.py" ;; *) run="build/fuzz/$$t" ;; esac
	  echo "== $$t: $(FUZZ_SECONDS) s"
	  start=$$(date +%s.%N)
	  rc=0
	  ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	    $$run $(FUZZ_FLAGS) -max_total_time=$(FUZZ_SECONDS) -artifact_prefix=build/fuzz/artifacts/$$t- \
	    build/fuzz/corpus/$$t fuzz/corpus/$$t > build/fuzz/$$t.log 2>&1 || rc=$$?
	  echo "$$rc $$start $$(date +%s.%N)" > build/fuzz/$$t.rc
	  [ $$rc = 0 ] || { status=1; tail -40 build/fuzz/$$t.log; }
	done
	$(VPY) fuzz/report.py build/fuzz $(FUZZ_CPP_TARGETS) $(FUZZ_PY_TARGETS)
	exit $$status

fuzz-corpus: fuzz-build $(VENV)/.fuzz-stamp
	for t in $(FUZZ_CPP_TARGETS) $(FUZZ_PY_TARGETS); do
	  case " $(FUZZ_PY_TARGETS) " in *" $$t "*) run="$(VPY) fuzz/py/$$t.py" ;; *) run="build/fuzz/$$t" ;; esac
	  mkdir -p build/fuzz/corpus/$$t fuzz/corpus/$$t build/fuzz/merged/$$t
	  rm -f build/fuzz/merged/$$t/*
	  $$run -merge=1 -use_counters=0 -max_len=8192 build/fuzz/merged/$$t fuzz/corpus/$$t build/fuzz/corpus/$$t \
	    > build/fuzz/$$t.merge.log 2>&1
	  rm -f fuzz/corpus/$$t/* && cp build/fuzz/merged/$$t/* fuzz/corpus/$$t/
	  echo "$$t: $$(ls fuzz/corpus/$$t | wc -l) inputs"
	done

# The Python suite under AddressSanitizer + UndefinedBehaviorSanitizer + LeakSanitizer (part of `make sanitize`;
# docs/reliability.md). The extension is built with SW_SANITIZE=address in the C++ ASan build's directory
# (build/sanitize-address: the core library's objects are shared, only the bindings are added) and installed into
# its own prefix (build/sanitize-py/site), so the .venv's package stays as `make install` left it; pytest runs
# with the .venv's interpreter, that prefix first on PYTHONPATH and the ASan runtime preloaded (an uninstrumented
# python3 must load it first), with libstdc++ (loaded later, its __cxa_throw is one ASan cannot intercept: every
# C++ exception would stop the run). Reports go to build/sanitize-py/reports, one file per process (pytest captures
# stderr, and children the tests start report too); any report fails the target. PYTHONMALLOC=malloc sends every
# Python object through malloc, so ASan sees overruns of extension objects and LeakSanitizer sees what a Python
# object holds; tests/lsan.supp says why each suppressed leak is not the engine's. allocator_may_return_null=1: an
# allocation too large for ASan's allocator fails as it does without it (std::bad_alloc, the engine's MemoryError)
# instead of stopping the process. SW_SANITIZED=1 lets tests/conftest.py skip the few tests that measure what a sanitizer
# changes (its list says why). SAN_TESTS narrows the run, e.g. `make sanitize-py SAN_TESTS="-x tests/test_tensor.py"`.
SAN_PY := build/sanitize-py
SAN_TESTS ?= tests

.PHONY: sanitize-py
sanitize-py: deps
	rm -rf $(SAN_PY)/site
	PATH=$(abspath $(VENV)/bin):$$PATH CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) $(VPY) -m pip install -q --no-build-isolation \
	  --no-deps --target $(SAN_PY)/site -C build-dir=$(abspath build/sanitize-address) -C cmake.build-type=RelWithDebInfo \
	  -C cmake.define.SW_SANITIZE=address .
	rm -rf $(SAN_PY)/reports && mkdir -p $(SAN_PY)/reports
	start=$$(date +%s) status=0
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libstdc++.so)" \
	  PYTHONMALLOC=malloc SW_SANITIZED=1 PYTHONPATH=$(abspath $(SAN_PY)/site) \
	  ASAN_OPTIONS=detect_leaks=1:halt_on_error=1:allocator_may_return_null=1:log_path=$(abspath $(SAN_PY))/reports/asan \
	  LSAN_OPTIONS=suppressions=$(abspath tests/lsan.supp):print_suppressions=0 \
	  UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1:log_path=$(abspath $(SAN_PY))/reports/ubsan \
	  $(VPY) -m pytest -q -p no:cacheprovider $(SAN_TESTS) || status=$$?
	echo "sanitize-py: pytest under ASan+UBSan+LSan took $$(( $$(date +%s) - start )) s"
	if compgen -G "$(SAN_PY)/reports/*" >/dev/null; then
	  cat $(SAN_PY)/reports/*
	  echo "sanitize-py: the sanitizer reports above are in $(SAN_PY)/reports (one file per process)"
	  exit 1
	fi
	exit $$status
