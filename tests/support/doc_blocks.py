"""The code blocks of README.md and docs/*.md: read, checked, and run as written.

Every fenced block names its language. `python` and `bash` blocks (`sh`, `shell`, `console`
too) run; `text` and `json` blocks (command synopses, outputs, file listings, data) do not.
An HTML comment on the line just before a block, invisible on GitHub, says how it runs:

  <!-- doctest: setup=NAME -->     first prepare what the block assumes (files in its
                                   directory, names such as `model`): a setup of
                                   tests/doc_fixtures.py, which also says what it needs
                                   installed (torch, transformers) and whether it is slow
  <!-- doctest: continue -->       run in the directory and namespace of the block before
  <!-- doctest: check=NAME -->     afterwards, check that it did what its comments say
  <!-- doctest: slow -->           mark it slow (`pytest -m "not slow"` leaves it out)
  <!-- doctest: skip (REASON) -->  do not run it, for the reason given

Words combine (`<!-- doctest: continue check=hf_cli -->`), except `skip`, which stands alone.
A block without a comment runs as it is, alone. Each block (with the blocks that continue
it) runs in a fresh empty directory and a fresh namespace: python in-process, bash as
`bash -e` with `ucp` and `python` on PATH. Before a setup, JAX gets 8 CPU devices; a block
that runs first without one has the default devices, as a reader would.

`python tests/support/doc_blocks.py docs/orbax.md` runs one document's blocks (tests/
test_docs_examples.py runs every document's, grouped into a few processes).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LANGUAGES = {"python": "python", "py": "python", "bash": "bash", "sh": "bash", "shell": "bash"}
LANGUAGES |= {"console": "console", "text": "text", "json": "text", "jsonc": "text"}
_FENCE = re.compile(r"^( {0,3})(`{3,}|~{3,})\s*([\w+-]*)")
_DIRECTIVE = re.compile(r"^\s*<!--\s*doctest:(.*?)-->\s*$")
_SKIP = re.compile(r"^skip\s*\((.*\S.*)\)$")
_WORD = re.compile(r"^(continue|slow|setup=[\w-]+|check=[\w-]+)$")


@dataclasses.dataclass(frozen=True)
class Block:
  """One fenced block; `line` is its opening fence's (1-based), `code` its text."""

  doc: str
  line: int
  lang: str
  code: str
  problems: tuple[str, ...] = ()  # with its fence or its doctest comment
  skip: str | None = None
  setup: str | None = None
  check: str | None = None
  cont: bool = False
  slow: bool = False

  @property
  def kind(self) -> str | None:
    """python, bash, console, text, or None for a language this file does not know."""
    return LANGUAGES.get(self.lang)

  @property
  def runs(self) -> bool:
    return self.kind in ("python", "bash", "console") and self.skip is None

  @property
  def where(self) -> str:
    return f"{self.doc}:{self.line}"


@dataclasses.dataclass(frozen=True)
class Group:
  """Blocks that run together: one, and those that `continue` it."""

  blocks: tuple[Block, ...]

  @property
  def line(self) -> int:
    return self.blocks[0].line

  @property
  def setups(self) -> list[str]:
    return [b.setup for b in self.blocks if b.setup]

  @property
  def checks(self) -> list[str]:
    return [b.check for b in self.blocks if b.check]


def documents() -> list[str]:
  """README.md and docs/*.md, relative to the repository root."""
  return ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("docs/*.md"))]


def parse(doc: str, text: str | None = None) -> tuple[list[Block], list[str]]:
  """The blocks of `doc` (or of `text`), and doctest comments that precede no block."""
  lines = (text if text is not None else (ROOT / doc).read_text()).splitlines()
  blocks, problems, i = [], [], 0
  while i < len(lines):
    fence = _FENCE.match(lines[i])
    comment = _DIRECTIVE.match(lines[i])
    if comment and not (i + 1 < len(lines) and _FENCE.match(lines[i + 1])):
      problems.append(f"{doc}:{i + 1}: a doctest comment must be the line just before a block")
    if not fence:
      i += 1
      continue
    indent, marks, lang = fence.groups()
    closing = re.compile(rf"^ {{0,3}}{marks[0]}{{{len(marks)},}}\s*$")
    end = next((j for j in range(i + 1, len(lines)) if closing.match(lines[j])), len(lines))
    code = "\n".join(
      line[len(indent) :] if line.startswith(indent) else line for line in lines[i + 1 : end]
    )
    words = _DIRECTIVE.match(lines[i - 1]) if i else None
    block, trouble = _block(
      doc, i + 1, lang, code + "\n", words.group(1).strip() if words else None
    )
    blocks.append(dataclasses.replace(block, problems=tuple(trouble)))
    i = end + 1
  return blocks, problems


