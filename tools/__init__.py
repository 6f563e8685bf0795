"""Tools run from a checkout: ``tools/notebooks.py`` writes the notebooks, ``tools/launches.py`` captures what the
matmul's calls launch."""
