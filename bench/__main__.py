"""``python -m bench``: the benchmark sections (``bench/run.py``)."""

from bench.run import main

main()
