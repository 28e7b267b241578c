"""Every link of README.md and docs/*.md stays inside the repository and resolves.

- A relative markdown link or image (`[text](path)`, `![alt](path)`, `<img src="path">`) names a file or folder
  that git tracks (or that is in the working tree), relative to the page; a `#anchor` into a markdown page names
  one of its headings (GitHub's slugs).
- A `path/file.py:LINE` (or `:FIRST-LAST`) names a file of the repository (by its path from the root, from the
  page's folder or from the package, or by a unique tail such as `rollout_pipeline.py`) with at least LINE lines.
- No link points to the files that live outside the repository (DESIGN.md, NOTES-environment.md, ../shared, the
  paper's folder): cite the paper by its title and arXiv number instead.
"""
from __future__ import annotations

import os
import re
import subprocess
from functools import lru_cache
from typing import Dict, List, Set

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HTML_SRC = re.compile(r"<(?:img|a)\b[^>]*\b(?:src|href)=\"([^\"]+)\"", re.IGNORECASE)
FILE_LINE = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w.-]+\.(?:py|sh|toml|yaml|yml|txt|cfg)):(\d+)(?:-(\d+))?\b")
OUTSIDE = re.compile(r"DESIGN\.md|NOTES-environment\.md|\.\./shared|(?<![\w-])paper/")
FENCE = re.compile(r"^(```|~~~)")


def _pages() -> List[str]:
    docs = os.path.join(REPO, "docs")
    return ["README.md"] + sorted(os.path.join("docs", name) for name in os.listdir(docs) if name.endswith(".md"))


@lru_cache(maxsize=None)
def _repository_files() -> Set[str]:
    """Paths (from the root) that git tracks, plus the working tree's untracked, unignored files."""
    try:
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                                capture_output=True, text=True, check=True).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: every file of the tree
        listed = [os.path.relpath(os.path.join(root, name), REPO)
                  for root, _, names in os.walk(REPO) for name in names]
    return {path for path in listed if path and os.path.exists(os.path.join(REPO, path))}


@lru_cache(maxsize=None)
def _repository_folders() -> Set[str]:
    folders = set()
    for path in _repository_files():
        parent = os.path.dirname(path)
        while parent:
            folders.add(parent)
            parent = os.path.dirname(parent)
    return folders


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\*|_(?=\W)|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@lru_cache(maxsize=None)
def _anchors(page: str) -> Set[str]:
    anchors: Set[str] = set()
    seen: Dict[str, int] = {}
    in_fence = False
    with open(os.path.join(REPO, page), encoding="utf-8") as handle:
        for line in handle:
            if FENCE.match(line.strip()):
                in_fence = not in_fence
            if in_fence:
                continue
            match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
            if match:
                slug = _slug(match.group(1))
                count = seen.get(slug, 0)
                anchors.add(slug if count == 0 else f"{slug}-{count}")
                seen[slug] = count + 1
    return anchors


def _links(page: str) -> List[tuple]:
    found = []
    with open(os.path.join(REPO, page), encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            for pattern in (LINK, HTML_SRC):
                for match in pattern.finditer(line):
                    found.append((number, match.group(1)))
    return found


def _resolve_link(page: str, target: str) -> str:
    """The problem with a link, or '' when it resolves."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:
        return ""
    path, _, anchor = target.partition("#")
    if path:
        resolved = os.path.normpath(os.path.join(os.path.dirname(page), path))
        if resolved.startswith(".."):
            return f"{target}: leaves the repository"
        if resolved not in _repository_files() and resolved not in _repository_folders():
            return f"{target}: no such file in the repository ({resolved})"
    else:
        resolved = page
    if anchor and resolved.endswith(".md") and anchor not in _anchors(resolved):
        return f"{target}: {resolved} has no heading with the anchor #{anchor}"
    return ""


def _resolve_file_line(page: str, reference: str, line: int) -> str:
    files = _repository_files()
    candidates = [path for path in (reference, os.path.normpath(os.path.join(os.path.dirname(page), reference)),
                                    os.path.join("hacpo_megatron", reference)) if path in files]
    if not candidates:
        candidates = sorted(path for path in files if path.endswith("/" + reference))
    if not candidates:
        return f"{reference}:{line}: no such file in the repository"
    lengths = {}
    for path in candidates:
        with open(os.path.join(REPO, path), encoding="utf-8", errors="replace") as handle:
            lengths[path] = sum(1 for _ in handle)
    if not any(length >= line for length in lengths.values()):
        return f"{reference}:{line}: {', '.join(f'{p} has {n} lines' for p, n in lengths.items())}"
    return ""


@pytest.mark.parametrize("page", _pages())
def test_every_relative_link_resolves_to_a_file_of_the_repository(page):
    problems = [f"{page}:{number}: {problem}" for number, target in _links(page)
                if (problem := _resolve_link(page, target))]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", _pages())
def test_every_file_line_reference_names_a_file_that_long(page):
    problems = []
    in_fence = False
    with open(os.path.join(REPO, page), encoding="utf-8") as handle:
        for number, text in enumerate(handle, start=1):
            if FENCE.match(text.strip()):
                in_fence = not in_fence
            if in_fence:  # a command's output (`bad.yaml:9: ...`) is an example, not a reference
                continue
            for match in FILE_LINE.finditer(text):
                last = int(match.group(3) or match.group(2))
                problem = _resolve_file_line(page, match.group(1), last)
                if problem:
                    problems.append(f"{page}:{number}: {problem}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", _pages())
def test_no_link_points_outside_the_repository(page):
    problems = [f"{page}:{number}: {target}" for number, target in _links(page) if OUTSIDE.search(target)]
    assert not problems, "links to files outside the repository (cite the paper by title and arXiv number):\n" + \
        "\n".join(problems)


def test_the_checks_catch_what_they_are_for(tmp_path):
    assert _resolve_link("docs/x.md", "../README.md") == ""
    assert _resolve_link("docs/x.md", "config.md") == ""
    assert "no such file" in _resolve_link("docs/x.md", "missing.md")
    assert "leaves the repository" in _resolve_link("docs/x.md", "../../shared/x.md")
    assert _resolve_link("README.md", "https://arxiv.org/abs/0000.00000") == ""
    assert "no heading" in _resolve_link("README.md", "docs/config.md#no-such-heading")
    assert _resolve_link("README.md", "docs/config.md#algorithm") == ""
    assert _resolve_file_line("README.md", "hacpo_megatron/config/schema.py", 1) == ""
    assert _resolve_file_line("README.md", "schema.py", 1) == ""
    assert "lines" in _resolve_file_line("README.md", "hacpo_megatron/config/schema.py", 100000)
    assert "no such file" in _resolve_file_line("README.md", "nowhere/missing.py", 1)
    assert _slug("Two real models: SmolLM2-135M-Instruct × Gemma 3 270M") == \
        "two-real-models-smollm2-135m-instruct--gemma-3-270m"
    assert [m.group(1) for m in FILE_LINE.finditer("see launch.py:63-65 and a/b.py:2, not x.py or 1.5:3")] == \
        ["launch.py", "a/b.py"]


def test_the_readme_is_a_front_door_under_2000_words_with_its_sections():
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    assert len(text.split()) < 2000, "README.md: over 2,000 words; move detail into a guide under docs/"
    headings = set(re.findall(r"^## (.+)$", text, re.MULTILINE))
    for section in ("Quick start", "Concepts", "Configs", "Configuration", "Scaling up", "Troubleshooting", "Results",
                    "Guides"):
        assert section in headings, f"README.md: no '## {section}' section"
