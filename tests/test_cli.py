"""The `kvtier` command line: every flag checked before anything heavy, and each command end to end."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvtier import cli
from kvtier.bench import transfer_sets
from kvtier.cli import args as cli_args
from kvtier.cli import parser
from kvtier.cli.bench_args import BENCHES

ROOT = Path(__file__).resolve().parents[1]

# Runs `kvtier.cli.main` on its arguments, then says on stdout which heavy modules it imported.
PROBE = """
import sys
from kvtier.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print("heavy:" + ",".join(sorted(m for m in ("torch", "transformers", "numpy") if m in sys.modules)))
sys.exit(code)
"""


def probe(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", PROBE, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def refused(argv: list[str], capsys) -> str:
    """The stderr of `kvtier argv` refused by the parser with exit code 2."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("kvtier")
    return err.strip().splitlines()[-1]


# -- parsing -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["demo", "--help"],
        ["serve", "--help"],
        ["bench", "--help"],
        ["bench", "transfer", "--help"],
        ["bench", "overlap", "--help"],
        ["bench", "cache", "--help"],
        ["bench", "served", "--help"],
        ["bench", "storage", "--help"],
        ["bench", "multiturn", "--help"],
        ["bench", "batching", "--help"],
    ],
)
def test_help_imports_neither_torch_nor_transformers(argv: list[str]) -> None:
    out = probe(*argv)
    assert out.returncode == 0, out.stderr
    assert "usage: kvtier" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "heavy:"  # no heavy module imported


SUBCOMMANDS = [["serve"], ["demo"], *(["bench", b] for b in BENCHES)]


def help_blocks(text: str) -> dict[str, str]:
    """`--flag` -> its help text, from argparse's `--help` output (an option's lines after its name)."""
    blocks: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("  -"):
            invocation, _, rest = line.strip().partition("  ")
            current = re.search(r"--[\w-]+", invocation).group(0)
            blocks[current] = [rest.strip()]
        elif current is not None and line.startswith("   "):
            blocks[current].append(line.strip())
        else:
            current = None
    return {flag: " ".join(x for x in lines if x) for flag, lines in blocks.items()}


@pytest.mark.parametrize("argv", SUBCOMMANDS, ids=" ".join)
def test_every_flag_has_help_and_the_help_shows_every_default(argv: list[str], capsys) -> None:
    p = cli.build_parser()
    with pytest.raises(SystemExit):
        p.parse_args([*argv, "--help"])
    blocks = help_blocks(capsys.readouterr().out)
    defaults = vars(p.parse_args(argv))
    for dest, default in defaults.items():
        flag = "--" + dest.replace("_", "-")
        if dest in ("command", "bench", "verbose") or flag not in blocks:
            assert dest in ("command", "bench", "verbose"), f"{flag} is not in the help of {argv}"
            continue
        assert blocks[flag], f"{flag} has no help"
        if default is not None and default is not False and default != ():
            assert "(default: " in blocks[flag], f"{flag}'s help does not show its default {default!r}"
    assert all(help_ for help_ in blocks.values()), blocks


