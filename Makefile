# Two entry points, each sets up .venv from nothing first (torch is pinned to the CPU wheel).
PY := .venv/bin/python
export PYTHONUNBUFFERED := 1

.PHONY: demo test bench fuzz setup clean

# The training demo on RANKS CPU processes (gloo), one thread each; ARGS go to the script
# (make demo RANKS=8 ARGS="--seq 65536 --steps 200"; see examples/train_longnet.py --help).
RANKS ?= 4
ARGS ?=

demo: .venv/.done
	OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run --standalone --nproc-per-node $(RANKS) \
		examples/train_longnet.py $(ARGS)

test: .venv/.done
	$(PY) -m pytest -q

# The random campaign of SDPA sites against the float64 reference (tests/fuzz.py, docs/testing.md):
# 2000 cases from seed 0 unless ARGS say otherwise (make fuzz ARGS="--cases 2000 --seed 7").
fuzz: .venv/.done
	$(PY) tests/fuzz.py $(or $(ARGS),--cases 2000)

# Every benchmark, then each target met / not met (benchmarks/README.md); ARGS="--quick" for a smoke run.
bench: .venv/.done
	$(PY) benchmarks/run_all.py $(ARGS)

setup: .venv/.done

.venv/.done: pyproject.toml
	python3 -m venv .venv
	.venv/bin/pip install -q --upgrade pip
	.venv/bin/pip install -q torch==2.13.0
	.venv/bin/pip install -q -e '.[test]'
	touch $@

clean:
	rm -rf .venv build *.egg-info
