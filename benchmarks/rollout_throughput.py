"""Rollout throughput of verl's agent loop against its env backends, the shipped inline env calls measured in the same
run.

    python benchmarks/rollout_throughput.py                       # both parts, the issue's sizes
    python benchmarks/rollout_throughput.py --part loop --sessions 64 --turns 5 --latency 0.05
    python benchmarks/rollout_throughput.py --part envs --envs minigrid sokoban
    .venv-vllm/bin/python benchmarks/rollout_throughput.py --part servers     # real hfcpu and vLLM servers

Part ``loop``: N sessions of the real :class:`agentcredit.verl.agent_loop.EnvAgentLoop` on one event loop (as verl's
agent-loop worker runs them), each T turns, against a stand-in LLM server that answers after G seconds (an
``asyncio.sleep``: the only stand-in) and the ``faulty`` env (a ``synthetic`` task whose every step costs E seconds,
either sleeping, GIL released, or computing in Python, GIL held). Backends:

* ``inline``: the env called on the event loop, as the loop did before its env executor (the baseline);
* ``thread/6``: a thread pool the size of asyncio's default executor (``min(32, cpus + 4)``);
* ``thread``: the loop's default env pool (128 threads);
* ``process``: one worker process per env.

Each backend first plays one untimed round (building and warming its envs; reported as ``build``), then the timed
one, with the envs reused. Printed: wall seconds, the ideal ``T (G + E)`` (for the CPU-bound env, the larger of that
and ``N T E / cores``) and their ratio, and first the loop's own floor: the same sessions with E = 0 (what the loop
itself costs beyond ``T G``: prompt building, tokenisation and parsing, Python work that no env backend removes).

Part ``servers`` (run from the vLLM-CPU environment, ``scripts/vllm-cpu-env.sh``): the real loop playing Sokoban
against the two real generation servers of the CPU, in the same run: the ``hfcpu`` backend's server (one request at
a time) and vLLM's own async engine (continuous batching), both in this process on ``tiny-qwen2-h32``. G is one
request's latency on the idle server, E one Sokoban step; printed: wall, the ideal ``T (G + E)`` and their ratio.

Part ``envs``: the real envs (MiniGrid, Sokoban, the ALFWorld fixture, ScienceWorld, TextWorld-Express, search-QA)
through each backend: the seconds to build one env, and the steps per second of ``--sessions-envs`` envs stepped at
once with random legal actions (reset time excluded).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from env_adapters import turns  # noqa: E402
from env_adapters.executor import BACKENDS, EnvExecutor, ThreadHandle, register_backend  # noqa: E402


class InlineHandle(ThreadHandle):
    """The baseline: the env called on the caller's thread, the event loop included (no pool, no timeout)."""

    async def apply(self, fn, *args, timeout=None, **kwargs):
        return fn(self.env, *args, **kwargs)


register_backend("inline", InlineHandle)


# ---- part loop ----------------------------------------------------------------------------------------------------
class SleepyServer:
    """``LLMServerClient.generate``'s signature; answers a fixed action after ``latency`` seconds."""

    def __init__(self, tokenizer, latency: float):
        self.latency = latency
        self.ids = tokenizer.encode("<action>look around</action>", add_special_tokens=False)

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        await asyncio.sleep(self.latency)
        return TokenOutput(token_ids=list(self.ids), stop_reason="completed")


def _loop_cls():
    import agentcredit.verl.agent_loop as agent_loop

    return agent_loop.EnvAgentLoop


def _config(turns_: int):
    from omegaconf import OmegaConf

    return OmegaConf.create({
        "actor_rollout_ref": {"rollout": {"n": 1, "prompt_length": 4096, "response_length": 32, "temperature": 1.0,
                                          "top_p": 1.0, "top_k": -1, "full_determinism": False,
                                          "calculate_log_probs": False}},
        "data": {"apply_chat_template_kwargs": {}},
        "algorithm": {}, "trainer": {"total_training_steps": 1}})


def _tokenizer():
    from transformers import AutoTokenizer

    from agentcredit.models import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("tiny-qwen2"))


def play_sessions(backend: str, workers: int, n: int, turns_: int, g: float, e: float, busy: bool, tok) -> tuple:
    """Build the loop objects (one per session, as verl does) and run two rounds; (build seconds, timed seconds)."""
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap
    from verl.utils.dataset.rl_dataset import RLHFDataset

    cfg = _config(turns_)
    server = SleepyServer(tok, g)
    latency = {"step_busy_s": e} if busy else {"step_sleep_s": e}
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": False}
    loops = []

    async def round_() -> float:
        t0 = time.perf_counter()
        out = await asyncio.gather(*(lp.run(dict(sampling), raw_prompt=[], uid="bench", session_id=i, seed=i)
                                     for i, lp in enumerate(loops)))
        assert all(len(o) == turns_ and not o[0].extra_fields["env_error"] for o in out), "an episode ended early"
        return time.perf_counter() - t0

    async def main():
        loops.extend(_loop_cls()(  # built on the running loop (each captures it), one per session as verl does
            trainer_config=DictConfigWrap(cfg), server_manager=server, tokenizer=tok, processor=None,
            dataset_cls=RLHFDataset, data_config=DictConfigWrap(cfg.data), hf_model_type="qwen2",
            env_name="faulty", env_options={"env": "synthetic", "env_options": {"family": "rooms"}, **latency},
            max_steps=turns_, env_backend=backend, env_workers=workers, env_timeout_s=None) for _ in range(n))
        return await round_(), await round_()

    build, timed = asyncio.run(main())
    loops[0].envs.close()
    return build, timed


