"""Every ``agentcredit`` subcommand names itself in its errors (``agentcredit verl: error: ...``, never another
command's name), on one line of stderr with exit code 2."""

from pathlib import Path

import pytest

from agentcredit import cli

ROOT = Path(__file__).resolve().parents[1]
TRL_RECIPE = str(ROOT / "recipes" / "trl" / "minigrid_gigpo.yaml")
COMMANDS = ("list", "describe", "train", "sft", "ross", "verl", "compare", "robustness")


def _error_of(capsys, argv: list[str]) -> str:
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    return err


@pytest.mark.parametrize("command, argv", [
    ("train", ["train", "MISSING.yaml"]),
    ("train", ["train", "MISSING.yaml", "--bogus"]),
    ("sft", ["sft", "MISSING.yaml", "--out", "OUT"]),
    ("sft", ["sft", "MISSING.yaml", "--out", "OUT", "notakeyvalue"]),
    ("sft", ["sft", TRL_RECIPE, "--out", "OUT", "--player", "bogus"]),
    ("compare", ["compare", "MISSING.yaml", "--credit", "grpo", "--seeds", "2"]),
    ("compare", ["compare", TRL_RECIPE, "--credit", "grpo", "--seeds", "0"]),
    ("robustness", ["robustness", "MISSING.yaml", "--checkpoint", "X"]),
    ("ross", ["ross", "MISSING.yaml", "--archive", "a.jsonl", "--out", "OUT"]),
    ("verl", ["verl", "MISSING.yaml"]),
    ("verl", ["verl", "MISSING.yaml", "--cpu-smoke"]),
    ("verl", ["verl", TRL_RECIPE]),
    ("describe", ["describe", "nope"]),
    ("list", ["list", "all", "extra"]),
])
def test_each_subcommand_names_itself_in_its_errors(capsys, command, argv):
    err = _error_of(capsys, argv)
    assert err.startswith(f"agentcredit {command}: error: "), err
    others = [c for c in COMMANDS if c != command and f"agentcredit {c}:" in err]
    assert not others, err


def test_verl_refuses_a_trl_recipe_naming_the_command_that_runs_it(capsys):
    err = _error_of(capsys, ["verl", TRL_RECIPE])
    assert "not a verl (Hydra) recipe" in err and f"agentcredit train {TRL_RECIPE}" in err


def test_verl_smoke_set_up_errors_are_one_line_of_the_verl_command(capsys, monkeypatch, tmp_path):
    from agentcredit.verl import smoke

    def no_loop(*a, **k):
        raise ValueError("x.yaml: actor_rollout_ref.rollout.agent.agent_loop_config_path is not set")

    monkeypatch.setattr(smoke, "prepare", no_loop)
    recipe = next((ROOT / "recipes" / "verl").glob("*.yaml"))
    err = _error_of(capsys, ["verl", str(recipe), "--cpu-smoke", "--workdir", str(tmp_path)])
    assert err == "agentcredit verl: error: x.yaml: actor_rollout_ref.rollout.agent.agent_loop_config_path is not set"
