"""[hooks] contracts: load + validate with clear errors, and each hook run end to end."""

import pytest
from openai import OpenAI

from clawrl.config import dump_toml
from clawrl.gateway.routes import create_app
from clawrl.hooks import HookError, hook_params, load_hook
from clawrl.storage.catalog import run_query
from clawrl.storage.writer import DataStore
from tests.utils import example_hooks
from tests.utils.gateway_server import running_gateway

H = "tests.utils.example_hooks"


@pytest.mark.parametrize("kind,path,message", [
    ("reward", "nopkg.nomod:f", "cannot import module 'nopkg.nomod'"),
    ("reward", f"{H}:absent", "has no attribute 'absent'"),
    ("reward", f"{H}:NOT_CALLABLE", "is not callable"),
    ("reward", f"{H}:not_async_reward", "must be an async function"),
    ("reward", f"{H}:reward_missing_param", "does not accept next_state"),
    ("loss", f"{H}:loss_needs_extra", "requires alpha"),
    ("loss", f"{H}:reward", "must be a plain (non-async) function"),
    ("nosuch", f"{H}:reward", "unknown hook 'nosuch'"),
    ("generate", "justaname", "expected 'package.module:function'"),
])
def test_bad_hooks_fail_with_a_message_naming_the_hook(kind, path, message):
    with pytest.raises(HookError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_hook(kind, path)


def test_good_hooks_load_in_both_path_spellings():
    assert load_hook("reward", f"{H}:reward") is example_hooks.reward
    assert load_hook("loss", f"{H}.loss") is example_hooks.loss
    assert load_hook("generate", "") is None


def test_generate_hook_serves_through_the_gateway(make_settings, tiny_engine):
    s = make_settings({"server.open_mode": True, "hooks.generate": f"{H}:generate"})
    store = DataStore(s.storage.data_root)
    before = example_hooks.CALLS.get("generate", 0)
    with running_gateway(create_app(s, engine=tiny_engine, tokenizer=tiny_engine.tokenizer, store=store)) as gw:
        client = OpenAI(base_url=gw.base_url, api_key="x")
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=50,
                                           extra_body={"temperature": 1.0})
        chunks = list(client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                     stream=True, max_tokens=50))
    assert r.usage.completion_tokens <= 3
    assert example_hooks.CALLS["generate"] == before + 2
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    store.close()
    assert len(run_query(s.storage.data_root, "select * from turns").to_pylist()) == 2


def test_reward_loss_and_sample_source_hooks_end_to_end(prefect_harness, make_settings, tiny_engine, tmp_path):
    """Judge flow with the reward hook; train flow with the sample_source and loss hooks."""
    from clawrl.flows.judge import judge_flow
    from clawrl.flows.train import train_flow

    s = make_settings({"server.open_mode": True, "ppo.advantage_estimator": "grpo", "ppo.rollout_batch_size": 2,
                       "ppo.kl_coef": 0.0, "hooks.reward": f"{H}:reward", "hooks.loss": f"{H}:loss",
                       "hooks.sample_source": f"{H}:sample_source"})
    conf = tmp_path / "hooks.toml"
    conf.write_text(dump_toml(s))
    store = DataStore(s.storage.data_root)
    with running_gateway(create_app(s, engine=tiny_engine, tokenizer=tiny_engine.tokenizer, store=store)) as gw:
        client = OpenAI(base_url=gw.base_url, api_key="x")
        for sid, reply in [("a", "thanks!"), ("b", "meh")]:
            msgs = [{"role": "user", "content": "q"}]
            r = client.chat.completions.create(model="m", messages=msgs, max_tokens=4, extra_body={"session_id": sid})
            msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": reply}]
            client.chat.completions.create(model="m", messages=msgs, max_tokens=2,
                                           extra_body={"session_id": sid, "session_done": True})
    store.close()
    out = judge_flow(config_path=str(conf))
    assert out["fates"]["sample"] == 2
    scores = run_query(s.storage.data_root, """select t.session_id, j.score, j.judge_backend from verdicts j
                       join turns t using (turn_id) order by 1""").to_pylist()
    assert scores == [{"session_id": "a", "score": 1, "judge_backend": "hook"},
                      {"session_id": "b", "score": -1, "judge_backend": "hook"}]
    trained = train_flow(config_path=str(conf), max_steps=1)["steps"]
    [step] = trained
    assert step["metrics"]["custom_loss"] == 1.0  # the loss hook ran inside the PPO step
    [batch] = run_query(s.storage.data_root, "select sample_ids, session_ids from batches").to_pylist()
    assert batch == {"sample_ids": ["custom0", "custom1"], "session_ids": ["custom-source"]}
    from clawrl.lineage import client

    params = client(s.storage.data_root).get_run(step["mlflow_run_id"]).data.params
    assert params["hook.loss"] == f"{H}:loss" and params["hook.sample_source"] == f"{H}:sample_source"
    assert hook_params(s.hooks)["hook.reward"] == f"{H}:reward"
