"""pgonce's benchmarks: ``make bench`` (``python -m bench``) writes ``bench/results/latest.md``.

Speed lives here, never in timed tests. Machines are shared and noisy, so every figure is reported
next to a reference measured in the same run, as ``NN % of <reference>``.
"""
