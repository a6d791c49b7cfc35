"""EVOKE's verl bridge (:mod:`agentcredit.verl.evoke`) piece by piece: the configuration block at start-up, the agent
loop's groups (a real MiniGrid prompt rewritten under the solver's goals), the driver's stateless sampling of ranked
rows, the data-parallel share and its scale, and the worker's term on a real tiny model against an independent
scorer. The whole path in a real ``main_ppo`` run is ``tests/verl/test_verl_e2e.py::test_minigrid_gigpo_with_evoke_term``.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings, strategies as st

pytest.importorskip("verl")

from omegaconf import OmegaConf  # noqa: E402

from agentcredit.verl import evoke  # noqa: E402
from agentcredit.verl.preflight import BLOCKS, check_config  # noqa: E402
from distill_plugins.evoke import evoke_loss  # noqa: E402


def _config(block, **more):
    return OmegaConf.create({"algorithm": {"adv_estimator": "gigpo", "agentcredit_evoke": block},
                             "trainer": {"total_training_steps": 10, **more.pop("trainer", {})}, **more})


# ---- configuration --------------------------------------------------------------------------------------------------
def test_the_block_is_an_agentcredit_entry_and_gives_the_terms_params():
    assert evoke.CONFIG_KEY in BLOCKS
    p = evoke.evoke_params(OmegaConf.create({"agentcredit_evoke": {"weight": 0.5, "goals": 3, "loss": "pairwise"}}))
    assert (p.weight, p.goals, p.loss, p.states) == (0.5, 3, "pairwise", 4)
    assert evoke.evoke_params(OmegaConf.create({})) is None
    check_config(_config({"weight": 0.1}))


@pytest.mark.parametrize("block, more, words", [
    ({"weight": -1.0}, {}, "algorithm.agentcredit_evoke: term 'evoke': weight=-1.0"),
    ({"loss": "ce"}, {}, "'ce'"),
    ({"goalz": 2}, {}, "goalz"),
    (0.1, {}, "must be a mapping of the evoke term's parameters"),
    ({}, {"trainer": {"use_v1": False}}, "trainer.use_v1=true"),
    ({}, {"actor_rollout_ref": {"actor": {"fsdp_config": {"ulysses_sequence_parallel_size": 2}}}},
     "Ulysses sequence parallelism"),
])
def test_a_bad_block_fails_at_start_naming_the_key(block, more, words):
    with pytest.raises(ValueError) as e:
        check_config(_config(block, **more))
    assert words in str(e.value)


# ---- agent loop: the turn's groups ------------------------------------------------------------------------------------
def test_turn_groups_rewrite_the_real_prompt_under_each_goal():
    """A MiniGrid turn prompt as the env loop builds it: each group's prompt is that prompt with the current
    observation redrawn for the alternative goal (the history and the rest unchanged), one ``<action>a</action>``
    candidate per legal action, and the solver's values; the goal draw is a pure function of its seed."""
    import env_adapters
    from env_adapters.prompting import build_prompt
    from transformers import AutoTokenizer

    from agentcredit.models import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("tiny-qwen2"))
    env = env_adapters.make("minigrid", size=6)
    observation = env.reset(3)
    text = tok.apply_chat_template([{"role": "user", "content": build_prompt(env.task, [], observation,
                                                                             env.legal_actions(), 2)}],
                                   add_generation_prompt=True, tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
    seed = evoke.goal_seed(0, 7, "s1", 2, 0)
    assert seed == evoke.goal_seed(0, 7, "s1", 2, 0) != evoke.goal_seed(0, 7, "s1", 2, 1)
    rankings = evoke.rank_goals(env, 2, seed)
    assert [r.goal for r in rankings] == [r.goal for r in evoke.rank_goals(env, 2, seed)]
    groups = evoke.turn_groups(tok, ids, rankings)
    assert len(groups) == len(rankings) == 2
    for g, r in zip(groups, rankings):
        new = tok.decode(g["prompt"])
        assert new == r.rewrite(tok.decode(ids)) and new != tok.decode(ids)
        assert [tok.decode(a) for a in g["answers"]] == [f"<action>{a}</action>" for a in env.legal_actions()]
        assert g["values"] == list(r.values) and len(set(g["values"])) > 1


def test_rank_goals_refuses_an_env_without_the_capability():
    with pytest.raises(ValueError, match="has no goal_rankings"):
        evoke.rank_goals(SimpleNamespace(), 2, 0)


# ---- driver: the step's sampled rows ----------------------------------------------------------------------------------
def _group(v):
    return {"prompt": [1, 2], "answers": [[3], [4]], "values": v}


def test_round_groups_hand_case():
    """Rows 0-4: row 1 is padding (a copy of row 0's fields), row 3 was not ranked, row 4's second group ties.
    ``states`` 2 of the ranked non-padding rows {0, 2, 4} drawn from seed and step; the tied group is left out."""
    rows = [{evoke.FIELD: [_group([1.0, 0.5])]}, {evoke.FIELD: [_group([1.0, 0.5])]},
            {evoke.FIELD: [_group([0.2, 0.9])]}, {evoke.FIELD: []},
            {evoke.FIELD: [_group([0.3, 0.1]), _group([0.4, 0.4])]}]
    padding = [False, True, False, False, False]
    picked = sorted(random.Random(5 * 1_000_003 + 9).sample([0, 2, 4], 2))
    groups, states = evoke.round_groups(rows, padding, 2, seed=5, step=9)
    assert states == 2
    expected = [g for i in picked for g in rows[i][evoke.FIELD] if len(set(g["values"])) > 1]
    assert groups == expected
    assert evoke.round_groups(rows, padding, 2, seed=5, step=9) == (groups, 2)  # stateless: a resume draws alike
    everything, n = evoke.round_groups(rows, padding, 10, seed=5, step=9)
    assert n == 3 and [g["values"] for g in everything] == [[1.0, 0.5], [0.2, 0.9], [0.3, 0.1]]
    with pytest.raises(ValueError, match="agentcredit_env"):
        evoke.round_groups([{}, {}], [False, False], 2, seed=0, step=1)


# ---- worker: the share of each data-parallel rank ---------------------------------------------------------------------
@settings(max_examples=80, deadline=None)
@given(st.lists(st.floats(0, 20, allow_nan=False), min_size=1, max_size=30), st.integers(1, 8),
       st.floats(0, 3, allow_nan=False))
def test_rank_shares_average_to_the_weighted_mean_over_all_groups(losses, world, weight):
    """Each rank's mean loss over its share, times :func:`share_scale`, averaged over ranks (verl's data-parallel
    gradient reduction) equals ``weight`` times the mean over all groups; the shares partition the groups."""
    shares = [evoke.share_of(list(range(len(losses))), r, world) for r in range(world)]
    assert sorted(i for s in shares for i in s) == list(range(len(losses)))
    total = 0.0
    for s in shares:
        mean = sum(losses[i] for i in s) / len(s) if s else 0.0
        total += evoke.share_scale(weight, world, len(s), len(losses)) * mean
    assert total / world == pytest.approx(weight * sum(losses) / len(losses), rel=1e-9, abs=1e-12)


def test_worker_term_equals_the_independent_scorer_and_carries_gradient():
    """:func:`evoke_term` on a real tiny model (one rank: the engine's module is the HF model) returns
    ``weight * L_EVOKE`` of the candidates' summed answer log-probs at the rollout temperature, the value the TRL
    scorer (a separate implementation: plain HF forward, right-aligned logits) gives, with gradient reaching the
    weights; a rank without a share still runs the forward and adds 0."""
    from tensordict import TensorDict
    from transformers import AutoModelForCausalLM
    from verl.utils import tensordict_utils as tu

    from agentcredit.models import resolve_model
    from agentcredit.trl.evoke import score_groups

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(resolve_model("tiny-qwen2"), torch_dtype=torch.float32)
    groups = [{"prompt": [5, 6, 7, 8], "answers": [[9, 10], [11], [12, 13, 14]], "values": [1.0, 0.5, 0.25]},
              {"prompt": [15, 16], "answers": [[17], [18, 19]], "values": [0.1, 0.9]}]
    engine = SimpleNamespace(module=model, _autocast_dtype=torch.float32, get_data_parallel_group=lambda: None,
                             get_data_parallel_size=lambda: 1, get_data_parallel_rank=lambda: 0)
    micro = TensorDict({}, batch_size=[])
    tu.assign_non_tensor(micro, temperature=0.7)
    model.train()
    added, stats = evoke.evoke_term(engine, micro, groups, 0.3, "listwise")
    scores, values, mask = score_groups(model, groups, pad=0, temperature=0.7)
    expected = evoke_loss(scores, values, mask)
    assert float(added) == pytest.approx(0.3 * float(expected), rel=1e-5)
    assert stats["loss"] == pytest.approx(float(expected), rel=1e-5) and 0 <= stats["rank_acc"] <= 1
    added.backward()
    assert any(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in model.parameters())

    lonely = SimpleNamespace(**{**vars(engine), "get_data_parallel_size": lambda: 3,
                                "get_data_parallel_rank": lambda: 2})  # 2 groups, 3 ranks: rank 2 has none
    zero, _ = evoke.evoke_term(lonely, micro, groups, 0.3, "listwise")
    assert float(zero) == 0.0 and zero.requires_grad
