"""Benchmarks: each module runs one measurement, renders its own table (`render`) and, where it is a
command, prints it and writes JSON (`command(args)`, called by `kvtier.cli`); results live under
bench/results/ and what they show in bench/FINDINGS.md."""
