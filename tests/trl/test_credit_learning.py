"""benchmarks/credit_learning.py is the warm start plus ``agentcredit compare --init``: its --quick mode on stand-in
subprocesses (the real runs are tests/trl/test_compare.py's)."""

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("trl")

from agentcredit import compare  # noqa: E402
from tests.helpers.compare_fakes import FakeTrain, kv  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("credit_learning", ROOT / "benchmarks" / "credit_learning.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_quick_makes_the_warm_start_once_and_starts_every_run_from_it(monkeypatch, tmp_path):
    cl = _load()
    fake = FakeTrain(wins={("grpo", 0): 2, ("gigpo", 0): 3})
    monkeypatch.setattr(compare, "launch", fake)
    work, out = tmp_path / "work", tmp_path / "cl.json"
    assert cl.main(["--quick", "--workdir", str(work), "--out", str(out)]) == 0
    sft, start, *runs = fake.calls
    assert sft[1] == "sft" and sft[sft.index("--steps") + 1] == "2" and sft[sft.index("--out") + 1] == str(
        work / "warm_start")
    assert start[1] == "evaluate-start" and f"model_name_or_path={work / 'warm_start'}" in start
    assert fake.runs() == [("grpo", 0), ("gigpo", 0)]
    for argv in runs:
        k = kv(argv)
        assert k["model_name_or_path"] == str(work / "warm_start") and k["max_steps"] == "1"
        assert k["agentcredit.groups_per_step"] == "1" and k["agentcredit.eval.seeds"] == "[20000,20004]"
    res = json.loads(out.read_text())
    assert [r["method"] for r in res["table"]] == ["grpo", "gigpo"]
    assert [r["per_seed"] for r in res["table"]] == [{"0": 0.25}, {"0": 0.375}]
    assert res["table"][1]["diff_vs_first"]["mean"] == pytest.approx(0.125)
    assert out.with_suffix(".png").stat().st_size > 10_000
    again = FakeTrain()
    monkeypatch.setattr(compare, "launch", again)
    assert cl.main(["--quick", "--workdir", str(work), "--out", str(out)]) == 0
    assert again.calls == []  # the warm start and every run are reused


def test_bad_settings_stop_before_the_warm_start(monkeypatch, tmp_path):
    cl = _load()
    fake = FakeTrain()
    monkeypatch.setattr(compare, "launch", fake)
    with pytest.raises(SystemExit, match="'nope' is not a registered estimator"):
        cl.main(["--quick", "--methods", "grpo,nope", "--workdir", str(tmp_path / "w")])
    assert fake.calls == []
