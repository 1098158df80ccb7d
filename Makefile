# Two commands on a fresh machine: `make test` and `make demo`. Each creates .venv when it
# is missing and installs prunus with torch pinned (an unpinned torch pulls gigabytes of CUDA).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.prunus-installed
# Where torch's CPU build comes from. The pin alone does not keep CUDA off a CPU machine: on plain PyPI
# torch==2.13.0 is the CUDA build, and this index holds 2.13.0+cpu, which pip prefers. It is probed first
# (5 s at most) and skipped with a note when unreachable, then pip's own configuration decides.
# `make test TORCH_INDEX=` uses no extra index; another URL (a mirror, a CUDA index) picks another build.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_PIN := torch==2.13.0
PIP := $(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt
DEMO ?= runs/demo
SERVE_PORT ?= 8765
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: test test-quick demo bench install clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@index='$(TORCH_INDEX)'; \
	if [ -n "$$index" ] && ! $(BIN)/python -c 'import sys, urllib.request; u = sys.argv[1]; u.startswith("http") and urllib.request.urlopen(u.rstrip("/") + "/torch/", timeout=5)' "$$index" 2>/dev/null; then \
		echo "note: TORCH_INDEX $$index cannot be reached; torch comes from pip's own configuration (make sure it is a +cpu build on a CPU machine)"; index=; fi; \
	echo "$(PIP) $${index:+--extra-index-url $$index }$(TORCH_PIN)"; \
	$(PIP) $${index:+--extra-index-url "$$index"} $(TORCH_PIN)
	$(PIP) -e ".[dev]"
	$(PIP) --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2  # structured outputs; --no-deps: its triton is for GPUs
	$(PIP) "ray[serve]==2.60.0"  # the ray extra: prunus serve --replicas on Ray Serve (tests/test_ray_serve.py)
	@touch $(STAMP)
	@echo "prunus is installed in $(VENV). To have the prunus command on your PATH, run: source $(BIN)/activate"

# Two pytest workers (pytest-xdist, a dev dependency), a test file to a worker (module fixtures and the tests that
# read what earlier tests of their file did stay together): most tests run one Python thread, and the process-group
# tests wait on rendezvous and I/O, so two workers on two cores take about half the time of one.
# PYTEST_WORKERS=0 runs everything in this one process.
# Each worker runs torch on one thread (OMP_NUM_THREADS=1): two workers of two threads each oversubscribed the two
# cores (1437 tests: 15 min 12 s so, 13 min 33 s with one thread a worker, the same machine and tree).
PYTEST_WORKERS ?= 2
ONE_THREAD = $(if $(filter 0,$(PYTEST_WORKERS)),,OMP_NUM_THREADS=1)

test: $(STAMP)
	$(ONE_THREAD) $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --durations=20

# The quick tier (about 2.5 minutes on 2 cores): every test but those marked slow (seconds each, or starting
# processes; tests/conftest.py SLOW_REASONS).
test-quick: $(STAMP)
	$(ONE_THREAD) $(BIN)/python -m pytest -q -m "not slow" -n $(PYTEST_WORKERS) --dist loadfile

demo: $(STAMP)
	@echo "== 1/6 train the 'small' preset on the built-in corpus (this Python's standard library) =="
	$(BIN)/prunus train --preset small --steps 240 --batch-size 16 --lr 3e-3 --min-lr 3e-4 --warmup-steps 24 \
		--eval-every 80 --ckpt-every 80 --out $(DEMO) --overwrite
	@echo "== 2/6 evaluate: validation bits per byte against the unigram baseline =="
	$(BIN)/prunus eval $(DEMO)/model
	@echo "== 3/6 generate with the KV cache =="
	$(BIN)/prunus generate $(DEMO)/model --prompt "def read_config(path):" --max-new-tokens 200 --temperature 0.6 --seed 0
	@echo "== 4/6 compress: int8 weight-only, with its report (quality, size, latency) =="
	$(BIN)/prunus compress $(DEMO)/model --recipe int8-weight-only --out $(DEMO)/int8 --overwrite
	@echo "== 5/6 export to ONNX Runtime: the fp32 model, and the int8 dir with its own int8 weights; each checked against PyTorch (parity) =="
	$(BIN)/prunus export $(DEMO)/model --format onnx --out $(DEMO)/onnx-fp32 --overwrite
	$(BIN)/prunus export $(DEMO)/int8 --format onnx --out $(DEMO)/onnx-int8 --overwrite
	@echo "== 6/6 serve the int8 export over HTTP (prunus serve) and ask it for a completion =="
	@$(BIN)/prunus serve $(DEMO)/onnx-int8 --port $(SERVE_PORT) & pid=$$!; \
	for i in $$(seq 1 240); do curl -sf http://127.0.0.1:$(SERVE_PORT)/health >/dev/null && break; sleep 0.5; done; \
	curl -sf http://127.0.0.1:$(SERVE_PORT)/v1/completions -H 'Content-Type: application/json' \
		-d '{"model": "onnx-int8", "prompt": "def read_config(path):", "max_tokens": 160, "temperature": 0.6, "seed": 0}' \
		| $(BIN)/python -c 'import json, sys; r = json.load(sys.stdin); print("def read_config(path):" + r["choices"][0]["text"]); print(r["usage"])'; \
	rc=$$?; kill $$pid; wait $$pid; exit $$rc
	@echo
	@echo "artifacts: run dir $(DEMO) (metrics.jsonl, loss.png, checkpoints/), model dir $(DEMO)/model, compressed $(DEMO)/int8 (report.md, report.png), exports $(DEMO)/onnx-fp32 $(DEMO)/onnx-int8 (parity.json); serve one: $(BIN)/prunus serve $(DEMO)/onnx-int8"
	@echo "inspect:   $(BIN)/prunus info $(DEMO)/model"

bench: $(STAMP)
	$(BIN)/python -m benchmarks.train_throughput

clean:
	rm -rf $(VENV) runs *.egg-info
