"""The `kvtier` command: the layer above the library, imported by nothing in it.

- `parser`: the command line (`build_parser`) and `main`, which runs one command and turns a
  `KVTierError` into one line on stderr and an exit code;
- `args`, `bench_args`: the flags' types and fixed choices, and the benchmarks' flags
  (parsing imports neither torch nor transformers);
- `console`: the console, progress lines and JSON reports; `build`: the device, cache,
  storage tier and engine a command's flags ask for;
- one module per command: `serve` (with `tensor_parallel`, the ranks of `--tp`), `demo`,
  `bench_cache` and `bench_commands` (the other benchmarks).

Only this package prints; the library logs.
"""

from kvtier.cli.parser import build_parser, main

__all__ = ["build_parser", "main"]
