"""A job's life on the worker side.

Its preparation, one pipeline whose stages each take what the last one made:

- ``prepare.py``: :func:`~.prepare.prepare`, a claimed job's record made ready for its model's engine (validated
  first), or :class:`~.prepare.BadRequest`.
- ``model.py``: :class:`~.model.ModelView`, what the stages need of the loaded model, handed to them whole.
- ``media.py``: its images, read, checked and processed by the model's processor.
- ``prompt.py``: its prompt through the model's chat template, tokenized and checked.
- ``toolcalls.py``: its tools' markers and parser, and the format its output must match.
- ``translate.py``: the wire's request as the engine's, and an engine output as the run's events.

Its run:

- ``run.py``: :class:`~.run.Run`, one run of a job on this worker, which builds and numbers the job's events,
  and its :class:`~.run.State`.
- ``transitions.py``: each move of a job (claim, append, end, hand back, refresh, reap, lapse, reject) as one
  atomic call of the protocol's scripts (``api/protocol/``), made for this worker's runs
  (:class:`~.transitions.Transitions`).
- ``table.py``: the :class:`~.table.RunTable`, a worker's runs by job id: the one place that changes a run,
  decides each job's terminal event and sends the EMIT calls, one per batch of engine outputs.
"""
