"""Upload an exported folder to the Hugging Face Hub (`finetune export ... --push-to-hub REPO`); the export stays either way.
"""

from __future__ import annotations

from pathlib import Path

from finetune.outputs.export import ExportError


def push_to_hub(out: Path, repo: str) -> str:
    """Upload the exported folder to a hub repo; ExportError (the export itself stays) when that is not possible."""
    import os

    from finetune.hub import offline_because_unreachable

    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        why = ("the hub is not reachable from this machine" if offline_because_unreachable() else
               "HF_HUB_OFFLINE is set")
        raise ExportError(
            f"--push-to-hub {repo}: {why}, so nothing was uploaded. The export in {out} is "
            f"complete; upload it later where the hub is reachable: `hf upload {repo} {out}`."
        )
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "10")
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "10")
    try:
        from huggingface_hub import HfApi

        api = HfApi()
        api.create_repo(repo, exist_ok=True, private=True)
        api.upload_folder(folder_path=str(out), repo_id=repo, commit_message="finetune export")
    except Exception as exc:  # noqa: BLE001 - network, auth and hub errors come in many types; all mean "not uploaded"
        reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise ExportError(
            f"--push-to-hub {repo}: upload failed ({reason}). The export in {out} is complete; check "
            f"the network and `hf auth login`, then `hf upload {repo} {out}`."
        ) from None
    return f"uploaded {out} to https://huggingface.co/{repo} (private)"
