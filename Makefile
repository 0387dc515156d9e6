# flashsale: every target runs in .venv, created and kept in step with requirements.txt.
# Without DATABASE_URL / REDIS_URL in the environment, test, serve and demo start an embedded
# PostgreSQL and Redis (python -m shop.devservices) and stop them afterwards.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
RUN := $(PY) -m shop.devservices --

HOST ?= 127.0.0.1
PORT ?= 8000
WORKERS ?= 2
PYTEST_ARGS ?=
DEMO_ARGS ?=
BENCH_ARGS ?=
ARGS ?=
STRATEGY ?= lua
ADMIN_USER ?= admin

.DEFAULT_GOAL := help
.PHONY: help venv test serve demo bench pitfall manage sale admin lint fmt clean clean-reports \
	clean-sandbox \
	chromium nginx compose

help: ## list the targets
	@echo "flashsale make targets:"
	@awk 'BEGIN {FS = ":.*## "} /^[a-z-]+:.*## / {printf "  %-13s %s\n", $$1, $$2}' $(MAKEFILE_LIST)
	@echo "Variables: PYTEST_ARGS, DEMO_ARGS, BENCH_ARGS, ARGS (pitfall, manage), HOST/PORT/WORKERS (serve),"
	@echo "  SKU/STOCK/STRATEGY/LIMIT/PRICE/OPENS_IN (sale), ADMIN_USER (admin), PYTHON (bootstrap)."
	@echo "DATABASE_URL / REDIS_URL unset => embedded PostgreSQL / Redis with data in .data/."

venv: $(STAMP) ## create .venv and install requirements.txt (done by every target)

$(STAMP): requirements.txt
	@command -v $(PYTHON) >/dev/null 2>&1 || { \
	  echo "error: '$(PYTHON)' not found; flashsale needs Python >= 3.11 (make PYTHON=/path/to/python3.11 ...)" >&2; exit 1; }
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { \
	  echo "error: flashsale needs Python >= 3.11, but $(PYTHON) is $$($(PYTHON) -V 2>&1); use make PYTHON=/path/to/python3.11 ..." >&2; exit 1; }
	@if [ -x $(PY) ] && ! $(PY) -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then \
	  echo "$(VENV) is broken or older than Python 3.11: recreating it"; rm -rf $(VENV); fi
	@[ -x $(PY) ] || { echo "creating $(VENV) with $$($(PYTHON) -V 2>&1)"; $(PYTHON) -m venv $(VENV); }
	$(PY) -m pip install --disable-pip-version-check --progress-bar off -r requirements.txt
	@touch $@

test: $(STAMP) ## run pytest (PYTEST_ARGS="-k lock -x" ...)
	$(RUN) $(PY) -m pytest $(PYTEST_ARGS)

serve: $(STAMP) ## migrate, then serve on HOST:PORT (127.0.0.1:8000) plus a Celery worker; Ctrl-C stops
	$(RUN) $(PY) -m shop.serve --host $(HOST) --port $(PORT) --workers $(WORKERS)

BENCH ?= strategies
bench: $(STAMP) ## the benchmarks without HTTP: every strategy, the peers, the ceilings (BENCH=settle: the order workers, BENCH=calls: redis-py's layers, BENCH=servers: the server designs over HTTP; BENCH_ARGS="--rounds 3 ...")
	$(RUN) sh -c '$(PY) manage.py migrate --noinput -v 0 && exec $(PY) manage.py bench $(BENCH) $(BENCH_ARGS)'

pitfall: $(STAMP) ## the pitfall lab: every scenario (ARGS="list", ARGS="run get-del-race --json")
	@case "$(ARGS)" in list*) exec $(PY) manage.py pitfall $(ARGS);; esac; \
	  exec $(RUN) $(PY) manage.py pitfall $(or $(ARGS),run --all)

manage: $(STAMP) ## any manage.py command, after migrate: make manage ARGS="sale audit phone --json"
	@if [ -z "$(ARGS)" ]; then echo 'usage: make manage ARGS="sale audit phone --json"' >&2; exit 2; fi
	$(RUN) sh -c '$(PY) manage.py migrate --noinput -v 0 && exec $(PY) manage.py "$$@"' manage $(ARGS)

demo: $(STAMP) ## flood every strategy with Locust, print the comparison, write the report (DEMO_ARGS="--stock 500 ...")
	$(RUN) sh -c '$(PY) manage.py migrate --noinput -v 0 && exec $(PY) manage.py loadtest $(DEMO_ARGS)'

