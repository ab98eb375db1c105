"""mlxq's engine: continuous batching over mlx-lm on one MLX thread per model. Imports no redis or arq."""
