"""[ppo] adapters = "namespace" at the gateway: each key's requests, through every API, go to the engine with that
key's own adapter (whatever `model` names), the turn records the adapter beside the base version, a sync from
another process takes effect on the next request, an engine that lost the adapter gets it again, and a forgotten
namespace is served the base. The engine is a fake with SGLang's LoRA API: the real multi-LoRA engine is another
part (tests/e2e/test_namespace_adapters.py drives both)."""

from __future__ import annotations

import asyncio
import shutil

import pytest
from openai import OpenAI

from clawrl.adapters import ServedAdapter, adapter_dir, write_served
from clawrl.engine.types import BadRequestError, GenerateRequest, SamplingParams
from clawrl.gateway.lora import AdapterEngine, ServedAdapters
from clawrl.ids import namespace_for_key
from clawrl.storage.catalog import run_query
from tests.utils.fake_engine import LoraFakeEngine

A, B = namespace_for_key("key-alpha"), namespace_for_key("key-beta")


def serve(checkpoints, namespace: str, version: int) -> ServedAdapter:
    d = adapter_dir(checkpoints, namespace, version)
    d.mkdir(parents=True, exist_ok=True)
    served = ServedAdapter(namespace, f"{namespace}@v{version}", version, str(d), "sha")
    write_served(checkpoints, served)
    return served


def test_each_key_is_served_its_own_adapter_on_every_api_and_its_turns_record_it(gateway, tiny_engine, monkeypatch):
    monkeypatch.setenv("CLAWRL_API_KEYS", "key-alpha,key-beta")
    engine = LoraFakeEngine(len(tiny_engine.tokenizer))
    s, store, ctx = gateway(engine=engine, server__open_mode=False, ppo__adapters="namespace")
    checkpoints = s.storage.data_root / "checkpoints"
    a1 = serve(checkpoints, A, 1)
    asyncio.run(engine.load_lora_adapter(a1.name, a1.path))
    with ctx as gw:
        alpha = OpenAI(base_url=gw.base_url, api_key="key-alpha", max_retries=0)
        beta = OpenAI(base_url=gw.base_url, api_key="key-beta", max_retries=0)
        msgs = [{"role": "user", "content": "hi"}]
        # `model` names B's... any adapter: ignored; the key decides
        r = alpha.chat.completions.create(model=f"clawrl-policy:{B}@v1", messages=msgs, max_tokens=2, logprobs=True)
        assert [t.logprob for t in r.choices[0].logprobs.content] == [-2.0, -2.0]  # decoded by A's v1
        alpha.responses.create(model="m", input="hi", max_output_tokens=2)
        alpha.completions.create(model="m", prompt="hi", max_tokens=2)
        b = beta.chat.completions.create(model=f"clawrl-policy:{A}@v1", messages=msgs, max_tokens=2, logprobs=True)
        assert [t.logprob for t in b.choices[0].logprobs.content] == [-1.0, -1.0]  # B has none: the base
        assert engine.seen == [a1.name, a1.name, a1.name, None]

        a2 = serve(checkpoints, A, 2)  # a sync from another process: loaded, then switched to
        asyncio.run(engine.load_lora_adapter(a2.name, a2.path))
        alpha.chat.completions.create(model="m", messages=msgs, max_tokens=2)
        engine.adapters.clear()  # the engine restarted without its adapters
        r = alpha.chat.completions.create(model="m", messages=msgs, max_tokens=2, logprobs=True, stream=False)
        assert [t.logprob for t in r.choices[0].logprobs.content] == [-3.0, -3.0]
        assert engine.loads[-1] == (a2.name, a2.path)  # loaded again from its directory, and the request went again
        stream = alpha.chat.completions.create(model="m", messages=msgs, max_tokens=2, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

        shutil.rmtree(checkpoints / "adapters" / A)  # forgotten: the base from the next request
        alpha.chat.completions.create(model="m", messages=msgs, max_tokens=2)
        assert engine.seen[4:] == [a2.name, a2.name, a2.name, a2.name, None]
        store.flush()
    rows = run_query(s.storage.data_root, "SELECT namespace, weight_version, adapter, request_params FROM turns "
                                          "ORDER BY created_at").to_pylist()
    assert [(r["namespace"], r["weight_version"], r["adapter"]) for r in rows] == [
        (A, "0", a1.name), (A, "0", a1.name), (A, "0", a1.name), (B, "0", None),
        (A, "0", a2.name), (A, "0", a2.name), (A, "0", a2.name), (A, "0", None)]
    assert [r["request_params"].count('"api":') for r in rows[1:3]] == [1, 1]  # Responses and completions APIs


def test_a_request_prepared_before_a_sync_goes_to_the_version_served_now(tmp_path):
    engine = LoraFakeEngine(100)
    served = ServedAdapters(tmp_path)
    wrapped = AdapterEngine(engine, served)
    old, new = serve(tmp_path, A, 1), serve(tmp_path, A, 2)
    asyncio.run(engine.load_lora_adapter(new.name, new.path))  # v1 was unloaded after the switch

    def request(name, ids=(1, 2)):
        return GenerateRequest(input_ids=list(ids), sampling_params=SamplingParams(max_new_tokens=2), lora_path=name)

    result = asyncio.run(wrapped.generate(request(old.name)))
    assert (result.lora_path, result.output_logprobs) == (new.name, [-3.0, -3.0])
    assert engine.seen == [old.name, new.name]
    result = asyncio.run(wrapped.generate(request(f"{B}@v9")))  # B is served none (forgotten since): the base
    assert (result.lora_path, result.output_logprobs) == (None, [-1.0, -1.0])
    with pytest.raises(BadRequestError, match="token id outside"):  # any other refusal stands, nothing reloaded
        asyncio.run(wrapped.generate(request(new.name, ids=(1, 500))))
    assert engine.loads == [(new.name, new.path)]


def test_a_gateway_over_an_engine_that_ignores_adapters_refuses_to_start(gateway_settings, tiny_engine):
    from clawrl.config import ConfigError
    from clawrl.gateway.routes import create_app
    from tests.utils.fake_engine import FakeEngine

    with pytest.raises(ConfigError, match=r"\[ppo\] adapters = 'namespace' needs a serving engine that serves LoRA "
                                          r"adapters; FakeEngine does not"):
        create_app(gateway_settings(ppo__adapters="namespace"), engine=FakeEngine(10), tokenizer=tiny_engine.tokenizer)
