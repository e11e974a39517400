"""Every command shown in README.md and docs/*.md runs as written.

The fenced code blocks are read as a user would copy them: a ``bash`` block line by line (with
``\\`` continuations, comments dropped), a plain block's lines that start with ``$ ``. Each
command of one of our entry points is then

- run as written where it is cheap: ``--help`` (through the entry point's ``main``), and
  ``--dry_run`` or ``--plan_for 1`` of the ``tiny`` or ``test`` preset (seconds each, in a
  process of their own; marked ``slow``, as end-to-end runs are);
- otherwise parsed, without running anything, by the parser its script builds:
  ``config.loading.parse_config`` for ``run_pretraining.py`` (every flag, its type, its choices
  and the config's validation), and for the other scripts their own argparse parser, caught as
  it returns; the flags a benchmark passes on to the run go through ``parse_config`` too.

A command shown followed by a ``run_pretraining.py: error: ...`` line must fail with exactly
that message. Links between the documents must lead to a file and a heading that exist.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import run_pretraining
from config.errors import ConfigError
from config.loading import parse_config
from tasks.specs import parse_finetuning_config

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Programs whose commands are not ours to check (installers, launchers' set-up, shell scripts).
FOREIGN = ("pip", "export", "data/wikipedia_download.sh", "data/wikipedia_extract.sh")
CHEAP_PRESETS = ("tiny", "test")
README_LINES = 350
# The scripts that train, and so run under torchrun.
ENTRY_POINTS = ("run_pretraining.py", "run_finetuning.py")


@dataclass(frozen=True)
class Command:
    """One command of a document: where it is, the script and the script's arguments."""

    where: str  # file:line
    text: str
    script: str  # "run_pretraining.py", "benchmarks.bench_step", "utils.plot", ...
    argv: tuple[str, ...]
    error: str | None = None  # the error line the document shows after it


def _blocks(path: Path):
    """(language, first line number, lines) of every fenced block of a markdown file."""
    lines = path.read_text().splitlines()
    start = None
    for number, line in enumerate(lines, 1):
        if line.startswith("```"):
            if start is None:
                start, language, body = number, line[3:].strip(), []
            else:
                yield language, start + 1, body
                start = None
        elif start is not None:
            body.append(line)


def _logical_lines(body: list[str], first: int):
    """(line number, text) with backslash continuations joined."""
    pending, at = "", first
    for offset, line in enumerate(body):
        if not pending:
            at = first + offset
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield at, pending + line
        pending = ""


def _command(words: list[str], where: str, text: str, error: str | None) -> Command | None:
    """The entry point and its arguments in a shell command (through torchrun, mpiexec, srun)."""
    for index, word in enumerate(words):
        if word.endswith(".py") and (word.startswith(("benchmarks/", "data/")) or "/" not in word):
            return Command(where, text, word, tuple(words[index + 1 :]), error)
        if word == "-m" and index + 1 < len(words):  # python -m MODULE
            module = words[index + 1]
            ours = module.split(".")[0] in ("utils", "benchmarks", "data")
            return Command(where, text, module, tuple(words[index + 2 :]), error) if ours else None
    return None


def document_commands() -> list[Command]:
    """Every command of ours shown in README.md and docs/*.md."""
    commands = []
    for path in DOCUMENTS:
        name = path.relative_to(ROOT)
        for language, first, body in _blocks(path):
            lines = list(_logical_lines(body, first))
            for index, (number, line) in enumerate(lines):
                if language in ("bash", "sh", "shell"):
                    text = line
                elif line.startswith("$ "):
                    text = line[2:]
                else:
                    continue
                words = shlex.split(text, comments=True)
                if not words or words[0] in FOREIGN or words[0].startswith("#"):
                    continue
                following = lines[index + 1][1] if index + 1 < len(lines) else ""
                error = following if ": error: " in following else None
                command = _command(words, f"{name}:{number}", text, error)
                if command is not None:
                    commands.append(command)
    return commands


