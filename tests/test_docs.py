"""The docs: the README stays a short front page whose links all lead somewhere, and the MkDocs site
in docs/ builds with --strict (a broken link or anchor, a page missing from the nav, or a nav entry
without its page fails the build), offline, with no asset fetched from another host."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from processes import REPO

README = REPO / "README.md"
README_MAX_LINES = 250
# [text](target) and ![alt](target), the target up to the first space or ')'; and [label]: target
INLINE_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")


def relative_links(markdown: str) -> list[str]:
    """Link targets of a Markdown text that point into the repository (no scheme, not only an
    anchor), without their #fragment; links inside code blocks and code spans are not links."""
    text = CODE_SPAN.sub("", FENCE.sub("", markdown))
    targets = INLINE_LINK.findall(text) + REFERENCE_LINK.findall(text)
    return [t.split("#", 1)[0] for t in targets
            if not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", t) and not t.startswith("#")]


def mkdocs_build(project: Path, site_dir: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about its successor
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(project / "mkdocs.yml"), "--site-dir", str(site_dir)],
                          cwd=project, env=env, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)


def test_readme_is_a_front_page_of_at_most_250_lines() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines, at most {README_MAX_LINES}"


def test_every_relative_link_of_the_readme_resolves_to_a_file_in_the_repository() -> None:
    links = relative_links(README.read_text(encoding="utf-8"))
    assert "docs/index.md" in links  # the parser finds the README's links at all
    broken = [link for link in links
              if not (REPO / link).resolve().is_relative_to(REPO) or not (REPO / link).exists()]
    assert not broken, f"README.md links to files that do not exist: {broken}"


def test_the_link_parser_skips_urls_anchors_and_code() -> None:
    text = ("[a](docs/a.md) ![b](docs/b.png \"title\") [c](https://example.org) [d](#top) "
            "[e](docs/e.md#part) `[f](f.md)`\n```\n[g](g.md)\n```\n[h]: docs/h.md\n")
    assert sorted(relative_links(text)) == ["docs/a.md", "docs/b.png", "docs/e.md", "docs/h.md"]


@pytest.mark.slow
def test_the_docs_site_builds_strictly_and_offline(tmp_path: Path) -> None:
    result = mkdocs_build(REPO, tmp_path / "site")
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    assert "WARNING" not in result.stderr, result.stderr
    pages = sorted(p.relative_to(REPO / "docs").as_posix() for p in (REPO / "docs").glob("*.md"))
    for page in pages:  # every page was built (strict mode already refuses one missing from the nav)
        built = tmp_path / "site" / ("index.html" if page == "index.md" else f"{page[:-3]}/index.html")
        assert built.exists(), f"{page} was not built"
    html = (tmp_path / "site" / "index.html").read_text(encoding="utf-8")
    fetched = re.findall(r"<(?:link|script|img)[^>]+(?:href|src)=\"(https?://[^\"]+)\"", html)
    assert not fetched, f"the site loads assets from other hosts (fonts, scripts): {fetched}"
    assert (tmp_path / "site" / "compare_cora.png").exists()


@pytest.mark.slow
def test_the_strict_build_fails_on_a_broken_link_anchor_or_page_outside_the_nav(tmp_path: Path) -> None:
    """The same configuration on a copy of the docs, broken three ways: the build must refuse it."""
    shutil.copy(REPO / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    with (tmp_path / "docs" / "index.md").open("a", encoding="utf-8") as page:
        page.write("\n[gone](no-such-page.md) [nowhere](store.md#no-such-anchor) [repo](../Makefile)\n")
    (tmp_path / "docs" / "orphan.md").write_text("# Not in the nav\n", encoding="utf-8")
    result = mkdocs_build(tmp_path, tmp_path / "site")
    assert result.returncode != 0
    for problem in ("no-such-page.md", "#no-such-anchor", "../Makefile", "orphan.md"):
        assert problem in result.stderr, f"{problem!r} not reported:\n{result.stderr}"
