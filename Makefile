# One-command set-up: every target creates .venv and installs what it needs.
# torch is pinned first: a bare `torch` requirement with no torch installed would pull a
# multi-GB CUDA build, while torch==2.13.0 takes the CPU build.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: venv test test-real torture demo bench bench-schedulers explain test-compat clean

# The stamp holds the torch pin the venv was built with; another TORCH_PIN reinstalls.
ifneq ($(shell cat $(STAMP) 2>/dev/null),$(TORCH_PIN))
.PHONY: $(STAMP)
endif

$(STAMP): setup.cfg pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --disable-pip-version-check "$(TORCH_PIN)"
	$(VPY) -m pip install -q --disable-pip-version-check -e ".[test]"
	echo '$(TORCH_PIN)' > $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(VPY) -m pytest -q tests

# The randomized torture at full size (CI runs it with a few hundred calls of the mixed cases):
# >= 5,000 calls of issue 9's wrong-result paths, each compared bitwise with eager.
TORTURE_CALLS ?= 5000
torture: $(STAMP)
	TORCHSYNC_TORTURE_CALLS=$(TORTURE_CALLS) $(VPY) -m pytest -q tests/test_torture.py -m "not inductor"

# The real libraries' own loops (diffusers schedulers, Llama generate), tiny random weights, no hub.
test-real: $(STAMP)
	$(VPY) -m pip install -q --disable-pip-version-check -e ".[test,real]"
	TORCHSYNC_PASS_REAL=1 $(VPY) -m pytest -q tests/real

demo: $(STAMP)
	$(VPY) -m torchsync_pass.explain examples/diffusion_loop.py

bench: $(STAMP)
	$(VPY) benchmarks/ab.py

bench-schedulers: $(STAMP)
	$(VPY) -m pip install -q --disable-pip-version-check -e ".[test,real]"
	$(VPY) benchmarks/schedulers.py

# COMPAT_DIR=/work/compat (env or make variable) reuses venvs built by another checkout.
test-compat:
	bash tests/compat.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
