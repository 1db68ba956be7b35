"""Secrets never leave the environment: API keys, the admin key and the provider key, all set as env
vars with distinctive values, are looked for everywhere clawrl writes or says something.

Traffic goes through the real gateway (uvicorn, the openai SDK and raw HTTP) with the right keys and
a wrong key that carries its own distinctive string (a 401 must not echo it); the judge flow runs
with the rule judge and again with the provider judge (the provider is this gateway itself, reached
with the provider key, and once more with a wrong provider key so its 401 lands in the judge's
error records); the train flow trains, logs to MLflow and syncs the served engine through the
gateway's /engine with the admin key from the env (the sync fails without it). Then every file
under the data root (Parquet decoded as well as raw bytes, the write-ahead log segments before
conversion, config snapshots, checkpoints, the MLflow sqlite db and artifacts) and the Prefect test
server's database, all log records of every logger (flows' prints included: log_prints), every
MLflow param and tag of every run and model version, and every error body received are searched for
each secret. Nothing runs in a subprocess here but the Prefect test server, which never sees a key.
"""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path

import httpx
import openai
import pyarrow.parquet as pq
import pytest
from openai import OpenAI

from clawrl.config import dump_toml
from clawrl.engine.embedded import EmbeddedEngine
from clawrl.gateway.routes import create_app
from clawrl.storage.catalog import run_query
from clawrl.storage.writer import DataStore
from tests.utils.gateway_server import running_gateway
from tests.utils.waiting import HANG_S

pytestmark = [pytest.mark.reliability]

USER_KEY = "sk-live-USRSECRET-q8w7e6r5t4"
PROVIDER_KEY = "sk-live-PROVSECRET-p0o9i8u7y6"
ADMIN_KEY = "sk-admin-ADMSECRET-z1x2c3v4b5"
WRONG_KEY = "sk-wrong-WRONGSECRET-m5n6b7v8c9"
# each secret and its random tail: a truncated or re-encoded leak still contains the tail
NEEDLES = [s for k in (USER_KEY, PROVIDER_KEY, ADMIN_KEY, WRONG_KEY) for s in (k, k.split("-")[-1], k.split("-")[2])]


class Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
        except Exception:  # a bad format string must not hide the raw message and args
            text = f"{record.msg!r} {record.args!r}"
        if record.exc_info:
            text += "\n" + logging.Formatter().formatException(record.exc_info)
        self.lines.append(f"{record.name}: {text}")


def _attach(handler: logging.Handler) -> list[logging.Logger]:
    """The root logger and every logger that does not propagate to it (Prefect's, uvicorn's...)."""
    loggers = [logging.getLogger()] + [lg for lg in logging.root.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger) and not lg.propagate]
    for lg in loggers:
        lg.addHandler(handler)
    return loggers


def _file_texts(path: Path) -> list[bytes]:
    """The raw bytes, plus decoded forms where the bytes may be compressed."""
    raw = path.read_bytes()
    out = [raw]
    if path.suffix == ".parquet":
        table = pq.read_table(path)
        out.append(json.dumps(table.to_pylist(), default=str).encode())
        out.append(str(table.schema.metadata).encode())
    elif path.suffix == ".gz":
        out.append(gzip.decompress(raw))
    return out


def _conversation(client: OpenAI, sid: str, question: str, feedback: str) -> None:
    msgs = [{"role": "user", "content": question}]
    r = client.chat.completions.create(model="m", messages=msgs, max_tokens=8, extra_body={"session_id": sid})
    msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": feedback}]
    client.chat.completions.create(model="m", messages=msgs, max_tokens=4,
                                   extra_body={"session_id": sid, "session_done": True})


