"""The engine's MLX adapters: what runs the core's backend protocols on mlx-lm's and mlx-vlm's batches on one
MLX thread per model (loading, the batch, speculation, constrained decoding, the prefix cache and its disk tier).
Imports are absolute or relative: this package's name does not shadow the ``mlx`` library."""
