"""Benchmarks: each module runs one measurement and renders its own table (`render`); their commands
(`kvtier bench ...`: flags, printing, JSON reports) are `kvtier.cli.bench_*`. Results live under
bench/results/ and what they show in bench/FINDINGS.md."""
