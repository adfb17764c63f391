# Two entry points on a fresh CPU-only machine:
#   make demo   installs into .venv and runs the main job
#   make test   installs into .venv and runs the test suite
# The CPU torch wheel is pinned so that pip never downloads a CUDA build.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# numpy<2.4: the Triton 3.6 interpreter (used by the CPU tests) fails on numpy 2.4 scalar conversion.
CPU_PINS := torch==2.13.0+cpu triton==3.6.0 fbgemm-gpu-cpu==1.8.0 "numpy<2.4"
# Where pip finds torch==2.13.0+cpu: this machine's pip configuration has it; elsewhere pass
# TORCH_INDEX="--extra-index-url https://download.pytorch.org/whl/cpu" (PyTorch's CPU wheels).
TORCH_INDEX ?=
TORCHREC_DEPS := tensordict torchmetrics tqdm pyre-extensions
TEST_DEPS := pytest pytest-xdist hypothesis nbclient nbformat ipykernel matplotlib

.PHONY: demo test bench info install clean gpu-tests gpu-tests-block gpu-tests-rest gpu-tests-forced gpu-check gpu-grid gpu-candidates \
	gpu-candidates-bench gpu-candidates-bwd-bench gpu-flash-bwd-bench gpu-profile-bwd gpu-fa4-part-a gpu-fa4-install gpu-flash-peers \
	gpu-grouped-d128

$(VENV)/.installed: setup.cfg pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q setuptools wheel
	$(PIP) install -q $(TORCH_INDEX) $(CPU_PINS) $(TORCHREC_DEPS) $(TEST_DEPS) pyyaml
	$(PIP) install -q --no-deps torchrec==1.8.0
	$(PIP) install -q --no-deps --no-build-isolation -e .
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(PY) -m blockattn_layers demo $(ARGS)

# Two test workers (pytest-xdist): the CPU suite takes about 8.5 minutes on 2 cores so, against 14.5-16 in one
# process (2026-12-06).
test: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 --durations=25 $(ARGS)

bench: $(VENV)/.installed
	$(PY) -m blockattn_layers.bench $(ARGS)

info: $(VENV)/.installed
	$(PY) -m blockattn_layers info

# On a CUDA machine whose python3 already has torch and triton (the lent H200): install this
# package there, run the GPU tests in parallel (JIT compiles dominate) and the full benchmark.
# A device call runs at most 10 minutes: `make gpu-tests` (about 6 minutes with cold compile caches
# on the H200's 8 workers) fits one call there; on an H100 (6 workers) run its halves `make
# gpu-tests-block` (tests/test_triton_gpu.py) and `make gpu-tests-rest` in two calls; `make
# gpu-tests-forced` (over 4 minutes on an H100) one more. `make gpu-check` is the whole of it, for a
# machine without that limit.
GPU_OUT ?= bench_out
# Test workers: one per 12 GiB of GPU memory, at most 8 (8 on the H200; 6 on an 80 GB H100, where 8
# workers' compiled kernels and float64 oracles ran it out of memory).
GPU_WORKERS ?= $(shell python3 -c "import torch; print(max(1, min(8, torch.cuda.get_device_properties(0).total_memory // (12 << 30))))" 2>/dev/null || echo 1)
GPU_PYTEST = python3 -m pytest -q -m gpu -n $(GPU_WORKERS) --dist loadgroup -p no:cacheprovider -rfE
gpu-tests:
	python3 -m pip install -q --no-deps --no-build-isolation -e .
	$(GPU_PYTEST) tests

gpu-tests-block:
	python3 -m pip install -q --no-deps --no-build-isolation -e .
	$(GPU_PYTEST) tests/test_triton_gpu.py

gpu-tests-rest:
	python3 -m pip install -q --no-deps --no-build-isolation -e .
	$(GPU_PYTEST) tests --ignore=tests/test_triton_gpu.py

gpu-tests-forced:
	python3 -m pip install -q --no-deps --no-build-isolation -e .
	BLOCKATTN_KERNELS=simple $(GPU_PYTEST) tests/test_triton_gpu.py
	BLOCKATTN_KERNELS=hopper_ws $(GPU_PYTEST) tests/test_triton_gpu.py tests/test_prepared_backward.py

gpu-check: gpu-tests gpu-tests-forced
	python3 -m blockattn_layers verify-arch --quick --no-bench --out $(GPU_OUT)/verify_arch.md
	python3 -m blockattn_layers.bench --shapes all --plot --out $(GPU_OUT)

