"""Where a model is: a bundled name, a local folder, or a Hugging Face hub id (its cached
snapshot, or the id itself when it must be downloaded). Imports no torch: `novarl validate`
and `plan` locate models without it."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from novarl.errors import UserError
from novarl.models.bundled import resolve_bundled


def resolve_model_path(name_or_path: str, *, download: bool = True, key: str = "policy.model_name") -> str:
    """The folder or hub id to load: bundled names first, then local paths, then hub ids.

    An `org/name` that is not a local folder is a Hugging Face hub id: see
    `resolve_hub_id` (`download=False` for callers that read only config.json from
    the cache, such as `novarl plan`). Anything else that is not a model folder is
    an error naming it (and `key`, the setting that gave it).
    """
    bundled = resolve_bundled(name_or_path)
    if bundled is not None:
        return str(bundled)
    path = Path(name_or_path).expanduser()
    try:
        is_dir, exists = path.is_dir(), path.exists()
        has_config = is_dir and (path / "config.json").is_file()
    except (OSError, ValueError) as err:  # a name too long, a folder that may not be entered, a NUL byte
        raise UserError(f"{key}='{name_or_path}': cannot open it "
                        f"({getattr(err, 'strerror', None) or err}).") from None
    if is_dir:
        if not has_config:
            raise UserError(f"{key}='{name_or_path}': the folder has no config.json; "
                            "give a Hugging Face model folder (config.json + *.safetensors).")
        return str(path)
    hub_id = name_or_path.count("/") == 1 and not name_or_path.startswith((".", "/", "~"))
    if not hub_id or exists:
        raise UserError(f"{key}='{name_or_path}': no model folder there. Give a local "
                        "Hugging Face folder, a hub id (org/name), or a bundled model (tiny-arith).")
    return resolve_hub_id(name_or_path, download=download)


HUB_PROBE_TIMEOUT_S = 3.0
"""How long the one reachability probe of the hub may take before the hub counts as unreachable."""

_REACHABLE: set[tuple[str, str]] = set()
"""(endpoint, repo id) pairs the hub has answered for in this process: probed once, not per load."""


def resolve_hub_id(repo_id: str, *, download: bool = True) -> str:
    """The local Hugging Face cache's snapshot folder of `repo_id`, or `repo_id` itself
    when it must be downloaded and the hub answers; otherwise a `UserError` in seconds.
    With `download=False` nothing touches the network: the snapshot folder when
    config.json is cached, else `repo_id` as it is (the caller reads the cache only).

    A cached snapshot with config.json and safetensors weights is returned as a folder,
    so nothing touches the network afterwards. A snapshot with config.json only (say
    the config alone was downloaded) is completed from the hub when it answers, else
    returned as it is. Without a usable snapshot, HF_HUB_OFFLINE=1 fails at once;
    otherwise one probe (no retries, `HUB_PROBE_TIMEOUT_S`) decides: transformers'
    own downloads retry a dead network with backoff for about a minute
    (huggingface_hub `hf_hub_download` -> `http_backoff`, 5 retries a file).
    """
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    cache_dir = constants.HF_HUB_CACHE  # HF_HUB_CACHE, else HF_HOME/hub, as huggingface_hub reads them
    try:
        cached = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache_dir)
    except HFValidationError as err:
        raise UserError(f"policy.model_name='{repo_id}' is neither a local folder nor a valid Hugging Face "
                        f"hub id: {_first_line(err)}") from None
    snapshot = Path(cached).parent if isinstance(cached, str) else None
    if snapshot is not None and (not download or _has_safetensors_weights(snapshot)):
        return str(snapshot)
    if not download:
        return repo_id
    where = f"it is not in the local Hugging Face cache ({cache_dir})"
    fix = (f"Download it on a machine with access (hf download {repo_id}) and copy the cache, point "
           "HF_HOME or HF_HUB_CACHE at a cache that holds it, or give a local model folder.")
    if hub_offline():
        if snapshot is not None:
            return str(snapshot)
        raise UserError(f"policy.model_name='{repo_id}': {where} and HF_HUB_OFFLINE=1 forbids downloading "
                        f"it (there is no local folder of that name either). {fix}")
    endpoint = os.environ.get("HF_ENDPOINT", constants.ENDPOINT).rstrip("/")
    problem = probe_hub(endpoint, repo_id)
    if problem is None:
        return repo_id
    if snapshot is not None:
        return str(snapshot)
    raise UserError(f"policy.model_name='{repo_id}': cannot reach the Hugging Face hub at {endpoint} "
                    f"({problem}), and {where}; there is no local folder of that name either. {fix} "
                    "Set HF_HUB_OFFLINE=1 to fail at once without trying the network.")


def hub_offline() -> bool:
    from huggingface_hub import constants

    flags = (os.environ.get("HF_HUB_OFFLINE"), os.environ.get("TRANSFORMERS_OFFLINE"))
    return constants.HF_HUB_OFFLINE or any(f is not None and f.upper() in {"1", "ON", "YES", "TRUE"} for f in flags)


def _has_safetensors_weights(folder: Path) -> bool:
    """Whether `folder` holds every safetensors shard its index names (or one file without an index)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError):
            return False
        return all((folder / shard).is_file() for shard in shards)
    return any(folder.glob("*.safetensors"))


def probe_hub(endpoint: str, repo_id: str, repo_type: str = "model") -> str | None:
    """None when the hub at `endpoint` answers (any HTTP status: the id may be private or
    wrong, which transformers reports), else what went wrong. One request, no retries,
    bounded by `HUB_PROBE_TIMEOUT_S` even where name resolution hangs."""
    if (endpoint, repo_id) in _REACHABLE:
        return None
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    outcome: list[str | None] = []

    def probe() -> None:
        try:
            HfApi(endpoint=endpoint).repo_info(repo_id, repo_type=repo_type, timeout=HUB_PROBE_TIMEOUT_S)
            outcome.append(None)
        except HfHubHTTPError:
            outcome.append(None)  # the server answered
        except Exception as err:  # noqa: BLE001 - connection refused, DNS, TLS, proxy, ...: all unreachable
            outcome.append(f"{type(err).__name__}: {_first_line(err)}")

    thread = threading.Thread(target=probe, name="novarl-hub-probe", daemon=True)
    thread.start()
    thread.join(HUB_PROBE_TIMEOUT_S + 1.0)
    if not outcome:
        return f"no answer in {HUB_PROBE_TIMEOUT_S + 1.0:.0f} s"
    if outcome[0] is None:
        _REACHABLE.add((endpoint, repo_id))
    return outcome[0]


def download_snapshot(repo_id: str) -> str:
    """`repo_id`'s config, tokenizer and safetensors files, downloaded into the local Hugging
    Face cache now, in this process, as a folder: what the Megatron backend converts (its
    ranks read files, not hub ids)."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
    except Exception as err:  # noqa: BLE001 - network, permissions, a gated repo: all end the same way
        raise UserError(f"policy.model_name='{repo_id}': downloading it for the Megatron conversion failed "
                        f"({type(err).__name__}: {_first_line(err)}).") from None


def _first_line(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