COMMANDS = document_commands()


def _flag_value(argv: tuple[str, ...], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv[:-1] else None


def is_cheap(command: Command) -> bool:
    """Whether running the command takes seconds: --help, or a dry run or --plan_for 1 of a
    small preset."""
    if command.script != "run_pretraining.py" or command.error:
        return False
    if "--help" in command.argv or "-h" in command.argv:
        return True
    small = (_flag_value(command.argv, "--config") or "tiny") in CHEAP_PRESETS
    return small and ("--dry_run" in command.argv or _flag_value(command.argv, "--plan_for") == "1")


class _Parsed(Exception):
    """Raised by the patched argparse as a script's parser returns, so nothing else runs."""

    def __init__(self, namespace: argparse.Namespace, extra: list[str]):
        super().__init__()
        self.namespace, self.extra = namespace, extra


@contextlib.contextmanager
def _stop_after_parsing():
    """argparse parses as usual (and fails as usual), then stops the script."""
    known = argparse.ArgumentParser.parse_known_args

    def parse_known_args(self, args=None, namespace=None):
        namespace, extra = known(self, args, namespace)
        raise _Parsed(namespace, extra)

    def parse_args(self, args=None, namespace=None):
        namespace, extra = known(self, args, namespace)
        if extra:
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        raise _Parsed(namespace, [])

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_known_args", parse_known_args)
        patch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
        yield


def _main_of(script: str):
    """The ``main`` function of a script file or a module name."""
    if not script.endswith(".py"):
        return importlib.import_module(script).main
    path = ROOT / script
    assert path.is_file(), f"{script} does not exist"
    name = "_docs_" + re.sub(r"\W", "_", script)
    if name not in sys.modules:  # registered first: dataclasses look their module up
        spec = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name].main


def parse_only(command: Command) -> None:
    """Parses a command's arguments with its script's own parser, running nothing else.

    Raises:
        ConfigError or SystemExit: the arguments do not parse (SystemExit 0 for --help).
    """
    if command.script == "run_pretraining.py":
        parse_config(list(command.argv))
        return
    if command.script == "run_finetuning.py":  # pretraining's tree and flags, plus the task's
        parse_finetuning_config(list(command.argv))
        return
    main = _main_of(command.script)
    with _stop_after_parsing(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", [command.script, *command.argv])
        try:
            main(list(command.argv)) if _takes_argv(main) else main()
        except _Parsed as parsed:
            namespace, extra = parsed.namespace, parsed.extra
        else:
            raise AssertionError(f"{command.script} did not parse its arguments with argparse")
    if extra or hasattr(namespace, "config"):  # a benchmark's flags for the run
        parse_config(["--config", getattr(namespace, "config", "tiny"), *extra])


def _takes_argv(main) -> bool:
    return bool(main.__code__.co_argcount)


def test_the_documents_show_commands_of_every_kind():
    """The extraction finds what the documents hold, so the checks below cannot pass empty."""
    scripts = {c.script for c in COMMANDS}
    assert len([c for c in COMMANDS if c.script == "run_pretraining.py"]) >= 25
    assert {"run_generation.py", "convert_checkpoint.py", "utils.plot"} <= scripts
    assert {"benchmarks.bench_step", "data/write_into_tfrecord.py"} <= scripts
    assert len([c for c in COMMANDS if is_cheap(c)]) >= 3
    assert len([c for c in COMMANDS if c.error]) >= 2
    torchrun = [c for c in COMMANDS if c.text.startswith("torchrun")]
    assert torchrun and all(c.script in ENTRY_POINTS for c in torchrun)


def test_every_benchmark_shown_runs_as_a_module():
    """``python benchmarks/NAME.py`` would put benchmarks/ first on the path, not the checkout,
    and the library would not import: a benchmark is shown as ``python -m benchmarks.NAME``."""
    as_files = [f"{c.where}: {c.text}" for c in COMMANDS if c.script.startswith("benchmarks/")]
    assert not as_files, "shown as a file: " + "; ".join(as_files)


@pytest.mark.parametrize("command", [c for c in COMMANDS if not c.error], ids=lambda c: c.where)
def test_every_command_shown_parses(command):
    try:
        parse_only(command)
    except SystemExit as exit:
        assert exit.code == 0, f"{command.where}: {command.text}: exit {exit.code}"
    except ConfigError as err:
        pytest.fail(f"{command.where}: {command.text}: {err}")


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.error], ids=lambda c: c.where)
def test_every_error_shown_is_the_error_given(command):
    with pytest.raises(ConfigError) as caught:
        parse_only(command)
    assert command.error == f"run_pretraining.py: error: {caught.value}", command.where