def test_the_help_shows_the_defaults_it_parses(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    blocks = help_blocks(capsys.readouterr().out)
    assert blocks["--port"].endswith("(default: 8000)")
    assert blocks["--request-timeout"].endswith("(default: 600)")
    assert blocks["--write-policy"].endswith("(default: write_through)")
    assert "(default: $KVTIER_API_KEY, else no key)" in blocks["--api-key"]
    with pytest.raises(SystemExit):
        cli.main(["bench", "cache", "--help"])
    assert help_blocks(capsys.readouterr().out)["--parts"].endswith("(default: trace,alloc,reload)")


def test_version_is_the_packages_and_imports_nothing_heavy() -> None:
    import kvtier

    out = probe("--version")
    assert out.returncode == 0 and out.stdout.splitlines() == [f"kvtier {kvtier.__version__}", "heavy:"]


def test_python_dash_m_runs_the_command() -> None:
    """The device scripts call `python3 -m kvtier.cli`; users `python -m kvtier`."""
    for module in ("kvtier", "kvtier.cli"):
        out = subprocess.run(
            [sys.executable, "-m", module, "bench", "--help"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0 and "transfer" in out.stdout


def test_every_subcommand_parses_with_its_defaults() -> None:
    p = cli.build_parser()
    demo = p.parse_args(["demo"])
    assert (demo.write_policy, demo.device, demo.device_tokens, demo.max_tokens) == (
        "write_through",
        "auto",
        320,
        32,
    )
    serve = p.parse_args(["serve"])
    assert (serve.write_policy, serve.host_layout, serve.host_alloc, serve.port) == (
        "write_through",
        "layer_first",
        "contiguous",
        8000,
    )
    assert demo.storage is None and serve.storage is None  # no third tier unless asked for
    for args in (demo, serve):  # the engine's own defaults
        assert (args.dtype, args.max_num_seqs, args.max_num_batched_tokens) == ("auto", 64, 2048)
    assert (serve.max_queue, serve.request_timeout, serve.max_body_mb) == (256, 600.0, 16.0)
    assert (serve.body_timeout, serve.shutdown_timeout) == (15.0, 5.0)
    transfer = p.parse_args(["bench", "transfer"])
    assert (
        transfer.host_sets == transfer_sets.HOST_SETS and transfer.variants == transfer_sets.DEFAULT_VARIANTS
    )
    assert (transfer.direction, transfer.cycles, transfer.tokens, transfer.kernel) == ("both", 8, None, None)
    assert not hasattr(transfer, "layers") and not hasattr(transfer, "staging_tokens")
    assert p.parse_args(["bench", "transfer", "--tokens", "1024,4096"]).tokens == (1024, 4096)
    overlap = p.parse_args(["bench", "overlap"])
    assert (overlap.rounds, overlap.rounds_log, overlap.layout) == (5, None, "layer_first")
    served = p.parse_args(["bench", "served"])
    assert (served.setups, served.prefix, served.cycles, served.repeats) == (cli_args.SETUPS, None, 4, 3)
    assert served.layers is None  # each setup's own
    cache = p.parse_args(["bench", "cache"])
    assert cache.parts == ("trace", "alloc", "reload") and cache.write_policy == "all"
    assert (cache.evict_nodes, cache.evict_k, cache.reload_tokens) == (100_000, 1000, 131072)


def test_lists_and_shapes_parse() -> None:
    p = cli.build_parser()
    t = p.parse_args(["bench", "transfer", "--host-sets", "runs-1,first_fit-churn", "--kernel", "8x32s2"])
    assert t.host_sets == ("runs-1", "first_fit-churn")
    lengths = p.parse_args(["bench", "transfer", "--host-sets", "runs-300,runs-1"])
    assert lengths.host_sets == ("runs-300", "runs-1")
    assert (t.kernel.sm_budget, t.kernel.rows_per_program, t.kernel.stages) == (8, 32, 2)
    s = p.parse_args(
        ["bench", "served", "--setups", "deepseek-v3", "--prefix", "8192,131072", "--device", "cuda:1"]
    )
    assert (s.setups, s.prefix, s.device) == (("deepseek-v3",), (8192, 131072), "cuda:1")
    s = p.parse_args(["bench", "served", "--setups", "glm-5,smollm2", "--layers", "2"])
    assert (s.setups, s.layers) == (("glm-5", "smollm2"), 2)
    c = p.parse_args(["bench", "cache", "--parts", "reload,eviction", "--evict-nodes", "200000"])
    assert c.parts == ("reload", "eviction") and c.evict_nodes == 200000


@pytest.mark.parametrize("command", ["serve", "demo"])
def test_the_storage_flags_build_the_storage_config(command: str) -> None:
    from kvtier.cli.build import storage_config
    from kvtier.storage.config import Compression, PrefetchPolicy, StorageConfig, StorageWrite

    p = cli.build_parser()
    argv = [command, "--storage", "redis+cluster://10.0.0.1:7000,10.0.0.2:7000"]
    argv += ["--storage-write", "write_back", "--storage-prefetch", "best_effort"]
    argv += ["--storage-prefetch-timeout", "0.5", "--storage-min-tokens", "256"]
    argv += ["--storage-compression", "zstd", "--storage-size", "10G", "--storage-pool-size", "4"]
    argv += ["--storage-ttl", "3600", "--storage-model", "my-model"]
    config = storage_config(p.parse_args(argv))
    assert config == StorageConfig(
        "redis+cluster://10.0.0.1:7000,10.0.0.2:7000",
        write=StorageWrite.WRITE_BACK,
        prefetch=PrefetchPolicy.BEST_EFFORT,
        timeout_base_s=0.5,
        min_tokens=256,
        compression=Compression.ZSTD,
        size_bytes=10 << 30,
        pool_size=4,
        ttl_s=3600,
        model="my-model",
    )
    # A flag left out keeps the config's default; no --storage is no tier.
    assert storage_config(p.parse_args([command, "--storage", "file:///kv"])) == StorageConfig("file:///kv")
    assert storage_config(p.parse_args([command])) is None
    # The demo's restart part has a store of its own when --storage is left out.
    only = p.parse_args([command, "--storage-compression", "lz4"])
    assert storage_config(only, "file:///tmp/x") == StorageConfig("file:///tmp/x", compression="lz4")


def test_the_defaults_the_storage_help_states_are_the_configs() -> None:
    from kvtier.storage.config import StorageConfig

    c = StorageConfig("file:///kv")
    stated = (c.write, c.prefetch, c.timeout_base_s, c.compression, c.size_bytes, c.pool_size, c.ttl_s)
    assert stated == ("write_through", "timeout", 2.0, "none", 0, 16, 0)


@pytest.mark.parametrize(
    ("text", "value"),
    [("0", 0), ("1024", 1024), ("512M", 512 << 20), ("10G", 10 << 30), ("10GiB", 10 << 30), ("2t", 2 << 40)],
)
def test_sizes_take_binary_suffixes(text: str, value: int) -> None:
    assert cli_args.byte_size(text) == value


def test_the_write_policy_has_one_name_everywhere(capsys) -> None:
    p = cli.build_parser()
    assert p.parse_args(["demo", "--write-policy", "write_back"]).write_policy == "write_back"
    assert p.parse_args(["serve", "--write-policy", "write_back"]).write_policy == "write_back"
    assert p.parse_args(["bench", "cache", "--write-policy", "write_back"]).write_policy == "write_back"
    for argv in (["demo", "--policy", "write_back"], ["bench", "cache", "--policy", "write_back"]):
        assert "unrecognized arguments: --policy write_back" in refused(argv, capsys)  # the old name is gone
    with pytest.raises(SystemExit):
        p.parse_args(["demo", "--help"])
    shown = capsys.readouterr().out
    assert "--write-policy" in shown and "--policy" not in shown.replace("--write-policy", "")


def test_the_spelled_out_choices_match_what_they_name() -> None:
    from kvtier.alloc import AllocPolicy
    from kvtier.bench import served
    from kvtier.cache import WritePolicy
    from kvtier.cli.build import STORAGE_FIELDS
    from kvtier.engine.models import DEFAULT_MODEL, DTYPES
    from kvtier.pool import HostLayout
    from kvtier.pool.device import Direction
    from kvtier.spec import PRESETS
    from kvtier.storage.config import Compression, PrefetchPolicy, StorageConfig, StorageWrite
    from kvtier.transfer import TransferPath

    assert tuple(sorted(PRESETS)) == cli_args.SPECS
    assert tuple(m.value for m in HostLayout) == cli_args.LAYOUTS
    assert tuple(m.value for m in WritePolicy) == cli_args.WRITE_POLICIES
    assert tuple(m.value for m in AllocPolicy) == cli_args.ALLOC_POLICIES
    assert (*(m.value for m in Direction), "both") == cli_args.DIRECTIONS
    # Every variant but the planner's own and the stock kernel forces the path of its name.
    assert set(transfer_sets.VARIANTS) - {"planned", "fixed", "stock"} <= {m.value for m in TransferPath}
    assert set(transfer_sets.DEFAULT_VARIANTS) <= set(transfer_sets.VARIANTS)
    assert cli_args.SETUPS == served.SETUPS
    assert tuple(m.value for m in StorageWrite) == cli_args.STORAGE_WRITES
    assert tuple(m.value for m in PrefetchPolicy) == cli_args.PREFETCH_POLICIES
    assert tuple(m.value for m in Compression) == cli_args.COMPRESSIONS
    assert ("auto", *DTYPES) == cli_args.DTYPES
    assert cli_args.DEFAULT_MODEL == DEFAULT_MODEL
    # Every --storage-* flag of both commands sets a field of StorageConfig.
    for command in ("serve", "demo"):
        parsed = vars(cli.build_parser().parse_args([command]))
        flags = {name for name in parsed if name.startswith("storage_")}
        assert flags == set(STORAGE_FIELDS)
    assert set(STORAGE_FIELDS.values()) <= {f.name for f in dataclasses.fields(StorageConfig)}
    assert set(parser.COMMANDS) == {
        "demo",
        "serve",
        *(
            f"bench {b}"
            for b in ("transfer", "overlap", "cache", "served", "storage", "multiturn", "batching", "vllm")
        ),
    }


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["demo", "--write-policy", "bogus"], "invalid choice: 'bogus'"),
        (["demo", "--device", "gpu"], "expected auto, cpu, cuda or cuda:N"),
        (["demo", "--device-tokens", "0"], "expected a positive integer, got 0"),
        (["demo", "--max-tokens", "-1"], "expected a positive integer"),
        (["serve", "--host-layout", "page_last"], "invalid choice: 'page_last'"),
        (["serve", "--host-alloc", "best_fit"], "invalid choice"),
        (["serve", "--port", "70000"], "expected a port in [1, 65535], got 70000"),
        (["serve", "--port", "0"], "expected a port in [1, 65535], got 0"),
        (["serve", "--port", "http"], "expected a port in [1, 65535], got 'http'"),
        (["serve", "--model", "/nonexistent"], "got '/nonexistent' (no such folder)"),
        (["demo", "--model", "pyproject.toml"], "(not a folder)"),
        (["serve", "--model", "kvtier"], "(no config.json in it)"),
        (["serve", "--chat-template", "/nonexistent"], "no such file: '/nonexistent'"),
        (["demo", "--chat-template", "kvtier"], "cannot read 'kvtier'"),
        (["serve", "--host-tokens", "many"], "expected a positive integer, got 'many'"),
        (["serve", "--storage", "s3://bucket/kv"], "expected file://PATH, redis://HOST:PORT[/DB]"),
        (["serve", "--storage", "file://"], "expected file://PATH"),
        (["demo", "--storage", "/var/kv"], "expected file://PATH"),
        (["serve", "--storage-write", "write_around"], "invalid choice: 'write_around'"),
        (["demo", "--storage-prefetch", "never"], "invalid choice: 'never'"),
        (["serve", "--storage-prefetch-timeout", "-1"], "expected a non-negative number, got '-1'"),
        (["serve", "--storage-prefetch-timeout", "nan"], "expected a non-negative number"),
        (["serve", "--storage-min-tokens", "-5"], "expected a non-negative integer, got -5"),
        (["demo", "--storage-compression", "gzip"], "invalid choice: 'gzip'"),
        (["serve", "--storage-size", "10X"], "expected a size in bytes such as 1073741824, 512M or 10G"),
        (["serve", "--storage-size", "1.5G"], "expected a size in bytes"),
        (["serve", "--storage-pool-size", "0"], "expected a positive integer, got 0"),
        (["demo", "--storage-ttl", "soon"], "expected a non-negative integer, got 'soon'"),
        (["serve", "--dtype", "float8"], "invalid choice: 'float8'"),
        (["demo", "--dtype", "fp16"], "invalid choice: 'fp16'"),
        (["serve", "--max-num-seqs", "0"], "expected a positive integer, got 0"),
        (["demo", "--max-num-seqs", "many"], "expected a positive integer, got 'many'"),
        (["serve", "--max-num-batched-tokens", "-1"], "expected a positive integer, got -1"),
        (["demo", "--max-num-batched-tokens", "0"], "expected a positive integer, got 0"),
        (["serve", "--max-queue", "0"], "expected a positive integer, got 0"),
        (["serve", "--request-timeout", "0"], "expected a positive number, got '0'"),
        (["serve", "--request-timeout", "inf"], "expected a positive number, got 'inf'"),
        (["serve", "--request-timeout", "soon"], "expected a positive number, got 'soon'"),
        (["serve", "--max-body-mb", "-1"], "expected a positive number, got '-1'"),
        (["bench", "transfer", "--layout", "page_last"], "invalid choice"),
        (["bench", "transfer", "--spec", "gpt-5"], "invalid choice: 'gpt-5'"),
        (["bench", "transfer", "--host-sets", "runs-1,runs-0"], "invalid choice(s) runs-0"),
        (["bench", "transfer", "--host-sets", "runs-1,runs-x"], "invalid choice(s) runs-x"),
        (["bench", "transfer", "--device-sets", "striped"], "invalid choice(s) striped"),
        (["bench", "transfer", "--variants", "planned,fast"], "invalid choice(s) fast"),
        (["bench", "transfer", "--direction", "sideways"], "invalid choice"),
        (["bench", "transfer", "--tokens", "0"], "must be a comma list of positive token counts"),
        (["bench", "transfer", "--tokens", "1024,x"], "must be a comma list of positive token counts"),
        (["bench", "transfer", "--tokens", ","], "must be a comma list of positive token counts"),
        (["bench", "transfer", "--page-size", "0"], "expected a positive integer"),
        (["bench", "transfer", "--batch", "0"], "expected a positive integer"),
        (["bench", "transfer", "--repeats", "0"], "expected a positive integer"),
        (["bench", "transfer", "--warmup", "-1"], "expected a non-negative integer"),
        (["bench", "transfer", "--cycles", "-1"], "expected a non-negative integer"),
        (["bench", "transfer", "--kernel", "4x0"], "must be one or two positive numbers"),
        (["bench", "transfer", "--kernel-sweep", "8x32,x"], "expected PROGRAMSxROWS"),
        (["bench", "overlap", "--rounds", "0"], "expected a positive integer"),
        (["bench", "served", "--setups", "smollm2,gpt"], "invalid choice(s) gpt"),
        (["bench", "served", "--prefix", "8192,0"], "expected a positive integer, got 0"),
        (["bench", "served", "--prefix", "8k"], "expected a positive integer, got '8k'"),
        (["bench", "served", "--repeats", "0"], "expected a positive integer"),
        (["bench", "served", "--layers", "0"], "expected a positive integer"),
        (["bench", "storage", "--setup", "glm-5"], "invalid choice: 'glm-5'"),
        (["bench", "cache", "--parts", "trace,lru"], "invalid choice(s) lru"),
        (["bench", "cache", "--write-policy", "write_around"], "invalid choice"),
        (["bench", "cache", "--reload-ids", "int8"], "invalid choice: 'int8'"),
        (["bench", "cache", "--reload-layout", "page_last"], "invalid choice"),
        (["bench", "cache", "--reload-host-runs", "-2"], "expected a positive integer"),
        (["bench", "cache", "--reload-tokens", "two"], "expected a positive integer"),
        (["bench", "cache", "--evict-nodes", "0"], "expected a positive integer"),
        (["bench", "cache", "--evict-k", "-1"], "expected a positive integer"),
        (["bench", "cache", "--alloc-churn", "-1"], "expected a non-negative integer"),
        (["bench", "cache", "--device-slots", "0"], "expected a positive integer"),
    ],
)
def test_a_bad_value_is_one_usage_error_and_exit_code_2(argv: list[str], says: str, capsys) -> None:
    line = refused(argv, capsys)
    assert "error: argument" in line and says in line


