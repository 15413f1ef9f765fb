"""Every `moebench ...` command a user can paste from README.md and docs/*.md still works, so a moved directory or a
renamed option fails here, not in a reader's terminal.

Commands are taken from the code blocks (a line's commands, `&&` / `;` separated, `\\` continued) and the inline code
spans. How each is checked, cheaply:
  - a template (SWEEP, RUN_DIR, N, `[...]`, `a|b`, `<run>`, `$f`) parses with the command line's parser once its
    placeholders are filled in (`[--x]` kept, `a|b` as a);
  - a bare `moebench run` (a mention of the command, not a command) is not checked;
  - `run` with a concrete sweep: `--dry-run` through the real entry point (exit 0; the sweep, its size, its
    plugins and files resolved), in a temporary directory;
  - `tune` and `profile`: parsed, and their sweep loaded at its size (the point index checked);
  - `report`, `plot`, `compare`: parsed, and every path matches something: a committed directory, or a run a bundled
    sweep's `moebench run` would create (results/runs/<sweep>-<UTC time>);
  - `list`, `--version` and the README's `moebench plot` of a committed run (on a copy) are run for real.
A run at the CPU size for real takes 25 s at least (quickstart), too slow here: tests/run/test_quickstart.py and
tests/run/test_scenarios.py run those.
"""

from __future__ import annotations

import fnmatch
import glob
import itertools
import re
import shlex
import shutil
from pathlib import Path

import pytest

from moebench.cli import build_parser, main
from moebench.run.paths import bundled_sweeps, sweep_argument_path
from moebench.run.sweep import load_sweep

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
NEEDS_ARGS = {"run", "tune", "plot", "compare", "report", "profile"}
# files a page creates before its command (the worked example's): tests/test_plugins.py runs that example
MADE_BY_THE_PAGE = {"my_sweep.yaml": "docs/plugins.md's worked example, run by tests/test_plugins.py"}
PLACEHOLDER = re.compile(r"^(?:[A-Z][A-Z0-9_]*(?:\.\.\.|\.yaml)?|\$\w+|\"\$\w+\")$|<[^>]*>|\.\.\.")
FILL = {"N": "1", "PCT": "10"}
# besides `list`, run for real (a few seconds): the README's plot of a committed run
RUN_FOR_REAL = {"moebench plot results/h200/grouped_router-20261201T131317Z"}


def doc_commands(text: str) -> list[tuple[int, str]]:
    """(line, command) of every `moebench ...` in the code blocks and inline code spans of a page."""
    out, in_block, pending = [], False, ""
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip().startswith("```"):
            in_block = not in_block
            continue
        if not in_block:
            out += [(number, m.group(1).strip()) for m in re.finditer(r"`(moebench [^`]*)`", line)]
            continue
        code = (pending + " " + line.strip()).strip() if pending else line.strip()
        pending = ""
        if code.endswith("\\"):
            pending = code[:-1]
            continue
        code = re.split(r"\s#\s|\s{2,}#", code)[0]
        for part in re.split(r"&&|;", code):
            part = re.sub(r"^\s*(do|then)\s+", "", part).strip()
            if part.startswith("moebench ") or part == "moebench":
                out.append((number, part))
    return out


def all_commands() -> list[tuple[str, str]]:
    return [(f"{page.relative_to(REPO)}:{n}", cmd) for page in DOCS for n, cmd in doc_commands(page.read_text())]


