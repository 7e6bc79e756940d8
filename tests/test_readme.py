"""The README's commands and the CLI agree: every `blockpilot` command it shows exists and takes the flags shown,
every subcommand the CLI has is shown, and the modules, scripts and make targets it names exist."""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
import subprocess
import sys
from pathlib import Path

from blockpilot.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def shell_lines(text: str) -> list[str]:
    """The commands of every ```bash block, continuation lines joined and comments dropped."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def subcommands(
    parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()
) -> dict[tuple[str, ...], argparse.ArgumentParser]:
    """Every leaf subcommand of the CLI, by its words (("zoo", "build"), ("label",), ...), with its parser."""
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                found.update(subcommands(child, (*prefix, name)) or {(*prefix, name): child})
    return found


def documented_invocations() -> list[list[str]]:
    """The words after `blockpilot` of each command the documents show (the line's optional [..] parts dropped)."""
    invocations = []
    for document in DOCUMENTS:
        for line in shell_lines(document.read_text()):
            words = shlex.split(re.sub(r"\[[^\]]*\]", " ", line).replace("|", " "))
            for index, word in enumerate(words):
                if word == "blockpilot" and (index == 0 or words[index - 1] in ("-m", "run", "exec")):
                    invocations.append(words[index + 1 :])
    return invocations


def test_every_command_the_readme_shows_exists_and_takes_its_flags():
    commands = subcommands(build_parser())
    shown = documented_invocations()
    assert len(shown) >= 8, "the README shows the stages' commands"
    for words in shown:
        path = next((p for p in commands if tuple(words[: len(p)]) == p), None)
        assert path is not None, f"`blockpilot {' '.join(words)}`: no such command"
        known = set(commands[path]._option_string_actions)
        flags = [word.split("=")[0] for word in words[len(path) :] if word.startswith("--")]
        assert set(flags) <= known, f"`blockpilot {' '.join(path)}` has no {sorted(set(flags) - known)}"


def test_every_subcommand_is_in_the_readme():
    shown = {tuple(words[:2]) for words in documented_invocations()} | {
        (words[0],) for words in documented_invocations()
    }
    missing = [" ".join(path) for path in subcommands(build_parser()) if path not in shown]
    assert not missing, f"subcommands the README (or docs/) never shows: {missing}"


def test_the_modules_scripts_and_make_targets_it_names_exist():
    text = "\n".join(document.read_text() for document in DOCUMENTS)
    for module in set(re.findall(r"python -m (pipelines\.\w+)", text)):
        assert callable(getattr(importlib.import_module(module), "main", None)), module
    for script in set(re.findall(r"\b((?:benchmarks|notebooks)/[\w.]+\.(?:py|ipynb))", text)):
        assert (ROOT / script).is_file(), script
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
    assert set(re.findall(r"\bmake ([\w-]+)", text)) <= targets


def test_the_readme_is_short_and_its_links_resolve():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300, "the README stays a page: details go to docs/"
    for document in DOCUMENTS:
        for target in re.findall(r"\]\(((?:docs/)?[\w./-]+\.md)(?:#[\w-]+)?\)", document.read_text()):
            assert (document.parent / target).is_file(), f"{document.name} links to {target}, which does not exist"


def test_the_cli_reference_is_current():
    checked = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "make_cli.py"), "--check"], capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stderr


def test_no_code_cites_the_readme_for_its_reasons():
    citing = [
        f"{path.relative_to(ROOT)}:{number}"
        for folder in ("blockpilot", "pipelines", "benchmarks")
        for path in (ROOT / folder).rglob("*.py")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "README" in line
    ]
    assert not citing, f"reasons live beside the code or in docs/log.md, not in a README paragraph: {citing}"
