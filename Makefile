# Everything goes through scripts/bootstrap.sh, which installs what is missing and is quick
# when nothing is.
SHELL := /bin/bash
VENV := .venv
CONFIG := config/aiproxy.toml
# Extra pytest arguments, e.g. make test PYTEST_ARGS="tests/test_demo_upstream.py -x"
PYTEST_ARGS ?=
# Extra arguments for `make bench` (pytest-benchmark) and `make bench-e2e` (bench/e2e.py).
BENCH_ARGS ?=
E2E_ARGS ?=

.PHONY: run test lint bench bench-e2e pgo clean

# Two demo upstreams in the background, the proxy in the foreground. The trap stops the
# upstreams when the proxy exits or on Ctrl-C; the proxy is not exec'ed because that would
# drop the trap.
run:
	scripts/bootstrap.sh
	@trap 'kill $$a $$b 2>/dev/null; wait 2>/dev/null' EXIT; \
	trap 'exit 130' INT; \
	trap 'exit 143' TERM; \
	$(VENV)/bin/aiproxy demo-upstream --listen 127.0.0.1:9001 --name demo-a & a=$$!; \
	$(VENV)/bin/aiproxy demo-upstream --listen 127.0.0.1:9002 --name demo-b & b=$$!; \
	$(VENV)/bin/aiproxy -c $(CONFIG)

# Slow tests are left out here rather than in pyproject, so `pytest -m slow` still selects
# them. pytest exits 5 when it collected nothing, which must not pass quietly.
test:
	scripts/bootstrap.sh --test
	@$(VENV)/bin/python -m pytest -m "not slow" $(PYTEST_ARGS); status=$$?; \
	if [ $$status -eq 5 ]; then echo "no tests collected: treat as failure" >&2; fi; \
	exit $$status

lint:
	scripts/bootstrap.sh --lint
	$(VENV)/bin/ruff check .

# Micro benchmarks; every run is saved under .benchmarks/ so a later one can compare:
# make bench BENCH_ARGS="--benchmark-compare --benchmark-compare-fail=median:10%"
bench:
	scripts/bootstrap.sh --test
	$(VENV)/bin/python -m pytest bench --benchmark-only --benchmark-autosave --benchmark-storage=.benchmarks $(BENCH_ARGS)

# aiproxy beside nginx and haproxy (wrk, several minutes); E2E_ARGS="--quick" for a short pass.
bench-e2e:
	scripts/bootstrap.sh --test
	$(VENV)/bin/python bench/e2e.py $(E2E_ARGS)

# The extensions rebuilt profile-guided (GCC): built with counters, trained on the bundled
# config and demo upstreams, built again with the profile (scripts/pgo_build.sh).
# scripts/bootstrap.sh does this after each install; this target redoes it on demand.
pgo:
	AIPROXY_PGO_BUILD=0 scripts/bootstrap.sh
	scripts/pgo_build.sh

# BPF objects for the kernel fast paths (the package build also runs this).
.PHONY: bpf
bpf:
	$(MAKE) -C bpf

# The shipped intent model (builtin:clinc150), trained with numpy on the CLINC150 train
# split plus its out-of-scope rows; the validation split only picks the oos threshold and
# is recorded in the model's metadata. Same seed, same weights. The settings were compared
# on a held-out fifth of the train split and on val (README, "Semantic routing"): three
# members with logits averaged (one folded table at run time, so no slower), label
# smoothing 0.2, and 16,384 buckets (half the table of 32,768, no less accurate on val).
# Three more members are trained with frozen GloVe 50d word vectors (the [train] extra),
# and only their rows for the train split's words, at half weight, join the table: the
# n-gram scores stay the first three members', so out-of-scope texts do not get more
# confident, and words the train split never has still score through their vectors.
CLINC150 ?= ../shared/data/clinc150
.PHONY: model
model:
	scripts/bootstrap.sh --train
	$(VENV)/bin/aiproxy router train --seed 1 \
	  --data $(CLINC150)/train.jsonl --data $(CLINC150)/oos_train.jsonl \
	  --val $(CLINC150)/val.jsonl --val $(CLINC150)/oos_val.jsonl \
	  --domains $(CLINC150)/domains.json \
	  --buckets 16384 --dim 128 --hidden 0 --word-ngrams 3 --char-ngrams 3,5 \
	  --pooling mean --epochs 10 --batch 32 --lr 0.01 --lr-embed 0.03 --lr-decay 0.1 \
	  --dropout 0.3 --average-from 4 --no-output-bias --label-smoothing 0.2 --ensemble 3 \
	  --word-vectors glove-6b-50d --vocab-top 0 --word-vector-members 3 \
	  --word-vector-weight 0.5 \
	  --fold --threshold-target 0.55 --dtype int8 --jobs 2 \
	  -o aiproxy/semantic/models/clinc150.onnx

clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache .benchmarks
	rm -f aiproxy/kernel/objects/*.bpf.o
	rm -f aiproxy/*/*.c aiproxy/*/*.so aiproxy/*/*.html
	rm -f $(VENV)/.aiproxy-install-stamp
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +
