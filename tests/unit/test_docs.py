"""The docs say only what exists: every ``kvcodec ...`` command line in a code block of README.md,
docs/*.md and perf/results/README.md parses with the real parser and names only flags that subcommand has; every
``make TARGET`` they name is a target of the Makefile; every relative link points at a file; and
the settings table of docs/deploy.md equals the one generated from the code.

A command line in a code block may be a synopsis: ``[--flag VALUE]`` (brackets dropped),
``a|b`` (the first alternative), ``...`` (dropped), ``\\`` continuations, ``VAR=value`` and ``env``
before the command, and a ``#`` comment after it. Placeholders (``DIR``, ``URL``) are fine as values.
"""
from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path
from typing import Iterator, List, Tuple

import pytest

from kvcodec_tools import settings_table
from kvcodec_tools.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "perf" / "results" / "README.md"]
KVCODEC_PROGRAMS = ("kvcodec", ".venv/bin/kvcodec", ".venv-vllm/bin/kvcodec")


def code_blocks(text: str) -> Iterator[Tuple[int, str]]:
    """(line number, line) of every line inside a fenced code block or an indented one (4 spaces)."""
    fenced = False
    previous_blank = True
    indented = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            yield number, line
            continue
        if line.startswith("    ") and (previous_blank or indented) and line.strip():
            indented = True
            yield number, line
        elif line.strip():
            indented = False
        previous_blank = not line.strip()


def logical_lines(lines: List[Tuple[int, str]]) -> Iterator[Tuple[int, str]]:
    """Lines joined over their shell continuations (a trailing backslash)."""
    start, parts = None, []
    for number, line in lines:
        if start is None:
            start = number
        if line.rstrip().endswith("\\"):
            parts.append(line.rstrip()[:-1])
            continue
        parts.append(line)
        yield start, " ".join(parts)
        start, parts = None, []
    if parts:
        yield start, " ".join(parts)


def kvcodec_commands(text: str) -> Iterator[Tuple[int, List[str]]]:
    """(line number, argv after the program) of each kvcodec command line in the code blocks."""
    for number, line in logical_lines(list(code_blocks(text))):
        for command in re.split(r"\s(?:&&|\|\||;)\s", line):
            try:
                words = shlex.split(command, comments=True)
            except ValueError:
                words = command.split()
            while words and (words[0] == "env" or re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0])
                             or words[0] in ("time", "sudo", "$")):
                words.pop(0)
            if words and words[0] in KVCODEC_PROGRAMS:
                yield number, synopsis_to_argv(words[1:])


def synopsis_to_argv(words: List[str]) -> List[str]:
    argv = []
    for word in words:
        word = word.strip("[]")
        if not word or word in ("...", "|") or word.startswith("..."):
            continue
        if "|" in word and not word.startswith("-"):
            word = word.split("|")[0]
        argv.append(word)
    return argv


def _subparsers(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    return None


PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$")  # DIR, URL, N, RUNG: a value the reader fills in


def _subcommand(parser: argparse.ArgumentParser, argv: List[str]) -> Tuple[argparse.ArgumentParser, int]:
    """The innermost subparser argv names, and the index of the first word after its name."""
    node, start = parser, 0
    while True:
        sub = _subparsers(node)
        if sub is None:
            return node, start
        name = next((w for w in argv[start:] if not w.startswith("-")), None)
        if name is None or name not in sub.choices:
            return node, start
        start = argv.index(name, start) + 1
        node = sub.choices[name]


def _fill_placeholders(node: argparse.ArgumentParser, words: List[str]) -> List[str]:
    """A typed option's placeholder value (``--max-tokens N``) as a value of its type or its first choice."""
    by_flag = {opt: action for action in node._actions for opt in action.option_strings}
    out = list(words)
    for i in range(len(out) - 1):
        action = by_flag.get(out[i])
        if action is None or action.nargs == 0 or not PLACEHOLDER.match(out[i + 1]):
            continue
        if action.choices:
            out[i + 1] = str(next(iter(action.choices)))
        elif action.type is not None:
            out[i + 1] = "1"
    return out


def check_command(argv: List[str]) -> None:
    """Raise AssertionError unless argv parses and every --flag is an exact option of its subcommand
    (argparse would accept an abbreviation)."""
    parser = build_parser()
    node, start = _subcommand(parser, argv)
    filled = argv[:start] + _fill_placeholders(node, argv[start:])
    try:
        parser.parse_args(filled)
    except SystemExit as exc:
        raise AssertionError(f"kvcodec {' '.join(argv)}: does not parse (exit {exc.code})") from None
    options = {opt for action in node._actions for opt in action.option_strings}
    for word in argv[start:]:
        if word.startswith("--"):
            flag = word.split("=", 1)[0]
            assert flag in options, f"kvcodec {' '.join(argv)}: {flag} is not an option (known: {sorted(options)})"


def all_commands():
    out = []
    for path in DOCS:
        for number, argv in kvcodec_commands(path.read_text()):
            out.append(pytest.param(argv, id=f"{path.relative_to(REPO)}:{number}"))
    return out


def test_the_docs_hold_commands_to_check():
    files = {p.id.split(":")[0] for p in all_commands()}
    assert "README.md" in files and len(all_commands()) >= 20, files


@pytest.mark.parametrize("argv", all_commands())
def test_each_kvcodec_command_in_the_docs_parses(argv):
    check_command(argv)


def test_the_check_refuses_a_flag_that_does_not_exist():
    check_command(["serve", "--store", "URL", "--engine", "vllm"])
    with pytest.raises(AssertionError, match="does not parse"):
        check_command(["serve", "--no-such-flag", "1"])
    with pytest.raises(AssertionError, match="not an option"):
        check_command(["serve", "--stor", "URL"])  # an abbreviation argparse would take
    with pytest.raises(AssertionError):
        check_command(["profile", "fit", "--weight"])
    check_command(["generate", "--text-file", "F", "--max-tokens", "N", "--protocol", "PROTOCOL"])
    with pytest.raises(AssertionError, match="does not parse"):
        check_command(["generate", "--text-file", "F", "--max-tokens", "many"])  # not a placeholder
    text = "Run:\n\n```sh\n.venv/bin/kvcodec ingest --text-file F \\\n    --no-such-flag\n```\n"
    ((_, argv),) = list(kvcodec_commands(text))
    assert argv == ["ingest", "--text-file", "F", "--no-such-flag"]
    with pytest.raises(AssertionError):
        check_command(argv)


def test_synopses_are_read_as_their_first_alternative():
    text = "```\nKVCODEC_MODEL=DIR kvcodec generate --text-file F [--protocol grpc|http] [--json]  # note\n```\n"
    ((_, argv),) = list(kvcodec_commands(text))
    assert argv == ["generate", "--text-file", "F", "--protocol", "grpc", "--json"]
    check_command(argv)


def makefile_targets() -> set:
    targets = set()
    for line in (REPO / "Makefile").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+(?:\s+[A-Za-z0-9_.-]+)*)\s*:(?!=)", line)
        if m and not line.startswith("\t"):
            targets.update(m.group(1).split())
    return targets