# Kernels and options off their defaults, on a CUDA machine: `make gpu-candidates` runs their GPU
# tests (the e4m3 projection, the fp8 forward's options and float32 rotation, the persistent flash forward, the Gluon
# dK/dV pass of the flash backward in its forms) under a time limit, so that a hang would not hold the machine
# (about 5 minutes); `make gpu-candidates-bench` times the projection by each kernel and option, the fp8
# forward and sub-layers with their time per kernel (`bench.fp8 --kernels`), and the flash forward's
# loop and tile options (about 7 minutes); `make gpu-candidates-bwd-bench` the flash backward's forms
# beside ours on the full-attention shapes (about 4 minutes).
CANDIDATE_FLASH_ROWS ?= triton_flash,triton_flash[fast_bwd],triton_flash[triton_bwd],triton_flash[triton_fast_bwd],triton_flash[gluon_bwd],triton_flash[gluon_fast_bwd],triton_flash[gluon_bwd_consumer_adds],triton_flash[gluon_fast_bwd_consumer_adds],triton_flash[gluon_fast_bwd_p_beside_dp],triton_flash[gluon_fast_bwd_rows_by_loader],triton_flash[gluon_bwd_rows_by_loader],triton_flash[gluon_fast_bwd_consumer_rows],triton_flash[gluon_bwd_consumer_rows],triton_flash[gluon_dkdv_bwd]
gpu-candidates:
	python3 -m pip install -q --no-deps --no-build-isolation -e .
	timeout 420 python3 -m pytest -q -m gpu -n $(GPU_WORKERS) -p no:cacheprovider tests/test_fp8_modules.py \
		tests/test_fp8.py tests/test_triton_flash_interpret.py \
		-k "warp_specialized_projection or candidate_options or persistent or gluon_backward or rotating_in_float32" || true

gpu-candidates-bench:
	python3 -m pip install -q --no-deps --no-build-isolation -e .
	mkdir -p $(GPU_OUT)
	timeout 60 python3 -m blockattn_layers.bench.fp8 --projection --out $(GPU_OUT)/fp8_projection.csv || true
	timeout 180 python3 -m blockattn_layers.bench.fp8 --kernels --out $(GPU_OUT)/fp8.csv || true
	timeout 120 python3 -m blockattn_layers.bench.fp8 --ws-options --out $(GPU_OUT)/fp8_ws_options.csv || true
	timeout 180 python3 -m blockattn_layers.bench --shapes seed3,seed3_d64,block256,block512 --modes fwd \
		--backends "triton_flash,triton_flash[triton_fwd],triton_flash[gluon_serial_joint],triton_flash[gluon_overlap_joint],triton_flash[gluon_m128],triton_flash[gluon_m192],triton_flash[gluon_pingpong],triton_flash[gluon_shift_last],triton_flash[gluon_early_release],triton_flash[gluon_thread_release]" \
		--out $(GPU_OUT)/flash_fwd || true

gpu-candidates-bwd-bench:
	python3 -m pip install -q --no-deps --no-build-isolation -e .
	timeout 240 python3 -m blockattn_layers.bench --shapes seed3,seed3_causal,seed3_gqa,prod_full \
		--backends "$(CANDIDATE_FLASH_ROWS),triton_flash[gluon_tiles]" --out $(GPU_OUT)/flash || true

# The flash backward's forms beside each other in one process, on the full-attention shapes (D 128 and
# D 64) and blocks of 256 / 512: the default (deterministic), the fast one, the deterministic one by the
# Triton passes alone and with the Gluon dK/dV-only pass (about 3 minutes).
FLASH_BWD_ROWS ?= triton_flash,triton_flash[fast_bwd],triton_flash[triton_bwd],triton_flash[gluon_dkdv_bwd]
gpu-flash-bwd-bench:
	python3 -m pip install -q --no-deps --no-build-isolation -e .
	timeout 300 python3 -m blockattn_layers.bench --shapes seed3,seed3_d64,seed3_causal,seed3_gqa,prod_full,block256,block512 \
		--backends "$(FLASH_BWD_ROWS)" --modes bwd --out $(GPU_OUT)/flash_bwd

# Nsight Compute on the Gluon dK/dV pass of the flash backward (one launch at seed3, the fast one's
# writer partition by TMA reduce-adds and the consumers' own adds): stall reasons, memory and tensor-core use, into $(GPU_OUT)/ncu_bwd_*.txt.
NCU_SECTIONS = --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis \
	--section ComputeWorkloadAnalysis --section SchedulerStats --section Occupancy
gpu-profile-bwd:
	python3 -m pip install -q --no-deps --no-build-isolation -e .
	mkdir -p $(GPU_OUT)
	for row in gluon_fast_bwd gluon_fast_bwd_consumer_adds; do \
		timeout 240 ncu --clock-control none $(NCU_SECTIONS) -k regex:_flash_bwd_ws_kernel -c 1 \
			python3 -m blockattn_layers.bench --shapes seed3 --backends "triton_flash[$$row]" --modes bwd --quick \
			> $(GPU_OUT)/ncu_bwd_$$row.txt 2>&1 || true; \
	done

