"""The engine's core: the scheduler and everything it works against (requests, sequences, admission, the pacer,
the backend's protocols). Imports no MLX, mlx-lm, mlx-vlm or llguidance, so it runs on fakes anywhere."""
