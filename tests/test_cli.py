"""The `ucp` command line, run as a user runs it."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ucp_jax
from ucp_jax import cli
from ucp_jax.cli import _progress


@pytest.fixture
def ckpt(tmp_path):
  path = tmp_path / "ckpt"
  ucp_jax.save(
    path,
    {"params": {"w": np.ones((4, 8), np.float32), "b": np.zeros(8, np.int32)}, "step": 3},
    step=3,
  )
  return path


def test_inspect_table(ckpt, capsys):
  assert cli.main(["inspect", str(ckpt)]) == 0
  out = capsys.readouterr().out
  assert "params/w" in out and "(4, 8)" in out and "float32" in out and "128 B" in out
  assert "3 arrays" in out and "168 B" in out


def test_inspect_json(ckpt, capsys):
  assert cli.main(["inspect", str(ckpt), "--json"]) == 0
  data = json.loads(capsys.readouterr().out)
  assert data["step"] == 3 and data["total_bytes"] == 168 and data["total_arrays"] == 3
  assert data["arrays"]["params/b"] == {"shape": [8], "dtype": "int32", "chunks": [8], "bytes": 32}
  assert data["arrays"]["step"]["kind"] == "scalar"


def test_verify_ok_and_bad(ckpt, capsys):
  assert cli.main(["verify", str(ckpt)]) == 0
  assert "OK, 3 arrays" in capsys.readouterr().out
  chunk = next(p for p in (ckpt / "params" / "w" / "c").rglob("*") if p.is_file())
  raw = bytearray(chunk.read_bytes())
  raw[0] ^= 1
  chunk.write_bytes(bytes(raw))
  (ckpt / "step" / "c").unlink()  # the one chunk of a 0-d array
  assert cli.main(["verify", str(ckpt)]) == 1
  out = capsys.readouterr().out
  assert (
    "2 bad array(s)" in out
    and "params/w: " in out
    and "checksum mismatch" in out
    and "step: 1 of 1 chunks missing" in out
  )


def test_a_bad_path_gets_the_same_words_from_every_command(tmp_path, capsys):
  (tmp_path / "notes.txt").write_text("x")
  for bad, words in (
    ("nope", "no such file or directory"),
    (
      "notes.txt",
      "a file that is no checkpoint ucp_jax reads (a checkpoint is a folder; the "
      "files read are torch.save files and .safetensors files)",
    ),
  ):
    path = str(tmp_path / bad)
    for argv in (
      ["inspect", path],
      ["verify", path],
      ["convert", path, str(tmp_path / "out")],
      ["diff", path, path],
      ["export", path, str(tmp_path / "out"), "--format", "hf"],
    ):
      assert cli.main(argv) == 2, argv
      assert capsys.readouterr().err == f"error: {path}: {words}\n", argv


def test_console_script_runs(ckpt):
  proc = subprocess.run(
    [sys.executable, "-m", "ucp_jax.cli", "verify", str(ckpt)],
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert proc.returncode == 0, proc.stderr
  assert "OK" in proc.stdout


@pytest.mark.slow
def test_demo_small(tmp_path, capsys):
  assert cli.main(["demo", "--out", str(tmp_path / "demo"), "--steps", "2"]) == 0
  out = capsys.readouterr().out
  assert "bit-identical to the saved state: True" in out and "PASS" in out
  rows = [line.split()[0] for line in out.splitlines() if re.match(r" +\d+ +\d", line)]
  assert rows == ["0", "1", "2", "3", "4", "5"], out  # the last step once
  assert ucp_jax.open(tmp_path / "demo" / "ckpt_leg2").step == 4
  assert "ucp demo: 2 runs of 6 steps" in out and "(about 5 s on 2 CPU cores" in out
  plot = tmp_path / "demo" / "losses.png"
  if importlib.util.find_spec("matplotlib") is None:
    assert "plot skipped: matplotlib is not installed" in out and not plot.exists()
  else:
    assert f"loss curves: {plot}" in out and plot.read_bytes().startswith(b"\x89PNG")


FIXTURES = Path(__file__).parent / "fixtures"


def test_failed_commands_print_one_line_and_commit_nothing(tmp_path, capsys):
  src = str(FIXTURES / "deepspeed" / "z2_fp32_dp2" / "ckpt")
  (tmp_path / "f").write_text("x")
  cases = [
    (["convert", src, str(tmp_path / "f" / "out")], "f is a file, not a directory"),
    (["convert", src, "memory://x"], "would vanish when ucp exits"),
    (["convert", str(FIXTURES / "tp" / "pp2" / "universal"), str(tmp_path / "u")], "TP/PP"),
    (["verify", str(tmp_path / "f")], "a file that is no checkpoint ucp_jax reads"),
  ]
  for argv, message in cases:
    assert cli.main(argv) == 2, argv
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
  assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_inspect_and_verify_read_a_deepspeed_folder_in_place(tmp_path, capsys):
  src = str(FIXTURES / "deepspeed" / "z2_fp32_dp2" / "ckpt")
  assert cli.main(["inspect", src, "--json"]) == 0
  listed = json.loads(capsys.readouterr().out)
  assert cli.main(["convert", src, str(tmp_path / "c")]) == 0
  capsys.readouterr()
  assert cli.main(["inspect", str(tmp_path / "c"), "--json"]) == 0
  converted = json.loads(capsys.readouterr().out)
  assert listed["arrays"] == converted["arrays"] and listed["step"] == converted["step"]
  assert listed["source"]["format"] == "deepspeed"
  assert cli.main(["verify", src]) == 0
  assert f"{src}: OK, 23 arrays, 11.5 KiB read in" in capsys.readouterr().out
  assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_convert_onto_a_checkpoint_names_the_flag(tmp_path, capsys):
  src, dst = str(FIXTURES / "deepspeed" / "z2_fp32_dp2" / "ckpt"), str(tmp_path / "out")
  assert cli.main(["convert", src, dst]) == 0
  assert capsys.readouterr().err == ""  # no progress noise where stderr is not a terminal
  assert cli.main(["convert", src, dst]) == 2
  err = capsys.readouterr().err
  assert "pass --overwrite" in err and "overwrite=True" not in err


def test_os_errors_and_interrupts_are_one_line(tmp_path, capsys, monkeypatch):
  from ucp_jax.sources import _convert

  def fail(*args, **kwargs):
    raise PermissionError(13, "Permission denied", "/data/out")

  monkeypatch.setattr(_convert, "convert", fail)
  assert cli.main(["convert", str(tmp_path), str(tmp_path / "out")]) == 2
  assert capsys.readouterr().err == "error: /data/out: Permission denied\n"

  def interrupt(*args, **kwargs):
    raise KeyboardInterrupt

  monkeypatch.setattr(_convert, "convert", interrupt)
  assert cli.main(["convert", str(tmp_path), str(tmp_path / "out")]) == 130
  assert capsys.readouterr().err == "interrupted\n"


def test_progress_lines_where_stderr_is_not_a_terminal(ckpt, capsys, monkeypatch):
  monkeypatch.setattr(_progress.Reporter, "interval", 0.0)
  assert cli.main(["verify", str(ckpt)]) == 0
  lines = capsys.readouterr().err.splitlines()
  assert re.fullmatch(r"verify: 168 B of 168 B \(100%\) in \d+ s, at step", lines[-1]), lines
  assert all(line.startswith("verify: ") for line in lines)


def test_a_progress_log_says_it_is_alive_while_a_large_item_runs(capsys):
  """Between the lines of finished items, the ticker's line says how long it has run (called
  here directly, as the ticker does after `interval` seconds without a line)."""
  from rich.console import Console

  err = Console(stderr=True, force_terminal=False, soft_wrap=True)  # as the command's
  with _progress.Reporter(err, "convert", total=1000) as progress:
    progress.update("small", 30)
    progress.beat()
  lines = capsys.readouterr().err.splitlines()
  assert re.fullmatch(
    r"convert: 30 B of 1000 B \(3%\) in \d+ s, working on the next item \(each reports when "
    r"it is done\)",
    lines[-1],
  ), lines


def test_staging_directory_is_refused(ckpt, tmp_path, capsys):
  staging = ckpt.rename(tmp_path / ".ckpt.ucp-tmp-00000000000000ff")
  assert cli.main(["inspect", str(staging)]) == 2
  assert "staging directory of a save to" in capsys.readouterr().err


def test_demo_arguments_checked_first(tmp_path, capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["demo", "--steps", "0"])
  assert e.value.code == 2 and "not a positive integer" in capsys.readouterr().err
  (tmp_path / "f").write_text("x")
  assert cli.main(["demo", "--out", str(tmp_path / "f"), "--steps", "1"]) == 2
  assert "a file is in the way" in capsys.readouterr().err


def test_export_says_when_rules_are_not_used(tmp_path, capsys):
  pytest.importorskip("torch")
  src = str(FIXTURES / "deepspeed" / "z2_fp32_dp2" / "ckpt")
  assert cli.main(["convert", src, str(tmp_path / "ckpt")]) == 0
  argv = [
    "export",
    "--format",
    "deepspeed",
    str(tmp_path / "ckpt"),
    str(tmp_path / "ds"),
    "--rules",
    "gpt2:num_heads=4",
  ]
  assert cli.main(argv) == 0
  out = capsys.readouterr().out
  assert "note: rules were not used: the checkpoint's parameters already have torch names" in out
  assert (
    cli.main(["export", "--format", "deepspeed", str(tmp_path / "ckpt"), str(tmp_path / "ds")]) == 2
  )
  assert "pass --overwrite to replace it" in capsys.readouterr().err


def test_inspect_says_when_there_is_no_optimizer_state(tmp_path, capsys):
  torch = pytest.importorskip("torch")
  torch.save({"w": torch.ones(2)}, tmp_path / "model.pt")
  assert cli.main(["inspect", str(tmp_path / "model.pt")]) == 0
  assert "parameters: 1 (0 frozen), named the torch way; no optimizer state (weights alone)" in (
    capsys.readouterr().out
  )


def test_inspect_piped_shows_whole_keys_and_the_parameter_groups(tmp_path):
  import optax
  from flax import nnx

  class Wide(nnx.Module):
    def __init__(self, rngs):
      name = "a_module_with_a_name_far_longer_than_any_terminal_is_wide_" * 2
      setattr(self, name, nnx.Linear(2, 3, rngs=rngs))

  model = Wide(nnx.Rngs(0))
  tx = optax.adamw(1e-3, weight_decay=0.05)
  ucp_jax.save_train_state(tmp_path / "c", model, nnx.Optimizer(model, tx, wrt=nnx.Param))
  run = subprocess.run(
    [sys.executable, "-m", "ucp_jax.cli", "inspect", str(tmp_path / "c")],
    capture_output=True,
    text=True,
  )
  assert run.returncode == 0, run.stderr
  long_key = "model/" + "a_module_with_a_name_far_longer_than_any_terminal_is_wide_" * 2 + "/kernel"
  assert long_key in run.stdout  # a pipe is no 80-column terminal: nothing cut
  assert "parameters: 2 (0 frozen), named the flax way; optimizer adamw, step 0" in run.stdout
  assert re.search(r"group 0: 2 parameters; lr 0.001, betas .*weight_decay 0.05", run.stdout)


def test_ctrl_c_while_the_command_starts_prints_no_traceback():
  # the signal arrives while the package imports: deterministic, not a race with a timer
  code = (
    "import os, signal, sys\n"
    "sys.argv = ['/venv/bin/ucp', 'inspect', 'x']\n"
    "import ucp_jax.base._startup\n"
    "os.kill(os.getpid(), signal.SIGINT)\n"
    "import ucp_jax.cli\n"
    "print('not reached')\n"
  )
  run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
  assert run.returncode == 130 and run.stderr == "interrupted\n" and not run.stdout


def test_diff_says_how_many_keys_it_did_not_list(tmp_path, capsys):
  ucp_jax.save(tmp_path / "a", {f"k{i}": np.ones(2) for i in range(25)})
  ucp_jax.save(tmp_path / "b", {"k0": np.ones(2)})
  assert cli.main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
  out = capsys.readouterr().out
  assert out.count("  only in ") == 20 and f"... and 4 more only in {tmp_path / 'a'}" in out


def test_native_log_lines_are_kept_out_of_a_logged_command():
  code = (
    "import os\n"
    "from ucp_jax.cli import _native_logs\n"
    "with _native_logs.filtered():\n"
    "  os.write(2, b'WARNING: All log messages before absl::InitializeLog() is called are "
    "written to STDERR\\n')\n"
    "  os.write(2, b'E1201 15:40:09.023765   22884 google_auth_provider.cc:188] Could not find "
    "the credentials file\\n')\n"
    "  os.write(2, b'error: a line of ours\\n')\n"
    "  os.write(2, b'W1201 15:40:09.1 1 x.cc:1] partial')\n"
    "os.write(2, b'after\\n')\n"
  )
  run = subprocess.run([sys.executable, "-c", code], capture_output=True)
  assert run.returncode == 0 and run.stderr == b"error: a line of ours\nafter\n", run.stderr
  kept = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, env={**os.environ, "UCP_NATIVE_LOGS": "1"}
  )
  assert b"google_auth_provider.cc:188]" in kept.stderr


def test_version_names_the_package(capsys):
  from ucp_jax import cli

  with pytest.raises(SystemExit) as exit_info:
    cli.main(["--version"])
  assert exit_info.value.code == 0
  assert capsys.readouterr().out.startswith("ucp_jax ")


def test_export_flags_come_from_each_sinks_options():
  import dataclasses

  from ucp_jax.cli import _export_flags, _main
  from ucp_jax.sinks import _registry as sinks

  parser = _main.build_parser(["export"])
  declared = {
    f.name
    for name in sinks.SINKS
    for f in dataclasses.fields(sinks.get(name).Options)
    if f.metadata["flag"]
  }
  assert declared == set(_export_flags.sink_flags()) >= {"zero_stage", "ranks", "ocdbt", "dtype"}
  args = parser.parse_args(
    ["export", "c", "d", "--format", "orbax", "--ocdbt", "false", "--chunk-bytes", "4096"]
  )
  assert (args.ocdbt, args.chunk_bytes, args.ranks, args.nnx) == (False, 4096, None, None)
  args = parser.parse_args(["export", "c", "d", "--format", "hf", "--max-shard-size", "2GB"])
  assert args.max_shard_size == "2GB" and args.compression is None
  with pytest.raises(SystemExit):
    parser.parse_args(["export", "c", "d", "--format", "orbax", "--zarr3", "maybe"])
