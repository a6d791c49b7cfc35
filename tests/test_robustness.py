"""``agentcredit robustness`` (:mod:`agentcredit.robustness`): the grid and checkpoint checks that fail before any model
loads, and one tiny real run (the tiny model, three held-out episodes, a noise and a quantisation cell)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("trl")

from agentcredit import cli, robustness  # noqa: E402
from agentcredit.recipe import RecipeError  # noqa: E402

RECIPE = str(Path(__file__).resolve().parents[1] / "recipes" / "trl" / "minigrid_sprpo.yaml")
FEW = ["agentcredit.eval.seeds=[20000,20003]", "agentcredit.max_turns=2", "agentcredit.warm_start=null",
       "per_device_train_batch_size=16"]


def test_grid_defaults_and_given_scales():
    assert robustness.parse_grid("quant") == [("quant", 8), ("quant", 4)]
    assert robustness.parse_grid("noise,prune", ["0.2", "prune=0.5,0.25"]) == [
        ("noise", 0.2), ("prune", 0.5), ("prune", 0.25)]


@pytest.mark.parametrize("types, scales, words", [
    ("noise,blur", None, "unknown perturbation type(s) ['blur']"),
    ("", None, "unknown perturbation type"),
    ("noise", ["0"], "noise scale 0 is out of range; noise takes 0 < scale <= 10"),
    ("prune", ["1.0"], "prune scale 1 is out of range"),
    ("quant", ["4.5"], "quant scale 4.5 is out of range; quant takes an integer bit width in [2, 16]"),
    ("quant", ["1"], "quant scale 1 is out of range"),
    ("noise", ["a,b"], "not a comma-separated list of numbers"),
    ("noise", ["quant=4"], "'quant' is not one of the --types"),
    ("noise", ["noise="], "no scale given"),
])
def test_bad_grids_are_recipe_errors(types, scales, words):
    with pytest.raises(RecipeError) as e:
        robustness.parse_grid(types, scales)
    assert words in str(e.value)


def test_resolve_policy_prefers_final_then_the_folder_then_the_latest_checkpoint(tmp_path):
    with pytest.raises(RecipeError, match="no such folder"):
        robustness.resolve_policy(str(tmp_path / "nope"))
    with pytest.raises(RecipeError, match="holds no model"):
        robustness.resolve_policy(str(tmp_path))
    for sub in ("checkpoint-2", "checkpoint-10"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "config.json").write_text("{}")
        (tmp_path / sub / "trainer_state.json").write_text("{}")
    assert robustness.resolve_policy(str(tmp_path)) == tmp_path / "checkpoint-10"
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "config.json").write_text("{}")
    assert robustness.resolve_policy(str(tmp_path)) == tmp_path / "final"


@pytest.mark.parametrize("argv, words", [
    (["--checkpoint", "/nonexistent/run"], "--checkpoint '/nonexistent/run': no such folder"),
    (["--checkpoint", ".", "--types", "noise,jpeg"], "unknown perturbation type(s) ['jpeg']"),
    (["--checkpoint", ".", "--types", "prune", "--scales", "2"], "prune scale 2 is out of range"),
    (["--checkpoint", ".", "--seeds", "0"], "--seeds must be a positive integer"),
])
def test_cli_errors_come_before_any_model(argv, words, capsys):
    assert cli.main(["robustness", RECIPE, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("agentcredit robustness: error:") and words in err


def test_a_recipe_without_eval_is_refused_before_the_model_loads(tmp_path, capsys):
    from agentcredit.models import resolve_model

    assert cli.main(["robustness", RECIPE, "agentcredit.eval=null", "--checkpoint", resolve_model("tiny-qwen2")]) == 2
    assert "no agentcredit.eval block" in capsys.readouterr().err


def test_an_advisor_without_its_executor_is_refused_before_the_model_loads(capsys, monkeypatch):
    """A trained advisd advisor is evaluated advising its executor: without the executor's path there is nothing to
    measure, so the command stops before any model loads and names the key."""
    from agentcredit import policy
    from agentcredit.models import resolve_model

    monkeypatch.setattr(policy, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    model = resolve_model("tiny-qwen2")
    assert cli.main(["robustness", "recipes/trl/minigrid_advisd.yaml", "--checkpoint", model]) == 2
    assert "agentcredit.terms.advisd.executor=PATH" in capsys.readouterr().err


def test_a_tiny_real_run_writes_the_table_and_the_json(tmp_path, capsys):
    from agentcredit.models import resolve_model

    out = tmp_path / "rob.json"
    rc = cli.main(["robustness", RECIPE, *FEW, "--checkpoint", resolve_model("tiny-qwen2"), "--types", "noise,quant",
                   "--scales", "noise=0.5", "--scales", "quant=4", "--seeds", "2", "--out", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    cells = result["cells"]
    assert [(c["kind"], c["scale"], c["draws"], c["episodes"]) for c in cells] == [
        ("clean", None, 1, 3), ("noise", 0.5, 2, 6), ("quant", 4, 1, 3)]
    for c in cells:
        lo, hi = c["success_ci"]
        assert 0 <= lo <= c["success_rate"] <= hi <= 1 and c["successes"] == round(c["success_rate"] * c["episodes"])
        assert c["delta"] == pytest.approx(c["success_rate"] - cells[0]["success_rate"])
    table = capsys.readouterr().out
    assert "perturbation" in table and "noise" in table and "quant" in table and str(out) in table
