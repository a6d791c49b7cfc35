"""AdviSD on TRL (agentcredit.trl.advisd): one real GRPOTrainer step on the tiny model where the policy advises a
frozen executor: the rows train the advice, the executor reads it and stays frozen, the influence and selection are
the pure core's on the recorded responses, the distillation term enters the loss with its weight; refusals."""

import math

import pytest
import torch

pytest.importorskip("trl")

from agentcredit.trl.advisd import AdvisedTurn, padded_batch, score_completions  # noqa: E402
from distill_plugins.advisd import advice_influence, advisd_loss, select_count  # noqa: E402
from tests.helpers.trl_runs import turn_rollout_trainer  # noqa: E402


def _advisd_trainer(advisd: dict, output_dir, **kwargs):
    from trl import GRPOTrainer

    from agentcredit.trl import make_trainer

    rounds = []

    class Spy(make_trainer(GRPOTrainer, credit="grpo", terms={"advisd": advisd})):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            episodes = self._advisd_rollout.last_episodes
            rounds.append({"episodes": episodes, "chunks": [[dict(d) for d in c] for c in self._advisd_chunks],
                           "rows": out})
            return out

    kwargs.setdefault("max_completion_length", 6)
    trainer = turn_rollout_trainer(Spy, str(output_dir), **kwargs)
    return trainer, rounds


def _logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


def test_advisd_one_grpo_step_advises_a_frozen_executor_and_adds_the_selective_term(tmp_path):
    params = {"weight": 1.0, "fraction": 0.5, "advice_tokens": 5}
    trainer, rounds = _advisd_trainer(params, tmp_path / "w1")
    executor = trainer._advisd_executor
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    (r,) = rounds
    turns = [tr for ep in r["episodes"] for tr in ep.turns]
    assert turns and all(isinstance(tr, AdvisedTurn) for tr in turns)
    tok = trainer.processing_class
    for tr in turns:
        # the row trains the advice (at most advice_tokens), not the executor's answer
        assert 1 <= len(tr.completion_ids) <= 5 and tr.response.startswith("<action>")
        # the executor read the user message plus the advice; the advisor's prompt holds the ask, not the advice
        exec_text = tok.decode(tr.exec_with_ids)
        assert tr.user in exec_text and f"Advice: {tr.advice}" in exec_text
        assert "Advice:" not in tok.decode(tr.exec_without_ids) and tr.user in tok.decode(tr.exec_without_ids)
        assert "You advise the player" in tok.decode(tr.prompt_ids)
    # the executor stayed frozen (the copy of the starting weights) while the advisor trained
    ex = executor.state_dict()
    assert all(torch.equal(ex[k], before[k]) for k in before)
    assert any(not torch.equal(v, before[k]) for k, v in trainer.model.state_dict().items())
    assert not any(p.requires_grad for p in executor.parameters())

    # selection: exactly ceil(fraction * n) decisions, the largest influences recomputed independently
    n = len(turns)
    chosen = [d for c in r["chunks"] for d in c]
    assert _logged(trainer, "agentcredit_advisd/decisions") == [float(n)]
    assert len(chosen) == select_count(n, 0.5)
    assert _logged(trainer, "agentcredit_advisd/selected_frac")[0] == pytest.approx(len(chosen) / n)
    pad = tok.pad_token_id
    model0 = type(trainer.model).from_pretrained(trainer.model.name_or_path)  # the weights the round scored with
    model0.eval()
    lw, mask = score_completions(model0, [(tr.exec_with_ids, tr.exec_response_ids) for tr in turns], pad)
    lo, _ = score_completions(model0, [(tr.exec_without_ids, tr.exec_response_ids) for tr in turns], pad)
    infl = advice_influence(lw, lo, mask)
    assert float(infl.max()) > 0
    top = sorted(infl.tolist(), reverse=True)[:len(chosen)]
    assert sorted(d["influence"] for d in chosen) == pytest.approx(sorted(top), abs=1e-4)
    assert _logged(trainer, "agentcredit_advisd/influence")[0] == pytest.approx(float(infl.mean()), abs=1e-4)
    # the teacher prompt is the advisor prompt plus the episode's outcome feedback
    for d in chosen:
        assert "Feedback on this episode" in tok.decode(d["teacher_prompt"])
        assert "Feedback" not in tok.decode(d["prompt"])

    term = _logged(trainer, "agentcredit_advisd/loss")[0]
    assert math.isfinite(term) and term > 0
    # an independent L_SD of the chosen decisions under the starting weights matches the logged one
    s_ids, s_att, amask = padded_batch([(d["prompt"], d["advice"]) for d in chosen], pad)
    t_ids, t_att, _ = padded_batch([(d["teacher_prompt"], d["advice"]) for d in chosen], pad)
    k = amask.size(1)
    with torch.no_grad():
        s = model0(input_ids=s_ids, attention_mask=s_att).logits[:, -k - 1:-1]
        t = model0(input_ids=t_ids, attention_mask=t_att).logits[:, -k - 1:-1]
    assert float(advisd_loss(s, t, amask, torch.ones(len(chosen), dtype=torch.bool))) == pytest.approx(term, rel=1e-3)

    # weight 0: same rollout and selection (seeded), the term measured only; the losses differ by exactly the term
    t0, r0 = _advisd_trainer({**params, "weight": 0.0}, tmp_path / "w0")
    t0.train()
    assert [tr.completion_ids for ep in r0[0]["episodes"] for tr in ep.turns] == [tr.completion_ids for tr in turns]
    assert _logged(t0, "agentcredit_advisd/loss")[0] == pytest.approx(term, rel=1e-5)
    assert _logged(trainer, "loss")[0] - _logged(t0, "loss")[0] == pytest.approx(term, rel=1e-3)


