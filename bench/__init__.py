"""The project's benchmarks, run from a checkout and never installed: ``python -m bench`` runs the sections
(``bench/run.py``); ``python -m bench.matmul``, ``bench.serve`` and ``bench.fsdp_qlora`` are the matmul sweep, the
serving benchmark and the FSDP QLoRA run. Helpers: ``timing``, ``weights``, ``results``, ``contenders``, ``plots``."""