def _is_help(command: Command) -> bool:
    return "--help" in command.argv or "-h" in command.argv


@pytest.mark.parametrize(
    "command", [c for c in COMMANDS if is_cheap(c) and _is_help(c)], ids=lambda c: c.where
)
def test_every_help_shown_runs(command, capsys):
    """Through the entry point's ``main``, in this process: it only prints."""
    with pytest.raises(SystemExit) as exit:
        run_pretraining.main(list(command.argv))
    assert exit.value.code == 0, f"{command.where}: {command.text}"
    assert "--global_batch_size" in capsys.readouterr().out


@pytest.mark.slow  # end-to-end runs of the entry point: the two take ~20 s on 2 cores
@pytest.mark.parametrize(
    "command", [c for c in COMMANDS if is_cheap(c) and not _is_help(c)], ids=lambda c: c.where
)
def test_every_cheap_command_runs(command, tmp_path):
    """Run as written, through the real entry point, in a scratch folder (a dry run writes its
    plan.json under runs/ by default). In a process of its own: ``--plan_for`` forks its
    workers, and in a process that had run a dry run before, it was seen to hang there."""
    argv = [sys.executable, str(ROOT / command.script), *command.argv]
    result = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{command.where}: {command.text}: {result.stderr[-600:]}"
    if "--dry_run" in command.argv:
        assert "verdict: FITS" in result.stdout, f"{command.where}: {result.stdout[-400:]}"
    if "--plan_for" in command.argv:
        assert "fastest: --data_parallel" in result.stdout, f"{command.where}"


@pytest.mark.parametrize(
    "argv",
    [
        ["--config", "tiny", "--made_up_flag", "1"],
        ["--config", "tiny", "--recompute", "sometimes"],
        ["--config", "no_such_preset"],
        ["--config", "tiny", "--layers", "two"],
    ],
)
def test_the_parsing_check_can_fail(argv):
    """The helper the documents' commands go through rejects what run_pretraining.py rejects."""
    with pytest.raises(ConfigError):
        parse_only(Command("here", " ".join(argv), "run_pretraining.py", tuple(argv)))


def test_a_made_up_flag_of_another_script_is_rejected():
    command = Command("here", "", "run_generation.py", ("--load", "x", "--prompt", "a", "--nope"))
    with pytest.raises((ConfigError, SystemExit)):
        parse_only(command)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    outside = True
    anchors = set()
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            outside = not outside
        elif outside and line.startswith("#"):
            anchors.add(_anchor(line.lstrip("#")))
    return anchors


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: p.name)
def test_every_link_between_documents_leads_somewhere(path):
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"\w+://", target):
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        assert resolved.exists(), f"{path.name}: link to {target}: no such file"
        if anchor and resolved.suffix == ".md":
            assert anchor in _anchors(resolved), f"{path.name}: link to {target}: no such heading"


def test_the_readme_is_short_and_links_every_document():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < README_LINES
    for doc in DOCUMENTS[1:]:
        assert f"(docs/{doc.name}" in readme, f"README does not link docs/{doc.name}"
