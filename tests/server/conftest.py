"""The server most API tests share: the default model in float32 behind an API key (`server_utils.KEY`), one per test
module (module scope), so no module sees another's cache or counters. A module that needs other flags
defines its own `server` fixture, which takes precedence."""

from __future__ import annotations

import pytest

from tests.server_utils import SHARED_SERVER_FLAGS, running_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("srv") / "server.log"
    with running_server(*SHARED_SERVER_FLAGS, log=log) as base:
        yield base
