# Set-up, main job and tests. Every target creates .venv (and the system libraries
# Mooncake needs) on first use, so each works on a fresh machine.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
APT_PKGS := libibverbs1 librdmacm1 libnl-3-200 libnl-route-3-200 libnuma1

.PHONY: setup demo serve test soak-test gpu-test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@missing=$$(for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing system libraries for Mooncake: $$missing"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	fi
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[service,mooncake,bench,tensordict,dev]"
	$(MAKE) --no-print-directory $(VENV)/bin/promtool
	touch $(STAMP)

# promtool (tests/deploy checks the alert rules with it): the static binary from Debian's
# prometheus package, unpacked into .venv/bin without installing the server.
$(VENV)/bin/promtool:
	@tmp=$$(mktemp -d); cd $$tmp && SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  (apt-get download prometheus >/dev/null 2>&1 || ($$SUDO apt-get update -qq && apt-get download prometheus)) && \
	  dpkg -x prometheus_*.deb x && install -m 755 x/usr/bin/promtool $(CURDIR)/$(VENV)/bin/promtool; \
	  rc=$$?; rm -rf $$tmp; exit $$rc

demo: $(STAMP)
	$(VENV)/bin/rlplane demo

serve: $(STAMP)
	$(VENV)/bin/rlplane serve

# Two pytest processes at once: the tests on Ray (tests/service, tests/e2e) in one, the
# engine's own tests (tests/unit, no Ray) and the chart's beside them (tests/run_split.sh).
test: $(STAMP)
	tests/run_split.sh $(PY)

soak-test: $(STAMP)
	$(PY) -m pytest tests -q -m soak

# On a host with a CUDA device (and a CUDA build of torch): CUDA tensors through put/read on every path.
gpu-test: $(STAMP)
	$(PY) -m pytest tests/gpu -q -s -m gpu

bench: $(STAMP)
	$(VENV)/bin/rlplane bench --json out/bench.json

clean:
	rm -rf $(VENV)
