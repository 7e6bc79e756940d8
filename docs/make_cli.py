"""Write docs/cli.md, the reference of every `blockpilot` subcommand and flag, from the CLI's own parser (the flags of
the Ray stages come from their job dataclasses' option fields). `python docs/make_cli.py` rewrites it;
`--check` exits 1 when the file is not current (the test suite runs that)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from blockpilot.cli import build_parser  # noqa: E402

OUT = Path(__file__).with_name("cli.md")


def leaf_commands(
    parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], str, argparse.ArgumentParser]]:
    """(words, help, parser) of every leaf subcommand, in the order the CLI declares them."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, child in action.choices.items():
                nested = leaf_commands(child, (*prefix, name))
                found.extend(nested or [((*prefix, name), helps.get(name) or "", child)])
    return found


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def option_row(action: argparse.Action) -> str:
    flag = ", ".join(f"`{option}`" for option in action.option_strings)
    if action.choices is not None:
        value = " | ".join(str(choice) for choice in action.choices)
    elif action.nargs == 0:
        value = "(switch)"
    else:
        value = action.metavar or action.dest.upper()
    if action.required:
        default = "required"
    elif action.nargs == 0 or action.default is None:
        default = ""
    else:
        shown = action.default
        if isinstance(shown, (tuple, list)):
            shown = ",".join(str(item) for item in shown)
        default = f"`{shown}`"
    return f"| {flag} | {cell(str(value))} | {default} | {cell(action.help or '')} |"


def render() -> str:
    lines = [
        "# The `blockpilot` command",
        "",
        "Generated from the CLI's parser by `python docs/make_cli.py` (a test checks it is current); the flags of",
        "`label`, `train`, `train-step`, `serve`, `zoo build` and `demo` are the option fields of their job dataclasses",
        "in `pipelines/`. `python -m blockpilot` is the same command. Bad flags exit with status 2 naming the flag.",
        "",
    ]
    for words, summary, parser in leaf_commands(build_parser()):
        lines += [f"## `blockpilot {' '.join(words)}`", "", f"{summary[0].upper()}{summary[1:]}.", ""]
        lines += ["| flag | value | default | meaning |", "|---|---|---|---|"]
        lines += [option_row(action) for action in parser._actions if action.option_strings and action.dest != "help"]
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    text = render()
    if "--check" in sys.argv[1:]:
        if not OUT.is_file() or OUT.read_text() != text:
            print(f"{OUT} is not current: run `python docs/make_cli.py`", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"-> {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
