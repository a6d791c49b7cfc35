"""agentcredit.vllm_cpu's patches that need no vLLM: verl's version alias and the engine defaults (the patches of
vLLM's own code are tested on the real build in tests/vllm/test_vllm_cpu_patches.py)."""

from __future__ import annotations

import importlib.metadata
import types
from pathlib import Path

import pytest

from agentcredit import vllm_cpu

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "verl" / "sokoban_gigpo.yaml"


@pytest.fixture
def cpu_build(monkeypatch):
    """Pretend the CPU build is installed: a ``vllm-cpu`` distribution 0.31.0 and no ``vllm`` one."""
    versions = {"vllm": None, "vllm-cpu": "0.31.0"}
    monkeypatch.setattr(vllm_cpu, "_dist_version", lambda name: versions.get(name, "1.0"))
    monkeypatch.setattr(importlib.metadata, "version", importlib.metadata.version)  # restored after the test
    return versions


def test_verl_sees_the_cpu_builds_version_for_vllm_only(cpu_build, monkeypatch):
    original = importlib.metadata.version
    assert vllm_cpu.alias_vllm_version() is True
    version = importlib.metadata.version
    assert version("vllm") == "0.31.0+cpu"  # what vLLM itself calls its CPU build
    assert version("pluggy") == original("pluggy")
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        version("surely-not-installed-xyz")
    assert vllm_cpu.alias_vllm_version() is False and importlib.metadata.version is version  # idempotent
    from packaging.version import Version

    assert Version(version("vllm")) >= Version("0.18.0")  # verl 0.9.1's floor


def test_no_alias_without_the_cpu_build_or_beside_the_cuda_build(cpu_build):
    before = importlib.metadata.version
    cpu_build["vllm-cpu"] = None
    assert vllm_cpu.alias_vllm_version() is False
    cpu_build["vllm-cpu"], cpu_build["vllm"] = "0.31.0", "0.31.0"
    assert vllm_cpu.alias_vllm_version() is False
    assert importlib.metadata.version is before


def test_the_alias_refuses_a_verl_that_reads_the_version_another_way(cpu_build, monkeypatch, tmp_path):
    pkg = tmp_path / "verl"
    (pkg / "third_party" / "vllm").mkdir(parents=True)
    (pkg / "third_party" / "vllm" / "__init__.py").write_text("vllm_version = detect()\n")
    spec = types.SimpleNamespace(submodule_search_locations=[str(pkg)])
    monkeypatch.setattr(vllm_cpu.importlib.util, "find_spec", lambda name: spec)
    before = importlib.metadata.version
    with pytest.raises(vllm_cpu.VLLMInternalsChanged, match="package_name"):
        vllm_cpu.alias_vllm_version()
    assert importlib.metadata.version is before


def test_the_installed_verl_reads_the_version_as_the_alias_expects():
    verl = pytest.importorskip("verl")
    text = (Path(verl.__path__[0]) / "third_party" / "vllm" / "__init__.py").read_text()
    assert all(line in text for line in vllm_cpu.VERL_VERSION_LINES)


def test_engine_defaults_fill_what_the_caller_left_out(cpu_build):
    calls = []
    module = types.SimpleNamespace(__name__="fake_trl_module", LLM=lambda *a, **kw: calls.append((a, kw)) or "llm")
    assert vllm_cpu.engine_defaults(module) is True
    assert module.LLM(model="m") == "llm"
    assert calls[-1] == ((), {"model": "m", **vllm_cpu.ENGINE_KWARGS})
    module.LLM(model="m", dtype="bfloat16")  # the caller's choice wins
    assert calls[-1][1]["dtype"] == "bfloat16" and calls[-1][1]["enforce_eager"] is True
    assert vllm_cpu.engine_defaults(module) is False  # idempotent


def test_engine_defaults_do_nothing_without_the_cpu_build_and_refuse_a_missing_factory(cpu_build):
    cpu_build["vllm-cpu"] = None
    module = types.SimpleNamespace(__name__="m", LLM=object)
    assert vllm_cpu.engine_defaults(module) is False and module.LLM is object
    cpu_build["vllm-cpu"] = "0.31.0"
    with pytest.raises(vllm_cpu.VLLMInternalsChanged, match="LLM"):
        vllm_cpu.engine_defaults(types.SimpleNamespace(__name__="m"))


def test_smoke_refuses_a_vllm_rollout_without_the_cpu_build_before_any_work(tmp_path, monkeypatch):
    from agentcredit.verl import smoke

    monkeypatch.setattr(vllm_cpu, "cpu_build_installed", lambda: False)
    with pytest.raises(ValueError, match="scripts/vllm-cpu-env.sh"):
        smoke.prepare(RECIPE, tmp_path / "w", rollout="vllm")
    assert not (tmp_path / "w").exists()
    with pytest.raises(ValueError, match="rollout='sglang'"):
        smoke.prepare(RECIPE, tmp_path / "w", rollout="sglang")
