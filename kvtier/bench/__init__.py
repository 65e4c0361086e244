"""Benchmarks: each prints a table and can write JSON; results live under bench/results/."""
