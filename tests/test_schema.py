"""The universal schema as typed records: checked when read, written in one canonical form."""

import json

import numpy as np
import optax
import pytest
from flax import nnx

import ucp_jax
from ucp_jax.plugins import GroupEntry, Optimizer, ParamEntry
from ucp_jax.store._manifest import seal

TREE = {
  "params": {"w": np.ones(4, np.float32), "b": np.ones(2, np.float32)},
  "exp_avg": {"w": np.zeros(4, np.float32)},
  "exp_avg_sq": {"w": np.zeros(4, np.float32)},
}
SCHEMA = ucp_jax.Schema(
  params={
    "w": ParamEntry("params/w", {"exp_avg": "exp_avg/w", "exp_avg_sq": "exp_avg_sq/w"}, 0),
    "b": ParamEntry("params/b", frozen=True),
  },
  optimizer=Optimizer("adamw", step=3, groups=(GroupEntry({"lr": 0.1, "step": 3}),)),
  extra={"scheduler": {"last_epoch": 3}},
)


def test_records_round_trip_through_a_save(tmp_path):
  ucp_jax.save(tmp_path / "c", TREE, schema=SCHEMA)
  manifest = ucp_jax.open(tmp_path / "c").manifest
  assert manifest.typed_schema == SCHEMA
  assert manifest.schema == SCHEMA.to_json()  # the JSON form stays public
  assert manifest.schema["params"]["b"] == {
    "value": "params/b",
    "slots": {},
    "group": None,
    "frozen": True,
    "tied_to": None,
  }
  group = manifest.typed_schema.optimizer.groups[0]
  assert group.step == 3 and group.hyperparameters == {"lr": 0.1}
  assert list(manifest.typed_schema.trainable) == ["w"]


def test_every_builder_writes_the_canonical_form(tmp_path):
  model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
  saved = ucp_jax.save_train_state(tmp_path / "ts", model, optimizer)
  ucp_jax.save(tmp_path / "plain", {"model": nnx.state(model, nnx.Param)})
  for manifest in (ucp_jax.open(saved).manifest, ucp_jax.open(tmp_path / "ts").manifest):
    schema = manifest.schema
    assert ucp_jax.Schema.from_json(schema, "here").to_json() == schema
    assert schema["optimizer"]["type"] == "adamw" and schema["naming"] == "flax"
  assert ucp_jax.open(tmp_path / "plain").manifest.typed_schema is None


def _with_schema(path, schema) -> None:
  manifest = path / "manifest.json"
  data = json.loads(manifest.read_text())
  manifest.write_bytes(seal({**data, "schema": schema}))


def test_a_malformed_schema_is_refused_when_read_listing_every_problem(tmp_path):
  ucp_jax.save(tmp_path / "c", TREE, schema=SCHEMA)
  good = SCHEMA.to_json()
  bad = {
    **good,
    "naming": "jax",
    "pramas": {},
    "params": {
      "w": {**good["params"]["w"], "slot": {"exp_avg": "exp_avg/w"}},
      "b": {**good["params"]["b"], "frozen": "yes", "group": 1.5},
      "\x1b[31mred": [],
    },
    "buffers": {"mean": 7},
    "optimizer": {**good["optimizer"], "step": "3", "groups": [{"lr": 0.1}, 2]},
  }
  _with_schema(tmp_path / "c", bad)
  with pytest.raises(ucp_jax.ManifestError) as e:
    ucp_jax.open(tmp_path / "c")
  lines = str(e.value).splitlines()
  assert lines[0] == f"{tmp_path / 'c' / 'manifest.json'}: malformed parameter schema:"
  assert sorted(line.strip() for line in lines[1:]) == sorted(
    [
      "unknown field 'pramas' (known: version, naming, params, buffers, optimizer, extra)",
      '`naming` is \'jax\', not "torch" or "flax"',
      "`params.w`: unknown field 'slot' (known: value, slots, group, frozen, tied_to, pattern)",
      "`params.b` `frozen` is 'yes', not true or false",
      "`params.b` `group` is 1.5, not an integer or null",
      "`params.'\\x1b[31mred'` is [], not an object",
      "`buffers` `mean` is 7, not a key (a string)",
      "`optimizer.step` is '3', not an integer or null",
      "`optimizer.groups[1]` is 2, not an object",
    ]
  )
  _with_schema(tmp_path / "c", [1, 2])
  with pytest.raises(ucp_jax.ManifestError, match=r"malformed manifest: \"schema\" is \[1, 2\]"):
    ucp_jax.open(tmp_path / "c")


def test_save_checks_the_schema_it_is_given_before_writing(tmp_path):
  bad = {"params": {"w": {"value": "params/w", "slots": ["exp_avg"]}}}
  with pytest.raises(ucp_jax.InvalidArgumentError) as e:
    ucp_jax.save(tmp_path / "c", TREE, schema=bad)
  assert str(e.value) == (
    "schema=: malformed parameter schema: `params.w` `slots` is ['exp_avg'], not an object"
  )
  assert not (tmp_path / "c").exists()


def test_inspect_reads_the_records(tmp_path, capsys):
  from ucp_jax.cli import _main

  ucp_jax.save(tmp_path / "c", TREE, schema=SCHEMA)
  assert _main.main(["inspect", str(tmp_path / "c")]) == 0
  out = capsys.readouterr().out
  assert "parameters: 2 (1 frozen), named the torch way; optimizer adamw, step 3" in out
  assert "group 0: 1 parameters; lr 0.1, step 3" in out
