"""verl's own vLLM server replicas, for real: ``main_ppo`` on the CPU with ``rollout.name=vllm`` on vLLM's CPU build.

Each test is a real 2-step run of a shipped recipe through :func:`agentcredit.verl.smoke.prepare` with
``rollout="vllm"`` (``agentcredit verl RECIPE --cpu-smoke --rollout vllm``): verl starts its ``vLLMHttpServer``
replica with dummy weights and syncs the actor's into it before each step's rollout; the agent-loop workers generate
through verl's client and load balancer. The model is ``tiny-qwen2-h32`` (two heads of size 32: vLLM's CPU attention
refuses head size 16), primed to answer in the action format. Besides what ``tests/verl/test_verl_e2e.py``'s
``_check_step`` asserts for every step (rows, credit, and rollout/trainer log-probs equal to 1e-4: the synced
weights), each test checks what its loop must show on this server:

* the env loop (GiGPO) trains at learning rate 1e-2, so step 1's update moves the weights by far more than the
  log-prob tolerance (the TRL negative control in ``test_trl_vllm_cpu.py`` measures ~2.6 nats for stale weights after
  one such update), and step 2's rollout still matches the trainer: the sync after an update works; a step-1 gap
  that small also shows the first sync replaced the dummy weights;
* the tree loop (SIPO) branches through the same server;
* Guided-OPD (``sokoban_opw`` with the ``guided`` schedule, p0 = 0.5 decaying to 0 over 2 steps): the teacher is
  a second vLLM server (verl's distillation teacher pool); the turns it writes are longer than one token (verl
  builds the teacher's server for one-token prompt scoring), masked out of the loss (the policy's turns still match
  their rollout log-probs), and the teacher's prompt log-prob traffic is reported
  (``agentcredit_distill/teacher_tokens``).

These three ran on the ``hfcpu`` server before; they moved here rather than run twice (``tests/verl/test_verl_e2e.py``
keeps the other loops on ``hfcpu``).
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("verl")

from tests.verl.test_verl_e2e import SESSIONS, TASKS, _check_step, _run, workdir  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.vllm, pytest.mark.verl_e2e, pytest.mark.slow]


def test_sokoban_gigpo_env_loop_on_vllm_servers_writes_the_ross_archive(workdir):  # noqa: F811
    """Also writes the ROSS archive (``+algorithm.agentcredit_archive``): every rollout of both steps, every turn with
    its prompt and generated token ids, in the format ``agentcredit ross`` reads."""
    from distill_plugins.ross import read_archive

    archive = workdir / "rollouts.jsonl"
    overrides = ["actor_rollout_ref.actor.optim.lr=1e-2", f"+algorithm.agentcredit_archive={archive}"]
    metrics, log = _run("sokoban_gigpo", workdir, rollout="vllm", overrides=overrides)
    assert "vLLMHttpServer" in log and "hfcpu" not in log.lower()
    for step in (1, 2):
        _check_step(metrics[step], nonzero_adv=step == 1)
        assert metrics[step]["agentcredit/archived_trajectories"] == metrics[step]["agentcredit/trajectories"]
    assert metrics[1]["actor/grad_norm"] > 0  # the update before step 2's rollout moved the weights
    print({s: {k: v for k, v in m.items() if k.startswith(("training/rollout_probs", "timing_s/"))}
           for s, m in metrics.items()})
    archived = list(read_archive(archive))
    assert [a.step for a in archived] == [1] * (TASKS * SESSIONS) + [2] * (TASKS * SESSIONS)
    assert sum(len(a.turns) for a in archived if a.step == 1) == metrics[1]["agentcredit/steps"]
    assert all(a.source == "verl" and a.turns[0].prompt_ids and a.turns[0].completion_ids for a in archived)
    assert all(u.t == k for a in archived for k, u in enumerate(a.turns))


def test_sokoban_sipo_tree_loop_on_vllm_servers(workdir):  # noqa: F811
    metrics, _ = _run("sokoban_sipo", workdir, rollout="vllm")
    for step in (1, 2):
        m = metrics[step]
        # one tree per task (rollout.n=1): 2 initial chains + 1 x 2 forks = 4 leaves per task; rows = tree nodes,
        # whose count verl may pad to its batch multiple
        _check_step(m, trajectories=None, exact_rows=False, padding=True)
        assert m["agentcredit/steps"] >= TASKS * 4
    print({s: {k: v for k, v in m.items() if k.startswith(("training/rollout_probs", "timing_s/", "agentcredit/steps",
                                                            "agentcredit/padding"))} for s, m in metrics.items()})


def test_guided_opd_teacher_turns_on_a_vllm_teacher_server(workdir):  # noqa: F811
    overrides = ["algorithm.agentcredit_distill.schedule=guided", "~algorithm.agentcredit_distill.params",
                 "+algorithm.agentcredit_distill.params={p0:0.5,decay_steps:2}"]
    metrics, log = _run("sokoban_opw", workdir, rollout="vllm", overrides=overrides)
    assert "hfcpu" not in log.lower()
    shown = {s: {k: v for k, v in m.items() if "guided" in k or "distill" in k or "teacher" in k or "timing" in k}
             for s, m in metrics.items()}
    print(shown)
    share = [metrics[s]["agentcredit/guided_teacher_turns"] for s in (1, 2)]
    assert 0.0 < share[0] < 1.0 and 0.0 <= share[1] < 1.0, shown    # p = 0.5, then 0.25
    for m in metrics.values():
        _check_step(m, nonzero_adv=False)  # the policy's turns: synced log-probs (teacher turns are masked out)
        assert m["agentcredit_distill/teacher_rows"] == m["agentcredit/steps"], shown
        # the teacher's prompt log-prob traffic: every row's prompt and response, scored once
        assert m["agentcredit_distill/teacher_tokens"] > m["agentcredit/steps"] * 16, shown
        assert m["actor/grad_norm"] > 0.0, shown
        if m["agentcredit/guided_teacher_turns"] > 0:
            assert m["agentcredit/guided_teacher_tokens"] > 1, shown  # a whole turn, not verl's one scoring token
    # step 1's update left finite weights: step 2's policy still matches its rollout log-probs. (verl's logged loss
    # values can be NaN here: a micro-batch of teacher turns only has no token for their normaliser.)
    assert math.isfinite(metrics[2]["actor/ppo_kl"]) and abs(metrics[2]["actor/ppo_kl"]) < 1e-2, shown
