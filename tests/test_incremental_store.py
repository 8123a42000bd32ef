"""Incremental saves on object stores (memory://): a pool of generations beside the
checkpoints, references that keep them alive, and a collector safe against running saves."""

from __future__ import annotations

import json
import uuid

import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts

import ucp_jax
from ucp_jax.store import _location, _pool
from ucp_jax.store._manifest import seal


def _root() -> str:
  return f"memory://incremental_{uuid.uuid4().hex[:12]}"


def _store(url: str):
  return ts.KvStore.open(url.rstrip("/") + "/", context=_location.context()).result()


def _keys(url: str) -> list[str]:
  return sorted(k.decode() for k in _store(url).list().result())


def _generations(root: str) -> set[str]:
  return {k.split("/")[1] for k in _keys(root) if k.startswith(".ucp-pool/g")}


def _delete(root: str, step: int) -> None:
  """`rm -r` of a step: every object below its prefix."""
  _store(root).delete_range(_location.prefix_range(f"{step}/")).result()


FROZEN = {f"w{i}": jnp.full((64, 256), float(i)) for i in range(3)}


def _state(step: int) -> dict:
  return {"frozen": FROZEN, "adapter": jnp.full((8,), float(step))}


def _chain(root: str, last: int) -> None:
  """Steps 1 to `last` saved under `root`, each but the first on the one before."""
  ucp_jax.save(f"{root}/1", _state(1))
  for step in range(2, last + 1):
    ucp_jax.save(f"{root}/{step}", _state(step), base=f"{root}/{step - 1}")


def _holds(url: str, step: int) -> None:
  assert ucp_jax.open(url).verify() == {}
  out = ucp_jax.restore(url)
  for key, value in FROZEN.items():
    np.testing.assert_array_equal(out["frozen"][key], np.asarray(value))
  np.testing.assert_array_equal(out["adapter"], np.full((8,), float(step)))


def test_steps_reference_the_pool_and_each_restores_alone():
  root = _root()
  _chain(root, 4)  # 1 is not in a pool: the next save writes all into one
  m2, m4 = (ucp_jax.open(f"{root}/{s}").manifest for s in (2, 4))
  assert m4.format_version == 4 and m4.pool == "../.ucp-pool/" and not m4.data
  assert {m4.arrays[f"frozen/{k}"].at for k in FROZEN} == {f"g{m2.token}/"}
  assert m4.arrays["adapter"].at == f"g{m4.token}/"
  assert not [k for k in _keys(f"{root}/4") if k not in ("manifest.json", "zarr.json")]
  for step in (1, 2, 3):
    _delete(root, step)
  _holds(f"{root}/4", 4)
  ucp_jax.save(f"{root}/5", _state(5), base=f"{root}/4")  # collects what only 2 and 3 held
  m5 = ucp_jax.open(f"{root}/5").manifest
  assert _generations(root) == {f"g{m.token}" for m in (m2, m4, m5)}
  refs = {k.removeprefix(".ucp-pool/refs/") for k in _keys(root) if "/refs/" in k}
  assert refs == {m4.token, m5.token}
  _holds(f"{root}/4", 4)
  _holds(f"{root}/5", 5)
  _delete(root, 4)
  ucp_jax.save(f"{root}/5", _state(6), base=f"{root}/5", overwrite=True)  # over its own base
  _holds(f"{root}/5", 6)
  assert len(_generations(root)) == 2  # the frozen arrays', and the last adapter's
  assert not [k for k in _keys(root) if "condemned" in k]


def test_any_step_alone_after_the_others_are_deleted_and_collected():
  root = _root()
  _chain(root, 4)
  for step in (1, 2, 4):  # the newest too
    _delete(root, step)
  ucp_jax.save(f"{root}/5", _state(5), base=f"{root}/3")  # collects what 2 and 4 alone held
  _holds(f"{root}/3", 3)
  _delete(root, 3)
  ucp_jax.save(f"{root}/6", _state(6), base=f"{root}/5")
  _holds(f"{root}/5", 5)
  _holds(f"{root}/6", 6)
  used = {
    a.at.rstrip("/") for s in (5, 6) for a in ucp_jax.open(f"{root}/{s}").manifest.arrays.values()
  }
  assert _generations(root) == used


def test_sha256_and_async_saves_reference_the_pool():
  root = _root()
  weights = {"w": np.arange(4096.0).reshape(64, 64), "b": np.zeros(64)}
  ucp_jax.save(f"{root}/1", weights, unchanged="sha256", base=None)
  ucp_jax.save(f"{root}/2", dict(weights), unchanged="sha256", base=f"{root}/1")
  changed = {"w": weights["w"].copy(), "b": weights["b"] + 1}
  ucp_jax.save_async(f"{root}/3", changed, unchanged="sha256", base=f"{root}/2").result()
  m2, m3 = (ucp_jax.open(f"{root}/{s}").manifest for s in (2, 3))
  assert m3.arrays["w"].at == m2.arrays["w"].at and m3.arrays["b"].at == f"g{m3.token}/"
  _delete(root, 2)
  np.testing.assert_array_equal(ucp_jax.restore(f"{root}/3")["b"], np.ones(64))


