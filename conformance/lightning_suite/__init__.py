"""Lightning's own test suite, run with its ``ddp`` strategy names resolved to ``custom_ddp``.

``custom_ddp`` promises to be a drop-in for Lightning's ``ddp``; this room checks that promise against
the tests Lightning wrote for ``ddp``, each run once under Lightning's ``ddp`` and once swapped:

- ``swap``: the pytest plugin loaded into Lightning's test run (``-p conformance.lightning_suite.swap``):
  the swap of the registry names, and a log of every multi-process launch.
- ``selection``: which of Lightning's test files and standalone tests run, and the expected differences.
- ``outcomes``: JUnit XML read into per-test outcomes, the two modes compared, the Markdown summary.
- ``pytest_run``: one pytest of a test file (or a standalone test) in one mode: its own process group, a
  timeout, the tests folder left as it was, its record kept for a resumed runner.
- ``run``: ``python -m conformance.lightning_suite.run --tests PATH`` runs it all and writes
  ``conformance/results/lightning_suite/results.json``.

Test harness, not product code; nothing is imported here.
"""
