"""The GPU check: one command a lent GPU machine runs in under 10 minutes, with only what travels there.

    python benchmarks/gpu/check.py --out "$OUT/gpu_check.json"       # CUDA, bf16
    python benchmarks/gpu/check.py --dry-run --out /tmp/gpu_check.json   # the same code on the CPU, fp32, small (CI)

What the machine needs: torch, transformers, peft and accelerate (installed there), TRL and its two missing
dependencies as wheels carried in the working tree (no package index, no model hub, no Ray, verl or vLLM)::

    pip download --no-deps -d wheels trl==1.16.0 datasets jmespath   # here, before the run
    pip install --no-deps wheels/*.whl && pip install --no-deps -e . && python benchmarks/gpu/check.py --out ...

Three parts, each recorded in the JSON file (a part that fails records its error and the others still run):

1. ``trl``: one real ``GRPOTrainer`` step per estimator family, each with the rollout it reads: the flat turn
   estimators (``grpo``, ``gigpo``) and the graph ones (``graphhca``, ``crbc``, ``mvpo``) on the turn rollout, the
   tree family (``sipo``) on the tree rollout, the counterfactual one (``asct``) on the counterfactual rollout; on
   CUDA in bf16 with ``tiny-qwen2-4x256`` (built in code), on the CPU in fp32 with ``tiny-qwen2`` in the dry run.
   Recorded: loss, grad norm, seconds, the device the model trained on.
2. ``estimators``: every flat estimator of ``benchmarks/credit_speed.py``'s ALFWorld-shaped batch at 10^6 rows
   (10^4 in the dry run), its columns handed over as tensors on the device, as a GPU trainer holds them; the time
   includes the copy to the host (the estimators are NumPy/SciPy code). Best of 3.
3. ``bf16_noise``: ``benchmarks/bf16_noise.py``'s log-prob noise floor (the same sequence alone and in a padded
   batch, bf16 and fp32) on the device: the floor under every log-prob gap a bf16 GPU run logs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

#: (family, estimator, rollout) of part 1
FAMILIES = (("flat", "grpo", "turn"), ("flat", "gigpo", "turn"), ("graph", "graphhca", "turn"),
            ("graph", "crbc", "turn"), ("graph", "mvpo", "turn"), ("tree", "sipo", "tree"),
            ("counterfactual", "asct", "counterfactual"))
ABS = {"size": 5, "moves": "absolute", "view": "coords"}


def _rollout(kind: str):
    from agentcredit.trl.rollouts import TurnRollout
    from agentcredit.trl.search_rollouts import CounterfactualRollout, TreeRollout

    if kind == "turn":
        return TurnRollout("minigrid", ABS, max_turns=2, max_new_tokens=6), 8
    if kind == "tree":
        r = TreeRollout("minigrid", ABS, max_turns=2, max_new_tokens=6, initial=2, iterations=1, beam=1, branches=1)
        return r, r.max_nodes
    return CounterfactualRollout("minigrid", ABS, max_turns=2, max_new_tokens=6, budget=4), 4


def trl_steps(device: str, dry: bool) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from agentcredit.models import TINY, TINY_4X256, resolve_model
    from agentcredit.trl import make_trainer

    path = resolve_model(TINY if dry else TINY_4X256)
    bf16 = device == "cuda"
    out = []
    for family, credit, kind in FAMILIES:
        record = {"family": family, "credit": credit, "rollout": kind}
        try:
            rollout, G = _rollout(kind)
            tok = AutoTokenizer.from_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16 if bf16 else torch.float32)
            with tempfile.TemporaryDirectory() as tmp:
                args = GRPOConfig(output_dir=tmp, max_steps=1, num_generations=G, per_device_train_batch_size=G,
                                  max_completion_length=6, report_to="none", logging_steps=1, use_cpu=device == "cpu",
                                  bf16=bf16, save_strategy="no", disable_tqdm=True, temperature=1.0, seed=0)
                trainer = make_trainer(credit=credit)(model=model, processing_class=tok,
                                                      reward_funcs=[rollout.reward_func], rollout_func=rollout,
                                                      train_dataset=rollout.dataset(range(4)), args=args)
                start = time.perf_counter()
                trainer.train()
                log = next(h for h in trainer.state.log_history if "loss" in h)
                record |= {"seconds": round(time.perf_counter() - start, 2), "loss": log["loss"],
                           "grad_norm": log.get("grad_norm", math.nan),
                           "device": str(next(trainer.model.parameters()).device),
                           "dtype": str(next(trainer.model.parameters()).dtype)}
        except Exception:  # noqa: BLE001 - recorded; the other families still run
            record["error"] = traceback.format_exc(limit=3)
        out.append(record)
        print(json.dumps(record), flush=True)
    return out


def estimator_timings(device: str, rows: int) -> list[dict]:
    import numpy as np
    import torch

    import credit_plugins as cp
    from benchmarks.credit_speed import alfworld_like_batch, best_of, run_estimator

    cols = alfworld_like_batch(rows)

    def on_device(value):
        if isinstance(value, dict):
            return {k: on_device(v) for k, v in value.items()}
        return torch.as_tensor(np.asarray(value)).to(device)

    held = on_device(cols)

    def host(value):
        if isinstance(value, dict):
            return {k: host(v) for k, v in value.items()}
        return value.cpu().numpy()

    given = set(cols) | set(cols["extras"])
    out = []
    for name in cp.available():
        if not set(cp.get(name).required_fields) <= given:
            continue
        record = {"estimator": name, "rows": int(len(cols["traj"]))}
        try:
            seconds = best_of(lambda: run_estimator(name, cp.StepTable(**host(held))), 3)
            record |= {"seconds": round(seconds, 4), "rows_per_s": round(record["rows"] / seconds)}
        except Exception:  # noqa: BLE001
            record["error"] = traceback.format_exc(limit=3)
        out.append(record)
        print(json.dumps(record), flush=True)
    return out


def bf16_noise(device: str, dry: bool) -> dict:
    import torch

    import benchmarks.bf16_noise as noise

    build, logprobs = noise.build_model, noise.token_logprobs

    def build_on_device(*args, **kwargs):
        return build(*args, **kwargs).to(device)

    def logprobs_on_device(model, ids, mask, dtype):
        return logprobs(model, ids.to(device), mask.to(device), dtype).cpu()

    noise.build_model, noise.token_logprobs = build_on_device, logprobs_on_device
    try:
        sizes = {"hidden": 64, "layers": 2, "vocab": 512, "length": 32, "batch": 4} if dry else {}
        with torch.no_grad():
            return noise.measure(**sizes)
    finally:
        noise.build_model, noise.token_logprobs = build, logprobs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--dry-run", action="store_true", help="CPU, fp32, small sizes: checks the script itself")
    p.add_argument("--rows", type=int, default=None, help="estimator batch rows (default 10^6, dry run 10^4)")
    a = p.parse_args(argv)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch

    device = "cpu" if a.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run on a machine without one", file=sys.stderr)
        return 2
    result = {"dry_run": a.dry_run, "device": torch.cuda.get_device_name(0) if device == "cuda" else
              platform.processor() or platform.machine(), "torch": torch.__version__}
    start = time.perf_counter()
    parts = (("trl", lambda: trl_steps(device, a.dry_run)),
             ("estimators", lambda: estimator_timings(device, a.rows or (10_000 if a.dry_run else 1_000_000))),
             ("bf16_noise", lambda: bf16_noise(device, a.dry_run)))
    for name, part in parts:
        try:
            result[name] = part()
        except Exception:  # noqa: BLE001 - a missing package (TRL not carried) loses its part only
            result[name] = {"error": traceback.format_exc(limit=3)}
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    result["seconds"] = round(time.perf_counter() - start, 1)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {a.out} ({result['seconds']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