def test_the_serve_limits_are_not_demo_flags(capsys) -> None:
    for flag in ("--max-queue", "--request-timeout", "--max-body-mb"):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["demo", flag, "4"])
        assert exit_.value.code == 2
        assert capsys.readouterr().err.strip().splitlines() == [
            f"kvtier demo: error: unrecognized arguments: {flag} 4 (see kvtier demo --help)"
        ]


@pytest.mark.parametrize("argv", [["serve", "--dtype", "float8"], ["serve", "--max-num-seqs", "0"]])
def test_a_bad_engine_flag_exits_before_anything_is_loaded(argv: list[str]) -> None:
    out = probe(*argv)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("kvtier serve: error: argument")
    assert out.stdout.strip() == "heavy:"  # neither torch nor transformers imported


def test_auto_is_bfloat16_on_cuda_and_float32_on_the_cpu() -> None:
    from kvtier.engine.models import model_dtype
    from kvtier.errors import ConfigError

    assert model_dtype("auto", "cuda:0") == torch.bfloat16 and model_dtype("auto", "cpu") == torch.float32
    assert (
        model_dtype("float16", "cpu") == torch.float16 and model_dtype("bfloat16", "cuda") == torch.bfloat16
    )
    with pytest.raises(ConfigError, match="'float8'"):
        model_dtype("float8", "cpu")


