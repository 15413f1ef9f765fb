"""results/ and plots/ hold references, not history: records only, small, and every doc link resolves."""

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _tracked(*paths: str) -> list[str]:
    proc = subprocess.run(["git", "-C", str(REPO), "ls-files", *paths], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        pytest.skip("not a git checkout")
    return proc.stdout.split()


def test_every_relative_link_in_the_docs_resolves():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "plots").glob("*.md"))]
    dead = []
    for page in pages:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target) or target.startswith("#"):
                    continue
                if not (page.parent / target.split("#")[0]).exists():
                    dead.append(f"{page.relative_to(REPO)}:{n}: {target}")
    assert not dead, dead


def test_reference_runs_are_records_only_and_small():
    files = _tracked("results")
    assert files, "no committed reference run"
    assert not [f for f in files if f.endswith((".png", ".lock"))]
    assert not [f for f in files if "/plots/" in f]  # moebench plot RUN_DIR draws them
    for run in {Path(f).parent for f in files}:
        assert {"manifest.json", "records.jsonl", "summary.csv"} <= {p.name for p in (REPO / run).iterdir()}, run
    assert sum((REPO / f).stat().st_size for f in files) < 12_000_000  # the references of two cards (H200, H100)
    assert sum((REPO / f).stat().st_size for f in _tracked("plots")) < 1_000_000
