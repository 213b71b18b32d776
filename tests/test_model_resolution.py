"""Hub ids (org/name) in policy.model_name: the local Hugging Face cache first, and a
`UserError` in seconds when the model is not cached and cannot be downloaded --
not a minute of transformers' retries. Nothing here reaches beyond 127.0.0.1.

The cache is a folder under tmp_path in huggingface_hub's own layout
(models--org--name/{refs/main, blobs/, snapshots/<commit>/}); huggingface_hub reads
HF_HOME/HF_HUB_CACHE at import, so the in-process tests patch its constants too,
and one subprocess test sets HF_HOME in the environment alone.
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import time

import huggingface_hub
import pytest

from novarl.cli import main
from novarl.errors import UserError
from novarl.models.bundled import resolve_bundled
from novarl.models.loading import load_causal_lm, load_tokenizer, resolve_model_path

from tests.helpers.hub import REPO_ID, cache_snapshot

CLOSED_PORT = "http://127.0.0.1:9"  # discard port: nothing listens, the connection is refused at once


def bundled_files() -> dict[str, bytes]:
    folder = resolve_bundled("tiny-arith")
    return {path.name: path.read_bytes() for path in folder.iterdir() if path.is_file()}


CONFIG = json.dumps({"model_type": "llama"}).encode()


class HubStub:
    """An HTTP server on 127.0.0.1 that answers every request with `status`, counting them."""

    def __init__(self, status: int):
        requests: list[str] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - the http.server API
                requests.append(self.path)
                body = json.dumps({"id": REPO_ID} if status == 200 else {"error": "Repository not found"}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.requests = requests
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hub_stub(monkeypatch):
    stub = HubStub(status=200)
    monkeypatch.setenv("HF_ENDPOINT", stub.endpoint)
    yield stub
    stub.close()


# ============================================================ cached: a local folder, no network
def test_cached_hub_id_resolves_to_its_snapshot_folder(hub_cache, monkeypatch):
    snapshot = cache_snapshot(hub_cache, REPO_ID, {"config.json": CONFIG, "model.safetensors": b"weights",
                                                   "tokenizer.json": b"{}"})
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda *a, **k: pytest.fail("probed the hub"))
    assert resolve_model_path(REPO_ID) == str(snapshot)


def test_cached_hub_id_loads_with_the_hub_unreachable(hub_cache, monkeypatch):
    snapshot = cache_snapshot(hub_cache, "someorg/tiny", bundled_files())
    monkeypatch.setenv("HF_ENDPOINT", CLOSED_PORT)  # anything that tried the network would fail (after a minute)
    start = time.monotonic()
    tokenizer = load_tokenizer("someorg/tiny")
    model = load_causal_lm("someorg/tiny")
    assert time.monotonic() - start < 10
    assert tokenizer.name_or_path == str(snapshot)
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 2


def test_cached_hub_id_gives_plan_its_shape(hub_cache, capsys, monkeypatch):
    cache_snapshot(hub_cache, "someorg/tiny", {"config.json": bundled_files()["config.json"]})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = main(["plan", "--model", "someorg/tiny"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "layout advice skipped" not in out


@pytest.mark.parametrize("files", [
    {"config.json": CONFIG},
    {"config.json": CONFIG, "model.safetensors.index.json":
        json.dumps({"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}}).encode(),
     "model-1.safetensors": b"half"},
], ids=["config-only", "a-shard-missing"])
def test_incomplete_snapshot_is_completed_from_the_hub_when_it_answers(hub_cache, hub_stub, files):
    cache_snapshot(hub_cache, REPO_ID, files)
    assert resolve_model_path(REPO_ID) == REPO_ID  # transformers downloads the rest
    assert hub_stub.requests == [f"/api/models/{REPO_ID}"]


@pytest.mark.parametrize("offline", [True, False], ids=["offline", "hub-unreachable"])
def test_incomplete_snapshot_is_used_as_it_is_without_the_hub(hub_cache, monkeypatch, offline):
    snapshot = cache_snapshot(hub_cache, REPO_ID, {"config.json": CONFIG})  # enough for `novarl plan`
    monkeypatch.setenv("HF_HUB_OFFLINE" if offline else "HF_ENDPOINT", "1" if offline else CLOSED_PORT)
    assert resolve_model_path(REPO_ID) == str(snapshot)


def test_without_download_only_the_cache_is_read(hub_cache, monkeypatch):
    """For callers that need config.json alone (`novarl plan`): no probe, no error of ours."""
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda *a, **k: pytest.fail("probed the hub"))
    assert resolve_model_path(REPO_ID, download=False) == REPO_ID
    snapshot = cache_snapshot(hub_cache, REPO_ID, {"config.json": CONFIG})
    assert resolve_model_path(REPO_ID, download=False) == str(snapshot)


def test_hf_home_from_the_environment_is_honoured(tmp_path):
    home = tmp_path / "hf_home"
    snapshot = cache_snapshot(home / "hub", REPO_ID, {"config.json": CONFIG, "model.safetensors": b"weights"})
    env = {k: v for k, v in os.environ.items() if k not in {"HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"}}
    env.update(HF_HOME=str(home), HF_ENDPOINT=CLOSED_PORT)
    proc = subprocess.run([sys.executable, "-c", "from novarl.models.loading import resolve_model_path; "
                           f"print(resolve_model_path({REPO_ID!r}))"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(snapshot)


# ============================================================ not cached
def test_uncached_hub_id_offline_fails_at_once(hub_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", CLOSED_PORT)
    start = time.monotonic()
    with pytest.raises(UserError) as err:
        resolve_model_path(REPO_ID)
    assert time.monotonic() - start < 3
    msg = str(err.value)
    assert f"policy.model_name='{REPO_ID}'" in msg
    assert f"not in the local Hugging Face cache ({hub_cache})" in msg
    assert "HF_HUB_OFFLINE=1 forbids downloading it" in msg
    assert f"hf download {REPO_ID}" in msg
    assert "cannot reach" not in msg  # no probe was made


def test_uncached_hub_id_with_the_hub_unreachable_fails_in_seconds(hub_cache, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", CLOSED_PORT)
    start = time.monotonic()
    with pytest.raises(UserError) as err:
        resolve_model_path(REPO_ID)
    assert time.monotonic() - start < 10
    msg = str(err.value)
    assert f"policy.model_name='{REPO_ID}': cannot reach the Hugging Face hub at {CLOSED_PORT} (ConnectError" in msg
    assert f"not in the local Hugging Face cache ({hub_cache})" in msg
    assert f"hf download {REPO_ID}" in msg
    assert "Set HF_HUB_OFFLINE=1 to fail at once" in msg


@pytest.mark.parametrize("status", [200, 404], ids=["found", "not-found"])
def test_uncached_hub_id_is_passed_on_when_the_hub_answers(hub_cache, monkeypatch, status):
    stub = HubStub(status)
    monkeypatch.setenv("HF_ENDPOINT", stub.endpoint)
    try:
        assert resolve_model_path(REPO_ID) == REPO_ID  # transformers downloads it, or says it does not exist
        assert resolve_model_path(REPO_ID) == REPO_ID
        assert stub.requests == [f"/api/models/{REPO_ID}"]  # one probe a process, no retries
    finally:
        stub.close()


def test_invalid_hub_id_is_a_user_error(hub_cache):
    with pytest.raises(UserError, match="policy.model_name='some org/bad name' is neither a local folder "
                                        "nor a valid Hugging Face hub id"):
        resolve_model_path("some org/bad name")


@pytest.mark.parametrize("offline", [True, False], ids=["offline", "hub-unreachable"])
def test_eval_of_an_uncached_hub_id_exits_2_without_traceback(hub_cache, capsys, monkeypatch, offline):
    monkeypatch.setenv("HF_ENDPOINT", CLOSED_PORT)
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    code = main(["eval", REPO_ID])
    _, err = capsys.readouterr()
    assert time.monotonic() - start < 10
    assert code == 2
    assert "Traceback" not in err
    assert f"novarl: error: policy.model_name='{REPO_ID}'" in err
    assert f"hf download {REPO_ID}" in err


# ============================================================ unchanged: bundled names and folders
def test_bundled_names_and_local_folders_are_unchanged(tmp_path):
    assert resolve_model_path("tiny-arith") == str(resolve_bundled("tiny-arith"))
    (tmp_path / "model").mkdir()
    with pytest.raises(UserError, match="the folder has no config.json"):
        resolve_model_path(str(tmp_path / "model"))
    (tmp_path / "model" / "config.json").write_bytes(CONFIG)
    assert resolve_model_path(str(tmp_path / "model")) == str(tmp_path / "model")
    with pytest.raises(UserError, match="no model folder there"):
        resolve_model_path(str(tmp_path / "missing"))