def test_a_base_generation_collected_during_a_save_is_written_instead(monkeypatch):
  root = _root()
  ucp_jax.save(f"{root}/1", _state(1), base=None)
  ucp_jax.save(f"{root}/2", _state(2), base=f"{root}/1")  # into the pool
  monkeypatch.setattr(_pool, "usable", lambda pool, generation, keys: False)
  ucp_jax.save(f"{root}/3", _state(3), base=f"{root}/2")
  m3 = ucp_jax.open(f"{root}/3").manifest
  assert {a.at for a in m3.arrays.values()} == {f"g{m3.token}/"}
  _holds(f"{root}/3", 3)
  handle = ucp_jax.save_async(f"{root}/4", _state(4), base=f"{root}/3")
  with pytest.raises(ucp_jax.UcpError, match=r"deleted the base's data(.|\n)*frozen/w0"):
    handle.result()
  with pytest.raises(ucp_jax.CheckpointNotFoundError):
    ucp_jax.open(f"{root}/4")
  assert f"g{m3.token}" in _generations(root) and len(_generations(root)) == 2


# --- the collector against saves running at the same time ---


def _dead_generation(root: str) -> tuple[str, str]:
  """A pool whose generation G only a deleted checkpoint referenced; (pool URL, G)."""
  ucp_jax.save(f"{root}/1", _state(1), base=None)
  ucp_jax.save(f"{root}/2", _state(2), base=f"{root}/1")
  generation = f"g{ucp_jax.open(f'{root}/2').manifest.token}/"
  _delete(root, 2)
  return f"{root}/.ucp-pool", generation


def _running_save(root: str, pool_url: str, generation: str) -> _pool.Pool:
  """A save to ROOT/9 that holds its lock and has registered its use of `generation`."""
  token = 0x9999
  _store(f"{root}/9").write(".ucp-lock", json.dumps({"token": f"{token:016x}"}).encode()).result()
  pool = _pool.of(_location.resolve(f"{root}/9"), 1)
  _pool.register(pool, token, [pool.generation(token), generation])
  return pool


@pytest.mark.parametrize("when", ["before the second listing", "before the deletion", "after it"])
def test_the_collector_and_a_save_never_both_go_ahead(monkeypatch, when):
  """A save registers its use of G (and checks it) at one point of a collection of G."""
  root = _root()
  pool_url, generation = _dead_generation(root)
  seen = {}
  real_references = _pool._references
  real_delete, real_write = _location.KvStore.delete_range, _location.KvStore.write

  def save_now():
    pool = _running_save(root, pool_url, generation)
    seen["usable"] = _pool.usable(pool, generation, ["frozen/w0"])

  def references(store):
    seen["listings"] = seen.get("listings", 0) + 1
    if seen["listings"] == 2 and when == "before the second listing":
      save_now()
    return real_references(store)

  def delete_range(self, key_range):
    if when == "before the deletion":
      save_now()
    return real_delete(self, key_range)

  def write(self, key, value, **options):  # the collector removes the mark after deleting
    done = real_write(self, key, value, **options)
    if key.startswith("condemned/") and value is None and when == "after it":
      done.result()
      save_now()
    return done

  monkeypatch.setattr(_pool, "_references", references)
  monkeypatch.setattr(_location.KvStore, "delete_range", delete_range)
  monkeypatch.setattr(_location.KvStore, "write", write)
  deleted = _pool.collect(_location.resolve(pool_url))
  monkeypatch.undo()
  assert seen["usable"] is False  # the save never takes G ...
  kept = [k for k in _keys(pool_url) if k.startswith(generation)]
  if when == "before the second listing":  # ... and the collector, seeing its reference, keeps it
    assert deleted == [] and kept
    assert f"condemned/{generation.rstrip('/')}" in _keys(pool_url)  # never taken again
  else:  # ... or the collector deletes it, the save having read the mark or found it gone
    assert deleted == [generation] and not kept


def test_a_collector_killed_half_way_is_finished_by_the_next(monkeypatch):
  root = _root()
  pool_url, generation = _dead_generation(root)
  real = _location.KvStore.delete_range

  def die(self, key_range):
    raise KeyboardInterrupt  # killed while deleting the generation

  monkeypatch.setattr(_location.KvStore, "delete_range", die)
  with pytest.raises(KeyboardInterrupt):
    _pool.collect(_location.resolve(pool_url))
  monkeypatch.setattr(_location.KvStore, "delete_range", real)
  assert f"condemned/{generation.rstrip('/')}" in _keys(pool_url)
  ucp_jax.save(f"{root}/3", _state(3), base=f"{root}/1")  # not pooled base: writes all
  assert generation.rstrip("/") not in _generations(root)
  assert not [k for k in _keys(pool_url) if k.startswith("condemned/")]
  _holds(f"{root}/3", 3)