def test_a_bad_demo_policy_exits_before_anything_is_loaded() -> None:
    """Formerly the model was loaded, then a traceback: now argparse refuses it, importing nothing heavy."""
    out = probe("demo", "--write-policy", "bogus")
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert "invalid choice: 'bogus'" in out.stderr.strip().splitlines()[-1]
    assert out.stdout.strip() == "heavy:"  # neither torch nor transformers imported


# -- checks a command makes before it builds anything --------------------------------------

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


@no_cuda
@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--device", "cuda"],
        ["serve", "--device", "cuda:0"],
        ["bench", "transfer", "--device", "cuda"],
        ["bench", "served", "--device", "cuda"],
        ["bench", "cache", "--device", "cuda", "--parts", "alloc"],
    ],
)
def test_cuda_without_cuda_is_one_line_and_exit_1_before_anything_loads(argv: list[str], capsys) -> None:
    assert cli.main(argv) == 1  # the machine refuses, not the command line
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert (
        len(lines) == 1
        and f"error: --device {argv[argv.index('--device') + 1]}: no CUDA device is available" in lines[0]
    )
    assert captured.out == ""


@no_cuda
def test_the_demo_on_a_missing_cuda_says_so_without_a_traceback() -> None:
    out = probe("demo", "--device", "cuda")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [
        f"kvtier demo: error: --device cuda: no CUDA device is available (torch {torch.__version__})"
    ]


