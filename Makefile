# The two set-up commands of the README: `make demo` and `make test`.
# Both install everything into .venv first (idempotent; re-runs when pyproject.toml changes).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast lint plan clean

$(STAMP): pyproject.toml
	@ldconfig -p | grep -q libibverbs.so.1 || (echo "installing Debian libibverbs1 (Mooncake needs it)"; \
		apt-get update -q && apt-get install -y -q libibverbs1)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# exactly torch==2.13.0 first: any other spec pulls a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[all,test]"
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/dsakv demo

plan: install
	$(BIN)/dsakv plan glm-5.2 --role decode --kv-budget 96.33GiB --draft-layers 1

lint: install
	$(BIN)/ruff check src tests bench scripts
	$(BIN)/ruff format --check src tests bench scripts
	$(BIN)/mypy
	$(BIN)/python scripts/check_c.py  # every .c under src/dsakv builds with -Wall -Wextra -Werror

# two pytest workers (the machines have 2 cores), one test file per worker at a time so a module's cluster stays
# on one worker; the 25 slowest tests are listed at the end (CI must stay under 30 minutes)
PYTEST_JOBS ?= 2
test: lint
	$(BIN)/python -m pytest -q -n $(PYTEST_JOBS) --dist loadfile --durations=25

# the unit and in-process tiers only (no test that starts a process); `make test` (CI) runs every tier
test-fast: lint
	$(BIN)/python -m pytest -q -n $(PYTEST_JOBS) --dist loadfile tests/unit tests/inproc

clean:
	rm -rf $(VENV) build *.egg-info
