"""``benchmarks/gpu/check.py --dry-run``: the GPU check's own code on the CPU (fp32, small sizes), so the script a lent
GPU machine runs in one command is known to work before it travels. Every part must produce its records, none an
error: one real TRL step per estimator family with its rollout, the estimator timings, the noise floor."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytest.importorskip("minigrid")
pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_covers_every_family_and_part(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, "benchmarks/gpu/check.py", "--dry-run", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900, env={**__import__("os").environ,
                                                                            "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["dry_run"] is True and result["seconds"] > 0
    from benchmarks.gpu.check import FAMILIES

    assert [(r["family"], r["credit"], r["rollout"]) for r in result["trl"]] == list(FAMILIES)
    for r in result["trl"]:
        assert "error" not in r, r
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["device"] == "cpu"
        assert r["dtype"] == "torch.float32"
    assert {r["estimator"] for r in result["estimators"]} >= {"grpo", "gigpo", "graphhca", "crbc", "mvpo"}
    assert all("error" not in r and r["rows_per_s"] > 0 for r in result["estimators"]), result["estimators"]
    noise = result["bf16_noise"]
    assert noise["fp32: alone vs padded batch"]["max_abs"] < noise["bf16: alone vs padded batch"]["max_abs"] + 1e-3
    assert noise["bf16 vs fp32 (alone)"]["max_abs"] > 0  # bf16 rounds
