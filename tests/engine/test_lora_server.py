"""SGLang's LoRA contract over real HTTP: the embedded engine behind its SGLang-compatible server, driven by the real
SGLangClient (and plain HTTP for the bodies): load, serve by name (one request or a batch), list, refuse, unload."""

from __future__ import annotations

import httpx
import pytest

from clawrl.engine.lora import write_random_adapters
from clawrl.engine.sglang_client import SGLangClient
from clawrl.engine.types import BadRequestError, GenerateRequest, SamplingParams
from clawrl.models import load_causal_lm
from clawrl.runtime import run
from tests.utils.engine_server import PROMPT, make_tiny_engine, running_engine_server

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory, tiny_dir):
    root = tmp_path_factory.mktemp("adapters")
    return write_random_adapters(load_causal_lm(tiny_dir), [root / "a0", root / "a1"], rank=4, alpha=8, std=0.2)


def test_load_serve_list_and_unload_an_adapter_over_http(tiny_dir, adapter_dirs):
    with running_engine_server(lambda: make_tiny_engine(tiny_dir)) as srv:
        async def go():
            async with SGLangClient(srv.url, timeout_s=60) as client:
                loaded = await client.load_lora_adapter("u@v1", str(adapter_dirs[0]))
                base = await client.generate(GenerateRequest(input_ids=PROMPT, sampling_params=GREEDY))
                with_lora = await client.generate(GenerateRequest(input_ids=PROMPT, sampling_params=GREEDY,
                                                                  lora_path="u@v1"))
                twice = await client.load_lora_adapter("u@v1", str(adapter_dirs[1]))
                missing = await client.load_lora_adapter("u@v2", str(adapter_dirs[0].parent / "nope"))
                with pytest.raises(BadRequestError, match="not loaded: u@v3"):
                    await client.generate(GenerateRequest(input_ids=PROMPT, sampling_params=GREEDY, lora_path="u@v3"))
                return loaded, base, with_lora, twice, missing

        loaded, base, with_lora, twice, missing = run(go())
        batch = httpx.post(srv.url + "/generate", json={"input_ids": [PROMPT, PROMPT], "lora_path": [None, "u@v1"],
                                                        "sampling_params": GREEDY.to_dict()}, timeout=300).json()
        models = httpx.get(srv.url + "/v1/models").json()["data"]
        info = httpx.get(srv.url + "/server_info").json()
        unknown = httpx.post(srv.url + "/generate", json={"input_ids": PROMPT, "lora_path": "u@v3"}, timeout=300)
        unloaded = httpx.post(srv.url + "/unload_lora_adapter", json={"lora_name": "u@v1"}).json()
        again = httpx.post(srv.url + "/unload_lora_adapter", json={"lora_name": "u@v1"})
        no_name = httpx.post(srv.url + "/load_lora_adapter", json={"lora_path": str(adapter_dirs[0])})

    assert loaded.success and loaded.loaded_adapters == {"u@v1": str(adapter_dirs[0])} and loaded.message == ""
    assert with_lora.output_ids != base.output_ids and len(with_lora.output_ids) == 6
    assert [b["output_ids"] for b in batch] == [base.output_ids, with_lora.output_ids]
    assert not twice.success and "LoRA with name u@v1 already exists" in twice.message
    assert not missing.success and "is not a directory" in missing.message
    name = models[0]["id"]  # the served model
    assert [(m["id"], m["parent"]) for m in models] == [(name, None), ("u@v1", name)]
    assert models[1]["root"] == str(adapter_dirs[0])
    assert info["enable_lora"] and info["max_loaded_loras"] == 32 and info["max_loras_per_batch"] == 8
    assert info["lora_paths"] == {"u@v1": str(adapter_dirs[0])}
    assert unknown.status_code == 400 and unknown.json()["error"]["message"].startswith(
        "The following requested LoRA adapters are not loaded: u@v3")
    assert unloaded == {"success": True, "error_message": "", "loaded_adapters": {}}
    assert again.status_code == 400 and again.json()["error_message"].startswith("LoRA with name u@v1 does not exist")
    assert no_name.status_code == 400 and "lora_name" in no_name.json()["error"]["message"]


def test_an_engine_without_lora_refuses_adapters_with_a_reason(tiny_dir, adapter_dirs):
    with running_engine_server(lambda: make_tiny_engine(tiny_dir, max_loaded_loras=0)) as srv:
        load = httpx.post(srv.url + "/load_lora_adapter", json={"lora_name": "u", "lora_path": str(adapter_dirs[0])})
        gen = httpx.post(srv.url + "/generate", json={"input_ids": PROMPT, "lora_path": "u"}, timeout=300)
        info = httpx.get(srv.url + "/server_info").json()
    assert load.status_code == 400 and "LoRA is off on this engine" in load.json()["error_message"]
    assert gen.status_code == 400 and "LoRA is off on this engine" in gen.json()["error"]["message"]
    assert not info["enable_lora"] and info["lora_paths"] == {}
