"""One look at whether the Hugging Face hub answers, before anything loads from it.

Offline, `huggingface_hub` retries each request with back-off, so a model that is neither cached
nor local took over a minute to fail. When a run needs the hub and one connection attempt fails,
the hub libraries are switched to their offline mode (`HF_HUB_OFFLINE`, `HF_DATASETS_OFFLINE`)
before they are imported: cached files still load, anything else fails at once with its error.
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

REPO = Path(__file__).resolve().parents[1]
ENDPOINT = "https://huggingface.co"  # huggingface_hub's default; HF_ENDPOINT replaces it
PROBE_SECONDS = 3.0  # one TCP connection attempt: the hub answers in well under a second when reachable
OFFLINE = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def needs_hub(cfg: dict[str, Any]) -> bool:
    """Whether a composed run config loads anything from the hub: pretrained weights that are no
    folder here, or a dataset read from the hub (no `root`, no generator)."""
    model = cfg["model"]
    hub_id = str(model["hub_id"])
    if model["weights"] != "random" and not (Path(hub_id).expanduser().exists() or (REPO / hub_id).exists()):
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
    """Sets the hub libraries offline when some config needs the hub and one connection fails."""
    if any(os.environ.get(name) for name in OFFLINE) or not any(needs_hub(cfg) for cfg in configs):
        return
    host, port = probe_address()
    try:
        socket.create_connection((host, port), timeout=PROBE_SECONDS).close()
    except OSError as error:
        for name in OFFLINE:
            os.environ[name] = "1"
        print(f"note: the hub ({host}) is unreachable ({error.strerror or error}): loading from the local "
              "cache only", file=sys.stderr)
