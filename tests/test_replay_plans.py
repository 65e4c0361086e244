"""bench/replay_plans.py: the planner replayed on a bench run's own pools and slot sets gives the plans
that run measured, so a cost model's plans can be judged on the CPU."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from test_costs import rates

from kvtier import cli
from kvtier.pool.device import Direction
from kvtier.transfer.costs import CostModel

ROOT = Path(__file__).resolve().parent.parent


def _replay_module():
    spec = importlib.util.spec_from_file_location("replay_plans", ROOT / "bench" / "replay_plans.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_replayed_plans_are_the_plans_the_bench_ran(tmp_path) -> None:
    out = tmp_path / "run.json"
    args = ["bench", "transfer", "--device", "cpu", "--spec", "glm-5", "--tokens", "1024", "--repeats", "1"]
    assert cli.main([*args, "--warmup", "0", "--variants", "planned", "--json", str(out)]) == 0
    run = json.loads(out.read_text())
    ab = {"cal_glm-5_defaults": run, "cal_glm-5_calibrated": run}
    model = CostModel("calibrated test", {d: rates(28.0, 47.0) for d in Direction})
    rows = _replay_module().replay(ab, model, "glm-5")
    assert len(rows) == len(run["rows"]) > 0
    assert all(r["replayed_defaults_match"] for r in rows)
    assert {(r["direction"], r["host_runs"], r["device"]) for r in rows} == {
        (r["direction"], r["host_runs"], r["device"]) for r in run["rows"]
    }
