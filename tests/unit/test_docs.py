"""The documentation: `mkdocs build --strict` succeeds, every page under docs/ is in the nav, every
Markdown link and image of README.md and docs/ stays inside the repository (or is an http(s) URL),
and README.md is a short front door that starts with the two commands."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
README_MAX_LINES = 160

# [text](target "title") and ![alt](target); <target> may be bracketed. Reference definitions:
# [name]: target. HTML: href="..." / src="...".
INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+[\"'(][^)]*)?\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.MULTILINE)
HTML = re.compile(r"\b(?:href|src)\s*=\s*[\"']([^\"']+)[\"']")
FENCE = re.compile(r"^(\s*)(```|~~~).*?^\1\2[^\n]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
# Places that exist only outside the repository; nothing here may name them.
OUTSIDE = ["DESIGN.md", "../shared", "/work/shared", "demo-task-measurements"]


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def prose(text: str) -> str:
    """The text without fenced code blocks and code spans (whose brackets are not links)."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def link_targets(text: str) -> list[str]:
    body = prose(text)
    return [*INLINE.findall(body), *REFERENCE.findall(body), *HTML.findall(body)]


def link_problem(source: Path, target: str) -> str | None:
    """Why `target`, linked from `source`, is not allowed (None when it is)."""
    if re.match(r"^https?://[^/\s]+", target):
        return None
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):
        return "only http(s) URLs may leave the repository"
    path = unquote(target.split("#", 1)[0].split("?", 1)[0])
    if not path:
        return None if target.startswith("#") else "empty link"
    if path.startswith(("/", "~", "\\")):
        return "an absolute path: link relative to the file"
    resolved = (source.parent / path).resolve()
    if not resolved.is_relative_to(ROOT):
        return "points outside the repository"
    if not resolved.exists():
        return f"{resolved.relative_to(ROOT)} does not exist"
    return None


def nav_pages(node) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [page for item in node for page in nav_pages(item)]
    if isinstance(node, dict):
        return [page for value in node.values() for page in nav_pages(value)]
    return []


def mkdocs_config() -> dict:
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text())


def test_mkdocs_build_strict_succeeds(tmp_path):
    missing = [name for name in ("mkdocs", "material") if importlib.util.find_spec(name) is None]
    assert not missing, (
        f"{', '.join(missing)} not installed in {sys.executable}: run `bash scripts/ensure_venv.sh` "
        "(the dev extra of setup.py has mkdocs and mkdocs-material)"
    )
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # mkdocs-material's banner about MkDocs 2.0
    )  # fmt: skip
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    assert (tmp_path / "site" / "index.html").is_file()


def test_mkdocs_config_is_strict_and_builds_outside_docs():
    config = mkdocs_config()
    assert config.get("strict") is True
    site = (ROOT / config.get("site_dir", "site")).resolve()
    assert not site.is_relative_to(DOCS.resolve()), "site_dir must lie outside docs/"


def test_every_page_under_docs_is_in_the_nav():
    pages = set(nav_pages(mkdocs_config()["nav"]))
    on_disk = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert not on_disk - pages, f"pages missing from mkdocs.yml's nav: {sorted(on_disk - pages)}"
    assert not {p for p in pages if not (DOCS / p).is_file()}, "nav names pages that do not exist"


@pytest.mark.parametrize("source", markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_stay_inside_the_repository(source):
    text = source.read_text()
    problems = [f"{target}: {why}" for target in link_targets(text) if (why := link_problem(source, target))]
    assert not problems, f"{source.relative_to(ROOT)}:\n" + "\n".join(problems)
    named = [place for place in OUTSIDE if place in text]
    assert not named, f"{source.relative_to(ROOT)} names files outside the repository: {named}"


def test_the_link_check_refuses_what_leaves_the_repository():
    source = README
    assert link_problem(source, "https://github.com/NVIDIA/Megatron-LM") is None
    assert link_problem(source, "docs/index.md#where-to-read") is None
    assert link_problem(source, "#the-demo") is None
    assert link_problem(source, "../shared/DESIGN.md") == "points outside the repository"
    assert link_problem(source, "/etc/passwd") == "an absolute path: link relative to the file"
    assert link_problem(source, "file:///etc/passwd") == "only http(s) URLs may leave the repository"
    assert "does not exist" in link_problem(source, "docs/nothing-here.md")
    found = link_targets('[a](x.md) ![b](y.png "t") `[c](not-a-link)`\n```\n[d](nor-this)\n```\n[e]: z.md\n')
    assert found == ["x.md", "y.png", "z.md"]


def test_readme_is_a_front_door_starting_with_the_two_commands():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"
    top = "\n".join(lines[:12])
    block = re.search(r"```bash\n(.*?)```", top, re.DOTALL)
    assert block, "README.md starts with a bash block of the two commands"
    commands = [line.split("#")[0].strip() for line in block.group(1).splitlines()]
    assert commands[:2] == ["bash launch/demo.sh", "bash tests/run.sh"]