# FlashAttention-4 (flash-attn-4 and its wheels, PERFORMANCE.md's recipe) on the device: its CUDA
# library wheel is over one call's 64 MiB, so it travels in two parts, `out/fa4a` (the small wheels
# and part aa) and `out/fa4b` (part ab), in two calls made back to back while the machine stays warm:
# `make gpu-fa4-part-a` with carry ["out/fa4a"], then `make gpu-fa4-install gpu-flash-peers` with
# carry ["out/fa4b"]. The parts wait under /tmp there, outside the working tree.
FA4_DIR ?= /tmp/fa4
FA4_SITE ?= /tmp/site
FA4_LIBS_WHEEL := nvidia_cutlass_dsl_libs_cu12-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
FLASH_PEER_SHAPES ?= seed3,seed3_d64,prod_full,seed3_causal,seed3_gqa,block256,block512
FLASH_PEER_ROWS ?= triton_flash,triton_flash[fast_bwd],fa4_varlen,flex_blocks_flash,varlen_attn
gpu-fa4-part-a:
	mkdir -p $(FA4_DIR) && cp out/fa4a/* $(FA4_DIR)/

gpu-fa4-install:
	cp out/fa4b/* $(FA4_DIR)/
	cd $(FA4_DIR) && cat cu12.part.aa cu12.part.ab > $(FA4_LIBS_WHEEL) && rm cu12.part.*
	python3 -m pip install -q --no-index --no-deps --target $(FA4_SITE) $(FA4_DIR)/*.whl

gpu-flash-peers:
	python3 -m pip install -q --no-deps --no-build-isolation -e .
	PYTHONPATH=$(FA4_SITE):$(FA4_SITE)/nvidia_cutlass_dsl/dsl_packages python3 -m blockattn_layers.bench \
		--shapes $(FLASH_PEER_SHAPES) --backends "$(FLASH_PEER_ROWS)" --out $(GPU_OUT)/flash_peers

# The shape grid of issue 25 on a CUDA machine, one dtype, rotary form and causal setting per
# process (each slice compiles its 60 points first in 6 processes, more run out of GPU memory;
# about 2.5 minutes a slice on the H200): `make gpu-grid GRID_DTYPES=bf16 GRID_ROTARY="none split"
# GRID_CAUSAL=no` runs a part; `GRID_LENGTHS=aligned` the points of lengths rounded up to the
# block, where the cuDNN peers run.
GRID_BACKENDS ?= triton,triton[simple],triton[hopper_packed],fa2_varlen,rope_comp+fa2,sdpa_cudnn,rope_comp+cudnn,fa4_varlen
GRID_DTYPES ?= bf16 fp16
GRID_LENGTHS ?= prod
GRID_ROTARY ?= none split interleaved partial
GRID_CAUSAL ?= no yes
gpu-grid:
	python3 -m pip install -q --no-deps --no-build-isolation -e .
	for d in $(GRID_DTYPES); do for r in $(GRID_ROTARY); do for c in $(GRID_CAUSAL); do for l in $(GRID_LENGTHS); do \
		python3 -m blockattn_layers.bench --grid rotary=$$r causal=$$c lengths=$$l --dtype $$d --precompile 6 \
			--quiet --plot --backends "$(GRID_BACKENDS)" --out $(GPU_OUT)/grid_$${d}_$${r}_$${c}_$${l} || exit 1; \
		done; done; done; done

# The grouped block-128 D128 backward on the flash kernel with dQ stored (session 54), on an sm_90 machine: its GPU
# tests, then the grid slice routed and with a forced variant (the block kernels' backward) in one call (about 4
# minutes on an H100 with cold caches).
gpu-grouped-d128:
	python3 -m pip install -q --no-deps --no-build-isolation -e .
	timeout 240 $(GPU_PYTEST) tests/test_triton_gpu.py tests/test_ops.py \
		-k "grouped_d128 or forced_variant_keeps or hopper_forward_stores or session_28" || true
	python3 -m blockattn_layers.bench --grid block=128 dim=128 heads=2x2,4x1,8x2 rotary=none,interleaved \
		causal=no,yes --quiet --out $(GPU_OUT)/grouped_d128
	BLOCKATTN_KERNELS=rotated python3 -m blockattn_layers.bench --grid block=128 dim=128 heads=4x1,8x2 \
		rotary=none causal=no,yes --backends triton --quiet --out $(GPU_OUT)/grouped_d128_block_kernels

clean:
	rm -rf $(VENV) build *.egg-info
