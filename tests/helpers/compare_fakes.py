"""A stand-in for the subprocesses of ``agentcredit compare`` (``agentcredit train``, ``agentcredit sft``, the start's
evaluation): it writes the files each one writes, from a table of outcomes, without a model."""

from __future__ import annotations

import json
from pathlib import Path

from agentcredit import compare


class Done:
    """A finished child process."""

    def __init__(self, rc: int):
        self.rc = rc

    def poll(self):
        return self.rc

    def send_signal(self, sig):
        pass

    def kill(self):
        pass

    def wait(self):
        return self.rc


def kv(argv):
    return dict(a.split("=", 1) for a in argv if "=" in a and not a.startswith("-"))


class FakeTrain:
    """Stands in for the subprocesses: writes what ``agentcredit train`` (or the start's evaluation, or
    ``agentcredit sft``) writes. ``wins[(method, seed)]`` is the held-out successes of 8 episodes; the training curve
    is ``curve[(method, seed)]`` (default: 0.1 per step). ``fail`` holds the runs that exit 1; ``interrupt_at`` the
    call that raises KeyboardInterrupt (as a Ctrl-C while it starts)."""

    def __init__(self, wins=None, curve=None, fail=(), interrupt_at=None):
        self.wins, self.curve, self.fail, self.interrupt_at = wins or {}, curve or {}, set(fail), interrupt_at
        self.calls = []

    def __call__(self, argv, env, log):
        self.calls.append(list(argv))
        if self.interrupt_at is not None and len(self.calls) == self.interrupt_at:
            raise KeyboardInterrupt
        if argv[1] == "evaluate-start":
            compare.write_json(Path(argv[2]) / compare.RESULT_FILE, {"kind": "eval", "model": "tiny-qwen2", "eval": {
                "success_rate": 0.25, "success_ci": [0.07, 0.59], "n_episodes": 8}})
            return Done(0)
        if argv[1] == "sft":
            out = Path(argv[argv.index("--out") + 1])
            out.mkdir(parents=True)
            (out / "config.json").write_text("{}")
            flags = {k: argv[argv.index(f"--{k.replace('_', '-')}") + 1] for k in ("steps", "batch_size",
                                                                                    "learning_rate", "episodes")}
            flags = {k: float(v) if k == "learning_rate" else int(v) for k, v in flags.items()}
            (out / "sft_summary.json").write_text(json.dumps({"eval": {"success_rate": 0.5, "n_episodes": 8},
                                                              **flags}))
            return Done(0)
        args = kv(argv)
        out, method, seed = Path(args["output_dir"]), args["agentcredit.credit"], int(args["seed"])
        steps = int(args["max_steps"])
        if (method, seed) in self.fail:
            return Done(1)
        k = self.wins.get((method, seed), 4)
        with open(out / "eval_episodes.jsonl", "w") as f:
            for i in range(8):
                f.write(json.dumps({"phase": "after", "seed": 20000 + i, "success": i < k}) + "\n")
        curve = self.curve.get((method, seed), [0.1 * t for t in range(1, steps + 1)])
        with open(out / "metrics.jsonl", "w") as f:
            for t, v in enumerate(curve, 1):
                f.write(json.dumps({"step": t, "agentcredit/success": v}) + "\n")
        (out / "summary.json").write_text(json.dumps({
            "status": "finished", "steps": steps, "after": {"success_rate": k / 8, "n_episodes": 8, "valid_rate": 1.0},
            "wall_seconds": 1.0, "train_seconds": 0.5}))
        return Done(0)

    def runs(self):
        return [(kv(a)["agentcredit.credit"], int(kv(a)["seed"])) for a in self.calls if a[1] == "train"]
