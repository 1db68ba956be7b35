"""What the tests and the docs share: the offline environment, a model cache for the whole session, and the
docs themselves as tests - every python, bash, toml and json5 block of README.md and docs/*.md is a pytest
item named by its page and line (``README.md::line:37,column:1``), run by tests/utils/doc_examples.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from clawrl.config import apply_offline_env
from clawrl.supervisor import SHARED_CPU_ENV

apply_offline_env()  # before transformers/prefect/mlflow are imported by any test module
# before torch is imported: tests run engines in threads and services in subprocesses beside each
# other on 2 cores, where spinning OpenMP threads slow a busy process many times over (the servers
# `clawrl up` starts get the same setting)
for _k, _v in SHARED_CPU_ENV.items():
    os.environ.setdefault(_k, _v)

from tests.utils.doc_examples import DocPage, doc_examples  # noqa: E402  (after the environment is set)

REPO = Path(__file__).resolve().parent
# Built/converted models are reused across test runs on one machine (CI starts empty).
MODEL_CACHE = Path(os.environ.get("CLAWRL_TEST_MODEL_CACHE", REPO / ".cache" / "models"))

pytest_collect_file = doc_examples(REPO, fixture="doc_page").pytest()


@pytest.fixture(scope="session")
def model_cache() -> Path:
    MODEL_CACHE.mkdir(parents=True, exist_ok=True)
    return MODEL_CACHE


@pytest.fixture(scope="module")  # for a page's blocks the module is the page: they share its data and gateway
def doc_page(tmp_path_factory, model_cache):
    page = DocPage(tmp_path_factory.mktemp("doc-page"), model_cache)
    yield page
    page.close()
