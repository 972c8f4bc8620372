# The two commands of the README: `make demo` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test lint clean

$(VENV)/.base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.dev: $(VENV)/.base
	$(PY) -m pip install -q -e '.[dev,bench,examples]'
	touch $@

demo: $(VENV)/.base
	$(VENV)/bin/kvgate demo

lint: $(VENV)/.dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# The real-vLLM tier first and alone (its fidelity checks time a real engine against the
# simulated one: nothing else may load the cores meanwhile), then the rest on two workers
# (pytest-xdist; a module's tests stay on one worker, so its fixtures start once). Both always
# run; either failing fails the target (pytest's 5, "no tests collected", counts as success).
test: lint
	$(PY) -m pytest -q -p no:cacheprovider --durations=10 tests/vllm_tier; tier=$$?; \
	$(PY) -m pytest -q -p no:cacheprovider --durations=20 -n 2 --dist loadfile \
	    --ignore=tests/vllm_tier tests; rest=$$?; \
	for rc in $$tier $$rest; do \
	    if [ $$rc -eq 5 ]; then echo "no tests collected"; elif [ $$rc -ne 0 ]; then exit $$rc; fi; \
	done

clean:
	rm -rf $(VENV) build *.egg-info

# The engine model compiled with mypyc for the benchmarks below (`kvgate native build`: same
# results, 5-25% less time); rebuilt when its source changes.
$(VENV)/.native: $(VENV)/.dev adapters/sim/model.py adapters/sim/__init__.py
	$(VENV)/bin/kvgate native build
	touch $@


# The README's result tables: every report under bench-results/, then the markdown tables.
# Each report runs its policies side by side on the machine's cores (`kvgate bench --jobs`,
# by default as many as the process may use), so plain `make bench-tables` keeps them busy.
POLICIES := kvgate,kvgate-no-pace,kvgate-no-batch,kvgate-no-priority,kvgate-no-siblings,kvgate-routing-only,round-robin,least-loaded,session,sglang-like,sglang-0.3-like,llmd-like,llmd-approx-like,llmd-affinity-like,llmd-approx-affinity-like,llmd-p2p-tokenaware-like,dynamo-like
BENCH := $(VENV)/bin/kvgate bench --no-progress --policy $(POLICIES)
LONG := --profile h100x4-llama3-70b --workload-arg context_tokens=32000 --workload-arg agent_types=4
R := bench-results
REPORTS := $(R)/fanout.json $(R)/react.json $(R)/tree.json $(R)/debate.json \
	$(R)/fanout-long.json $(R)/react-long.json $(R)/tree-long.json $(R)/debate-long.json \
	$(R)/claude-code.json $(R)/mooncake-conversation.json $(R)/mooncake-synthetic.json \
	$(R)/prefix-groups.json

# The planner round's goodput reports (README, "Today's results"): the short-prefix workloads to 1%
# (a 1.2x question needs a finer ruler than the default 5%), the long ones to 10%.
PLANNER_LONG := --profile h100x4-llama3-70b --workload-arg context_tokens=32000 --workload-arg agent_types=4
.PHONY: bench-planner
bench-planner: $(VENV)/.native
	@mkdir -p $(R)
	for w in fanout tree debate react; do \
	  $(BENCH) --workload $$w --workflows 100 --goodput --goodput-precision 0.01 --json $(R)/planner-$$w.json > $(R)/planner-$$w.txt || exit 1; done
	for w in fanout debate tree; do \
	  $(BENCH) --workload $$w $(PLANNER_LONG) --workflows 24 --goodput --goodput-precision 0.1 --json $(R)/planner-$$w-long.json > $(R)/planner-$$w-long.txt || exit 1; done
	$(PY) -m kvgate.bench.tables $(R)/planner-*.json > $(R)/planner-tables.md

