# Two entry points, each sets up .venv from nothing first (torch is pinned to the CPU wheel).
PY := .venv/bin/python
export PYTHONUNBUFFERED := 1

.PHONY: demo test setup clean

demo: .venv/.done
	$(PY) examples/quickstart.py

test: .venv/.done
	$(PY) -m pytest -q

setup: .venv/.done

.venv/.done: pyproject.toml
	python3 -m venv .venv
	.venv/bin/pip install -q --upgrade pip
	.venv/bin/pip install -q torch==2.13.0
	.venv/bin/pip install -q -e '.[test]'
	touch $@

clean:
	rm -rf .venv build *.egg-info
