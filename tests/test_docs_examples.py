"""The code a user copies from README.md and docs/*.md runs as written; so do docstring examples.

Every fenced block of those documents either runs or says, in a comment beside it, why not
(the rules, and how to run one document's blocks by hand: tests/support/doc_blocks.py; the setups that
prepare what a block assumes, and the checks of what it promises: tests/doc_fixtures.py). A
new block runs by default; one that cannot, or a fence without a language, fails
`test_every_block_runs_or_says_why_not`. A document's blocks run in order in one process for
each set of needs (fast, slow, torch, transformers), each with its own empty directory.
"""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import os
import re
import subprocess
import sys

import doc_blocks
import doc_fixtures
import pytest

from ucp_jax import cli

ROOT = doc_blocks.ROOT


def _needs(group: doc_blocks.Group) -> tuple[bool, tuple[str, ...]]:
  setups = [doc_fixtures.SETUPS[s] for s in group.setups if s in doc_fixtures.SETUPS]
  slow = any(b.slow for b in group.blocks) or any(s.slow for s in setups)
  return slow, tuple(sorted({m for s in setups for m in s.requires}))


def _runs() -> list:
  """One test per document and set of needs: the first lines of the groups it runs."""
  params = []
  for doc in doc_blocks.documents():
    found, _ = doc_blocks.groups(doc_blocks.parse(doc)[0])
    by_needs: dict[tuple, list[int]] = {}
    for group in found:
      by_needs.setdefault(_needs(group), []).append(group.line)
    for (slow, requires), lines in by_needs.items():
      name = "-".join([doc, *(["slow"] if slow else []), *requires])
      marks = [pytest.mark.slow] if slow else []
      params.append(pytest.param(doc, lines, requires, marks=marks, id=name))
  return params


def _installed(module: str) -> bool:
  try:
    return importlib.util.find_spec(module) is not None
  except (ImportError, ValueError):  # ValueError: a module set to None in sys.modules
    return False


def test_every_block_runs_or_says_why_not():
  problems = []
  for doc in doc_blocks.documents():
    blocks, doc_problems = doc_blocks.parse(doc)
    problems += doc_problems + [f"{b.where}: {p}" for b in blocks for p in b.problems]
    problems += doc_blocks.groups(blocks)[1]
    for block in blocks:
      if block.setup and block.setup not in doc_fixtures.SETUPS:
        problems.append(f"{block.where}: no setup {block.setup!r} in tests/doc_fixtures.py")
      if block.check and block.check not in doc_fixtures.CHECKS:
        problems.append(f"{block.where}: no check {block.check!r} in tests/doc_fixtures.py")
  assert not problems, "\n".join([*problems, "(the rules: tests/support/doc_blocks.py)"])


def test_the_documents_have_blocks_that_run():
  """The parser finds the blocks (a broken one would find none and pass everything)."""
  blocks, _ = doc_blocks.parse("README.md")
  kinds = [b.kind for b in blocks]
  assert kinds.count("python") >= 5 and kinds.count("bash") >= 3 and "text" in kinds
  assert sum(len(lines) for _, lines, _ in (p.values for p in _runs())) >= 12


def test_a_block_that_neither_runs_nor_says_why_is_refused():
  text = """\
```
ucp inspect ckpt
```
<!-- doctest: skip -->
```python
```
<!-- doctest: skip (needs a GPU) -->
```python
```
<!-- doctest: continue -->
```bash
```
<!-- doctest: setup=a slow retry -->
```sh
```
<!-- doctest: continue -->

```text
```
"""
  blocks, problems = doc_blocks.parse("new.md", text)
  problems += [f"{b.where}: {p}" for b in blocks for p in b.problems]
  problems += doc_blocks.groups(blocks)[1]
  assert problems == [
    "new.md:16: a doctest comment must be the line just before a block",
    "new.md:1: a block in no language: name it python or bash (it runs), or text or json (it"
    " does not: a synopsis, an output, a listing)",
    "new.md:5: doctest comment: 'skip' is none of continue, slow, setup=NAME, check=NAME",
    "new.md:5: doctest comment: skip wants a reason, alone: skip (why)",
    "new.md:14: doctest comment: 'retry' is none of continue, slow, setup=NAME, check=NAME",
    "new.md:11: continues no block that runs",
  ]
  assert [(b.line, b.kind, b.runs, b.skip, b.setup, b.slow) for b in blocks] == [
    (1, None, False, None, None, False),
    (5, "python", True, None, None, False),
    (8, "python", False, "needs a GPU", None, False),
    (11, "bash", True, None, None, False),
    (14, "bash", True, None, "a", True),
    (18, "text", False, None, None, False),
  ]


@pytest.mark.parametrize(("doc", "lines", "requires"), _runs())
def test_blocks_run(doc, lines, requires, tmp_path):
  missing = [m for m in requires if not _installed(m)]
  if missing:
    pytest.skip(f"needs {', '.join(missing)} (pip install 'ucp_jax[torch]' / .ci/run)")
  script = ROOT / "tests" / "support" / "doc_blocks.py"
  command = [sys.executable, str(script), doc, "--dir", str(tmp_path)]
  command += ["--lines", ",".join(map(str, lines))]
  path = os.pathsep.join([str(ROOT / "scripts"), os.environ.get("PYTHONPATH", "")])  # torch twins
  proc = subprocess.run(
    command,
    cwd=ROOT,
    env={**os.environ, "PYTHONPATH": path},
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )
  assert proc.returncode == 0, f"{doc}: blocks at lines {lines} failed:\n{proc.stdout[-12000:]}"


def test_command_synopses_name_real_options():
  """`ucp ...` lines of text blocks (synopses, which do not run) name real commands and options."""
  parser = cli.build_parser()
  commands = next(a.choices for a in parser._actions if getattr(a, "choices", None))
  wrong = []
  for doc in doc_blocks.documents():
    for block in doc_blocks.parse(doc)[0]:
      lines = block.code.splitlines() if block.kind == "text" else []
      for line in (line.split("#")[0] for line in lines if line.startswith("ucp ")):
        name = line.split()[1]
        known = commands[name]._option_string_actions if name in commands else {}
        unknown = [o for o in re.findall(r"--[a-z][\w-]*", line) if o not in known]
        if name not in commands or unknown:
          wrong.append(f"{block.where}: {line.strip()!r}: {unknown or 'no such command'}")
  assert not wrong, "\n".join(wrong)


# docstring examples (`>>>`) of the package


def _modules_with_examples() -> list:
  params = []
  for file in sorted((ROOT / "ucp_jax").rglob("*.py")):
    if ">>>" in file.read_text():
      parts = file.relative_to(ROOT).with_suffix("").parts
      name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
      slow = name.startswith("ucp_jax.models.")  # they compile a model: seconds each
      params.append(pytest.param(name, marks=[pytest.mark.slow] if slow else [], id=name))
  return params


@pytest.mark.parametrize("name", _modules_with_examples())
def test_docstring_examples(name, monkeypatch, devices):
  monkeypatch.chdir(ROOT)  # some examples read the fixtures under tests/
  module = importlib.import_module(name)
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
  tests = doctest.DocTestFinder().find(module, name)
  assert tests
  for test in tests:
    runner.run(test)
  results = runner.summarize(verbose=False)
  assert results.failed == 0, f"{results.failed} docstring examples of {name} failed (see stdout)"
