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
# Set beside HF_HUB_OFFLINE when finetune set that itself (the hub did not answer), for this process and the ones it
# starts: a message about a model missing from the cache must not report the user's setting that was never made.
UNREACHABLE_MARK = "FINETUNE_HUB_UNREACHABLE"


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
    if not offline_requested():
        os.environ[UNREACHABLE_MARK] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    from huggingface_hub import constants

    constants.HF_HUB_OFFLINE = True
    datasets_config = sys.modules.get("datasets.config")  # if not imported yet, it reads the variable when it is
    if datasets_config is not None:
        datasets_config.HF_HUB_OFFLINE = True
    return True


def offline_because_unreachable() -> bool:
    """Offline because the hub did not answer (use_cache_only_if_unreachable set HF_HUB_OFFLINE), not by the user."""
    return os.environ.get(UNREACHABLE_MARK) == "1" and offline_requested()


def unreachable_and_not_cached(name: str, *, revision: str | None = None) -> bool:
    """Hub id `name` cannot load because the hub did not answer and the local hub cache lacks its config.json."""
    from huggingface_hub import try_to_load_from_cache

    return offline_because_unreachable() and not isinstance(
        try_to_load_from_cache(name, "config.json", revision=revision), str)


def unreachable_fix(name: str) -> str:
    """The sentence for a hub id that is neither reachable nor cached, when the hub did not answer (no user setting)."""
    return (f"the hub is not reachable from this machine (only the local cache was read), and the cache does not hold "
            f"`{name}`. Fix: download it where the hub is reachable (`hf download {name} --local-dir DIR`), bring DIR "
            "here and set model.name_or_path to DIR; or run where the hub is reachable.")
