"""Side-by-side benchmarks that print markdown tables (not tests): ``python -m benchmarks.X``."""
