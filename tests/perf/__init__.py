"""The research benchmarks, apart from the product's ``mlxq bench``: one command runs them all and writes
``results.md`` (every measurement, and each of its targets, listed in tests/perf/README.md, with PASS or MISS),
``results.json`` and ``chart.png``::

    python3 -m tests.perf --out DIR [--quick] [--sizes tiny,small] [--concurrency 1,8,32,64] [--max-tokens 64]

``suite.py`` runs the phases in order: raw, engine, queue, serial, gateway and ``mlx_lm.server`` paths
(``paths.py``, ``gateway.py``, ``peer.py``); scheduling (``scheduling.py``); image jobs (``vision.py``); two
models in one worker (``models.py``); ``runs.py`` and ``results.py`` hold the configuration and the records,
``report.py`` the targets and the tables. They reuse the product bench's pieces
(``mlxq.worker.tools.bench``: the raw and queue paths, the HTTP client, statistics, the OpenBLAS preload, the
chart). A script package, not tests: pytest collects nothing here (no ``test_`` modules);
tests/test_perf.py runs a quick smoke of it.
"""
