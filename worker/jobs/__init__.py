"""A job's life on the worker side, in three modules:

- ``run.py``: :class:`~.run.Run`, one run of a job on this worker, which builds and numbers the job's events,
  and its :class:`~.run.State`.
- ``transitions.py``: each move of a job (claim, append, end, hand back, refresh, reap, lapse, reject) as one
  atomic call of the protocol's scripts (``api/protocol/``), made for this worker's runs
  (:class:`~.transitions.Transitions`).
- ``table.py``: the :class:`~.table.RunTable`, a worker's runs by job id: the one place that changes a run,
  decides each job's terminal event and sends the EMIT calls.
"""