def test_advisd_refuses_what_it_cannot_run(tmp_path):
    from trl import GRPOTrainer

    from agentcredit.trl import make_trainer

    cls = make_trainer(GRPOTrainer, credit="grpo", terms={"advisd": {}})
    with pytest.raises(ValueError, match="TurnRollout"):
        cls(model="unused", reward_funcs=[], args=None)
    with pytest.raises(ValueError, match="prompt: compact"):
        turn_rollout_trainer(cls, str(tmp_path), rollout_options={"prompt": "verl-agent"})
    with pytest.raises(ValueError, match="fraction"):
        make_trainer(GRPOTrainer, credit="grpo", terms={"advisd": {"fraction": 2.0}})
    # executor: a second local model, loaded frozen (not the policy's copy)
    named = turn_rollout_trainer(make_trainer(GRPOTrainer, credit="grpo", terms={"advisd": {"executor": "tiny-qwen2"}}),
                                 str(tmp_path / "named"))
    ex = named._advisd_executor
    assert ex is not named.model and not ex.training and not any(p.requires_grad for p in ex.parameters())


def test_advisd_is_stateless_across_resume(tmp_path):
    """Nothing to checkpoint: a resumed run's executor is the starting weights (not the checkpoint's) and its random
    draw (seeded by seed + global_step) picks what the uninterrupted run picked at that step."""
    import os

    opts = dict(save_strategy="steps", save_steps=1, max_steps=2, learning_rate=1e-3)
    params = {"mode": "random", "fraction": 0.3, "advice_tokens": 4, "seed": 5}
    full, full_rounds = _advisd_trainer(params, tmp_path / "full", **opts)
    start = {k: v.clone() for k, v in full.model.state_dict().items()}
    full.train()
    assert len(full_rounds) == 2
    assert not any(f.startswith("agentcredit_advisd") for f in os.listdir(tmp_path / "full" / "checkpoint-1"))
    resumed, resumed_rounds = _advisd_trainer(params, tmp_path / "resumed", **opts)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-1"))
    assert len(resumed_rounds) == 1

    def picked(r):
        return [(d["advice"], d["prompt"]) for c in r["chunks"] for d in c]

    assert picked(resumed_rounds[0]) == picked(full_rounds[1])
    assert picked(full_rounds[0]) != picked(full_rounds[1])
    ex = resumed._advisd_executor.state_dict()
    assert all(torch.equal(ex[k], start[k]) for k in start)
    assert any(not torch.equal(ex[k], v) for k, v in resumed.model.state_dict().items())


def test_evaluate_advisor_plays_held_out_episodes_with_the_executor_acting():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentcredit.models import resolve_model
    from agentcredit.trl.advisd import evaluate_advisor
    from agentcredit.trl.generation import HFGenerator, TurnSampling

    path = resolve_model("tiny-qwen2")
    tok = AutoTokenizer.from_pretrained(path)
    executor = AutoModelForCausalLM.from_pretrained(path)
    advisor = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():  # a different advisor: its own greedy answers differ from the executor's
        for prm in advisor.parameters():
            prm.add_(0.05 * torch.randn(prm.shape, generator=torch.Generator().manual_seed(0)))
    advisor.train()
    kw = dict(params={"advice_tokens": 3}, max_turns=2, max_new_tokens=4, greedy=True)
    opts = {"size": 5, "moves": "absolute", "view": "coords"}
    res = evaluate_advisor(advisor, executor, tok, "minigrid", opts, range(3), **kw)
    again = evaluate_advisor(advisor, executor, tok, "minigrid", opts, range(3), **kw)
    assert res.n_episodes == 3 and advisor.training and not executor.training  # modes restored
    turns = [tr for ep in res.episodes for tr in ep.turns]
    assert turns and all(isinstance(tr, AdvisedTurn) and 1 <= len(tr.completion_ids) <= 3 for tr in turns)
    assert [tr.completion_ids for ep in again.episodes for tr in ep.turns] == [tr.completion_ids for tr in turns]
    # the env played the executor's answer to the prompt holding the advice (greedy: reproducible by hand)
    params = TurnSampling(max_new_tokens=4, greedy=True)
    by_executor = HFGenerator(executor, tok).generate([tr.exec_with_ids for tr in turns], params)
    by_advisor = HFGenerator(advisor, tok).generate([tr.exec_with_ids for tr in turns], params)
    assert [list(ids) for ids, _, _ in by_executor] == [tr.exec_response_ids for tr in turns]
    assert [list(ids) for ids, _, _ in by_advisor] != [tr.exec_response_ids for tr in turns]
    assert all(f"Advice: {tr.advice}" in tok.decode(tr.exec_with_ids) for tr in turns)


