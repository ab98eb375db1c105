"""The tools around the worker runtime: the demo, the benchmark and what they need (a private redis-server,
worker processes, the BLAS check). The runtime (worker/) never imports them."""
