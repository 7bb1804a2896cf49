"""The async front-end over a stub model: concurrent consumers, a lagging
consumer, cancellation, and the engine thread dying."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from types import SimpleNamespace

import pytest

from kiln.engine.loader import LoadedEngine
from kiln.engine.request import SamplingParams
from kiln.entrypoints.async_engine import AsyncEngine, EngineDeadError
from tests.unit.test_engine_core import expected, make_engine

GREEDY = SamplingParams(max_tokens=12, temperature=0)


def _async_engine(**kwargs) -> AsyncEngine:
    engine = make_engine(**kwargs)
    config = SimpleNamespace(max_model_len=engine.max_model_len, sampling_defaults={})
    return AsyncEngine(LoadedEngine(engine, None, config, None, None, {}))  # type: ignore[arg-type]


async def _collect(ae: AsyncEngine, prompt: list[int], params: SamplingParams = GREEDY, pause: float = 0.0):
    tokens, deltas, prompt_logprobs = [], 0, []
    async for delta in ae.generate(prompt, params):
        tokens += delta.token_ids
        deltas += 1
        prompt_logprobs += [delta.prompt_logprobs] if delta.prompt_logprobs is not None else []
        await asyncio.sleep(pause)  # a slow client
    return tokens, deltas, delta.finish_reason, prompt_logprobs


def test_concurrent_and_lagging_consumers_get_all_their_tokens() -> None:
    async def main():
        ae = _async_engine()
        ae.start()
        try:
            prompts = [[1, 2, 3], [4] * 7, [9, 9]]
            fast = [asyncio.ensure_future(_collect(ae, p)) for p in prompts]
            slow = asyncio.ensure_future(_collect(ae, [5, 6], replace(GREEDY, prompt_logprobs=1), pause=0.05))
            return await asyncio.gather(*fast), await slow, ae
        finally:
            ae.shutdown()

    results, (slow_tokens, slow_deltas, reason, prompt_logprobs), ae = asyncio.run(main())
    assert [r[0] for r in results] == [expected(p, 12) for p in ([1, 2, 3], [4] * 7, [9, 9])]
    assert all(r[2] == "length" for r in results)
    assert slow_tokens == expected([5, 6], 12) and reason == "length"
    assert slow_deltas < 12  # the lagging consumer got merged deltas, and lost nothing
    # its prompt's logprobs came once, merged or not
    assert len(prompt_logprobs) == 1 and prompt_logprobs[0][0] is None and len(prompt_logprobs[0]) == 2
    assert ae.stats.kv_cache_usage == 0.0


def test_a_cancelled_consumer_aborts_its_request() -> None:
    async def main():
        ae = _async_engine()
        ae.start()
        try:
            long = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
            gen = ae.generate([1, 2, 3], long)
            first = await gen.__anext__()
            await gen.aclose()  # the client went away
            for _ in range(100):
                await asyncio.sleep(0.01)
                if ae.stats.num_running == 0 and ae.stats.num_waiting == 0:
                    break
            return first, ae.stats
        finally:
            ae.shutdown()

    first, stats = asyncio.run(main())
    assert first.token_ids and stats.num_running == 0 and stats.kv_cache_usage == 0.0


def test_when_the_engine_thread_dies_every_request_gets_an_error() -> None:
    async def main():
        ae = _async_engine()
        real = ae.engine.runner.execute
        calls = {"n": 0}

        def failing(sched):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("device lost")
            return real(sched)

        ae.engine.runner.execute = failing
        ae.start()
        results = await asyncio.gather(*(_collect(ae, [i + 1, 2]) for i in range(3)), return_exceptions=True)
        with pytest.raises(EngineDeadError, match="device lost"):
            await _collect(ae, [1])
        return results, ae

    results, ae = asyncio.run(main())
    assert all(isinstance(r, EngineDeadError) and "device lost" in str(r) for r in results)
    assert not ae.healthy


def test_health_turns_503_after_the_engine_died() -> None:
    from fastapi.testclient import TestClient

    from kiln.entrypoints.openai.server import ServerState, build_app

    async def dead_engine() -> AsyncEngine:
        ae = _async_engine()
        ae.engine.runner.execute = lambda sched: (_ for _ in ()).throw(RuntimeError("boom"))
        ae.start()
        with pytest.raises(EngineDeadError):
            await _collect(ae, [1, 2])
        return ae

    state = ServerState("stub", ("unused", {}))
    client = TestClient(build_app(state))  # no lifespan: nothing loads
    assert client.get("/health").status_code == 503  # loading
    assert client.post("/v1/completions", json={"prompt": [1]}).json()["error"]["code"] == 503
    state.engine = asyncio.run(dead_engine())
    state.serving = object()  # type: ignore[assignment]
    r = client.get("/health")
    assert r.status_code == 503 and "boom" in r.text


def test_an_api_key_guards_the_v1_paths_and_leaves_the_probes_open() -> None:
    from fastapi.testclient import TestClient

    from kiln.entrypoints.openai.server import ServerState, build_app

    client = TestClient(build_app(ServerState("stub", ("unused", {}), api_key="s3cret")))  # no lifespan
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        r = client.post("/v1/completions", json={"prompt": [1]}, headers=headers)
        error = r.json()["error"]
        assert r.status_code == 401 and error["code"] == 401 and error["type"] == "AuthenticationError"
        assert client.get("/v1/models", headers=headers).status_code == 401
    good = {"Authorization": "Bearer s3cret"}
    assert client.post("/v1/completions", json={"prompt": [1]}, headers=good).status_code == 503  # loading
    assert client.get("/health").status_code == 503 and client.get("/version").status_code == 200