def test_the_recipe_evaluation_plays_an_advisd_policy_as_the_advisor_of_its_executor():
    """`agentcredit.evaluation.evaluate` on an advisd recipe: the start advises a copy of itself, a named executor is
    loaded from the term's path, and a trained advisor without a known executor is refused before any episode."""
    from agentcredit.evaluation import evaluate
    from agentcredit.recipe import RecipeError, load_recipe
    from agentcredit.trl.advisd import evaluate_advisor, load_executor

    over = ["model_name_or_path=tiny-qwen2", "agentcredit.max_new_tokens=4",
            "agentcredit.eval={seeds: [30000, 30003], greedy: true}", "agentcredit.terms.advisd.advice_tokens=3",
            "agentcredit.env_options={size: 5, moves: absolute, view: coords}"]
    recipe = load_recipe("recipes/trl/minigrid_advisd.yaml", over)
    from agentcredit import policy

    _, tok, model = policy.load_model(recipe)
    model.train()
    with pytest.raises(RecipeError, match=r"agentcredit.terms.advisd.executor=PATH"):
        evaluate(model, tok, recipe)
    ac = recipe.agentcredit
    kw = dict(params=dict(ac.terms["advisd"]), max_turns=ac.max_turns, max_new_tokens=4, greedy=True, system=ac.system)

    def answers(res):
        return [(tr.completion_ids, tr.exec_response_ids) for ep in res.episodes for tr in ep.turns]

    start = evaluate(model, tok, recipe, start=True)
    assert model.training and start.n_episodes == 3
    assert all(isinstance(tr, AdvisedTurn) for ep in start.episodes for tr in ep.turns)
    by_hand = evaluate_advisor(model, model, tok, "minigrid", dict(recipe.agentcredit.env_options), range(30000, 30003),
                               **kw)
    assert answers(start) == answers(by_hand)
    with torch.no_grad():  # a trained advisor: no longer the executor's weights
        for prm in model.parameters():
            prm.add_(0.05 * torch.randn(prm.shape, generator=torch.Generator().manual_seed(1)))
    named = load_recipe("recipes/trl/minigrid_advisd.yaml", over + ["agentcredit.terms.advisd.executor=tiny-qwen2"])
    res = evaluate(model, tok, named)
    by_hand = evaluate_advisor(model, load_executor("tiny-qwen2", tok), tok, "minigrid",
                               dict(recipe.agentcredit.env_options), range(30000, 30003), **kw)
    assert answers(res) == answers(by_hand) != answers(start)


def test_several_processes_select_over_the_whole_round(tmp_path, monkeypatch):
    """With 2 processes the mixin all-gathers (influence, valid) and keeps its share of one round-wide selection:
    process 1 here holds the round's largest influence but also the lowest, and k = ceil(0.5 * 4) = 2 counts both
    processes' decisions; the logged round metrics are the whole round's."""
    from types import SimpleNamespace

    import accelerate.utils

    trainer, _ = _advisd_trainer({"fraction": 0.5}, tmp_path / "mp")
    other = ([0.2, 3.0], [True, True])  # process 0's decisions
    seen = []

    def gather(obj):
        seen.append(obj)
        return [other, *obj]

    monkeypatch.setattr(accelerate.utils, "gather_object", gather)
    monkeypatch.setattr(trainer, "accelerator", SimpleNamespace(num_processes=2, process_index=1))
    mine, (inf, valid, sel) = trainer._advisd_select(torch.tensor([5.0, 0.1], dtype=torch.float64),
                                                     torch.tensor([True, True]))
    assert seen == [[([5.0, 0.1], [True, True])]]
    assert mine.tolist() == [True, False] and sel.tolist() == [False, True, True, False]
    assert inf.tolist() == [0.2, 3.0, 5.0, 0.1] and valid.all()
    # alone (one process) the same two decisions would select one of its own: k = ceil(0.5 * 2) = 1
    monkeypatch.setattr(trainer, "accelerator", SimpleNamespace(num_processes=1, process_index=0))
    alone, _ = trainer._advisd_select(torch.tensor([5.0, 0.1], dtype=torch.float64), torch.tensor([True, True]))
    assert alone.tolist() == [True, False] and len(seen) == 1
    # a process without decisions still joins the gather and gets an empty share
    monkeypatch.setattr(trainer, "accelerator", SimpleNamespace(num_processes=2, process_index=1))
    empty, (_, _, sel) = trainer._advisd_select(torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.bool))
    assert empty.tolist() == [] and sel.tolist() == [False, True] and len(seen) == 2
