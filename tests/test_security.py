"""No code of ours loads pickles that can run code, or runs a model repository's own code.

`torch.load` unpickles: without `weights_only=True` a checkpoint file can run arbitrary code when
it is loaded (a run folder or a downloaded checkpoint is not necessarily trusted).
`trust_remote_code=True` makes transformers import and run Python shipped with a model folder.
"""
import ast
import os
import re
from typing import List

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOTS = ("hacpo_megatron", "tools", "examples", "configs")  # configs: text only (no Python there)
TORCH_LOADS = {"torch.load", "torch.serialization.load"}
REMOTE_CODE_TEXT = re.compile(r"trust_remote_code\s*[=:]\s*[\"']?true", re.I)


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _is_true(node) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _is_false(node) -> bool:
    return isinstance(node, ast.Constant) and node.value is False


def unsafe_lines(source: str, filename: str) -> List[str]:
    """`file:line: what` for every torch.load without a literal weights_only=True and every
    trust_remote_code that is not a literal False (keyword or dict entry) in Python source."""
    found = []
    torch_load_names = set(TORCH_LOADS)
    tree = ast.parse(source, filename)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("torch", "torch.serialization"):
            torch_load_names.update(alias.asname or alias.name for alias in node.names if alias.name == "load")
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            if _dotted(node.func) in torch_load_names:
                keywords = {k.arg: k.value for k in node.keywords}
                if not _is_true(keywords.get("weights_only")):
                    found.append(f"{filename}:{node.lineno}: torch.load without weights_only=True")
            for keyword in node.keywords:
                if keyword.arg == "trust_remote_code" and not _is_false(keyword.value):
                    found.append(f"{filename}:{node.lineno}: trust_remote_code={ast.unparse(keyword.value)}")
                if keyword.arg is None and isinstance(keyword.value, ast.Dict):  # **{"trust_remote_code": ...}
                    found += _dict_entries(keyword.value, filename)
        elif isinstance(node, ast.Dict):
            found += _dict_entries(node, filename)
    return sorted(set(found))


def _dict_entries(node: ast.Dict, filename: str) -> List[str]:
    return [f"{filename}:{node.lineno}: trust_remote_code: {ast.unparse(value)}"
            for key, value in zip(node.keys, node.values)
            if isinstance(key, ast.Constant) and key.value == "trust_remote_code" and not _is_false(value)]


def _files():
    for root in ROOTS:
        for folder, dirs, names in os.walk(os.path.join(REPO, root)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for name in sorted(names):
                yield os.path.join(folder, name)


def test_the_checker_finds_what_it_looks_for():
    bad = ("import torch\nfrom torch import load as tl\n"
           "a = torch.load(p)\nb = torch.load(p, weights_only=False)\nc = tl(p)\n"
           "m = AutoModel.from_pretrained(x, trust_remote_code=True)\n"
           "n = AutoTokenizer.from_pretrained(x, trust_remote_code=flag)\n"
           "kw = {'trust_remote_code': True}\n")
    assert [line.split(": ", 1)[0] for line in unsafe_lines(bad, "bad.py")] == [
        "bad.py:3", "bad.py:4", "bad.py:5", "bad.py:6", "bad.py:7", "bad.py:8"]
    good = ("import torch\na = torch.load(p, weights_only=True, map_location='cpu')\n"
            "m = AutoModel.from_pretrained(x, trust_remote_code=False)\n")
    assert unsafe_lines(good, "good.py") == []
    assert REMOTE_CODE_TEXT.search("trust_remote_code: true") and REMOTE_CODE_TEXT.search("--trust_remote_code=True")


def test_no_unsafe_torch_load_or_remote_code():
    found = []
    for path in _files():
        relative = os.path.relpath(path, REPO)
        if path.endswith(".py"):
            with open(path, encoding="utf-8") as f:
                found += unsafe_lines(f.read(), relative)
        elif path.endswith((".yaml", ".yml", ".json", ".sh", ".md", ".txt", ".toml", ".cfg")):
            with open(path, encoding="utf-8", errors="replace") as f:
                for number, line in enumerate(f, 1):
                    if REMOTE_CODE_TEXT.search(line):
                        found.append(f"{relative}:{number}: {line.strip()}")
    assert not found, "unsafe loading (see tests/test_security.py for why):\n" + "\n".join(found)


@pytest.mark.parametrize("root", ROOTS)
def test_roots_exist(root):
    assert os.path.isdir(os.path.join(REPO, root))
