"""`kvtier bench multiturn --trace`: a trace file's rows, read into a plan and replayed on the tiny shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from kvtier import cli
from kvtier.bench import engines, multiturn
from kvtier.bench.multiturn_plan import Plan, Turn
from kvtier.bench.multiturn_trace import read_trace
from kvtier.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "bench" / "traces" / "multiturn_example.csv"
# `kvtier bench multiturn` on the tiny shape, on the CPU, replaying the trace that follows.
TINY_TRACE = ["bench", "multiturn", "--shape", "tiny", "--device", "cpu", "--trace"]
GOOD = """arrival_s,conversation,input_tokens,output_tokens,model
100.5,x,20,3,m
100.0,y,10,2,m

100.7,x,30,4,m
101.0,y,16,1,m
"""


def test_a_csv_trace_becomes_conversations_whose_turns_append_what_is_new(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text(GOOD)
    plan = read_trace(path, seed=5)
    # y arrives first; times from the earliest; x's second turn appends 30 - (20 + 3) tokens.
    assert plan == Plan(
        (
            (Turn(10, 2, 0.0), Turn(4, 1, 1.0)),
            (Turn(20, 3, 0.5), Turn(7, 4, 0.7)),
        ),
        seed=5,
    )
    assert plan.scheduled and plan.total_turns == 4 and plan.longest_tokens == 34


def test_the_same_rows_as_json_lines_give_the_same_plan(tmp_path: Path) -> None:
    csv_path, jsonl = tmp_path / "t.csv", tmp_path / "t.jsonl"
    csv_path.write_text(GOOD)
    rows = [
        {"arrival_s": 100.5, "conversation": "x", "input_tokens": 20, "output_tokens": 3, "extra": [1]},
        {"arrival_s": 100.0, "conversation": "y", "input_tokens": 10, "output_tokens": 2},
        {"arrival_s": 100.7, "conversation": "x", "input_tokens": 30, "output_tokens": 4},
        {"arrival_s": 101, "conversation": "y", "input_tokens": "16", "output_tokens": 1},
    ]
    jsonl.write_text(
        "\n".join(json.dumps(r) for r in rows[:2]) + "\n\n" + "\n".join(json.dumps(r) for r in rows[2:])
    )
    assert read_trace(jsonl) == read_trace(csv_path)


def test_the_example_trace_parses() -> None:
    plan = read_trace(EXAMPLE)
    assert len(plan.conversations) == 6 and plan.total_turns == 16
    assert {t.output_tokens for conv in plan.conversations for t in conv} == {1, 16, 32, 64, 128}
    assert plan.conversations[0][0] == Turn(256, 32, 0.0)


@pytest.mark.parametrize(
    ("name", "text", "says"),
    [
        ("t.csv", "arrival_s,conversation,input_tokens\n0,a,5\n", "t.csv:1: the header lacks output_tokens"),
        (
            "t.csv",
            "arrival_s,conversation,input_tokens,output_tokens\n0,a,5,\n",
            "t.csv:2: missing output_tokens",
        ),
        (
            "t.csv",
            "arrival_s,conversation,input_tokens,output_tokens\n-1,a,5,1\n",
            "t.csv:2: arrival_s must be",
        ),
        (
            "t.csv",
            "arrival_s,conversation,input_tokens,output_tokens\nnan,a,5,1\n",
            "t.csv:2: arrival_s must be",
        ),
        ("t.csv", "arrival_s,conversation,input_tokens,output_tokens\nsoon,a,5,1\n", "got 'soon'"),
        (
            "t.csv",
            "arrival_s,conversation,input_tokens,output_tokens\n0,a,5.5,1\n",
            "input_tokens must be a positive",
        ),
        (
            "t.csv",
            "arrival_s,conversation,input_tokens,output_tokens\n0,a,5,0\n",
            "output_tokens must be a positive",
        ),
        (
            "t.csv",
            "arrival_s,conversation,input_tokens,output_tokens\n0, ,5,1\n",
            "t.csv:2: conversation is empty",
        ),
        (
            "t.csv",
            "arrival_s,conversation,input_tokens,output_tokens\n0,a,10,4\n1,b,3,1\n2,a,14,1\n",
            "t.csv:4: conversation 'a' is 14 tokens long by then",
        ),
        ("t.csv", "arrival_s,conversation,input_tokens,output_tokens\n", "has no requests"),
        (
            "t.jsonl",
            '{"arrival_s": 0, "conversation": "a", "input_tokens": 5, "output_tokens": 1}\n{oops',
            "t.jsonl:2: not JSON",
        ),
        ("t.jsonl", "[0, 1, 2, 3]\n", "t.jsonl:1: expected an object"),
        (
            "t.jsonl",
            '{"arrival_s": 0, "conversation": "a", "input_tokens": true, "output_tokens": 1}',
            "input_tokens",
        ),
        (
            "t.txt",
            "arrival_s,conversation,input_tokens,output_tokens\n0,a,5,1\n",
            "expected a .csv or a .jsonl",
        ),
    ],
)
def test_a_bad_row_is_refused_naming_the_line(tmp_path: Path, name: str, text: str, says: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        read_trace(path)
    assert says in str(e.value)


def test_a_missing_trace_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the trace"):
        read_trace(tmp_path / "nowhere.csv")


def test_a_bad_trace_stops_the_cli_before_the_model_is_built(tmp_path: Path, capsys) -> None:
    bad, out = tmp_path / "bad.csv", tmp_path / "out.json"
    bad.write_text("arrival_s,conversation,input_tokens,output_tokens\n0,a,10,4\n1,a,12,1\n")
    assert cli.main([*TINY_TRACE, str(bad), "--json", str(out)]) == 2
    captured = capsys.readouterr()
    assert "bad.csv:3" in captured.err and "building the model" not in captured.out + captured.err
    assert not out.exists()
    assert cli.main([*TINY_TRACE, str(EXAMPLE), "--output-tokens", "4"]) == 2
    assert "drop --request-rate and --output-tokens" in capsys.readouterr().err


def test_a_replayed_trace_sends_each_turn_at_its_time_and_counts_from_it(tmp_path: Path) -> None:
    """Every request goes no earlier than its row's time, nor before its conversation's previous
    answer; its TTFT counts from the later of the two; answers are as long as the rows ask."""
    path = tmp_path / "t.csv"
    path.write_text(GOOD.replace("100.5", "100.05").replace("100.7", "100.12").replace("101.0", "100.2"))
    plan = read_trace(path)
    tiny = engines.build_shape("tiny", torch.device("cpu"), torch.float32)
    eng = multiturn.build_engine(
        "kvtier", tiny, None, multiturn.EngineSetup(device_tokens=128, host_tokens=512)
    )
    try:
        records, duration, steps = multiturn.drive(eng, plan, engines.vocab_size(tiny))
    finally:
        eng.close()
    assert len(records) == 4 and 0 < steps.longest_s <= duration
    by = {(r.client, r.round): r for r in records}
    for c, conv in enumerate(plan.conversations):
        for k, turn in enumerate(conv):
            r = by[(c, k + 1)]
            assert r.output_tokens == turn.output_tokens and len(r.token_gaps_s) == turn.output_tokens - 1
            assert r.arrived_s >= turn.arrival_s and r.submitted_s >= r.arrived_s
            assert r.ttft_s > 0 and r.total_s >= r.ttft_s
            if k:
                before = by[(c, k)]
                assert r.arrived_s >= before.arrived_s + before.total_s - 1e-6
    assert [by[(0, 1)].prompt_tokens, by[(0, 2)].prompt_tokens] == [10, 16]
    assert [by[(1, 1)].prompt_tokens, by[(1, 2)].prompt_tokens] == [20, 30]
