"""The protocol every mlxq process speaks over Redis: producers (api/) and workers alike.

- ``keys``: every Redis name, under one prefix, and the queue-name format (written once; ``lua/queues.lua``
  builds and parses names from the same parts).
- ``jobrecord``: the job and result records, as arq stores them (the result record is the job's kept result).
- ``scripts``: the loader of the Lua scripts (``lua/*.lua``, shipped as package data) and their declared layouts.
- ``producer``, ``enqueuer``: ENQUEUE (batched per event-loop pass) and CANCEL.
- ``claim``, ``emit``, ``upkeep``: the worker's calls, CLAIM; EMIT; REFRESH, SWEEP, LAPSE and REJECT.
- ``notify``: webhook events (a stream the gateways deliver from): ``publish``, and ``watch`` (a job's end made
  an event by EMIT).

It imports only redis, pydantic, the standard library and other ``mlxq.api`` modules: producers install without
MLX or arq.
"""