def test_a_storage_option_without_a_store_is_refused_before_the_model_loads(tmp_path: Path, capsys) -> None:
    """Formerly ignored; the model named does not load, so a refusal after loading would say so instead."""
    (tmp_path / "config.json").write_text("{}")
    argv = [
        "serve",
        "--device",
        "cpu",
        "--model",
        str(tmp_path),
        "--storage-size",
        "1G",
        "--storage-ttl",
        "60",
    ]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.strip() == (
        "kvtier serve: error: --storage-size, --storage-ttl given without --storage: "
        "there is no storage tier to apply it to"
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "transfer", "--layers", "2"],
        ["bench", "transfer", "--staging-tokens", "64"],
        ["bench", "cache", "--reload-layers-per-load", "2"],
        ["calibrate"],
    ],
)
def test_the_flags_and_command_of_the_old_transfer_paths_are_gone(argv, capsys) -> None:
    line = refused(argv, capsys)
    assert "unrecognized arguments" in line or "invalid choice" in line


def test_transfer_refuses_tokens_that_are_not_whole_pages(capsys) -> None:
    assert cli.main(["bench", "transfer", "--device", "cpu", "--tokens", "66", "--page-size", "4"]) == 2
    assert "--tokens 66 must be a multiple of --page-size 4" in capsys.readouterr().err


