"""`kvtier bench vllm`'s rows (no vLLM needed): medians, ratios, and answer checks that catch a hit
whose answer differs, and the command refusing a missing vLLM python before starting anything."""

from __future__ import annotations

import pytest

from kvtier.bench.vllm_report import answers_of, render, rows_of
from kvtier.cli import parser


def test_rows_take_medians_and_catch_an_answer_that_differs() -> None:
    samples = {
        ("miss", 4096): [3.0, 2.0, 4.0],
        ("host_hit", 4096): [0.5, 0.4, 0.6],
        ("storage_hit", 4096): [1.0, 0.8, 0.9],
        ("prefix_cache_hit", 4096): [0.3, 0.3, 0.3],
    }
    same = {
        (c, 4096, r): f"answer {r}"
        for c in ("miss", "host_hit", "storage_hit", "prefix_cache_hit")
        for r in range(3)
    }
    (row,) = rows_of("vllm", 3, [4096], samples, same)
    assert (row.ttft_miss_s, row.ttft_host_hit_s, row.ttft_storage_hit_s) == (3.0, 0.5, 0.9)
    assert (row.miss_over_host, row.miss_over_storage) == (6.0, 3.33)
    assert row.identical and row.same_as_prefix_cache and row.ttft_no_connector_miss_s is None
    differs = dict(same)
    differs[("storage_hit", 4096, 2)] = "another answer"
    (row,) = rows_of("vllm", 3, [4096], samples, differs)
    assert not row.identical and not row.same_as_prefix_cache
    rounding = dict(same)
    rounding[("miss", 4096, 1)] = "a full prefill's answer"  # the hits agree with vLLM's own cache
    (row,) = rows_of("vllm", 3, [4096], samples, rounding)
    assert not row.identical and row.same_as_prefix_cache
    meta = {"repeats": 3, "vllm": "0.32.0", "dtype": "bfloat16", "device": "cpu", "tokens": [4096, 16384]}
    meta |= {"lengths": [4096], "context": 8192, "counted": {}}
    report = {"meta": meta, "rows": [row.__dict__], "answers": answers_of(rounding)}
    assert "16384 tokens do not fit" in render(report).renderables[1]


def test_the_command_refuses_a_missing_vllm_python(monkeypatch, capsys) -> None:
    monkeypatch.delenv("KVTIER_VLLM_PYTHON", raising=False)
    assert parser.main(["bench", "vllm"]) == 2
    assert "--vllm-python" in capsys.readouterr().err
    assert parser.main(["bench", "vllm", "--vllm-python", "/nonexistent/python"]) == 2
    with pytest.raises(SystemExit):
        parser.main(["bench", "vllm", "--tokens", "0"])