@pytest.mark.timeout(HANG_S)
def test_keys_never_reach_logs_parquet_mlflow_or_error_messages(prefect_harness, make_settings, tiny_dir, tmp_path,
                                                                monkeypatch):
    from prefect.settings import PREFECT_API_DATABASE_CONNECTION_URL

    from clawrl.lineage import client as mlflow_client
    from clawrl.flows.judge import judge_flow
    from clawrl.flows.train import train_flow

    monkeypatch.setenv("CLAWRL_API_KEYS", f"{USER_KEY},{PROVIDER_KEY}")
    monkeypatch.setenv("CLAWRL_ADMIN_KEYS", ADMIN_KEY)
    monkeypatch.setenv("CLAWRL_PROVIDER_API_KEY", PROVIDER_KEY)
    monkeypatch.setenv("CLAWRL_WRONG_PROVIDER_KEY", WRONG_KEY)
    base = {"server.open_mode": False, "ppo.rollout_batch_size": 2, "ppo.advantage_estimator": "grpo",
            "ppo.temperature": 1.0, "ppo.lr": 1e-3, "ppo.micro_batch_size": 2, "prm.backend": "rule",
            "prm.judge_samples": 1, "prm.max_new_tokens": 8}
    s = make_settings(base)
    confs = {}
    for name, extra in (("rule", {}),
                        ("provider", {"prm.backend": "provider", "provider.model": "m"}),
                        ("wrong", {"prm.backend": "provider", "provider.model": "m",
                                   "provider.api_key_env": "CLAWRL_WRONG_PROVIDER_KEY",
                                   "prm.max_new_tokens": 6})):  # another judge config hash: judged again
        confs[name] = (tmp_path / f"{name}.toml", extra)
    handler = Collect()
    loggers = _attach(handler)
    root_level = logging.getLogger().level
    logging.getLogger().setLevel(logging.DEBUG)
    engine = EmbeddedEngine(tiny_dir, max_batch_size=8, max_context_len=1024)
    store = DataStore(s.storage.data_root, flush_interval_s=3600)  # the WAL stays until flushed: scanned below
    errors: list[str] = []
    wal_hits: list[tuple[str, str]] = []
    wal_files: list[Path] = []
    try:
        with running_gateway(create_app(s, engine=engine, tokenizer=engine.tokenizer, store=store)) as gw:
            for name, (path, extra) in confs.items():
                cs = make_settings({**base, **extra, "provider.base_url": gw.base_url})
                path.write_text(dump_toml(cs))
            user = OpenAI(base_url=gw.base_url, api_key=USER_KEY, max_retries=0)
            _conversation(user, "alice", "What is the capital of France?", "no, answer in one word please")
            _conversation(user, "bob", "Name a primary color.", "thanks, perfect!")
            # wrong keys everywhere, and a user key where an admin key is needed
            with pytest.raises(openai.AuthenticationError) as e:
                OpenAI(base_url=gw.base_url, api_key=WRONG_KEY, max_retries=0).chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}])
            errors += [str(e.value), json.dumps(e.value.body)]
            user_routes = [("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("GET", "/v1/sessions/alice")]
            admin_routes = [("POST", "/admin/pause"), ("POST", "/engine/update_weights_from_disk"),
                            ("GET", "/engine/model_info")]
            for key, routes in ((WRONG_KEY, user_routes + admin_routes), (USER_KEY, admin_routes),
                                (f"{WRONG_KEY}{ADMIN_KEY}", user_routes + admin_routes)):
                for method, path in routes:
                    r = httpx.request(method, gw.url + path, headers={"Authorization": f"Bearer {key}"},
                                      json={"messages": [{"role": "user", "content": "hi"}], "model_path": "/x"})
                    errors.append(f"{r.status_code} {dict(r.headers)} {r.text}")
            assert sorted(e[:3] for e in errors[2:]) == ["401"] * 12 + ["403"] * 3, errors
            admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
            assert httpx.post(gw.url + "/admin/pause", headers=admin).status_code == 200
            assert httpx.post(gw.url + "/admin/resume", headers=admin).status_code == 200
            mine = httpx.get(gw.base_url + "/sessions/alice", headers={"Authorization": f"Bearer {USER_KEY}"})
            assert mine.status_code == 200 and len(mine.json()["turns"]) == 2
            _conversation(user, "carol", "Name a planet.", "thanks!")  # in the write-ahead log only, until flushed
            wal_files = sorted(Path(s.storage.data_root).rglob("*.wal"))
            wal_hits = [(str(p), n) for p in wal_files for n in NEEDLES if n.encode() in p.read_bytes()]
            assert len(wal_files) >= 2 and any(b"Name a planet" in p.read_bytes() for p in wal_files)
            store.flush()

            judged = judge_flow(config_path=str(confs["rule"][0]))
            assert judged["fates"]["sample"] == 3, judged
            out = train_flow(config_path=str(confs["rule"][0]), max_steps=1, engine_url=gw.url + "/engine")
            [step] = out["steps"]
            assert step["sync"]["success"] and step["sync"]["weight_version"] == "1", step["sync"]  # via the admin key
            assert httpx.get(gw.url + "/engine/model_info", headers=admin).json()["weight_version"] == "1"
            provider = judge_flow(config_path=str(confs["provider"][0]))  # the provider key, sent to this gateway
            assert provider["judged"] >= 2 and provider["fates"].get("judge_error", 0) == 0, provider
            wrong = judge_flow(config_path=str(confs["wrong"][0]))  # 401s from the "provider"
            assert wrong["fates"].get("judge_error", 0) >= 2 and wrong["fates"].get("sample", 0) == 0, wrong
            store.flush()
    finally:
        store.close()
        for lg in loggers:
            lg.removeHandler(handler)
        logging.getLogger().setLevel(root_level)
    recorded_errors = [r["error"] for r in run_query(s.storage.data_root,
                                                     "select error from verdicts where error is not null").to_pylist()]
    assert recorded_errors and all("HTTP 401" in e for e in recorded_errors), recorded_errors[:3]
    errors += recorded_errors

    # MLflow: every param and tag of every run, and of every registered model version
    ml = mlflow_client(s.storage.data_root)
    mlflow_items: list[str] = []
    runs = [r for exp in ml.search_experiments() for r in ml.search_runs([exp.experiment_id])]
    for run in runs:
        mlflow_items += [f"{k}={v}" for k, v in {**run.data.params, **run.data.tags}.items()]
    for mv in ml.search_model_versions():
        mlflow_items += [f"{k}={v}" for k, v in mv.tags.items()] + [str(mv.source), str(mv.description)]
    assert len(runs) >= 1 and len(mlflow_items) >= 20

    # files: everything under the data root, and the Prefect test server's database directory
    prefect_db = Path(PREFECT_API_DATABASE_CONNECTION_URL.value().split("///", 1)[1]).parent
    files = [p for root in (s.storage.data_root, prefect_db) for p in Path(root).rglob("*") if p.is_file()]
    kinds = {p.suffix for p in files}
    assert {".parquet", ".db", ".toml", ".safetensors"} <= kinds, kinds
    assert any("mlflow" in p.parts and "artifacts" in p.parts for p in files)
    hits = list(wal_hits)
    for p in files:
        for blob in _file_texts(p):
            hits += [(str(p), n) for n in NEEDLES if n.encode() in blob]
    for where, texts in (("log", handler.lines), ("mlflow", mlflow_items), ("error body", errors)):
        hits += [(where, n) for t in texts for n in NEEDLES if n in t]
    print(f"secrets scan: {len(wal_files)} WAL segments + {len(files)} files ({sorted(kinds)}), "
          f"{len(handler.lines)} log records, {len(mlflow_items)} MLflow "
          f"params/tags of {len(runs)} runs, {len(errors)} error bodies, {len(NEEDLES)} needles: {len(hits)} hits")
    assert len(files) > 0 and len(handler.lines) > 50 and len(errors) >= 15
    assert hits == []
