"""Held-out goal-swap ranking accuracy of saved policies (EVOKE's measurement, docs/methods/terms/evoke.md).

    python benchmarks/evoke_goal_swap.py --models runs/trl/minigrid_evoke/warm_start runs/trl/minigrid_evoke/final
    python benchmarks/evoke_goal_swap.py --models A B --seeds 30000 30256 --goals 2 --out goal_swap.json

Per held-out seed: reset, 0..``--walk`` uniformly random legal moves, ``--goals`` alternative goals there
(``env.goal_rankings``), each legal move scored by the policy under the rewritten compact prompt
(:func:`agentcredit.trl.evoke.goal_swap_groups`); reported per model: ``rank_acc`` (pairwise agreement with the
solver's order; t-interval over the groups) and ``top1_acc`` (Wilson interval), as
:func:`distill_plugins.evoke.ranking_accuracy` defines them. The env defaults to the CPU demo's room.
"""

from __future__ import annotations

import argparse
import json
import math

DEMO = {"size": 6, "moves": "absolute", "view": "coords", "shaping": 1.0, "invalid_penalty": -1.0}


def measure(path: str, env: str, options: dict, seeds: range, goals: int, walk: int, system: str | None) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentcredit.stats import t_interval, wilson_interval
    from agentcredit.trl.evoke import goal_swap_groups
    from distill_plugins.evoke import ranking_accuracy

    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    s, v, m = goal_swap_groups(model, tok, env, options, seeds, goals=goals, walk=walk, system=system)
    per = [ranking_accuracy(s[i:i + 1], v[i:i + 1], m[i:i + 1]) for i in range(s.size(0))]
    ra = [p["rank_acc"] for p in per if not math.isnan(p["rank_acc"])]
    top = [p["top1_acc"] for p in per if not math.isnan(p["top1_acc"])]
    return {"model": path, "groups": len(ra), "rank_acc": sum(ra) / len(ra), "rank_acc_ci": t_interval(ra),
            "top1_acc": sum(top) / len(top), "top1_ci": wilson_interval(sum(top), len(top))}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", required=True, help="saved policy folders (HF format)")
    ap.add_argument("--env", default="minigrid")
    ap.add_argument("--env-options", default=json.dumps(DEMO), help="JSON options of the env")
    ap.add_argument("--seeds", nargs=2, type=int, default=[30000, 30256], help="held-out seed range [lo, hi)")
    ap.add_argument("--goals", type=int, default=2)
    ap.add_argument("--walk", type=int, default=3)
    ap.add_argument("--system", default="Grid game.")
    ap.add_argument("--out", default=None, help="write the results as JSON")
    a = ap.parse_args(argv)
    results = [measure(p, a.env, json.loads(a.env_options), range(*a.seeds), a.goals, a.walk, a.system)
               for p in a.models]
    for r in results:
        lo, hi = r["rank_acc_ci"]
        tlo, thi = r["top1_ci"]
        print(f"{r['model']}: rank_acc {r['rank_acc']:.3f} [{lo:.3f}, {hi:.3f}]  top1_acc {r['top1_acc']:.3f} "
              f"[{tlo:.3f}, {thi:.3f}]  ({r['groups']} groups)")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
