"""NKI kernels (per op: the kernel, its torch reference, and the test in tests/ that runs both) and their NumPy interpreter."""