def _block(doc: str, line: int, lang: str, code: str, words: str | None) -> tuple[Block, list[str]]:
  block, trouble = Block(doc, line, lang, code), []
  if block.kind is None:
    trouble.append(
      f"a block in {lang or 'no language'}: name it python or bash (it runs), or text or json"
      " (it does not: a synopsis, an output, a listing)"
    )
  if words is None:
    return block, trouble
  if block.kind == "text":
    trouble.append("a doctest comment before a text block, which never runs")
  if skip := _SKIP.match(words):
    return dataclasses.replace(block, skip=skip.group(1).strip()), trouble
  options: dict = {}
  for word in words.split():
    if not _WORD.match(word):
      trouble.append(f"doctest comment: {word!r} is none of continue, slow, setup=NAME, check=NAME")
      trouble += ["doctest comment: skip wants a reason, alone: skip (why)"] * (word == "skip")
      continue
    key, _, value = word.partition("=")
    options["cont" if key == "continue" else key] = value or True
  return dataclasses.replace(block, **options), trouble


def groups(blocks: list[Block]) -> tuple[list[Group], list[str]]:
  """The runnable blocks, grouped by `continue`; and any `continue` with nothing to continue."""
  found: list[list[Block]] = []
  problems, last = [], None
  for block in blocks:
    if block.kind == "text":
      continue
    if block.runs and block.cont:
      if last is None or not last.runs:
        problems.append(f"{block.where}: continues no block that runs")
      else:
        found[-1].append(block)
    elif block.runs:
      found.append([block])
    last = block
  return [Group(tuple(g)) for g in found], problems


# Running (in a process of its own: python tests/support/doc_blocks.py DOC [--lines L,...])


def _environment(bin_dir: Path) -> dict[str, str]:
  """A reader's shell: this Python as `python`, and its `ucp`, first on PATH; no XLA_FLAGS."""
  bin_dir.mkdir(parents=True, exist_ok=True)
  if not (bin_dir / "python").exists():
    (bin_dir / "python").symlink_to(sys.executable)
  scripts = [sysconfig.get_path("scripts"), os.path.dirname(sys.executable)]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # blocks ask (README's 1st line)
  env["PATH"] = os.pathsep.join([str(bin_dir), *scripts, env.get("PATH", "")])
  env.setdefault("JAX_PLATFORMS", "cpu")
  env.setdefault("HF_HUB_OFFLINE", "1")
  env.setdefault("TOKENIZERS_PARALLELISM", "false")
  return env


def _fixtures():
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  import doc_fixtures  # imports JAX: only once a setup or a check needs it

  return doc_fixtures


def _run_block(block: Block, namespace: dict) -> None:
  if block.kind == "python":
    padded = "\n" * block.line + block.code  # tracebacks give the document's line numbers
    exec(compile(padded, str(ROOT / block.doc), "exec"), namespace)
    return
  code = block.code
  if block.kind == "console":  # `$ command` lines; the rest is output
    code = "".join(line[2:] + "\n" for line in code.splitlines() if line.startswith("$ "))
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # a setup may have set it
  proc = subprocess.run(["bash", "-e", "-x", "-c", code, block.where], env=env)
  if proc.returncode:
    raise AssertionError(f"{block.where}: bash exited with {proc.returncode}")


def run_group(group: Group, here: Path) -> None:
  """Runs `group` in the empty directory `here`."""
  namespace: dict = {"__name__": "__main__"}
  os.chdir(here)
  for block in group.blocks:
    if block.setup:
      namespace.update(_fixtures().SETUPS[block.setup].make(here))
    _run_block(block, namespace)
    if block.check:
      _fixtures().CHECKS[block.check](namespace, here)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("doc", help="README.md or docs/NAME.md")
  parser.add_argument("--lines", help="run only the groups that start at these lines (1,7,...)")
  parser.add_argument("--dir", help="where the groups' directories go (default: a new one)")
  args = parser.parse_args(argv)
  path = Path(args.doc).resolve()
  doc = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
  blocks, problems = parse(doc)
  found, more = groups(blocks)
  problems += [f"{b.where}: {p}" for b in blocks for p in b.problems] + more
  for problem in problems:
    print(problem, file=sys.stderr)
  wanted = {int(n) for n in args.lines.split(",")} if args.lines else {g.line for g in found}
  base = Path(args.dir or tempfile.mkdtemp(prefix="doc_blocks-")).resolve()
  environment = _environment(base / "bin")
  os.environ.clear()
  os.environ.update(environment)
  failed = []
  for group in (g for g in found if g.line in wanted):
    here = base / f"{Path(doc).stem}-{group.line}"
    here.mkdir(parents=True)
    print(f"== {doc}:{group.line} ({len(group.blocks)} block(s), in {here})", flush=True)
    start = time.perf_counter()
    try:
      run_group(group, here)
    except (Exception, SystemExit):  # every failing group is reported
      traceback.print_exc()
      failed.append(f"{doc}:{group.line}")
    else:
      print(f"== {doc}:{group.line} ran in {time.perf_counter() - start:.1f} s", flush=True)
      os.chdir(base)
      shutil.rmtree(here, ignore_errors=True)
    sys.stdout.flush()
    sys.stderr.flush()
  print(f"failed: {', '.join(failed)}" if failed else "all ran", flush=True)
  return 1 if failed or (problems and not args.lines) else 0  # tests check problems apart


if __name__ == "__main__":
  sys.exit(main())
