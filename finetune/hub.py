"""Is the Hugging Face Hub reachable? Answered in seconds, so that offline machines fail fast instead of hanging.

huggingface_hub retries an unreachable endpoint five times with backoff (~23 s per file, longer per model), and
its timeouts do not cover that. One TCP connect with a short timeout tells us instead; when it fails we switch the
hub and `datasets` libraries to offline mode, so a name in their cache still loads and anything else fails at once.
Both for one call of finetune: in a process that goes on (a notebook), the next call asks the hub again, and the
offline switches are put back after each (`offline_switches`, for quiet.left_as_found).
"""

from __future__ import annotations

import os
import socket
import sys
from urllib.parse import urlparse

from finetune import quiet

_TRUE = ("1", "true", "yes", "on")
# Set beside HF_HUB_OFFLINE when finetune set that itself (the hub did not answer), for this process and the ones it
# starts: a message about a model missing from the cache must not report the user's setting that was never made.
UNREACHABLE_MARK = "FINETUNE_HUB_UNREACHABLE"


def offline_requested() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in _TRUE


# The hub's answer, per endpoint, until the call of finetune that asked ends (`offline_switches`): asked once per run,
# not for the life of the process (one unreachable moment said "not reachable" to every later run of a notebook).
_ANSWERS: dict[str, bool] = {}


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """One TCP connect to the hub endpoint (HF_ENDPOINT honoured); False when offline mode is requested."""
    if offline_requested():
        return False
    from huggingface_hub import constants

    if constants.ENDPOINT not in _ANSWERS:
        url = urlparse(constants.ENDPOINT)
        port = url.port or (443 if url.scheme == "https" else 80)
        try:
            with socket.create_connection((url.hostname, port), timeout=timeout_s):
                _ANSWERS[constants.ENDPOINT] = True
        except OSError:
            _ANSWERS[constants.ENDPOINT] = False
    return _ANSWERS[constants.ENDPOINT]


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


def _offline_as_imported() -> bool:
    return bool(quiet.environment_flag("HF_HUB_OFFLINE") or quiet.environment_flag("TRANSFORMERS_OFFLINE"))


def _datasets_offline_as_imported() -> bool:
    flag = quiet.environment_flag("HF_DATASETS_OFFLINE")
    return _offline_as_imported() if flag is None else flag


# What `use_cache_only_if_unreachable` sets: (module, attribute, what the module reads from the environment at import).
_OFFLINE_SWITCHES = (
    ("huggingface_hub.constants", "HF_HUB_OFFLINE", _offline_as_imported),
    ("datasets.config", "HF_HUB_OFFLINE", _datasets_offline_as_imported),
    ("datasets.config", "HF_DATASETS_OFFLINE", _datasets_offline_as_imported),
)


def offline_switches():
    """A snapshot for quiet.left_as_found: the offline switches as they are (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE, the
    mark, the libraries' constants), put back when the call ends; the hub's answer is forgotten at both ends (the
    next call asks again). A notebook stayed offline after one unreachable moment, its own downloads too (bb39)."""
    _ANSWERS.clear()
    put_back = quiet.settings_kept(("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", UNREACHABLE_MARK), _OFFLINE_SWITCHES)

    def put_back_and_forget() -> None:
        _ANSWERS.clear()
        put_back()

    return put_back_and_forget


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
