"""The benchmark questions and their runner: `python -m benchmarks list`, `python -m benchmarks QUESTION [options]`.

Each module of benchmarks/questions/ answers one question; benchmarks/runner.py runs it (a CPU-sized version with
--dry-run) and benchmarks/record.py writes its result folder. The other modules here are helpers the questions share.
"""
