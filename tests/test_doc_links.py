"""The docs' #anchors resolve (every `page.md#anchor` and `#anchor` link names a heading or an `<a id>` of its page;
that the linked files and results/ runs exist is tests/test_committed_results.py's), and docs/architecture.md's
package map matches the tree."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), ROOT / "plots" / "README.md"])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"```.*?```", re.S)


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())  # a link in a heading: its text
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = CODE.sub("", page.read_text(encoding="utf-8"))
    found, seen = set(), {}
    for m in re.finditer(r"^#{1,6} (.+)$", text, re.M):
        s = slug(m.group(1))
        found.add(s if s not in seen else f"{s}-{seen[s]}")
        seen[s] = seen.get(s, 0) + 1
    return found | set(re.findall(r"<a id=\"([^\"]+)\"", text))


def links(page: Path):
    for target in LINK.findall(CODE.sub("", page.read_text(encoding="utf-8"))):
        if not re.match(r"[a-z]+:", target):  # http:, https:, mailto: are not checked here
            yield target


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_link_anchors_resolve(page):
    bad = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if anchor and dest.suffix == ".md" and dest.is_file() and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not bad, f"{page.relative_to(ROOT)}: " + "; ".join(bad)


def test_anchor_links_are_checked():
    """The check sees the anchored links of the docs (a regex that matched nothing would pass every page)."""
    targets = [t for page in PAGES for t in links(page)]
    assert sum(".md#" in t for t in targets) >= 10 and any(t.startswith("#") for t in targets)
    assert slug("Dispatch on 2 x H200 (NVLink)") == "dispatch-on-2-x-h200-nvlink"
    assert slug("Staging (prepare_moe_inputs)") == "staging-prepare_moe_inputs"


def test_architecture_module_map_matches_the_tree():
    """docs/architecture.md's package map names every module of moebench/ (a package's __init__ by its folder) and
    no module that is gone."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = text.split("## Package map", 1)[1].split("```", 2)[1]
    named = set(re.findall(r"([A-Za-z_]\w*\.py)\b", block))
    folders = set(re.findall(r"([A-Za-z_]\w*)/", block))
    modules = sorted((ROOT / "moebench").rglob("*.py"))
    missing = [str(m.relative_to(ROOT)) for m in modules
               if not (m.parent.name in folders if m.name == "__init__.py" else m.name in named)
               or any(d not in folders for d in m.relative_to(ROOT / "moebench").parts[:-1])]
    assert not missing, f"docs/architecture.md's package map lacks {', '.join(missing)}"
    gone = sorted(n for n in named if not any(m.name == n for m in modules))
    assert not gone, f"docs/architecture.md's package map names modules that are gone: {', '.join(gone)}"