def test_the_overlap_bench_on_the_cpu_is_refused(capsys) -> None:
    assert cli.main(["bench", "overlap", "--device", "cpu", "--spec", "tiny-mla", "--tokens", "64"]) == 2
    assert capsys.readouterr().err.strip() == (
        "kvtier bench overlap: error: kvtier bench overlap needs a CUDA device, got --device cpu"
    )


def test_the_cache_bench_refuses_more_layers_than_the_spec_has(capsys) -> None:
    assert cli.main(["bench", "cache", "--device", "cpu", "--spec", "tiny-mla", "--layers", "99"]) == 2
    assert "--layers 99" in capsys.readouterr().err


# -- each command end to end, tiny ---------------------------------------------------------


def test_bench_transfer_prints_its_table_and_writes_the_json(tmp_path: Path, capsys) -> None:
    """A sweep of two sizes in one process: one table per size, rows and cells of both in the JSON."""
    out = tmp_path / "transfer.json"
    argv = ["bench", "transfer", "--device", "cpu", "--spec", "tiny-mla", "--tokens", "128,256"]
    argv += ["--direction", "load", "--host-sets", "contiguous,runs-16,first_fit-churn"]
    argv += ["--device-sets", "contiguous", "--variants", "planned,copy"]
    argv += ["--repeats", "1", "--warmup", "0", "--batch", "1", "--json", str(out)]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "tiny-mla" in text and "first_fit-churn" in text and f"wrote {out}" in text
    assert "of 128 tokens" in text and "of 256 tokens" in text
    report = json.loads(out.read_text())
    assert set(report) == {"meta", "sizes", "rows", "cells"}
    assert [m["tokens"] for m in report["sizes"]] == [128, 256] and report["meta"] == report["sizes"][0]
    assert report["meta"]["layout"] == "layer_first"
    rows = report["rows"]
    assert {(r["tokens"], r["host_runs"], r["variant"]) for r in rows} == {
        (t, h, v)
        for t in (128, 256)
        for h in ("contiguous", "runs-16", "first_fit-churn")
        for v in ("planned", "copy")
    }
    assert all(r["identical"] and r["direction"] == "load" for r in rows)
    assert set(rows[0]) >= {"path", "variant", "planned", "host_run_count", "gbps", "ceiling_ratio"}
    assert all(r["path"] == "copy" for r in rows if r["variant"] == "copy")
    cells = report["cells"]
    assert len(cells) == 6 and all(c["best_forced"] == "copy" and c["identical"] for c in cells)
    for c in cells:
        ratio = {
            r["variant"]: r["ceiling_ratio"]
            for r in rows
            if (r["tokens"], r["host_runs"]) == (c["tokens"], c["host"])
        }
        assert c["ratios"] == ratio and c["gap"] == round(ratio["planned"] - ratio["copy"], 3)


def test_bench_cache_runs_its_parts_and_writes_one_json(tmp_path: Path, capsys) -> None:
    out = tmp_path / "cache.json"
    argv = ["bench", "cache", "--device", "cpu", "--parts", "alloc,reload", "--page-size", "4"]
    argv += ["--alloc-slots", "65536", "--alloc-churn", "200", "--alloc-pairs", "5"]
    argv += [
        "--reload-tokens",
        "1024",
        "--reload-repeats",
        "1",
        "--reload-host-runs",
        "4",
        "--json",
        str(out),
    ]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "HostSlotAllocator, 65536 slots, page 4" in text and "1024-token prefix" in text
    report = json.loads(out.read_text())
    assert set(report) == {"meta", "alloc", "reload"}
    assert report["meta"]["alloc"] == {"slots": 65536, "churn": 200, "pairs": 5}
    assert {r["policy"] for r in report["alloc"]} == {"contiguous", "first_fit"}
    assert report["reload"]["host_runs"] == 4 and report["reload"]["loaded_bytes"] > 0


