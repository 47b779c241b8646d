"""Benchmarks and the cluster step-time / memory model (tide.bench.model).

Pure Python (numpy/matplotlib only for plots): nothing here imports tide._C at import time.
"""
