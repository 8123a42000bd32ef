"""The README stays true: its two opening commands, its links, and no section written twice."""

from __future__ import annotations

import collections
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_opens_with_the_demo_and_the_test_commands():
  first_block = README.split("```")[1]
  commands = [line.split("#")[0].strip() for line in first_block.splitlines()[1:] if line.strip()]
  assert commands == ["pip install -e . && ucp demo", "bash .ci/run"]
  ci = (ROOT / ".ci" / "run").read_text()
  assert "pytest" in ci


def test_no_section_or_paragraph_twice():
  headings = [line for line in README.splitlines() if re.match(r"#{1,6} ", line)]
  twice = [h for h, n in collections.Counter(headings).items() if n > 1]
  assert not twice, f"headings repeated: {twice}"
  paragraphs = [p.strip() for p in README.split("\n\n") if len(p.strip()) > 80]
  twice = [p[:60] for p, n in collections.Counter(paragraphs).items() if n > 1]
  assert not twice, f"paragraphs repeated: {twice}"


def test_every_referenced_file_exists():
  paths = set(re.findall(r"\b((?:docs|scripts|notebooks|tests)/[\w./-]+\.(?:md|py|ipynb))", README))
  assert paths, "the README names no files?"
  missing = sorted(p for p in paths if not (ROOT / p).exists())
  assert not missing, f"README names missing files: {missing}"


def test_the_cli_commands_it_shows_exist():
  from ucp_jax import cli

  shown = set(re.findall(r"^ucp (\w+)", README, flags=re.M))
  parser = cli.build_parser()
  commands = next(a.choices for a in parser._actions if getattr(a, "choices", None))
  assert shown >= {"inspect", "verify", "convert", "export", "demo"}
  assert not shown - set(commands), f"README shows commands the CLI lacks: {shown - set(commands)}"
