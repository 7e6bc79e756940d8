"""Command-line options declared once, on the dataclass field they fill. Torch-free (`--help` stays fast).

A job or settings dataclass marks a field as a flag with `option(...)` (its default, help and parser live on
the field), or as a group of flags with `nested(OtherDataclass)`. `add_options(parser, Job)` adds every flag;
`from_args(Job, args)` builds the frozen job from the parsed namespace. A new option is one field.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

# The families a random target may be built of (`zoo random --family`): transformers' classes the engine computes.
RANDOM_FAMILIES = ("qwen3", "llama", "qwen2", "qwen3_moe")

_OPTION = "blockpilot.option"
_NESTED = "blockpilot.nested"


# ----------------------------------------------------------------------------- argument types


def _integer_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
    return value


def positive_int_arg(text: str) -> int:
    return _integer_at_least(text, 1)


def non_negative_int_arg(text: str) -> int:
    return _integer_at_least(text, 0)


def non_negative_float_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def positive_float_arg(text: str) -> float:
    value = non_negative_float_arg(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def fraction_arg(text: str) -> float:
    """A number strictly between 0 and 1."""
    value = non_negative_float_arg(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1 (exclusive), got {text!r}")
    return value


def share_arg(text: str) -> float:
    """A number in [0, 1): a share, of resamples or of a throughput."""
    value = non_negative_float_arg(text)
    if not value < 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}")
    return value


def top_p_arg(text: str) -> float:
    """A number in (0, 1]."""
    value = non_negative_float_arg(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def model_ref(text: str) -> str:
    """A local model folder, or a hub id `org/name` (fetched when a hub is reachable)."""
    path = Path(text).expanduser()
    if path.is_dir():
        return str(path)
    if path.exists():
        raise argparse.ArgumentTypeError(f"{text!r} is a file; expected a model folder")
    if text.startswith((".", "/", "~")) or text.count("/") != 1:
        raise argparse.ArgumentTypeError(f"model folder {text!r} does not exist")
    return text


def _comma_list(text: str, convert: type, what: str) -> tuple:
    try:
        return tuple(convert(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}") from None


def block_size_list(text: str) -> tuple[int, ...]:
    """Comma-separated distinct integers >= 1."""
    values = _comma_list(text, int, "integers")
    if not values or any(v < 1 for v in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"expected distinct integers >= 1, got {text!r}")
    return values


def tree_budget_list(text: str) -> tuple[int, ...]:
    """Comma-separated distinct integers >= 1, or `none` (no trees)."""
    return () if text.strip().lower() == "none" else block_size_list(text)


def temperature_list(text: str) -> tuple[float, ...]:
    """Comma-separated finite numbers >= 0."""
    values = _comma_list(text, float, "numbers")
    if not values or any(not math.isfinite(v) or v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected finite numbers >= 0, got {text!r}")
    return values


# ----------------------------------------------------------------------------- options on dataclass fields


def option(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    type: Callable[[str], Any] | None = None,
    choices: Iterable[Any] | None = None,
    flag: str | None = None,
    required: bool = False,
) -> Any:
    """A dataclass field that is also a command-line flag (`--field-name` unless `flag` says otherwise).

    A bool field becomes a switch: `--name` sets True when the default is False; give `flag="--no-x"` for
    a field that defaults to True.
    """
    spec = {"help": help, "type": type, "choices": tuple(choices) if choices else None, "flag": flag}
    spec["required"] = required
    return dataclasses.field(default=default, metadata={_OPTION: spec})


def nested(cls: type) -> Any:
    """A dataclass field holding another options dataclass, whose flags join the parent's."""
    return dataclasses.field(default_factory=cls, metadata={_NESTED: cls})


def _flag(field: dataclasses.Field) -> str:
    return field.metadata[_OPTION]["flag"] or "--" + field.name.replace("_", "-")


def add_options(parser: argparse.ArgumentParser, cls: type, *, skip: Iterable[str] = ()) -> None:
    """Add a flag for every `option` field of `cls` (and of its `nested` fields), except the names in `skip`."""
    skipped = set(skip)
    for field in dataclasses.fields(cls):
        if field.name in skipped:
            continue
        if _NESTED in field.metadata:
            add_options(parser, field.metadata[_NESTED], skip=skipped)
            continue
        if _OPTION not in field.metadata:
            continue
        spec = field.metadata[_OPTION]
        kwargs: dict[str, Any] = {"dest": field.name, "help": spec["help"]}
        if field.default is dataclasses.MISSING:
            kwargs["required"] = True
        else:
            kwargs["default"] = field.default
        if isinstance(field.default, bool):
            kwargs["action"] = "store_false" if field.default else "store_true"
        else:
            if spec["type"] is not None:
                kwargs["type"] = spec["type"]
            if spec["choices"] is not None:
                kwargs["choices"] = spec["choices"]
            if spec["required"]:
                kwargs["required"] = True
        parser.add_argument(_flag(field), **kwargs)


def from_args(cls: type, args: argparse.Namespace, **overrides: Any) -> Any:
    """An instance of `cls` from parsed flags: every `option` field from its flag, `nested` fields recursively,
    other fields at their defaults; `overrides` win."""
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        if field.name in overrides:
            values[field.name] = overrides[field.name]
        elif _NESTED in field.metadata:
            values[field.name] = from_args(field.metadata[_NESTED], args)
        elif _OPTION in field.metadata and hasattr(args, field.name):
            values[field.name] = getattr(args, field.name)
    return cls(**values)
