"""TRL's ``GRPOTrainer`` with colocated vLLM, for real: vLLM's CPU build generates every turn of agentcredit's five
rollouts (turn, tree, counterfactual, memory context, search-QA) over 4 training steps each.

The runs happen in one subprocess (:mod:`tests.vllm.trl_colocate`; vLLM spawns and sets process-wide state), the
policy's HF ``generate`` raises, and the learning rate (1e-2) makes every update with a gradient move the log-probs by
nats. What each run must show:

* the engine is vLLM's ``LLM``, eager and fp32 (the CPU backend's settings, :mod:`agentcredit.vllm_cpu`), and every
  turn went through it (HF ``generate`` never called);
* TRL synced the weights before each step's generation, and the trainer's log-probs of the sampled tokens equal
  vLLM's to float rounding on every step, including the steps after an update that moved the weights
  (``sampling/sampling_logp_difference/max`` < 1e-4);
* the negative control: the same turn run with ``sync_weights`` a no-op has a gap above 0.1 nats on the step after
  the first update with a gradient, so the check above can fail and the generation really came from the engine.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
KINDS = ("turn", "tree", "counterfactual", "memory", "search")
STEPS = 4


def _runs(tmp_path: Path, *args: str) -> list[dict]:
    out = tmp_path / "runs.json"
    proc = subprocess.run([sys.executable, "-m", "tests.vllm.trl_colocate", "--out", str(out), "--steps", str(STEPS),
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    synced = _runs(tmp_path_factory.mktemp("synced"), "--kinds", ",".join(KINDS))
    unsynced = _runs(tmp_path_factory.mktemp("unsynced"), "--kinds", "turn", "--no-sync")
    print(json.dumps(synced + unsynced, indent=1))
    return {r["kind"]: r for r in synced}, unsynced[0]


def _first_moved(record: dict) -> int:
    """The first step whose update had a gradient (so the next step's generation sees other weights)."""
    moved = [k for k, g in enumerate(record["grad_norm"][:-1]) if g > 1e-3]
    assert moved, f"no update with a gradient in {STEPS} steps: {record}"
    return moved[0]


@pytest.mark.parametrize("kind", KINDS)
def test_rollout_generates_on_real_vllm_and_weights_stay_in_sync(runs, kind):
    record = runs[0][kind]
    assert record["engine"] == "vllm.entrypoints.llm.LLM"
    assert record["enforce_eager"] and record["dtype"] == "torch.float32"
    assert record["steps"] == STEPS and record["hf_generate_calls"] == 0
    assert record["generate"] >= STEPS and record["prompts"] >= record["generate"]
    assert record["sync"] == STEPS  # TRL syncs before every step's generation (the step changed)
    assert all(math.isfinite(x) for x in record["loss"])
    assert max(record["gap_max"]) < 1e-4, record  # fp32 engine and trainer: rounding only


def test_turn_rollout_weights_move_and_the_sync_is_what_keeps_the_gap_small(runs):
    synced, unsynced = runs[0]["turn"], runs[1]
    k = _first_moved(synced)
    assert unsynced["grad_norm"][: k + 1] == pytest.approx(synced["grad_norm"][: k + 1])  # the same run up to there
    assert synced["gap_mean"][k + 1] < 1e-4
    assert unsynced["gap_mean"][k + 1] > 0.1, unsynced  # stale engine weights: the check above can fail
