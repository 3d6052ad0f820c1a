"""AsyncLLMEngine: concurrent streams batch together, disconnects abort, bad input raises."""

from __future__ import annotations

import asyncio

import pytest
from conftest import PROMPTS

from tokenmill import SamplingParams
from tokenmill.engine.async_engine import AsyncLLMEngine, QueueFullError

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def aengine(tiny_llama_dir):
    eng = AsyncLLMEngine.from_args(tiny_llama_dir, dtype="float32", kv_cache_memory=0.02)
    yield eng
    eng.shutdown()


def _free_all(eng):
    kv = eng.engine.core.kv
    return kv.num_free_blocks == kv.num_usable_blocks


def test_concurrent_streams_equal_offline(aengine, tiny_llama_llm):
    expected = [o.outputs[0].text for o in tiny_llama_llm.generate(PROMPTS, GREEDY)]

    async def one(p):
        text = ""
        async for out in aengine.generate(p, GREEDY):
            text += out.outputs[0].delta_text
        assert out.finished and out.outputs[0].text == text
        return text

    async def main():
        return await asyncio.gather(*(one(p) for p in PROMPTS))

    assert asyncio.run(main()) == expected
    assert _free_all(aengine)


def test_disconnect_aborts_and_frees(aengine):
    async def main():
        gen = aengine.generate("Hello world", SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
        async for _ in gen:
            break
        await gen.aclose()
        for _ in range(100):
            await asyncio.sleep(0.02)
            if _free_all(aengine) and not aengine.engine.core.scheduler.requests:
                return True
        return False

    assert asyncio.run(main())


def test_bad_input_raises(aengine):
    async def main():
        async for _ in aengine.generate("", GREEDY):
            pass

    with pytest.raises(ValueError, match="empty"):
        asyncio.run(main())
    assert aengine.is_running


def test_max_waiting(tiny_llama_dir):
    eng = AsyncLLMEngine.from_args(tiny_llama_dir, dtype="float32", kv_cache_memory=0.02, max_waiting=0)

    async def main():
        async for _ in eng.generate("Hello", GREEDY):
            pass

    try:
        with pytest.raises(QueueFullError):
            asyncio.run(main())
    finally:
        eng.shutdown()


def test_from_args_builds_the_engine_on_its_thread(tiny_llama_dir, monkeypatch):
    """The engine thread must be the only one running torch ops: a second thread with OpenMP
    work of its own makes libgomp stop spinning at barriers (a third of the throughput on 2 cores)."""
    import threading

    from tokenmill.engine.llm_engine import LLMEngine

    built_on = []
    real = LLMEngine.__init__

    def spy(self, args):
        built_on.append(threading.current_thread().name)
        real(self, args)

    monkeypatch.setattr(LLMEngine, "__init__", spy)
    eng = AsyncLLMEngine.from_args(tiny_llama_dir, dtype="float32", kv_cache_memory=0.02)
    try:
        assert built_on == ["tokenmill-engine"] and eng._thread.name == "tokenmill-engine"

        async def main():
            return [o async for o in eng.generate("Hello", GREEDY)][-1]

        assert asyncio.run(main()).finished
    finally:
        eng.shutdown()


def test_from_args_raises_construction_errors(tiny_llama_dir):
    with pytest.raises(ValueError, match="max_model_len"):
        AsyncLLMEngine.from_args(tiny_llama_dir, dtype="float32", max_model_len=10**7)
