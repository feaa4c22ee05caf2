"""`pretrained: auto` against a small fake Hugging Face hub on 127.0.0.1: downloaded, then cached,
then unreachable, each through the real timm and huggingface_hub code paths (in a child process, so
that `HF_ENDPOINT` is read at import as it is in a stage)."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import timm
from safetensors.torch import save_file

from conftest import ROOT

CHILD = """
import json
from cnnpipe.config import ModelConfig
from cnnpipe.models import create_model
model, init = create_model(ModelConfig(name="test_resnet", pretrained="auto"), num_classes=10, in_chans=3)
print("INIT", json.dumps({**init.to_dict(), "stem": float(model.conv1[0].weight.flatten()[0])}))
"""


class FakeHub(http.server.ThreadingHTTPServer):
    """Serves one weights file at /<repo>/resolve/<revision>/model.safetensors (404 for anything else)
    with the headers huggingface_hub reads; counts the requests it gets."""

    def __init__(self, weights: Path) -> None:
        self.weights, self.requests = weights.read_bytes(), []
        self.etag = hashlib.sha256(self.weights).hexdigest()
        super().__init__(("127.0.0.1", 0), _Handler)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(http.server.BaseHTTPRequestHandler):
    def _answer(self, body: bool) -> None:
        hub: FakeHub = self.server  # type: ignore[assignment]
        hub.requests.append((self.command, self.path))
        if not self.path.split("?")[0].endswith("/model.safetensors"):
            self.send_response(404)
            self.send_header("X-Error-Code", "EntryNotFound")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("X-Repo-Commit", "0" * 40)
        self.send_header("ETag", f'"{hub.etag}"')
        self.send_header("Content-Length", str(len(hub.weights)))
        self.end_headers()
        if body:
            self.wfile.write(hub.weights)

    def do_HEAD(self) -> None:  # noqa: N802 (http.server's naming)
        self._answer(body=False)

    def do_GET(self) -> None:  # noqa: N802
        self._answer(body=True)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture()
def weights(tmp_path) -> Path:
    """test_resnet's ImageNet-shaped weights with a recognisable stem, as the hub would hold them."""
    model = timm.create_model("test_resnet", pretrained=False)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    state["conv1.0.weight"].fill_(0.125)
    path = tmp_path / "model.safetensors"
    save_file(state, str(path))
    return path


def load(endpoint: str, hf_home: Path) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}  # conftest keeps the suite offline
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(hf_home), HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1")
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("INIT "))
    return json.loads(line[5:]), proc.stderr


def test_auto_downloads_from_the_hub_then_uses_the_cache_then_says_when_it_has_neither(tmp_path, weights):
    hub = FakeHub(weights)
    threading.Thread(target=hub.serve_forever, daemon=True).start()
    try:
        init, _ = load(hub.endpoint, tmp_path / "hf")
        assert init["source"] == "hub" and init["location"] == "timm/test_resnet.r160_in1k"
        assert init["sha256"] == hub.etag and init["stem"] == 0.125  # the served weights, really loaded
        assert ("GET", "/timm/test_resnet.r160_in1k/resolve/main/model.safetensors") in hub.requests
        hub.requests.clear()
        init, _ = load(hub.endpoint, tmp_path / "hf")  # the same HF_HOME: the cache answers
        assert init["source"] == "hub-cache" and init["sha256"] == hub.etag and init["stem"] == 0.125
        assert hub.requests == []
    finally:
        hub.shutdown()
        hub.server_close()
    init, err = load(hub.endpoint, tmp_path / "empty-cache")  # the port is closed now
    assert init["source"] == "random" and init["stem"] != 0.125
    assert f"{hub.endpoint.removeprefix('http://')} is not reachable" in err and "RANDOM init" in err