def part_loop(args) -> None:
    tok = _tokenizer()
    n, t, g, e = args.sessions, args.turns, args.latency, args.latency
    cores = os.cpu_count() or 1
    rows = [("inline", 1), ("thread", min(32, cores + 4)), ("thread", 128), ("process", n)]
    print(f"part loop: N={n} sessions x T={t} turns, server G={g} s, env E={e} s, {cores} cores")
    _, floor = play_sessions("thread", 128, n, t, g, 0.0, False, tok)
    print(f"the loop's own floor (E = 0, thread backend): {floor:.2f} s against T G = {t * g:.2f} s (prompt "
          f"building, tokenisation, parsing: Python work of the loop, not of the env)")
    for busy in (False, True):
        kind = "CPU-bound (GIL held)" if busy else "sleeping (GIL released)"
        ideal = t * (g + e) if not busy else max(t * (g + e), n * t * e / cores)
        print(f"\nenv {kind}: ideal {ideal:.2f} s")
        print(f"{'backend':<12} {'build s':>8} {'wall s':>8} {'ideal s':>8} {'wall/ideal':>10}")
        base = None
        for backend, workers in rows:
            if busy and backend == "thread" and workers != 128:
                continue
            build, wall = play_sessions(backend, workers, n, t, g, e, busy, tok)
            base = wall if base is None else base
            name = backend if backend != "thread" or workers == 128 else f"thread/{workers}"
            print(f"{name:<12} {build:>8.2f} {wall:>8.2f} {ideal:>8.2f} {wall / ideal:>10.2f}   "
                  f"(inline/this: {base / wall:.1f}x)", flush=True)


# ---- part servers: real generation servers -------------------------------------------------------------------------
class HFServer:
    """The ``hfcpu`` backend's server (:class:`agentcredit.verl.cpu.rollout.HFCPUServer`), in this process: one
    request at a time, HF ``transformers`` sampling with a KV cache."""

    def __init__(self, path: str, response_length: int):
        from types import SimpleNamespace

        from agentcredit.verl.cpu.rollout import HFCPUServer

        config = SimpleNamespace(prompt_length=4096, response_length=response_length, max_model_len=None, seed=0)
        self.server = HFCPUServer(config, SimpleNamespace(path=path, local_path=path))

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        return await self.server.generate(prompt_ids, dict(sampling_params), request_id)


class VLLMServer:
    """vLLM's own async engine (``AsyncLLM``, continuous batching over every session's requests) in this process,
    answering the agent loop's ``generate`` as verl's ``vLLMHttpServer`` does (token ids and their log-probs)."""

    def __init__(self, path: str, response_length: int):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from agentcredit import vllm_cpu

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", vllm_cpu.KV_CACHE_GIB)
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=path, max_model_len=4096, seed=0,
                                                                **vllm_cpu.ENGINE_KWARGS))
        self.response_length = response_length

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        from verl.workers.rollout.replica import TokenOutput
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=int(sampling_params.get("max_tokens") or self.response_length),
                                temperature=float(sampling_params.get("temperature", 1.0)), logprobs=0)
        final = None
        async for out in self.engine.generate({"prompt_token_ids": list(prompt_ids)}, params, request_id):
            final = out
        done = final.outputs[0]
        lps = [next(iter(d.values())).logprob for d in done.logprobs] if done.logprobs else None
        return TokenOutput(token_ids=list(done.token_ids), log_probs=lps, stop_reason="completed")

    def close(self):
        self.engine.shutdown()


async def play_real(server, n: int, turns_: int, tok) -> float:
    """Seconds for ``n`` sessions of the real env loop on Sokoban, ``turns_`` turns each, against ``server`` (on the
    running event loop: vLLM's async engine lives on the loop that built it)."""
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap
    from verl.utils.dataset.rl_dataset import RLHFDataset

    cfg = _config(turns_)
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True}
    loops = [_loop_cls()(
        trainer_config=DictConfigWrap(cfg), server_manager=server, tokenizer=tok, processor=None,
        dataset_cls=RLHFDataset, data_config=DictConfigWrap(cfg.data), hf_model_type="qwen2",
        env_name="sokoban", env_options={"size": 6, "num_boxes": 1}, max_steps=turns_, env_backend="thread",
        env_workers=128, env_timeout_s=None) for _ in range(n)]
    try:
        t0 = time.perf_counter()
        await asyncio.gather(*(lp.run(dict(sampling), raw_prompt=[], uid="bench", session_id=i, seed=i)
                               for i, lp in enumerate(loops)))
        return time.perf_counter() - t0
    finally:
        loops[0].envs.close()


