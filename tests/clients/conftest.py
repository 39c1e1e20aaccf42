"""The client-compatibility suite (`pytest -m clients tests/clients`; each module sets
`pytestmark = pytest.mark.clients`, so the default run leaves them out): popular client libraries, as their
users call them, against a real `deepinfer serve` (default model) on 127.0.0.1. One server per module.

The libraries come from the `clients` extra (`pip install -e '.[clients]'`; instructor separately, see
pyproject.toml; llama-index from a virtualenv of its own, see llama_index_requirements.txt). A module whose
library is not installed is skipped. The tests assert protocol behaviour
(requests accepted, replies parsed into the library's types), not what the 135M model knows. Nothing
here reaches beyond 127.0.0.1: the environment below turns off telemetry, tracing and remote price maps.
"""

from __future__ import annotations

import os

import pytest

from tests.server_utils import running_server

for _key, _value in {
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # LiteLLM: the bundled price map, not GitHub's
    "LITELLM_TELEMETRY": "False",
    "OPENAI_AGENTS_DISABLE_TRACING": "1",  # the Agents SDK uploads traces to OpenAI by default
    "LANGCHAIN_TRACING_V2": "false",
    "LANGSMITH_TRACING": "false",
    "LOGFIRE_IGNORE_NO_CONFIG": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ[_key] = _value

KEY = "clients-test-key"
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> str:
    """A server for the module; its root URL (the OpenAI clients add /v1). $DEEPINFER_CLIENTS_SERVER: use
    that running server instead (started with `--api-key clients-test-key` or none; for iterating on a test)."""
    if os.environ.get("DEEPINFER_CLIENTS_SERVER"):
        yield os.environ["DEEPINFER_CLIENTS_SERVER"].rstrip("/")
        return
    log = tmp_path_factory.mktemp("srv") / "server.log"
    with running_server("--api-key", KEY, "--kv-cache-memory", "256MiB", "--max-model-len", "2048",
                        "--dtype", "float32", log=log) as base:
        yield base
