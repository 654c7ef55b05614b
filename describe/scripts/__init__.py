"""describe's scripts (benchmarks, the GPU check, the training-set descriptions and simulations): run
from describe/ as modules, `python -m scripts.NAME`, so that gpucast_describe and examples import
without installing anything."""
