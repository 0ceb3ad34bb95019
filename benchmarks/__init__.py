"""lit_dp's benchmarks, each against its peer in one run: ``python -m benchmarks.<name> key=value ...``.

One script per benchmark, its Hydra config in ``benchmarks/conf/<name>.yaml``; what they share
is in ``benchmarks.common``. Results and the commands that produced them: docs/benchmarks.md.
"""