def code_text(text: str) -> str:
    """What the docs show as code: the code blocks' lines and the inline `spans` of the prose."""
    block = {number for number, _ in code_blocks(text)}
    lines = text.splitlines()
    spans = [line for number, line in enumerate(lines, 1) if number in block]
    for number, line in enumerate(lines, 1):
        if number not in block and not line.lstrip().startswith("```"):
            spans += re.findall(r"`([^`]+)`", line)
    return "\n".join(spans)


def make_targets_named(text: str) -> Iterator[str]:
    """Targets of ``make TARGET`` (after any VAR=value) in the docs' code."""
    for m in re.finditer(r"(?<![\w/-])make((?:\s+[A-Z_]+=\S+)*)\s+([a-z][a-z0-9_-]*)", code_text(text)):
        yield m.group(2)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_each_make_target_the_docs_name_exists(path):
    targets = makefile_targets()
    assert {"demo", "test", "docs-settings"} <= targets
    named = set(make_targets_named(path.read_text()))
    missing = sorted(named - targets)
    assert not missing, f"{path.name} names make targets the Makefile lacks: {missing}"


def test_make_targets_are_found_in_text():
    text = "run `make demo ENGINE=vllm`, then\n\n```sh\nmake test   # all\n```\n\nto make a key; `make-believe`"
    assert set(make_targets_named(text)) == {"demo", "test"}


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_point_at_files(path):
    broken = []
    for m in re.finditer(r"\]\(([^)\s]+)\)", path.read_text()):
        target = m.group(1).split("#", 1)[0]
        if not target or re.match(r"^[a-z]+:", target):
            continue
        if not (path.parent / target).exists():
            broken.append(m.group(1))
    assert not broken, f"{path.name}: links to nothing: {broken}"


def code_sources() -> str:
    roots = [REPO / "backends", REPO / "perf" / "kvcodec_tools", REPO / "model_repository", REPO / "clients"]
    scripts = sorted((REPO / "deploy").rglob("*.sh"))  # the containers' entrypoint reads its own
    return "\n".join(p.read_text() for p in [*(p for root in roots for p in sorted(root.rglob("*.py"))), *scripts])


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_each_kvcodec_variable_the_docs_name_is_read_by_the_code(path):
    code = code_sources()
    named = set(re.findall(r"\b(KVCODEC_[A-Z0-9_]*[A-Z0-9])\b", path.read_text()))
    unknown = sorted(v for v in named if v not in code)
    assert not unknown, f"{path.name} names variables no code reads: {unknown}"


def test_the_settings_table_in_deploy_md_is_the_codes():
    path = REPO / "docs" / "deploy.md"
    text = path.read_text()
    assert settings_table.replace_block(text, settings_table.render()) == text, (
        "docs/deploy.md's settings table differs from backends/kvcodec/settings.py: run make docs-settings")


def test_the_settings_table_names_every_field():
    from dataclasses import fields

    from kvcodec.settings import Settings

    table = settings_table.render()
    for f in fields(Settings):
        assert f"| `{f.name}` | `KVCODEC_{f.name.upper()}` |" in table


def test_the_generator_refuses_a_field_without_a_row(monkeypatch):
    from kvcodec import settings as settings_module

    doc = settings_module.__doc__
    monkeypatch.setattr(settings_module, "__doc__", "\n".join(
        line for line in doc.splitlines() if not line.startswith("| prefill_slice")))
    with pytest.raises(ValueError, match="prefill_slice"):
        settings_table.render()