sale: $(STAMP) ## start a sale beside make serve: make sale SKU=phone STOCK=100 [STRATEGY=lua] [LIMIT=2] [PRICE=9.99]
	@if [ -z "$(SKU)" ] || [ -z "$(STOCK)" ]; then \
	  echo "usage: make sale SKU=phone STOCK=100 [STRATEGY=$(STRATEGY)] [LIMIT=2] [PRICE=9.99] [OPENS_IN=seconds]" >&2; exit 2; fi
	$(RUN) sh -c '$(PY) manage.py migrate --noinput -v 0 && exec $(PY) manage.py sale start "$$0" --stock "$$1" --strategy "$$2" $${3:+--limit "$$3"} $${4:+--price "$$4"} $${5:+--opens-in "$$5"}' \
	  "$(SKU)" "$(STOCK)" "$(STRATEGY)" "$(LIMIT)" "$(PRICE)" "$(OPENS_IN)"

admin: $(STAMP) ## create a staff login for the local shop's /admin/ (ADMIN_USER=admin; its password from DJANGO_SUPERUSER_PASSWORD, else asked at the terminal)
	$(RUN) sh -c '$(PY) manage.py migrate --noinput -v 0 && exec $(PY) manage.py staff "$$0"' "$(ADMIN_USER)"

nginx: ## install Debian's nginx for the tests of deploy/nginx.conf and nginx-cluster.conf (root only)
	@if command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ]; then \
	  echo "nginx: present"; \
	elif [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then \
	  echo "nginx: missing and not installable here (root and apt-get needed): its test is skipped"; \
	else \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y nginx-light || \
	  { DEBIAN_FRONTEND=noninteractive apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y nginx-light; }; \
	fi

compose: ## install Debian's docker-compose for the test that validates the compose files (root only)
	@if command -v docker-compose >/dev/null 2>&1; then \
	  echo "docker-compose: $$(docker-compose version --short 2>/dev/null || echo present)"; \
	elif [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then \
	  echo "docker-compose: missing and not installable here (root and apt-get needed): its test is skipped"; \
	else \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends docker-compose || \
	  { DEBIAN_FRONTEND=noninteractive apt-get update && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends docker-compose; }; \
	fi

chromium: ## install Debian's chromium and chromium-driver for the browser tests (root only)
	@if [ -x /usr/bin/chromium ]; then \
	  echo "chromium: $$(/usr/bin/chromium --version 2>/dev/null || echo present at /usr/bin/chromium)"; \
	elif [ "$$(id -u)" != 0 ]; then \
	  echo "chromium: /usr/bin/chromium is missing and this is not root: skipping the install;" \
	    "the browser tests will be skipped (as root: apt-get install chromium chromium-driver)"; \
	elif ! command -v apt-get >/dev/null 2>&1; then \
	  echo "chromium: /usr/bin/chromium is missing and there is no apt-get: skipping the install;" \
	    "the browser tests will be skipped"; \
	else \
	  DEBIAN_FRONTEND=noninteractive apt-get update && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y chromium chromium-driver; \
	fi

lint: $(STAMP) ## ruff check, ruff format --check and mypy (django-stubs)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	@# The stubs' plugin loads the settings, which only parse DATABASE_URL: nothing connects.
	DATABASE_URL=$${DATABASE_URL:-postgres://lint@localhost/lint} $(PY) -m mypy locking inventory shop loadtest pitfalls

fmt: $(STAMP) ## ruff format, then ruff check --fix
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

clean: ## remove .venv and .data (refuses while a serve or embedded PostgreSQL still runs); keeps reports/
	@if [ -f .data/serve.lock ] && command -v flock >/dev/null && ! flock -n .data/serve.lock true; then \
	  echo "error: make serve is running ($$(cat .data/serve.lock)): stop it with Ctrl-C first" >&2; exit 1; fi
	@if [ -f .data/postgres/postmaster.pid ] && kill -0 $$(head -n 1 .data/postgres/postmaster.pid) 2>/dev/null; then \
	  echo "error: the embedded PostgreSQL (pid $$(head -n 1 .data/postgres/postmaster.pid)) still runs on .data/postgres:" \
	    "stop the make test/serve/demo using it first (or kill that pid if it was left over)" >&2; exit 1; fi
	rm -rf $(VENV) .data .pytest_cache .ruff_cache
	@if [ -d reports ]; then \
	  echo "kept reports/ (the load runs' reports, $$(ls reports | wc -l) folders): make clean-reports removes it"; fi

clean-reports: ## remove reports/, the load runs' reports (a FLASHSALE_REPORTS_DIR elsewhere is left alone)
	rm -rf reports

clean-sandbox: $(STAMP) ## drop the load-run sandbox: the database where load runs and benchmarks sell, and its Redis keys
	$(RUN) $(PY) manage.py sandbox drop
