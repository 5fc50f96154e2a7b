"""One look at whether the Hugging Face hub answers, before anything loads from it.

Offline, `huggingface_hub` retries each request with back-off, so a model that is neither cached
nor local took over a minute to fail. When a run needs the hub and one connection attempt fails,
the hub libraries are switched to their offline mode (`HF_HUB_OFFLINE`, `HF_DATASETS_OFFLINE`)
before they are imported: cached files still load. A model from the hub that is not in the local
cache then cannot load at all, so offline it is refused here, before Hydra starts any job.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from evals.datasets import registry_spec
from longflow.errors import UserError

REPO = Path(__file__).resolve().parents[1]
ENDPOINT = "https://huggingface.co"  # huggingface_hub's default; HF_ENDPOINT replaces it
PROBE_SECONDS = 3.0  # one TCP connection attempt: the hub answers in well under a second when reachable
OFFLINE = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def hub_model(cfg: dict[str, Any]) -> tuple[str, str] | None:
    """(hub id, revision) of a composed run config's model when its weights come from the hub:
    pretrained weights that are no folder here."""
    model = cfg["model"]
    hub_id = str(model["hub_id"])
    if model["weights"] == "random" or Path(hub_id).expanduser().exists() or (REPO / hub_id).exists():
        return None
    return hub_id, str(model["revision"])


def needs_hub(cfg: dict[str, Any]) -> bool:
    """Whether a composed run config loads anything from the hub: pretrained weights that are no
    folder here, or a dataset read from the hub (no `root`, no generator)."""
    if hub_model(cfg) is not None:
        return True
    dataset = cfg["dataset"]
    overrides = dataset.get("overrides") or {}
    for name in dataset["names"]:
        spec = registry_spec(name, **overrides.get(name, {}))
        if spec.generator is None and not (spec.root or dataset.get("root")):
            return True
    return False


def probe_address() -> tuple[str, int]:
    """(host, port) of the first hop to the hub: the HTTPS proxy when one is set, else the endpoint."""
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
    url = urlparse(proxy or os.environ.get("HF_ENDPOINT", ENDPOINT))
    return url.hostname or "", url.port or (443 if url.scheme == "https" else 80)


def offline_unless_reachable(configs: Iterable[dict[str, Any]]) -> None:
    """Sets the hub libraries offline when some config needs the hub and one connection fails; offline
    (so, or by the user's `HF_HUB_OFFLINE`), a UserError when a config's model from the hub is not in
    the local cache."""
    configs = list(configs)
    if not any(needs_hub(cfg) for cfg in configs):
        return
    if any(os.environ.get(name) for name in OFFLINE):
        if os.environ.get("HF_HUB_OFFLINE"):
            check_cached(configs, "the hub is switched off (HF_HUB_OFFLINE)")
        return
    host, port = probe_address()
    try:
        socket.create_connection((host, port), timeout=PROBE_SECONDS).close()
    except OSError as error:
        for name in OFFLINE:
            os.environ[name] = "1"
        unreachable = f"the hub ({host}) is unreachable ({error.strerror or error})"
        check_cached(configs, unreachable)
        print(f"note: {unreachable}: loading from the local cache only", file=sys.stderr)


def check_cached(configs: list[dict[str, Any]], offline: str) -> None:
    """Every model the configs load from the hub is in the local hub cache (its config.json at its
    revision), or a UserError saying so after `offline`, the reason the hub cannot be asked."""
    # Imported once the offline switches are set: the hub library reads them when it is imported.
    from huggingface_hub import try_to_load_from_cache

    for hub_id, revision in dict.fromkeys(model for cfg in configs if (model := hub_model(cfg)) is not None):
        try:
            cached = isinstance(try_to_load_from_cache(hub_id, "config.json", revision=revision), str)
        except ValueError:  # not a repo id at all: nothing of it can be cached
            cached = False
        if not cached:
            raise UserError(f"{offline}, and the model {hub_id} (revision {revision}) is not in the local hub "
                            "cache: run where the hub is reachable, or set model.hub_id to a folder that holds it")
