"""mlxq's producer API: enqueue generation jobs and follow their events. Imports no MLX."""
