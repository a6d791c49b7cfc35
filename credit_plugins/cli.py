"""``agentcredit`` command line: ``list`` and ``describe NAME``."""

from __future__ import annotations

import argparse
import sys

from . import registry

KINDS = ("estimators", "schedulers", "envs")


def _cmd_list(args: argparse.Namespace) -> int:
    kinds = KINDS if args.kind == "all" else (args.kind,)
    for kind in kinds:
        items = registry.collect(kind)
        print(f"{kind}:")
        if not items:
            print("  (none registered)")
        for name in sorted(items):
            item, provider = items[name]
            summary = getattr(item, "paper", "") or (getattr(item, "__doc__", "") or "").strip().split("\n")[0]
            print(f"  {name:<12} {summary}  [{provider}]")
    return 0


def _cmd_describe(args: argparse.Namespace) -> int:
    for kind in KINDS:
        items = registry.collect(kind)
        if args.name in items:
            item = items[args.name][0]
            print(item.describe() if hasattr(item, "describe") else (item.__doc__ or args.name))
            print(f"\nprovided by {items[args.name][1]}")
            return 0
    known = sorted(n for k in KINDS for n in registry.collect(k))
    print(f"agentcredit: unknown name {args.name!r}; known: {known}", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentcredit", description="Credit-assignment and distillation plugins "
                                     "for verl and TRL agent RL.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("list", help="list the registered estimators, schedulers and environments")
    p.add_argument("kind", nargs="?", default="all", choices=("all",) + KINDS)
    p.set_defaults(func=_cmd_list)
    p = sub.add_parser("describe", help="paper, formula, parameters and required fields of one estimator")
    p.add_argument("name")
    p.set_defaults(func=_cmd_describe)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
