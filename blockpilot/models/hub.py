"""Local folder or hub id -> local folder."""

from __future__ import annotations

from pathlib import Path

# What loading a checkpoint reads from a hub repository: configs, safetensors weights and the tokenizer's files.
# Not the rest: the weights in Llama's `original/` (`consolidated.*.pth`, 16 GB again for Meta's own code), `*.bin`
# copies of the safetensors, images.
MODEL_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "merges.txt", "vocab.txt", "*.jinja"]
DRAFTER_FILES = ["*.json", "*.safetensors"]


def resolve_model_dir(path_or_id: str | Path, allow_patterns: list[str] | None = None) -> Path:
    """A local folder as is; otherwise a hub repo id, downloaded (or found in the HF cache): the files that match
    `allow_patterns` (default `MODEL_FILES`; fnmatch patterns over the repository's paths).

    With no hub reachable (`HF_HUB_OFFLINE=1`, or no network) a hub id that is not cached fails here,
    naming what was asked for.
    """
    path = Path(path_or_id).expanduser()
    if path.is_dir():
        return path
    text = str(path_or_id)
    if path.exists():
        raise NotADirectoryError(f"{text!r} is a file; expected a model folder or a hub id")
    if text.startswith((".", "/", "~")) or text.count("/") != 1:
        raise FileNotFoundError(f"model folder {text!r} does not exist (and is not a hub id 'org/name')")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(text, allow_patterns=allow_patterns or MODEL_FILES))
    except Exception as error:  # the hub client raises many kinds; all mean "cannot get it"
        raise FileNotFoundError(
            f"{text!r} is not a local folder and could not be fetched from the hub: {error}"
        ) from error
