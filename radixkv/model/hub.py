"""Where a model comes from: a local folder, or a Hugging Face repo id fetched through the Hub.

``resolve_model_folder("Qwen/Qwen2.5-0.5B-Instruct")`` returns the local snapshot folder of that
repo (downloading what is missing unless ``HF_HUB_OFFLINE`` is set) and the name to serve it
under: the id as the user wrote it, never the snapshot's commit hash. Only the files the loader
reads are fetched (:data:`MODEL_FILES`); the Hub's own cache layout
(``$HF_HOME/hub/models--org--name/snapshots/<sha>/``, ``refs/<revision>``) is used as is, so a
model another tool (transformers, vLLM, ``hf download``) already fetched is not fetched again.

``huggingface_hub`` is imported only when a repo id is resolved.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from radixkv.model.errors import ModelLoadError

# What the loader reads (loader.py): config and weights, tokenizer and chat template files.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
)
MODEL_FILES = (
    "config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    *TOKENIZER_FILES,
)

# "org/name" (or a bare "name"): the Hub's characters, no "--" or ".." (huggingface_hub's rules)
_REPO_ID = re.compile(r"^(?!.*(--|\.\.))[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_TRUE = {"1", "ON", "YES", "TRUE"}


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: the local ``folder`` to load and the ``name`` to serve it under."""

    folder: Path
    name: str


def looks_like_repo_id(text: str) -> bool:
    """True for ``org/name`` spellings (one slash, Hub characters); a path that exists locally is
    checked before this is asked."""
    return "/" in text and bool(_REPO_ID.match(text)) and not text.endswith((".git", "."))


def folder_display_name(folder: Path) -> str:
    """The name a local folder is served under: ``org/name`` for a Hub cache snapshot folder
    (``.../models--org--name/snapshots/<sha>``), else the folder's own name."""
    folder = Path(os.path.abspath(folder))
    snapshots = folder.parent
    repo = snapshots.parent.name
    if snapshots.name == "snapshots" and repo.startswith("models--"):
        return repo.removeprefix("models--").replace("--", "/")
    return folder.name


def hub_cache_dir() -> str | None:
    """The Hub cache folder from the environment as it is now (``HF_HUB_CACHE``, else
    ``HF_HOME``/hub); None: huggingface_hub's default. Read per call because huggingface_hub reads
    these variables once, when it is first imported."""
    if cache := os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(cache)
    if home := os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(home), "hub")
    return None


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) as it is set now."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in _TRUE


def resolve_model_folder(
    name_or_path: str | Path,
    *,
    revision: str | None = None,
    files: tuple[str, ...] = MODEL_FILES,
    what: str = "model",
) -> ModelSource:
    """The local folder for ``name_or_path`` (an existing folder, or a Hub repo id whose
    ``files`` are fetched at ``revision``, default the main branch) and the name to serve it
    under. Raises :class:`ModelLoadError` saying what was tried: a path that does not exist and
    does not look like a repo id, ``revision`` given for a local folder, a repo the Hub (or,
    offline, the cache) does not have."""
    text = str(name_or_path)
    path = Path(text).expanduser()
    if path.is_dir():
        if revision is not None:
            raise ModelLoadError(
                text, None, f"revision {revision!r} applies to Hugging Face repo ids, not folders"
            )
        return ModelSource(path, folder_display_name(path))
    if isinstance(name_or_path, Path) or not looks_like_repo_id(text):
        raise ModelLoadError(
            text,
            None,
            f"not a {what} folder (no such directory) and not a Hugging Face repo id (org/name)",
        )
    return ModelSource(_snapshot(text, revision, files, what), text)


def _snapshot(repo_id: str, revision: str | None, files: tuple[str, ...], what: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - a dependency; only a broken install lacks it
        raise ModelLoadError(
            repo_id, None, "loading a Hugging Face repo id needs huggingface_hub installed"
        ) from None
    offline = hub_offline()
    cache_dir = hub_cache_dir()
    try:
        folder = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache_dir,
            allow_patterns=list(files),
            local_files_only=offline,
        )
    except (OSError, ValueError) as exc:  # every Hub error is one of these
        where = cache_dir or "the default Hugging Face cache (~/.cache/huggingface/hub)"
        hint = (
            f"HF_HUB_OFFLINE is set, so it must already be in {where}"
            if offline
            else f"looked in {where} and on the Hub"
        )
        at = f" at revision {revision!r}" if revision else ""
        raise ModelLoadError(
            repo_id,
            None,
            f"cannot get the {what}{at} from the Hugging Face Hub ({hint}): "
            f"{type(exc).__name__}: {exc}",
        ) from exc
    return Path(folder)
