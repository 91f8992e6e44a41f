"""Servers shared by the fault tests: one with tight limits, debug endpoints and the priority policy."""

from __future__ import annotations

import pytest

from tests.live_server import API_KEY, start_server, stop_server

FAULT_MAX_MODEL_LEN = 512
FAULT_MAX_NUM_SEQS = 16
FAULT_MAX_WAITING = 300


@pytest.fixture(scope="session")
def fault_server(tmp_path_factory, smol_dir):
    log = tmp_path_factory.mktemp("fault-server") / "server.log"
    server = start_server(log, [
        "--api-key", API_KEY, "--num-kv-blocks", "224", "--max-num-seqs", str(FAULT_MAX_NUM_SEQS),
        "--max-model-len", str(FAULT_MAX_MODEL_LEN), "--max-waiting-requests", str(FAULT_MAX_WAITING),
        "--scheduling-policy", "priority", "--enable-debug-endpoints", "--max-request-bytes", "1MiB",
        "--log-interval", "1", "--shutdown-timeout", "5",
    ])
    yield server
    stop_server(server)
