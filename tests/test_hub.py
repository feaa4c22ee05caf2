"""`pretrained: auto` against a small fake Hugging Face hub on 127.0.0.1: downloaded, then cached,
then unreachable, each through the real timm and huggingface_hub code paths (in a child process, so
that `HF_ENDPOINT` is read at import as it is in a stage); and against torch hub's cache, where
torchvision's users keep weights (`$TORCH_HOME/hub/checkpoints`)."""

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
import sys
from cnnpipe.models import WeightsUnavailable
name = sys.argv[1] if len(sys.argv) > 1 else "test_resnet"
try:
    model, init = create_model(ModelConfig(name=name, pretrained="auto"), num_classes=10, in_chans=3)
except WeightsUnavailable as exc:
    print("REFUSED", exc)
    raise SystemExit(0)
stem = model.conv1[0].weight if name == "test_resnet" else model.conv1.weight
print("INIT", json.dumps({**init.to_dict(), "stem": float(stem.flatten()[0])}))
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


def run_child(endpoint: str, hf_home: Path, torch_home: Path | None = None,
              name: str = "test_resnet") -> subprocess.CompletedProcess:
    """`create_model(name, pretrained: auto)` in a fresh process, with its caches where the test says
    (`torch_home`: none given, an empty folder, so the machine's own torch hub cache stays out)."""
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}  # conftest keeps the suite offline
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(hf_home), HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1",
               TORCH_HOME=str(torch_home or hf_home.parent / "no-torch-home"))
    proc = subprocess.run([sys.executable, "-c", CHILD, name], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def load(endpoint: str, hf_home: Path, torch_home: Path | None = None, name: str = "test_resnet") -> tuple[dict, str]:
    proc = run_child(endpoint, hf_home, torch_home, name)
    line = next((line for line in proc.stdout.splitlines() if line.startswith("INIT ")), None)
    assert line, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(line[5:]), proc.stdout + proc.stderr


def test_auto_downloads_from_the_hub_then_uses_the_cache_then_says_when_it_has_neither(tmp_path, weights):
    hub = FakeHub(weights)
    threading.Thread(target=hub.serve_forever, daemon=True).start()
    try:
        init, _ = load(hub.endpoint, tmp_path / "hf")
        assert init["source"] == "hub" and init["location"] == "timm/test_resnet.r160_in1k"
        assert init["sha256"] == hub.etag and init["stem"] == 0.125  # the served weights, really loaded
        # counted from timm's own load: every backbone tensor, the 1000-class classifier left out for 10
        assert init["loaded"] == init["backbone"] > 0 and init["classifier"] == "replaced"
        assert ("GET", "/timm/test_resnet.r160_in1k/resolve/main/model.safetensors") in hub.requests
        hub.requests.clear()
        init, _ = load(hub.endpoint, tmp_path / "hf")  # the same HF_HOME: the cache answers
        assert init["source"] == "hub-cache" and init["sha256"] == hub.etag and init["stem"] == 0.125
        assert init["loaded"] == init["backbone"] > 0 and init["classifier"] == "replaced"
        assert hub.requests == []
    finally:
        hub.shutdown()
        hub.server_close()
    init, err = load(hub.endpoint, tmp_path / "empty-cache")  # the port is closed now
    assert init["source"] == "random" and init["stem"] != 0.125
    assert f"{hub.endpoint.removeprefix('http://')} is not reachable" in err and "RANDOM init" in err
    assert f"no test_resnet file in torch hub's cache {tmp_path / 'no-torch-home' / 'hub' / 'checkpoints'}" in err


def test_the_hub_path_counts_what_timm_loaded_and_refuses_a_partial_file(tmp_path, weights):
    """timm loads non-strictly whenever the class count differs (every fine-tune): a hub file that lacks
    part of the backbone would load silently. The count comes from the actual load, and it refuses."""
    from safetensors.torch import load_file

    state = load_file(str(weights))
    partial = {k: v for k, v in state.items() if not k.startswith("layer4.")}
    (tmp_path / "cut").mkdir()
    save_file(partial, str(cut := tmp_path / "cut" / "model.safetensors"))
    hub = FakeHub(cut)
    threading.Thread(target=hub.serve_forever, daemon=True).start()
    try:
        proc = run_child(hub.endpoint, tmp_path / "hf")
    finally:
        hub.shutdown()
        hub.server_close()
    refused = next((line for line in proc.stdout.splitlines() if line.startswith("REFUSED ")), "")
    assert "backbone tensors loaded; first missing: layer4." in refused, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "INIT" not in proc.stdout


@pytest.mark.parametrize("filename,counters", [("resnet50-11ad3fa6.pth", 53), ("resnet50-19c8e357.pth", 0)])
def test_auto_finds_torchvisions_file_in_torch_hubs_cache_and_says_which(tmp_path, filename, counters):
    """torchvision keeps `resnet50(weights=...)`'s file in `$TORCH_HOME/hub/checkpoints`: `auto` uses
    it when the Hugging Face cache has none (the hub unreachable), counts it and names it. The first
    name is IMAGENET1K_V2's in torchvision's weights enum; the second, the classic file from before
    the enum (and before BatchNorm's counters), found by torch.hub's `<name>-<hash>.pth` form."""
    import torch
    import torchvision

    state = torchvision.models.resnet50().state_dict()
    state = {k: v for k, v in state.items() if counters or not k.endswith("num_batches_tracked")}
    state["conv1.weight"].fill_(0.25)
    folder = tmp_path / "torch" / "hub" / "checkpoints"
    folder.mkdir(parents=True)
    torch.save(state, folder / filename)
    init, out = load("http://127.0.0.1:9", tmp_path / "hf", tmp_path / "torch", "resnet50")  # port 9: nothing listens
    assert init["source"] == "torch-hub-cache" and init["location"] == str(folder / filename)
    assert init["stem"] == 0.25 and init["loaded"] == init["backbone"] == 265
    assert (init["counters_loaded"], init["counters"]) == (counters, 53) and init["classifier"] == "replaced"
    assert f"model: {folder / filename} (torch hub's cache) -> resnet50: timm layout, 265/265" in out
