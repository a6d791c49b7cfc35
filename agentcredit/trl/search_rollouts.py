"""TRL rollouts that search: counterfactual decision tables for ASCT and branching trees for SIPO / AT²PO / TreeRL.

Both are ``rollout_func`` s in the one-row-per-turn layout of :class:`agentcredit.trl.rollouts.TurnRollout` and need an env
with ``snapshot()`` / ``restore()`` and ``legal_actions()`` (MiniGrid, Sokoban); any other env is refused when the
rollout is built.

* :class:`CounterfactualRollout` (spec credit §7): the actor plays its episodes as in ``TurnRollout``; at every
  decision it also (1) scores each legal action's answer ``"<action>" + a + "</action>"`` under the turn's prompt
  (length-normalised mean token log-prob, softmax over the legal labels: the frozen actor's ``legal_p``) and (2) runs
  :class:`env_adapters.counterfactual.CounterfactualEvaluator` from a snapshot of the state (``budget`` extra
  trials, every legal root action first) for ``q``. The rows carry ``legal_p``, ``legal_mask``, ``q``, ``chosen``
  (and ``visits``) as ``agentcredit_extras``; the tree never changes the actor's trajectory.
  [R] A turn whose answer is not a legal action gets one more column, "invalid", with frozen-actor probability 0
  and ``q`` = (its state's lowest legal ``q``) − ``invalid_utility``: the no-op leaves the state unchanged, so its
  value is bounded by the legal ones, and the penalty keeps "invalid" the worst choice. The baseline Σ p·Q̂ is over
  the legal actions only, so Σ_legal p·Â = 0 still holds.
* :class:`TreeRollout` (spec credit §8.1-8.2): per seed one tree: ``initial`` chains from the reset state, then
  ``iterations`` expansions; each ranks the candidates (every non-leaf node and the root) by the host score
  ``H - alpha * b`` (AT²PO) or SIPO's scale-free ``(H - mean)/std - lam * b`` (``criterion="sfc"``), selects the
  top ``beam`` and forks ``branches`` new siblings of each (restored from the snapshot before the node's turn; a
  selected root starts a new chain) that run to the end. Leaves = initial + iterations * beam * branches. One row
  per node (``agentcredit_traj`` = node id, ``agentcredit_t`` = 0), reward = the root-to-leaf return on leaves (0
  inside), extras ``parent``, ``surprisal`` (-mean log p of the node's sampled tokens at the sampling temperature),
  ``fresh``, ``sel_rank``, ``sel_ncand``, ``selected`` and the root's ``root_sel_rank``, ``root_sel_ncand``,
  ``root_selected`` (the ranking: :func:`env_adapters.search.fork_starts`). ``num_generations`` must hold the largest tree:
  ``(initial + iterations * beam * branches) * max_turns`` rows (the rest are padding rows).

Generation: :func:`agentcredit.trl.generation.rollout_generator` (HF ``generate``, or TRL's vLLM engine with
``use_vllm=true``, whose rows then carry its sampling log-probs; the tree's surprisal is then computed from vLLM's
log-probs, which TRL asks for after temperature and top-k/top-p). ASCT's label scores are always a forward pass of
the HF training model, on either back-end (TRL syncs the vLLM weights to it before each rollout call).

Extra rollouts per training step (reported by :meth:`metrics` as ``extra_env_steps`` / ``extra_generations``):
ASCT adds ``budget`` env-only trials per decision (no generation) plus one scoring forward over the legal labels;
the tree adds ``iterations * beam * branches`` generated branches per seed to the ``initial`` chains.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from credit_plugins.hashing import stable_hash

from env_adapters.prompting import build_prompt, parse_action
from env_adapters.search import Node, decision_row, fork_starts, new_root, require_search_env
from .generation import TurnSampling, rollout_generator, sampling_logprobs
from .prompts import ACTION_PREFIX, chat_text, compact_prompt, legal_actions
from .rollouts import TurnRollout

__all__ = ["CounterfactualRollout", "TreeRollout", "require_search_env"]


# ---- ASCT -----------------------------------------------------------------------------------------------------------
class CounterfactualRollout(TurnRollout):
    """:class:`TurnRollout` plus ASCT's decision table (see the module doc).

    Args (beyond TurnRollout's): ``evaluator`` (``"uniform"``, ``"uct"`` or ``"agentuct"``), ``budget`` (trials
    per visited state, at least the number of legal actions), ``evaluator_options`` (the evaluator's other keyword
    arguments; [R] by default a trial lasts at most ``max_turns`` env steps and its cost is normalised by
    ``max_turns``, i.e. ``C_0`` = the episode's step limit), ``invalid_utility`` (how far below the worst legal
    action an invalid answer's value lies).
    """

    def __init__(self, env: str, env_options: dict | None = None, *, evaluator: str = "uniform", budget: int = 12,
                 evaluator_options: dict | None = None, invalid_utility: float = 0.1, **kwargs: Any):
        super().__init__(env, env_options, **kwargs)
        require_search_env(self._pool[0], "CounterfactualRollout (ASCT)")
        from env_adapters.counterfactual import CounterfactualEvaluator

        n_legal = len(self._pool[0].legal_actions())
        if budget < n_legal:
            raise ValueError(f"budget={budget} is below the {n_legal} legal actions of {env!r}: ASCT's root coverage "
                             f"needs one trial per legal action (budget >= {n_legal})")
        options = {"max_depth": self.max_turns, "cost_norm": float(self.max_turns), **dict(evaluator_options or {})}
        self.evaluator = CounterfactualEvaluator(kind=evaluator, budget=int(budget), **options)
        self.invalid_utility = float(invalid_utility)
        self.__name__ = "CounterfactualRollout"

    def _before_step(self, model, tokenizer, trainer):
        from credit_plugins.estimators.asct import legal_probs
        from agentcredit.trl.privileged import score_tokens

        temperature = float(getattr(trainer.args, "temperature", 1.0) or 1.0)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        stats = self._search_stats = {"extra_env_steps": 0.0, "label_forwards": 0.0, "search_seconds": 0.0}

        def before_step(envs, prompt_ids, action_texts) -> list[dict]:
            t0 = time.perf_counter()
            legal = [list(env.legal_actions()) for env in envs]
            width = max(len(a) for a in legal) + 1  # + the "invalid" column
            # frozen-actor probabilities: every legal label's answer scored under the turn's prompt, one batch
            prompts, labels, where = [], [], []
            for i, acts in enumerate(legal):
                for k, a in enumerate(acts):
                    prompts.append(prompt_ids[i])
                    labels.append(tokenizer(a + "</action>", add_special_tokens=False)["input_ids"])
                    where.append((i, k))
            T = max(len(x) for x in labels)
            ids = torch.full((len(labels), T), pad, dtype=torch.long)
            mask = torch.zeros((len(labels), T), dtype=torch.long)
            for r, x in enumerate(labels):
                ids[r, :len(x)] = torch.tensor(x)
                mask[r, :len(x)] = 1
            lp, _ = score_tokens(model, prompts, ids, mask, temperature=temperature, batch_size=self.batch_size,
                                 pad_id=pad)
            mean_lp = torch.full((len(envs), width), float("-inf"), dtype=torch.float64)
            legal_mask = torch.zeros((len(envs), width), dtype=torch.bool)
            for r, (i, k) in enumerate(where):
                mean_lp[i, k] = float(lp[r].sum() / mask[r].sum())
                legal_mask[i, k] = True
            p = legal_probs(torch.where(legal_mask, mean_lp, torch.zeros_like(mean_lp)), legal_mask)
            out = []
            for i, env in enumerate(envs):
                values = self.evaluator.evaluate(env)
                stats["extra_env_steps"] += float(values.new_steps)
                out.append(decision_row(env, values, action_texts[i], p[i][:len(legal[i])], width,
                                        self.invalid_utility))
            stats["label_forwards"] += float(len(labels))
            stats["search_seconds"] += time.perf_counter() - t0
            return out

        return before_step

    def metrics(self) -> dict[str, float]:
        return {**super().metrics(), **getattr(self, "_search_stats", {})}


# ---- trees ----------------------------------------------------------------------------------------------------------
class TreeRollout(TurnRollout):
    """A TRL ``rollout_func`` that grows one search tree per seed (see the module doc).

    Args (beyond TurnRollout's): ``initial`` (M chains), ``iterations`` (L), ``beam`` (K selected per iteration),
    ``branches`` (B forks per selection), ``criterion`` (``"host"``: AT²PO's ``H - alpha*b``; ``"sfc"``: SIPO's
    scale-free criterion with penalty ``lam``).
    """

    FIELDS = TurnRollout.FIELDS[:-1]  # all but agentcredit_state_text: tree nodes keep only the state's hash

    def __init__(self, env: str, env_options: dict | None = None, *, initial: int = 4, iterations: int = 1,
                 beam: int = 2, branches: int = 2, criterion: str = "sfc", alpha: float = 0.05, lam: float = 0.05,
                 **kwargs: Any):
        super().__init__(env, env_options, **kwargs)
        require_search_env(self._pool[0], "TreeRollout")
        if criterion not in ("host", "sfc"):
            raise ValueError(f"criterion={criterion!r}; choose 'host' (AT²PO) or 'sfc' (SIPO)")
        if min(initial, beam, branches) < 1 or iterations < 0:
            raise ValueError("initial, beam and branches must be >= 1 and iterations >= 0")
        self.initial, self.iterations, self.beam, self.branches = int(initial), int(iterations), int(beam), int(branches)
        self.criterion, self.alpha, self.lam = criterion, float(alpha), float(lam)
        self.__name__ = "TreeRollout"

    @property
    def leaves(self) -> int:
        return self.initial + self.iterations * self.beam * self.branches

    @property
    def max_nodes(self) -> int:
        return self.leaves * self.max_turns

    def __call__(self, prompts: list[str], trainer) -> dict[str, Any]:
        t0 = time.perf_counter()
        model = trainer.accelerator.unwrap_model(trainer.model)
        G = int(getattr(trainer, "num_generations_eval", 0) if not model.training else 0) or \
            int(getattr(trainer, "num_generations", 0) or 0)
        if G < self.max_nodes or len(prompts) % G:
            raise ValueError(f"TreeRollout needs num_generations (got {G}) >= the largest tree, (initial + "
                             f"iterations * beam * branches) * max_turns = {self.max_nodes} rows, and whole groups "
                             f"of num_generations prompts per call (got {len(prompts)})")
        blocks = len(prompts) // G
        seeds = []
        for b in range(blocks):
            block = {self._seed(p) for p in prompts[b * G:(b + 1) * G]}
            if len(block) != 1:
                raise ValueError(f"a block of num_generations={G} consecutive prompts must repeat one seed")
            seeds.append(block.pop())
        tok = trainer.processing_class
        args = trainer.args
        max_new = self._answer_budget(tok, args, seeds[0])
        params = TurnSampling(max_new_tokens=max_new, temperature=float(getattr(args, "temperature", 1.0) or 1.0),
                              top_p=float(getattr(args, "top_p", 1.0)), top_k=int(getattr(args, "top_k", 0) or 0),
                              min_p=getattr(args, "min_p", None))
        gen = rollout_generator(trainer, model, tok, batch_size=self.batch_size, logprobs=True)  # for the surprisal
        self._gen = _Generator(gen, tok, params, system=self.system, prompt=self.prompt,
                               history_length=self.history_length)
        trees: list[list[Node]] = [[] for _ in range(blocks)]
        self._roots = [new_root() for _ in range(blocks)]
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), torch.autocast("cpu", enabled=False):
                self._grow(trees, [(b, -1, None, 0, 0.0, False) for b in range(blocks) for _ in range(self.initial)],
                           seeds)
                for _ in range(self.iterations):
                    starts = []
                    for b, tree in enumerate(trees):
                        starts += self._expansions(b, tree)
                    self._grow(trees, starts, seeds)
        finally:
            model.train(was_training)
        out = self._rows(trees, G, tok.eos_token_id)
        leaves = [n for tree in trees for n in tree if n.leaf]
        self._metrics = {
            "episodes": float(len(leaves)), "success_rate": sum(n.success for n in leaves) / max(len(leaves), 1),
            "valid_rate": sum(n.valid for tree in trees for n in tree) / max(sum(map(len, trees)), 1),
            "mean_return": sum(n.path_return for n in leaves) / max(len(leaves), 1),
            "nodes_per_tree": sum(map(len, trees)) / max(blocks, 1),
            "extra_generations": float(sum(n.fresh for tree in trees for n in tree)),
            "rollout_seconds": time.perf_counter() - t0}
        self.last_trees = trees
        return out

    # -- growth ------------------------------------------------------------------------------------------------------
    def _grow(self, trees: list[list[Node]], starts: list[tuple], seeds: list) -> None:
        """Run each start ``(block, parent, snapshot, depth, path_return, fresh)`` to the end of its episode."""
        envs = self._envs(len(starts))
        live = []
        for env, (b, parent, snap, depth, ret, fresh) in zip(envs, starts):
            if snap is None:
                env.reset(seeds[b])
            else:
                env.restore(snap)
            live.append({"env": env, "block": b, "parent": parent, "depth": depth, "ret": ret, "fresh": fresh,
                         "obs": env.render() if hasattr(env, "render") else env.state_key()})
        while live:
            turns = self._gen.turns([x["env"] for x in live], [x["obs"] for x in live])
            still = []
            for x, (p_ids, c_ids, response, surprisal, lps) in zip(live, turns):
                env, tree = x["env"], trees[x["block"]]
                snap = env.snapshot()
                action_text = parse_action(response)
                key = env.action_key(action_text) if action_text is not None else None
                state = stable_hash(env.state_key())
                res = env.step(action_text)
                node = Node(id=len(tree), parent=x["parent"], depth=x["depth"], prompt_ids=p_ids,
                            completion_ids=c_ids, state=state, action=-1 if key is None else stable_hash(key),
                            reward=float(res.reward), valid=key is not None, surprisal=surprisal, fresh=x["fresh"],
                            snapshot=snap, path_return=x["ret"] + float(res.reward), logprobs=lps)
                tree.append(node)
                if node.parent >= 0:
                    tree[node.parent].children.append(node.id)
                if res.done or x["depth"] + 1 >= self.max_turns:
                    node.leaf, node.success = True, bool(res.done and res.success)
                    node.truncated = not res.done
                    continue
                x.update(parent=node.id, depth=x["depth"] + 1, ret=node.path_return, fresh=False,
                         obs=res.observation)
                still.append(x)
            live = still

    def _expansions(self, b: int, tree: list[Node]) -> list[tuple]:
        return [(b, *start) for start in fork_starts(tree, self.beam, self.branches, self.criterion, self.alpha,
                                                     self.lam, self._roots[b])]

    def _rows(self, trees: list[list[Node]], G: int, eos: int) -> dict[str, Any]:
        out: dict[str, Any] = {"prompt_ids": [], "completion_ids": [], "env_mask": [], "agentcredit_extras": [],
                               "logprobs": [] if self._gen.gen.sampling_logprobs else None}
        out.update({k: [] for k in self.FIELDS})

        def row(p, c, m, values, extras, lps=None):
            if out["logprobs"] is not None:
                out["logprobs"].append(sampling_logprobs(lps, len(c)))
            out["prompt_ids"].append(p)
            out["completion_ids"].append(c)
            out["env_mask"].append(m)
            out["agentcredit_extras"].append(extras)
            for k, v in zip(self.FIELDS, values):
                out[k].append(v)

        pad_extras = {"parent": -1, "surprisal": 0.0, "fresh": False, "sel_rank": -1, "sel_ncand": 0,
                      "selected": False, "root_sel_rank": -1, "root_sel_ncand": 0, "root_selected": False}
        for b, tree in enumerate(trees):
            base = b * G
            root = {f"root_{k}": v for k, v in self._roots[b].items()}
            for n in tree:
                reward = n.path_return if n.leaf else 0.0
                row(n.prompt_ids, n.completion_ids, [1] * len(n.completion_ids),
                    (base + n.id, 0, n.state, n.action, reward, n.success, n.truncated, n.valid),
                    {"parent": base + n.parent if n.parent >= 0 else -1, "surprisal": n.surprisal,
                     "fresh": n.fresh, "sel_rank": n.sel_rank, "sel_ncand": n.sel_ncand, "selected": n.selected,
                     **root}, n.logprobs)
            for _ in range(G - len(tree)):
                row([eos], [eos], [0], (-1, 0, 0, -1, 0.0, False, False, False), pad_extras)
        return out


class _Generator:
    """One batched turn for many envs through a generator (:mod:`agentcredit.trl.generation`): prompts, sampled
    completions, their surprisal (-mean log p of the sampled tokens) and the generator's log-probs."""

    def __init__(self, generator, tokenizer, params, *, system, prompt, history_length):
        self.gen, self.tok, self.params = generator, tokenizer, params
        self.system, self.prompt, self.history_length = system, prompt, history_length

    def turns(self, envs, observations) -> list[tuple[list[int], list[int], str, float, list[float]]]:
        prompts = []
        for env, obs in zip(envs, observations):
            task, legal = getattr(env, "task", ""), legal_actions(env)
            user = (compact_prompt(task, obs, legal) if self.prompt == "compact"
                    else build_prompt(task, [], obs, legal, self.history_length))
            prompts.append(self.tok(chat_text(self.tok, user, self.system), add_special_tokens=False)["input_ids"])
        out = []
        for p_ids, (c_ids, text, lps) in zip(prompts, self.gen.generate(prompts, self.params)):
            surprisal = -math.fsum(lps) / len(lps) if lps else 0.0
            out.append((p_ids, c_ids, ACTION_PREFIX + text, surprisal if math.isfinite(surprisal) else 0.0, lps))
        return out
