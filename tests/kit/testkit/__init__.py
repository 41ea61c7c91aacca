"""The test infrastructure shared by the suites, the benchmarks and the version matrix.

- `harness`: the one way every suite, benchmark and matrix cell runs a child (its environment, free
  ports, the `RESULT` protocol, a timeout that stops the child and what it started)
- `warm_starts` (with `warm/`): integration scripts started as forks of a warm interpreter
- `faultkit` (with `faults/`): the reliability suite's hostile set-ups and its tally
- `subproc`: what the installed frameworks are, for skips
- `call_grid`: the grid of checkpoint call shapes (`python tests/kit/testkit/call_grid.py`)
- `reliability_table`: docs/RELIABILITY.md (`python tests/kit/testkit/reliability_table.py`)

Importable without a path edit: pytest finds it through `pythonpath` in pyproject.toml; anything
else run from a clone installs it (`pip install -e tests/kit`).
"""
