"""Is the Hugging Face Hub reachable? Answered in seconds, so that offline machines fail fast instead of hanging.

huggingface_hub retries an unreachable endpoint five times with backoff (~23 s per file, longer per model), and
its timeouts do not cover that. One TCP connect with a short timeout tells us instead; when it fails we switch the
hub and `datasets` libraries to offline mode, so a name in their cache still loads and anything else fails at once.
"""

from __future__ import annotations

import functools
import os
import socket
import sys
from urllib.parse import urlparse

_TRUE = ("1", "true", "yes", "on")


def offline_requested() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in _TRUE


@functools.lru_cache(maxsize=1)
def hub_reachable(timeout_s: float = 3.0) -> bool:
    """One TCP connect to the hub endpoint (HF_ENDPOINT honoured); False when offline mode is requested."""
    if offline_requested():
        return False
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def use_cache_only_if_unreachable() -> bool:
    """Put huggingface_hub and datasets in offline mode when the hub cannot be reached; True if offline."""
    if hub_reachable():
        return False
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    from huggingface_hub import constants

    constants.HF_HUB_OFFLINE = True
    datasets_config = sys.modules.get("datasets.config")  # if not imported yet, it reads the variable when it is
    if datasets_config is not None:
        datasets_config.HF_HUB_OFFLINE = True
    return True