.PHONY: bench-moves
MOVE_POLICIES := kvgate,kvgate-no-prefetch,kvgate-no-replicate,kvgate-pulls,dynamo-like,sglang-like,llmd-p2p-like,llmd-p2p-affinity-like,llmd-p2p-tokenaware-like,llmd-like,llmd-affinity-like
MOVES := $(VENV)/bin/kvgate bench --no-progress
bench-moves: $(VENV)/.native
	@mkdir -p $(R)
	$(MOVES) --workload fanout $(PLANNER_LONG) --workflows 48 --link rdma --goodput \
	  --policy $(MOVE_POLICIES) --json $(R)/moves-fanout-long.json > $(R)/moves-fanout-long.txt
	for w in tree debate; do \
	  $(MOVES) --workload $$w $(PLANNER_LONG) --workflows 24 --link rdma --goodput \
	  --policy $(MOVE_POLICIES) --json $(R)/moves-$$w-long.json > $(R)/moves-$$w-long.txt || exit 1; done

# "Today's results" in the README, exactly as its commands there (hours: claude-code alone
# is about 45 minutes a policy). The tables go to $(R)/today-tables.md.
TODAY_SHORT := kvgate,kvgate-no-batch,kvgate-no-priority,kvgate-no-siblings,kvgate-routing-only,round-robin,least-loaded,session,sglang-like,llmd-like,llmd-approx-like,llmd-affinity-like,llmd-p2p-tokenaware-like,dynamo-like
TODAY_REACT := kvgate,session,least-loaded,round-robin,dynamo-like,llmd-p2p-tokenaware-like,llmd-affinity-like,sglang-like
TODAY_LONG := kvgate,kvgate-no-batch,kvgate-no-prefetch,kvgate-no-replicate,sglang-like,sglang-0.3-like,dynamo-like,session,llmd-like,llmd-affinity-like,llmd-p2p-like,llmd-p2p-tokenaware-like,llmd-p2p-affinity-like
TODAY := $(VENV)/bin/kvgate bench --no-progress --goodput
.PHONY: bench-today
bench-today: $(VENV)/.native
	@mkdir -p $(R)
	for w in fanout tree debate; do \
	  $(TODAY) --workload $$w --workflows 100 --goodput-precision 0.01 --policy $(TODAY_SHORT) \
	  --json $(R)/today-$$w.json > $(R)/today-$$w.txt || exit 1; done
	$(TODAY) --workload react --workflows 1000 --goodput-precision 0.01 --policy $(TODAY_REACT) \
	  --json $(R)/today-react.json > $(R)/today-react.txt
	for w in fanout tree debate; do \
	  $(TODAY) --workload $$w $(PLANNER_LONG) --workflows 48 --link rdma --goodput-precision 0.01 \
	  --policy $(TODAY_LONG) --json $(R)/today-$$w-long.json > $(R)/today-$$w-long.txt || exit 1; done
	for p in kvgate dynamo-like; do \
	  $(TODAY) --workload claude-code --workload-arg think_scale=0 --workflows 77 --policy $$p \
	  --json $(R)/today-claude-code-$$p.json > $(R)/today-claude-code-$$p.txt || exit 1; done
	$(PY) -m kvgate.bench.tables $(R)/today-*.json > $(R)/today-tables.md
	@echo "tables in $(R)/today-tables.md"

.PHONY: bench-tables
bench-tables: $(REPORTS)
	$(PY) -m kvgate.bench.tables $(REPORTS) > $(R)/tables.md
	@echo "tables in $(R)/tables.md"

$(R)/%.json: $(VENV)/.native
	@mkdir -p $(R)
	$(BENCH) --workload $* --workflows 100 --goodput --json $@ > $(R)/$*.txt

$(R)/%-long.json: $(VENV)/.native
	@mkdir -p $(R)
	$(BENCH) --workload $* $(LONG) --workflows 24 --goodput --goodput-precision 0.1 --json $@ > $(R)/$*-long.txt

$(R)/claude-code.json: $(VENV)/.native
	@mkdir -p $(R)
	$(BENCH) --workload claude-code --workload-arg sessions=subagents --workflows 4 --engines 4 --json $@ > $(R)/claude-code.txt

$(R)/mooncake-%.json: $(VENV)/.native
	@mkdir -p $(R)
	$(BENCH) --workload mooncake-$* --workflows 300 --goodput --goodput-precision 0.1 --json $@ > $(R)/mooncake-$*.txt

$(R)/prefix-groups.json: $(VENV)/.native
	@mkdir -p $(R)
	$(BENCH) --workload prefix-groups --profile h200-qwen3-32b --rate 6 --workflows 750 --json $@ > $(R)/prefix-groups.txt