def _brace_expand(word: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", word)
    if not m:
        return [word]
    return list(itertools.chain.from_iterable(
        _brace_expand(word[:m.start()] + alt + word[m.end():]) for alt in m.group(1).split(",")))


def _is_template(args: list[str]) -> bool:
    return any(PLACEHOLDER.search(a) or "[" in a or "|" in a for a in args)


def _filled(command: str) -> list[str]:
    """A template's words with `[`/`]` dropped, `a|b` as a, `...` dropped and placeholders filled."""
    text = command.replace("[", " ").replace("]", " ")
    words = []
    for w in text.split()[1:]:
        if "|" in w:
            w = w.split("|")[0]
        if w == "..." and words and words[-1].startswith("--") and "=" not in words[-1]:
            w = "key=value"  # `[--set ...]`: the option's value
        elif w in ("...", "|") or not w:
            continue
        words.append(FILL.get(w.rstrip("."), w.rstrip(".") if w.endswith("...") else w))
    return words


def _run_dir_pattern_ok(path: str) -> bool:
    """A path under results/runs/ matches the directory a bundled sweep's run creates."""
    names = [p.stem for p in bundled_sweeps()]
    made = [f"results/runs/{name}-20261201T000000Z" for name in names]
    return any(fnmatch.fnmatch(m, path.rstrip("/")) for m in made)


def _paths_ok(args: list[str]) -> list[str]:
    """The path arguments of report / plot / compare that match nothing (a committed path or a run's directory)."""
    bad = []
    for arg in args:
        if arg.startswith("-") or arg.endswith((".html", ".md")):
            continue
        for path in _brace_expand(arg):
            if path.startswith("results/runs/"):
                if not _run_dir_pattern_ok(path):
                    bad.append(path)
            elif not glob.glob(str(REPO / path)):
                bad.append(path)
    return bad


def _sweep_path(arg: str) -> str:
    """A SWEEP argument as the pages mean it, from the repository root: a path there, else a bundled name."""
    return str(REPO / arg) if (REPO / arg).exists() else sweep_argument_path(arg)


COMMANDS = all_commands()


def test_the_pages_have_commands_to_check():
    """The extraction itself: the README's install line, a continued line, a loop's body are found."""
    found = {cmd for _, cmd in COMMANDS}
    assert "moebench run quickstart" in found and "moebench list --models" in found
    assert any(cmd.startswith("moebench report results/runs/{sp_padding_straggler") and "scenarios.html" in cmd
               for cmd in found)
    assert 'moebench run "$f"' in found
    assert len(COMMANDS) > 40


@pytest.mark.parametrize("where, command", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_a_pasted_command_works(where, command, tmp_path, monkeypatch, capsys):
    args = shlex.split(command)[1:]
    parser = build_parser()
    if args == ["--version"]:
        with pytest.raises(SystemExit) as e:
            main(args)
        assert e.value.code == 0
        return
    if not args or (len(args) == 1 and args[0] in NEEDS_ARGS):
        return  # a mention of the command, not a command
    if _is_template(command.split()):
        parser.parse_args(_filled(command))  # SystemExit (exit 2) on an unknown option or subcommand
        return
    parsed = parser.parse_args(args)
    sub = args[0]
    if sub == "list":
        assert main(args) == 0, (where, command, capsys.readouterr().err)
        return
    if sub == "run":
        if parsed.sweep in MADE_BY_THE_PAGE:
            return
        monkeypatch.chdir(tmp_path)
        code = main(["run", str(_sweep_path(parsed.sweep)), *args[2:], "--dry-run",
                     "--out", str(tmp_path / "out")])
        assert code == 0, (where, command, capsys.readouterr().err)
        assert not (tmp_path / "out").exists()  # a dry run writes nothing
        return
    if sub in ("tune", "profile"):
        sweep = load_sweep(_sweep_path(parsed.sweep), parsed.set or [], size=parsed.size)
        if sub == "profile":
            from moebench.run.runner import check_point_index

            check_point_index(sweep, parsed.point)
        return
    assert sub in ("report", "plot", "compare"), (where, command)
    assert not _paths_ok(args[1:]), (where, command, _paths_ok(args[1:]))
    if command in RUN_FOR_REAL:  # on a copy of the committed run, in a temporary directory
        for arg in args[1:]:
            if (REPO / arg).is_dir():
                shutil.copytree(REPO / arg, tmp_path / arg)
        monkeypatch.chdir(tmp_path)
        assert main(args) == 0, (where, command, capsys.readouterr().err)
        assert list((tmp_path / args[1] / "plots").glob("*.png"))


def test_the_commands_run_for_real_are_still_on_the_pages():
    assert RUN_FOR_REAL <= {cmd for _, cmd in COMMANDS}


def test_runs_go_where_the_pages_look_for_them():
    """A report command of the old layout (results/<sweep>-*) would fail: runs go to results/runs/."""
    assert _paths_ok(["results/sp_padding_straggler-*"]) == ["results/sp_padding_straggler-*"]
    assert _paths_ok(["results/runs/sp_padding_straggler-*"]) == []


NUMBER_WORDS = {"two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10,
                "eleven": 11, "twelve": 12}


def test_the_pages_count_the_bundled_scenarios_right():
    """A count of the bundled scenarios in the docs is the number the package ships."""
    bundled = len([p for p in bundled_sweeps() if p.parent.name == "scenarios"])
    for page in DOCS:
        for m in re.finditer(r"\b(\w+) bundled scenarios\b", page.read_text(), flags=re.I):
            word = m.group(1).lower()
            count = int(word) if word.isdigit() else NUMBER_WORDS.get(word)
            if count is not None:
                assert count == bundled, f"{page.name}: {m.group(0)!r}, {bundled} are bundled"
