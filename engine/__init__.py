"""mlxq's engine: continuous batching over mlx-lm on one MLX thread per model. Imports no redis or arq."""

import os

# MLX's CUDA backend throws out of an evaluation once one of its per-shape caches (cuDNN attention graphs, CUDA
# graphs) has missed more than twice its capacity over the process's life ("Cache thrashing is happening"): a
# worker that meets new prompt lengths for weeks would die of it, and every job in it with it. Off unless the
# operator sets it; MLX reads it when a cache is first made, after this.
os.environ.setdefault("MLX_ENABLE_CACHE_THRASHING_CHECK", "0")