def test_the_collector_keeps_everything_it_cannot_judge():
  root = _root()
  pool_url, generation = _dead_generation(root)
  store = _store(pool_url)
  store.write("refs/0000000000000abc", b"{not json").result()
  assert _pool.collect(_location.resolve(pool_url)) == []
  store.write("refs/0000000000000abc", None).result()
  ucp_jax.save(f"{root}/5", _state(5))
  _store(f"{root}/5").write("manifest.json", b"garbage").result()  # a checkpoint it cannot read
  ref = {"checkpoint": "5", "token": "0" * 15 + "1", "generations": [generation]}
  store.write("refs/0000000000000001", json.dumps(ref).encode()).result()
  assert _pool.collect(_location.resolve(pool_url)) == []
  assert generation.rstrip("/") in _generations(root)


def test_hostile_references_only_ever_keep_data():
  root = _root()
  pool_url, generation = _dead_generation(root)
  store = _store(pool_url)
  for name, ref in {
    "0000000000000001": {"checkpoint": "../../etc", "token": "0" * 16, "generations": []},
    "0000000000000002": {"checkpoint": "1", "token": "x", "generations": [generation]},
    "0000000000000003": {"checkpoint": "1", "token": "0" * 16, "generations": ["../../x/"]},
  }.items():
    store.write(f"refs/{name}", json.dumps(ref).encode()).result()
  assert _pool.collect(_location.resolve(pool_url)) == []  # unreadable: nothing is dead
  for name in ("0000000000000001", "0000000000000002", "0000000000000003"):
    store.write(f"refs/{name}", None).result()
  assert _pool.collect(_location.resolve(pool_url)) == [generation]


# --- integrity and hostile manifests ---


def test_a_pool_generation_changed_underneath_is_detected():
  root = _root()
  _chain(root, 3)
  at = ucp_jax.open(f"{root}/3").manifest.arrays["frozen/w1"].at
  store = _store(f"{root}/.ucp-pool")
  chunk = next(
    k.decode() for k in store.list().result() if k.decode().startswith(f"{at}frozen/w1/c")
  )
  raw = bytearray(store.read(chunk).result().value)
  raw[10] ^= 0xFF
  store.write(chunk, bytes(raw)).result()
  problems = ucp_jax.open(f"{root}/3").verify()
  assert list(problems) == ["frozen/w1"]
  with pytest.raises(ucp_jax.CorruptCheckpointError):
    ucp_jax.open(f"{root}/3").read("frozen/w1")


def _edited(url: str, edit) -> None:
  store = _store(url)
  data = json.loads(store.read("manifest.json").result().value)
  edit(data)
  store.write("manifest.json", seal(data)).result()


def _set_pool(value):
  return lambda data: data.update(pool=value)


def _set_at(value):
  return lambda data: data["arrays"]["adapter"].update(at=value)


@pytest.mark.parametrize(
  ("edit", "pattern"),
  [
    (_set_pool("../" * 9 + ".ucp-pool/"), "first 8 ancestors"),
    (_set_pool("../other/"), "first 8 ancestors"),
    (_set_pool("/.ucp-pool/"), "first 8 ancestors"),
    (_set_pool("../" * 5 + ".ucp-pool/"), "above the root of its store"),
    (_set_at("../g0000000000000000/"), "a pool generation"),
    (_set_at("g00/"), "a pool generation"),
    (lambda d: d.update(format_version=3), "not of version 4"),
    (lambda d: d.pop("pool"), "version 4 without a pool"),
    (lambda d: d["arrays"]["adapter"].pop("at"), "a pool generation"),
  ],
)
def test_a_manifest_cannot_point_reads_outside_its_pool(edit, pattern):
  root = _root() + "/a/b"
  _chain(root, 2)
  _edited(f"{root}/2", edit)
  with pytest.raises(ucp_jax.ManifestError, match=pattern):
    ucp_jax.open(f"{root}/2")


def test_a_reference_to_another_generation_is_caught_by_place():
  root = _root()
  _chain(root, 3)
  older = ucp_jax.open(f"{root}/2").manifest.arrays["adapter"].at
  _edited(f"{root}/3", _set_at(older))  # step 2's adapter, a valid array of the same shape
  with pytest.raises(ucp_jax.CorruptCheckpointError, match="does not belong here"):
    ucp_jax.open(f"{root}/3").read("adapter")


def test_a_local_manifest_naming_a_pool_is_refused(tmp_path):
  ucp_jax.save(tmp_path / "ckpt", {"a": np.ones(3)})
  manifest = tmp_path / "ckpt" / "manifest.json"
  data = json.loads(manifest.read_text())
  data.update(format_version=4, pool="../.ucp-pool/")
  data["arrays"]["a"]["at"] = "g0000000000000000/"
  manifest.write_bytes(seal(data))
  with pytest.raises(ucp_jax.ManifestError, match="only checkpoints on object stores use"):
    ucp_jax.open(tmp_path / "ckpt")
