"""llama-index's OpenAI-like LLM (`llama-index-llms-openai-like`): `structured_predict` of a nested model
(its function-calling program: a required tool call over the model's schema), sync and async, `chat`,
`stream_chat`, and on the completions endpoint `complete` / `stream_complete`.

llama-index runs in a virtualenv of its own (every release of llama-index-llms-openai(-like) pins
openai<3; the clients extra has openai 3.x): `.ci/run` creates it from llama_index_requirements.txt at
$DEEPINFER_LLAMAINDEX_VENV (default ${TMPDIR:-/tmp}/deepinfer-llamaindex-venv). This test runs
llama_index_client.py with that venv's python against the module's real server; without the venv it skips.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.clients.conftest import KEY, MODEL

pytestmark = pytest.mark.clients
HERE = Path(__file__).parent
REQUIREMENTS = HERE / "llama_index_requirements.txt"
VENV = Path(os.environ.get("DEEPINFER_LLAMAINDEX_VENV") or Path(tempfile.gettempdir()) / "deepinfer-llamaindex-venv")
PYTHON = VENV / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python")
PINS = dict(line.split("==") for line in REQUIREMENTS.read_text().splitlines() if "==" in line and
            not line.startswith("#"))


@pytest.fixture(scope="module")
def run(request) -> dict:
    """llama_index_client.py's report (the server starts only once the virtualenv is known to be there)."""
    if not PYTHON.exists():
        pytest.skip(f"no llama-index virtualenv at {VENV}: create it with `python3 -m venv {VENV} && {PYTHON} -m "
                    f"pip install -r {REQUIREMENTS.relative_to(HERE.parent.parent)}` (.ci/run does)")
    server = request.getfixturevalue("server")
    env = {**os.environ, "PYTHONPATH": "", "DO_NOT_TRACK": "1"}
    done = subprocess.run([str(PYTHON), str(HERE / "llama_index_client.py"), server, KEY, MODEL], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    if out["versions"] != PINS:
        pytest.skip(f"the virtualenv at {VENV} has {out['versions']}, not the pinned {PINS}: reinstall it")
    return out


def test_versions_are_the_pinned_ones(run):
    assert run["versions"] == PINS and int(run["versions"]["openai"].split(".")[0]) < 3


@pytest.mark.parametrize("name", ["structured", "astructured"])
def test_structured_predict_nested(run, name):
    step = run[name]
    assert step["result"]["type"] == "Trip" and step["result"]["destination_type"] == "City"
    (req,) = step["requests"]  # one request: a forced call of the model's schema, nested model included
    body = req["body"]
    assert req["path"] == "/v1/chat/completions" and body["tool_choice"] == "required"
    (tool,) = body["tools"]
    assert tool["function"]["name"] == "Trip" and "City" in json.dumps(tool["function"]["parameters"])


def test_chat(run):
    step = run["chat"]
    assert step["result"]["role"] == "assistant" and step["result"]["content"].strip()
    assert [r["path"] for r in step["requests"]] == ["/v1/chat/completions"]


def test_stream_chat(run):
    step = run["stream_chat"]
    assert len(step["result"]) > 1 and "".join(step["result"]).strip()
    assert step["requests"][0]["body"]["stream"] is True


def test_complete_on_the_completions_endpoint(run):
    step = run["complete"]
    assert step["result"].strip()
    assert [r["path"] for r in step["requests"]] == ["/v1/completions"]
    stream = run["stream_complete"]
    assert len(stream["result"]) > 1 and "".join(stream["result"]).strip()
    assert stream["requests"][0]["path"] == "/v1/completions" and stream["requests"][0]["body"]["stream"] is True
