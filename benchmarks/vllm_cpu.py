"""The real-vLLM runs behind docs/integrations/vllm-cpu.md, in the environment of scripts/vllm-cpu-env.sh.

    .venv-vllm/bin/python benchmarks/vllm_cpu.py                 # TRL part (~2 min), writes the results file
    .venv-vllm/bin/python benchmarks/vllm_cpu.py --verl          # also one verl smoke run on vLLM (~4 min)

TRL: the five rollouts with colocated vLLM for 4 steps each, then the turn rollout again with ``sync_weights`` a
no-op (the negative control), each in one process (``tests/vllm/trl_colocate.py``). verl: ``agentcredit verl
recipes/verl/sokoban_gigpo.yaml --cpu-smoke --rollout vllm`` at lr 1e-2, its step metrics and wall time. Written
to ``benchmarks/results/vllm_cpu.json`` with the machine's CPU and the versions; the docs page's figures are checked
against that file by ``tests/test_docs_vllm.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "vllm_cpu.json"


def _trl(args: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "runs.json"
        subprocess.run([sys.executable, "-m", "tests.vllm.trl_colocate", "--out", str(out), "--steps", "4", *args],
                       cwd=ROOT, check=True, capture_output=True, text=True)
        return json.loads(out.read_text())


def _verl() -> dict:
    from agentcredit.verl import smoke

    with tempfile.TemporaryDirectory() as tmp:
        run = smoke.prepare(ROOT / "recipes" / "verl" / "sokoban_gigpo.yaml", tmp, rollout="vllm",
                            overrides=["actor_rollout_ref.actor.optim.lr=1e-2"])
        start = time.monotonic()
        rc, _, steps = smoke.run(run, timeout=1800)
        wall = time.monotonic() - start
    keep = ("training/rollout_probs_diff", "timing_s/", "actor/grad_norm", "agentcredit/steps")
    return {"rc": rc, "wall_seconds": round(wall, 1),
            "steps": {s: {k: v for k, v in m.items() if k.startswith(keep)} for s, m in steps.items()}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--verl", action="store_true", help="also one verl smoke run on vLLM's servers")
    p.add_argument("--out", default=str(OUT))
    a = p.parse_args(argv)
    from agentcredit import vllm_cpu

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", vllm_cpu.KV_CACHE_GIB)
    versions = vllm_cpu.check_environment()
    start = time.monotonic()
    synced = _trl([])
    trl_wall = time.monotonic() - start
    result = {"machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                          "capability": versions.pop("cpu")},
              "versions": versions, "trl": {"wall_seconds": round(trl_wall, 1), "synced": synced,
                                            "unsynced": _trl(["--kinds", "turn", "--no-sync"])}}
    if a.verl:
        result["verl"] = _verl()
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    for r in synced + result["trl"]["unsynced"]:
        print(f"{r['kind']:15s} sync={r['sync']} {r['seconds']:5.1f}s gap_max={max(r['gap_max']):.2g} "
              f"gap_mean={[round(x, 7) for x in r['gap_mean']]}")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