def part_servers(args) -> None:
    """The real env loop against the two CPU servers in the same run: G is one request's latency on an idle server
    (one session, one turn), E one env step; ideal T (G + E), wall / ideal. Needs vLLM's CPU build
    (scripts/vllm-cpu-env.sh) for the vLLM row."""
    from transformers import AutoTokenizer

    from agentcredit.models import TINY_H32
    from agentcredit.verl.smoke import primed_tiny_model

    path = primed_tiny_model(base=TINY_H32)
    tok = AutoTokenizer.from_pretrained(path)
    n, t = args.sessions, args.turns
    e = _sokoban_step_seconds()
    print(f"part servers: N={n} sessions x T={t} turns of Sokoban, {os.cpu_count()} cores, one Sokoban step "
          f"E={e * 1000:.2f} ms, {TINY_H32} primed, fp32")
    print(f"{'server':<8} {'G s':>7} {'wall s':>8} {'ideal s':>8} {'wall/ideal':>10} {'turns/s':>8}")

    async def measure(build):
        server = build(path, 32)
        try:
            await play_real(server, 1, 1, tok)  # warm-up
            g = await play_real(server, 1, 1, tok)
            return g, await play_real(server, n, t, tok)
        finally:
            getattr(server, "close", lambda: None)()

    for name, build in (("hfcpu", HFServer), ("vllm", VLLMServer)):
        g, wall = asyncio.run(measure(build))
        ideal = t * (g + e)
        print(f"{name:<8} {g:>7.3f} {wall:>8.2f} {ideal:>8.2f} {wall / ideal:>10.1f} {n * t / wall:>8.1f}", flush=True)


def _sokoban_step_seconds(steps: int = 200) -> float:
    import env_adapters

    env = env_adapters.make("sokoban", size=6, num_boxes=1)
    turns.start(env, 0)
    t0 = time.perf_counter()
    done = turns.play_random(env, 0, steps, 0)
    return (time.perf_counter() - t0) / max(done, 1)


# ---- part envs ----------------------------------------------------------------------------------------------------
def _env_specs(tmp: str) -> dict[str, tuple[dict, int]]:
    specs = {"minigrid": ({"size": 6, "moves": "absolute"}, 0), "sokoban": ({"size": 6, "num_boxes": 1}, 1),
             "search_qa": ({"k": 3}, 0)}
    if importlib.util.find_spec("alfworld"):
        from env_adapters.alfworld_fixture import write_fixture

        specs["alfworld"] = ({"data_dir": write_fixture(os.path.join(tmp, "alfworld"))}, 0)
    specs["scienceworld"] = ({"task": "find-living-thing", "simplifications": "easy"}, 0)
    specs["textworld_express"] = ({"game": "cookingworld"}, 3)
    return specs


def part_envs(args) -> None:
    print(f"\npart envs: {args.sessions_envs} envs stepped at once, {args.env_steps} random legal steps each")
    print(f"{'env':<18} {'backend':<8} {'build s':>8} {'steps/s':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, (options, seed) in _env_specs(tmp).items():
            if args.envs and name not in args.envs:
                continue
            for backend in ("inline", "thread", "process"):
                ex = EnvExecutor(backend, workers=max(args.sessions_envs, 1), timeout_s=None)
                try:
                    t0 = time.perf_counter()
                    handles = [ex.acquire_sync(name, options) for _ in range(args.sessions_envs)]
                    build = (time.perf_counter() - t0) / len(handles)
                    ex.run_all([(h, turns.start, (seed,)) for h in handles])
                    t0 = time.perf_counter()
                    if backend == "inline":
                        done = sum(turns.play_random(h.env, seed, args.env_steps, k) for k, h in enumerate(handles))
                    else:
                        done = sum(ex.run_all([(h, turns.play_random, (seed, args.env_steps, k))
                                               for k, h in enumerate(handles)]))
                    rate = done / (time.perf_counter() - t0)
                    print(f"{name:<18} {backend:<8} {build:>8.2f} {rate:>9.0f}", flush=True)
                except Exception as exc:  # noqa: BLE001 - an env whose package or runtime is missing here
                    print(f"{name:<18} {backend:<8} skipped: {str(exc).strip().splitlines()[-1][:90]}", flush=True)
                finally:
                    ex.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("loop", "envs", "servers", "all"), default="all",
                   help="all = loop and envs; servers (real HF and vLLM servers) runs only when named")
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--latency", type=float, default=0.05, help="G = E, seconds")
    p.add_argument("--sessions-envs", type=int, default=4)
    p.add_argument("--env-steps", type=int, default=100)
    p.add_argument("--envs", nargs="*")
    args = p.parse_args()
    assert "inline" in BACKENDS
    if args.part in ("loop", "all"):
        part_loop(args)
    if args.part in ("envs", "all"):
        part_envs(args)
    if args.part == "servers":
        part_servers(args)


if __name__ == "__main__":
    main()