def test_bench_cache_eviction_part(tmp_path: Path) -> None:
    pytest.importorskip("kvtier.bench.eviction")
    out = tmp_path / "cache.json"
    argv = [
        "bench",
        "cache",
        "--device",
        "cpu",
        "--parts",
        "eviction",
        "--evict-nodes",
        "2000",
        "--evict-k",
        "10",
    ]
    assert cli.main([*argv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["eviction"] and "eviction" in report["meta"]


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A tiny random Llama and a BPE tokenizer with a chat template, saved as a checkpoint folder."""
    pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    import transformers
    from tiny_models import tiny_llama

    path = tmp_path_factory.mktemp("tiny-checkpoint")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=None))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["</s>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(
        ["You are a concise assistant for a travel agency. Answer in one sentence."] * 20, trainer
    )
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    model = tiny_llama(len(tokenizer), 2048, eos_token_id=tokenizer.eos_token_id)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def demo_argv(checkpoint: Path) -> list[str]:
    argv = ["demo", "--model", str(checkpoint), "--device", "cpu", "--device-tokens", "512"]
    return [*argv, "--host-tokens", "8192", "--max-tokens", "4"]


RESTARTED = "tokens identical to the first engine's and to plain generation: yes"


def test_the_engine_flags_reach_the_engine_and_the_kv_follows_the_dtype(tiny_checkpoint: Path) -> None:
    from kvtier.cache import CacheConfig
    from kvtier.cli.build import engine_for
    from kvtier.cli.console import summary_lines

    argv = ["serve", "--model", str(tiny_checkpoint), "--device", "cpu", "--device-tokens", "256"]
    argv += ["--host-tokens", "1024", "--max-num-seqs", "3", "--max-num-batched-tokens", "128"]
    summaries = {}
    for dtype in ("auto", "bfloat16"):
        args = cli.build_parser().parse_args([*argv, "--dtype", dtype])
        _, engine = engine_for(args, "loading", CacheConfig())
        with engine:
            summaries[dtype] = engine.summary()
            assert {p.dtype for p in engine.model.parameters()} == {getattr(torch, summaries[dtype]["dtype"])}
    auto, bf16 = summaries["auto"], summaries["bfloat16"]
    assert (auto["dtype"], bf16["dtype"]) == ("float32", "bfloat16")  # auto on the CPU: float32
    assert auto["kv_bytes_per_token"] == 2 * bf16["kv_bytes_per_token"]  # the pools follow the model
    assert bf16["device_pool_bytes"] == 256 * bf16["kv_bytes_per_token"]
    assert (bf16["max_num_seqs"], bf16["max_num_batched_tokens"]) == (3, 128)
    lines = summary_lines(bf16)
    assert len(lines) == 2 and "bfloat16 on cpu" in lines[0]
    assert f"device pool 256 tokens ({bf16['device_pool_bytes'] / 1e9:.2f} GB)" in lines[0]
    assert "host pool 1024 tokens" in lines[0] and "of KV per token" in lines[0]
    assert "up to 3 running requests and 128 batched tokens per step" in lines[1]


def test_the_demo_end_to_end_on_a_tiny_checkpoint(tiny_checkpoint: Path, capsys) -> None:
    """Every answer equals plain `generate` while earlier turns come back from the host; then a
    restarted engine gets the first conversation back from a temporary store."""
    assert cli.main(demo_argv(tiny_checkpoint)) == 0
    text = capsys.readouterr().out
    assert "answers identical to plain generation without cache reuse: 9 of 9" in text
    assert "float32 on cpu" in text and "device pool 512 tokens" in text  # the startup summary
    assert "hit host" in text  # a conversation came back from the host
    assert "after the restart: hit storage" in text and RESTARTED in text
    # Nothing came from storage before the restart: the turns ran without a storage tier.
    assert "storage 0)" in text and "prompt tokens from storage" in text
    store = re.search(r"an engine over file://(\S+),", text).group(1)
    assert not Path(store).exists()  # the temporary store is gone with the demo


def test_the_demo_over_a_given_store_leaves_its_pages_there(
    tiny_checkpoint: Path, tmp_path: Path, capsys
) -> None:
    store = tmp_path / "store"
    argv = [
        *demo_argv(tiny_checkpoint),
        "--storage",
        f"file://{store}",
        "--storage-compression",
        "zstd",
        "--page-size",
        "1",
    ]
    assert cli.main([*argv, "--storage-prefetch", "wait_complete", "--storage-size", "64M"]) == 0
    text = capsys.readouterr().out
    assert "after the restart: hit storage" in text and RESTARTED in text
    hit = re.search(r"hit storage, (\d+) of (\d+) prompt tokens from storage", text)
    assert 0 < int(hit.group(1)) < int(hit.group(2))  # all but the last prompt token
    assert sum(1 for f in store.rglob("*") if f.is_file()) >= int(hit.group(1))  # page size 1: a file a page


def test_a_trace_too_long_for_the_device_pool_is_refused_before_pools_are_built(capsys) -> None:
    assert cli.main(["bench", "cache", "--device", "cpu", "--parts", "trace", "--device-slots", "1024"]) == 2
    assert "does not fit 1024 device slots" in capsys.readouterr().err


def test_every_public_name_resolves_and_errors_are_kvtier_errors() -> None:
    """`kvtier.__all__` is the public API: each name imports, every error class is a KVTierError."""
    import kvtier

    for name in kvtier.__all__:
        value = getattr(kvtier, name)
        if isinstance(value, type) and issubclass(value, Exception):
            assert issubclass(value, kvtier.KVTierError), name


def test_type_checkers_see_the_public_names_the_runtime_hands_out() -> None:
    """The `TYPE_CHECKING` imports of kvtier/__init__.py name `__all__` exactly, each from the module
    that the lazy `__getattr__` imports it from; and the package ships its `py.typed` marker."""
    import ast

    import kvtier

    init = Path(kvtier.__file__)
    tree = ast.parse(init.read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    seen = {a.name: n.module for n in block.body if isinstance(n, ast.ImportFrom) for a in n.names}
    assert seen == kvtier._EXPORTS
    assert sorted(seen) == sorted(kvtier.__all__) and len(set(kvtier.__all__)) == len(kvtier.__all__)
    assert (init.parent / "py.typed").is_file()


# -- `kvtier serve` refusals, each one line before the model loads (or once it has) --------


def one_line(capsys) -> str:
    """The single line on stderr; stdout empty: nothing was loaded, nothing served."""
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert captured.out == "", captured.out
    return lines[0]


def serve_argv(checkpoint: Path, *flags: str) -> list[str]:
    """`kvtier serve` of `checkpoint` on the CPU, on a free port unless `flags` name one."""
    from redis_servers import free_port

    argv = ["serve", "--model", str(checkpoint), "--device", "cpu", "--device-tokens", "256"]
    return [*argv, "--port", str(free_port()), *flags]  # a later --port wins


def test_a_port_in_use_is_refused_in_one_line_before_the_model_loads(tiny_checkpoint: Path, capsys) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(serve_argv(tiny_checkpoint, "--host-tokens", "1024", "--port", str(port))) == 1
    assert one_line(capsys) == (
        f"kvtier serve: error: --port {port}: the port is already in use on 127.0.0.1 "
        "(is another server running?)"
    )


def test_a_host_that_is_not_this_machines_is_refused_in_one_line(tiny_checkpoint: Path, capsys) -> None:
    # 192.0.2.0/24 is TEST-NET-1: never an address of this machine.
    assert cli.main(serve_argv(tiny_checkpoint, "--host", "192.0.2.1")) == 1
    assert one_line(capsys) == "kvtier serve: error: --host 192.0.2.1: not an address of this machine"


def test_an_empty_api_key_is_refused_before_the_model_loads(tmp_path: Path, capsys, monkeypatch) -> None:
    """The checkpoint does not load: a refusal after loading would say so instead."""
    (tmp_path / "config.json").write_text("{}")
    assert cli.main(serve_argv(tmp_path, "--api-key", "")) == 2
    assert one_line(capsys) == "kvtier serve: error: the API key (--api-key or $KVTIER_API_KEY) is empty"
    monkeypatch.setenv("KVTIER_API_KEY", " ")
    assert cli.main(serve_argv(tmp_path)) == 2
    assert "the API key (--api-key or $KVTIER_API_KEY) is empty" in one_line(capsys)


def test_a_checkpoint_that_does_not_load_is_one_line_and_exit_1(tmp_path: Path, capsys) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert cli.main(serve_argv(tmp_path)) == 1
    assert one_line(capsys).startswith(f"kvtier serve: error: could not load a causal LM from '{tmp_path}'")


def test_a_chat_template_that_is_not_jinja_is_one_line_and_exit_2(
    tiny_checkpoint: Path, tmp_path: Path, capsys
) -> None:
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m['content'] }}")
    serve, demo = serve_argv(tiny_checkpoint), demo_argv(tiny_checkpoint)
    for command, argv in (("serve", serve), ("demo", demo)):
        assert cli.main([*argv, "--chat-template", str(bad)]) == 2
        line = one_line(capsys)
        assert line.startswith(f"kvtier {command}: error: the chat template is not valid Jinja: line 1:"), (
            line
        )


def test_the_demo_on_a_tokenizer_without_a_chat_template_says_so_in_one_line(
    tiny_checkpoint: Path, tmp_path: Path, capsys
) -> None:
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(tiny_checkpoint, bare)
    for template in bare.glob("chat_template.j*"):
        template.unlink()
    config = bare / "tokenizer_config.json"
    config.write_text(
        json.dumps({k: v for k, v in json.loads(config.read_text()).items() if k != "chat_template"})
    )
    assert cli.main(demo_argv(bare)) == 2
    assert one_line(capsys) == (
        f"kvtier demo: error: the tokenizer of {bare} has no chat template, which the demo's conversations "
        "need: give one with --chat-template FILE"
    )
