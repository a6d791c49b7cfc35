#!/usr/bin/env python
"""Write train/val parquet files whose rows are environment episodes for the ``agentcredit_env`` agent loop.

    python recipes/verl/make_env_dataset.py --env sokoban --train 256 --val 64 --out ~/data/agentcredit/sokoban
    python recipes/verl/make_env_dataset.py --env sokoban --train 256 --val 64 --out DIR size=6 num_boxes=1
    python recipes/verl/make_env_dataset.py --env alfworld --train 3200 --val 128 --out ~/data/agentcredit/alfworld \\
        --val-options split=valid_unseen

One row = one episode (one prompt of verl's RLHFDataset); verl plays it ``actor_rollout_ref.rollout.n`` times, and the
n sessions of a row share its ``seed`` and options, so they start from the same state (one GiGPO / GraphHCA group).
Columns (``agentcredit/verl/agent_loop.py`` documents what the loop reads):

    data_source   "agentcredit/<env>"                      (verl's metrics are grouped by it)
    prompt        chat messages (RLHFDataset's prompt_key); verl copies it to ``raw_prompt``; the loop uses only its
                  ``system`` messages (``--system TEXT``) and builds each turn's user message from the env
    ability       "agent"
    reward_model  {"style": "env", "ground_truth": ""}      (unused: the loop returns the episode return as the score)
    extra_info    {"split", "index", "env_name", "seed"}
    agent_name    "agentcredit_env" (--agent-name)          (verl picks the loop per row by this column)
    env_name      the env_adapters name
    seed          distinct per row (train rows 0.., val rows start at --val-seed-offset)
    env_options   dict of the key=value options (only when some are given: parquet cannot store an empty struct;
                  the agent-loop config file's env_options apply underneath)
    max_steps     only with --max-steps (else the agent-loop config file's max_steps)

Values of key=value options are parsed as YAML scalars/lists (``num_boxes=2`` -> 2, ``task_types=[1,2]``).
"""

from __future__ import annotations

import argparse
import os
import sys

AGENT_NAME = "agentcredit_env"


def parse_options(items: list[str]) -> dict:
    import yaml

    options = {}
    for item in items or []:
        if "=" not in item:
            raise SystemExit(f"option {item!r} is not key=value")
        key, value = item.split("=", 1)
        options[key.strip()] = yaml.safe_load(value) if value != "" else None
    return options


def make_rows(env: str, n: int, split: str, seed0: int, options: dict, max_steps: int | None,
              system: str | None, agent_name: str = AGENT_NAME) -> list[dict]:
    rows = []
    for i in range(n):
        seed = seed0 + i
        prompt = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": f"Play one {env} episode (seed {seed})."}]
        row = {
            "data_source": f"agentcredit/{env}",
            "prompt": prompt,
            "ability": "agent",
            "reward_model": {"style": "env", "ground_truth": ""},
            "extra_info": {"split": split, "index": i, "env_name": env, "seed": seed},
            "agent_name": agent_name,
            "env_name": env,
            "seed": seed,
        }
        if options:
            row["env_options"] = dict(options)
        if max_steps is not None:
            row["max_steps"] = int(max_steps)
        rows.append(row)
    return rows


def write(rows: list[dict], path: str) -> None:
    import pandas as pd

    pd.DataFrame(rows).to_parquet(path, index=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--env", required=True, help="env_adapters name (sokoban, alfworld, minigrid, textworld)")
    ap.add_argument("--train", type=int, default=256, help="train episodes (rows)")
    ap.add_argument("--val", type=int, default=64, help="validation episodes (rows)")
    ap.add_argument("--out", required=True, help="output folder (train.parquet, val.parquet)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the first train row")
    ap.add_argument("--val-seed-offset", type=int, default=1_000_000, help="seed of the first val row")
    ap.add_argument("--max-steps", type=int, default=None, help="per-row step limit column")
    ap.add_argument("--system", default=None, help="system message prepended to every turn")
    ap.add_argument("--val-options", nargs="*", default=[], metavar="KEY=VALUE",
                    help="env options of the val rows only, over the shared ones (e.g. split=valid_unseen)")
    ap.add_argument("--agent-name", default=AGENT_NAME,
                    help="agent loop of every row: agentcredit_env (default), agentcredit_counterfactual (ASCT) or "
                         "agentcredit_tree (SIPO, AT2PO, TreeRL)")
    ap.add_argument("--check", action="store_true", help="build the env with the options and reset it once")
    ap.add_argument("options", nargs="*", metavar="KEY=VALUE", help="env options of every row")
    args = ap.parse_args(argv)

    import env_adapters

    if args.env not in env_adapters.available():
        raise SystemExit(f"unknown env {args.env!r}; available: {env_adapters.available()}")
    options = parse_options(args.options)
    val_options = {**options, **parse_options(args.val_options)}
    if args.check:
        env_adapters.make(args.env, **options).reset(args.seed)

    out = os.path.expanduser(args.out)
    os.makedirs(out, exist_ok=True)
    train = make_rows(args.env, args.train, "train", args.seed, options, args.max_steps, args.system,
                      args.agent_name)
    val = make_rows(args.env, args.val, "val", args.val_seed_offset, val_options, args.max_steps, args.system,
                    args.agent_name)
    write(train, os.path.join(out, "train.parquet"))
    write(val, os.path.join(out, "val.parquet"))
    print(f"wrote {len(train)} train / {len(val)} val {args.env} episodes to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
