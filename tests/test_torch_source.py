"""Plain `torch.save` files as a source: state dicts and training scripts' checkpoint dicts.

Every input is written by torch itself; the files are read with the safe reader (no pickled
code runs). The optimizer's integer ids become parameter names; a checkpoint restored into
Flax NNX + Optax takes the same next step as torch's AdamW.
"""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path

import numpy as np
import pytest

import ucp_jax
from ucp_jax import cli
from ucp_jax.sources import _registry

torch = pytest.importorskip("torch")

V, D, H = 11, 6, 8
HYPER = [  # per torch group: weights with decay, biases and LayerNorm without
  {"lr": 0.01, "weight_decay": 0.1},
  {"lr": 0.005, "weight_decay": 0.0},
]
BETAS, EPS = (0.9, 0.99), 1e-8
DECAY = ["embed.weight", "fc1.weight", "fc2.weight"]
NO_DECAY = ["fc1.bias", "ln.weight", "ln.bias", "fc2.bias"]


class Gate(torch.nn.Module):
  def __init__(self):
    super().__init__()
    self.weight = torch.nn.Parameter(torch.rand(H) + 0.5, requires_grad=False)


class Net(torch.nn.Module):
  """A tied embedding/head, a frozen `gate.weight` (not in the optimizer), two groups' worth.

  In state-dict order the gate comes after `fc2.bias`, so the optimizer's ids fit the
  parameters one way only; a frozen parameter first (shape (H,), like fc1.bias, ln.weight
  and ln.bias) would fit them in four (`test_ids_that_fit_two_ways_are_refused_until_named`).
  """

  def __init__(self):
    super().__init__()
    self.embed = torch.nn.Embedding(V, D)
    self.fc1 = torch.nn.Linear(D, H)
    self.ln = torch.nn.LayerNorm(H)
    self.fc2 = torch.nn.Linear(H, D)
    self.gate = Gate()
    self.head = torch.nn.Linear(D, V, bias=False)
    self.head.weight = self.embed.weight

  def forward(self, ids):
    h = self.fc1(self.embed(ids)) * self.gate.weight
    h = self.ln(torch.nn.functional.gelu(h))
    return self.head(self.fc2(h))


def _batch(seed: int):
  g = torch.Generator().manual_seed(seed)
  return torch.randint(0, V, (4, 5), generator=g), torch.randint(0, V, (4, 5), generator=g)


def _adamw(model, named: bool = False):
  params = dict(model.named_parameters())
  groups = [
    {"params": [(n, params[n]) if named else params[n] for n in names], **hyper}
    for names, hyper in zip((DECAY, NO_DECAY), HYPER)
  ]
  return torch.optim.AdamW(groups, betas=BETAS, eps=EPS)


def _step(model, opt, seed: int) -> float:
  ids, targets = _batch(seed)
  loss = torch.nn.functional.cross_entropy(model(ids).reshape(-1, V), targets.reshape(-1))
  opt.zero_grad()
  loss.backward()
  opt.step()
  return float(loss.detach())


def _trained(path: Path, *, named: bool = False, keys=("model", "optimizer"), steps: int = 3):
  torch.manual_seed(0)
  model = Net()
  opt = _adamw(model, named)
  for s in range(steps):
    _step(model, opt, s)
  torch.save({keys[0]: model.state_dict(), keys[1]: opt.state_dict(), "step": steps}, path)
  return model, opt


# What a file holds, by name.


def test_a_checkpoint_dict_names_every_slot_and_keeps_the_groups(tmp_path):
  model, opt = _trained(tmp_path / "ckpt.pt")
  ckpt = ucp_jax.open(tmp_path / "ckpt.pt")
  schema = ckpt.manifest.schema
  assert ckpt.step == 3 and ckpt.manifest.source["format"] == "torch"
  params = dict(model.named_parameters())
  for group, names in enumerate((DECAY, NO_DECAY)):
    for name in names:
      entry = schema["params"][name]
      assert (entry["group"], entry["frozen"], entry["tied_to"]) == (group, False, None)
      state = opt.state[params[name]]
      for slot in ("exp_avg", "exp_avg_sq"):
        assert entry["slots"][slot] == f"{slot}/{name}"
        np.testing.assert_array_equal(ckpt.read(f"{slot}/{name}"), state[slot].numpy())
      np.testing.assert_array_equal(ckpt.read(f"params/{name}"), params[name].detach().numpy())
  assert schema["params"]["gate.weight"]["frozen"]
  assert schema["params"]["gate.weight"]["slots"] == {}
  assert schema["params"]["head.weight"]["tied_to"] == "embed.weight"
  assert schema["params"]["head.weight"]["value"] == "params/embed.weight"
  optimizer = schema["optimizer"]
  assert optimizer["type"] == "adamw" and optimizer["step"] == 3
  for got, want in zip(optimizer["groups"], HYPER):
    assert {k: got[k] for k in want} == want
    assert (got["betas"], got["eps"], got["step"]) == (list(BETAS), EPS, 3)
  assert schema["extra"]["optimizer_names"] == "order"


@pytest.mark.parametrize(
  "keys",
  [("state_dict", "optimizer_state_dict"), ("model_state_dict", "optim"), ("module", "opt")],
)
def test_the_usual_key_spellings(tmp_path, keys):
  _trained(tmp_path / "ckpt.pth", keys=keys, steps=1)
  ckpt = ucp_jax.open(tmp_path / "ckpt.pth")
  assert ckpt.manifest.source["model_key"] == keys[0]
  assert ckpt.manifest.schema["params"]["fc1.bias"]["slots"]["exp_avg"] == "exp_avg/fc1.bias"


def test_lightning_optimizer_states_and_param_names(tmp_path):
  torch.manual_seed(0)
  model = Net()
  opt = _adamw(model, named=True)
  _step(model, opt, 0)
  assert opt.state_dict()["param_groups"][0]["param_names"] == DECAY
  torch.save(
    {"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()], "global_step": 7},
    tmp_path / "last.ckpt",
  )
  ckpt = ucp_jax.open(tmp_path / "last.ckpt")
  assert ckpt.step == 7 and ckpt.manifest.schema["extra"]["optimizer_names"] == "param_names"
  assert ckpt.manifest.schema["params"]["ln.bias"]["group"] == 1


def test_a_plain_state_dict_with_buffers(tmp_path):
  torch.manual_seed(0)
  model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
  model(torch.randn(5, 3))
  torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
  ckpt = ucp_jax.open(tmp_path / "pytorch_model.bin")
  assert ckpt.keys() == [
    "buffers/1.num_batches_tracked",
    "buffers/1.running_mean",
    "buffers/1.running_var",
    "params/0.bias",
    "params/0.weight",
    "params/1.bias",
    "params/1.weight",
  ]
  for name, value in model.state_dict().items():
    key = f"buffers/{name}" if "running" in name or "batches" in name else f"params/{name}"
    np.testing.assert_array_equal(ckpt.read(key), value.numpy())
  assert ckpt.manifest.schema["optimizer"] == {} and ckpt.step is None
  base = ckpt.array("params/1.weight")  # a view of the file's mapping: nothing copied
  while not isinstance(base, mmap.mmap):
    base = base.base if isinstance(base, np.ndarray) else base.obj
  assert not ckpt.array("params/1.weight").flags.writeable
  report = ucp_jax.convert(tmp_path, tmp_path.parent / "converted")  # a folder with one file
  assert (report.format, report.params, report.arrays) == ("torch", 4, 7)


def test_sgd_momentum(tmp_path):
  torch.manual_seed(0)
  model = torch.nn.Linear(3, 2)
  opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
  model(torch.randn(4, 3)).sum().backward()
  opt.step()
  torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "s.pt")
  schema = ucp_jax.open(tmp_path / "s.pt").manifest.schema
  assert schema["params"]["weight"]["slots"] == {"momentum_buffer": "momentum_buffer/weight"}
  assert schema["optimizer"]["type"] == "sgd" and schema["optimizer"]["step"] is None
  assert schema["optimizer"]["groups"][0]["nesterov"] is True


def test_amsgrad_slots_and_a_parameter_that_missed_a_step(tmp_path):
  p, q = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
  opt = torch.optim.Adam([p, q], amsgrad=True)
  for step in range(3):
    opt.zero_grad(set_to_none=True)
    (p.sum() + (q.sum() if step == 0 else 0)).backward()
    opt.step()
  torch.save(
    {"model": {"p": p.detach(), "q": q.detach()}, "optimizer": opt.state_dict()}, tmp_path / "a.pt"
  )
  ckpt = ucp_jax.open(tmp_path / "a.pt")
  schema = ckpt.manifest.schema
  assert sorted(schema["params"]["q"]["slots"]) == ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"]
  np.testing.assert_array_equal(ckpt.read("max_exp_avg_sq/q"), opt.state[q]["max_exp_avg_sq"])
  assert schema["optimizer"]["step"] == 3 and schema["optimizer"]["type"] == "adam"
  assert schema["extra"]["param_steps"] == {"q": 1}


def test_ids_that_fit_two_ways_are_refused_until_named(tmp_path):
  p, q = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.zeros(3))
  opt = torch.optim.Adam([{"params": [q]}, {"params": [p], "lr": 0.5}])
  (p.sum() + 2 * q.sum()).backward()
  opt.step()
  path = tmp_path / "two.pt"
  torch.save({"model": {"p": p.detach(), "q": q.detach()}, "optimizer": opt.state_dict()}, path)
  with pytest.raises(ucp_jax.SourceFormatError) as e:
    ucp_jax.open(path)
  assert str(e.value) == (
    f"{path}: ['optimizer']'s 2 ids fit the state dict's 2 parameters in more than one way "
    "(parameters of equal shapes in 2 groups); name them: build the optimizer from "
    "model.named_parameters() (torch >= 2.6 then saves param_groups[i]['param_names']), or "
    "pass param_names=[[names of group 0, in order], ...] to ucp_jax.convert"
  )
  ucp_jax.convert(path, tmp_path / "c", param_names=[["q"], ["p"]])
  ckpt = ucp_jax.open(tmp_path / "c")
  assert ckpt.manifest.schema["params"]["p"]["group"] == 1
  np.testing.assert_array_equal(ckpt.read("exp_avg/q"), opt.state[q]["exp_avg"].numpy())


def test_an_optimizer_of_another_model_is_refused(tmp_path):
  _trained(tmp_path / "ckpt.pt", steps=1)
  data = torch.load(tmp_path / "ckpt.pt", weights_only=True)
  del data["model"]["fc2.weight"], data["model"]["fc2.bias"]
  torch.save(data, tmp_path / "other.pt")
  with pytest.raises(ucp_jax.SourceFormatError, match=r"holds 7 parameters, the state dict 6 "):
    ucp_jax.open(tmp_path / "other.pt")


# Bad input: one clear error naming file and key, through open, convert and inspect.


def _number_in_state_dict(tmp_path):
  torch.save({"w": torch.ones(2), "n": 3}, tmp_path / "model.pt")
  return tmp_path / "model.pt", "not a state dict of tensors: ['n'] holds int 3, not a tensor"


def _string_in_model(tmp_path):
  state = {"w": torch.ones(2), "b": "oops"}
  torch.save({"model": state, "epoch": 1}, tmp_path / "model.pt")
  return tmp_path / "model.pt", "['model']['b'] holds str 'oops', not a tensor"


def _slot_of_another_shape(tmp_path):
  w = torch.nn.Parameter(torch.ones(2, 3))
  opt = torch.optim.Adam([w])
  w.sum().backward()
  opt.step()
  osd = opt.state_dict()
  osd["state"][0]["exp_avg"] = torch.ones(3, 2)
  torch.save({"model": {"w": w.detach()}, "optimizer": osd}, tmp_path / "model.pt")
  return tmp_path / "model.pt", (
    "the optimizer's state does not fit the model: ['optimizer']['state'][0]['exp_avg'] (w): "
    "shape (3, 2), the parameter's is (2, 3)"
  )


BAD = {
  "a number in a state dict": _number_in_state_dict,
  "a string in the model": _string_in_model,
  "a slot of another shape": _slot_of_another_shape,
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_clear_error(case, tmp_path, capsys):
  path, says = BAD[case](tmp_path)
  before = sorted(os.listdir(tmp_path))
  with pytest.raises(ucp_jax.SourceFormatError) as e:
    ucp_jax.open(path)
  message = str(e.value)
  assert message.startswith(f"{path}: ") and says in message and "\n" not in message
  with pytest.raises(ucp_jax.SourceFormatError):
    ucp_jax.convert(path, tmp_path / "dst")
  assert sorted(os.listdir(tmp_path)) == before
  assert cli.main(["inspect", str(path)]) == 2
  assert capsys.readouterr().err.strip().splitlines() == [f"error: {message}"]


def test_sniffing_is_unambiguous(tmp_path):
  fixture = Path(__file__).parent / "fixtures" / "deepspeed" / "z2_bf16_dp3" / "ckpt"
  assert _registry.sniff(fixture).NAME == "deepspeed"
  torch.save({"w": torch.ones(1)}, tmp_path / "a.pt")
  assert _registry.sniff(tmp_path / "a.pt").NAME == "torch"
  assert _registry.sniff(tmp_path).NAME == "torch"
  (tmp_path / "config.json").write_text(json.dumps({}))
  assert _registry.sniff(tmp_path).NAME == "torch"  # a config.json is not weights
  os.rename(tmp_path / "a.pt", tmp_path / "pytorch_model.bin")
  assert _registry.sniff(tmp_path).NAME == "hf"  # save_pretrained(safe_serialization=False)
  os.rename(tmp_path / "pytorch_model.bin", tmp_path / "a.pt")
  os.remove(tmp_path / "config.json")
  torch.save({"w": torch.ones(1)}, tmp_path / "b.bin")
  assert _registry.sniff(tmp_path) is None
  with pytest.raises(ucp_jax.SourceFormatError, match="not a checkpoint ucp_jax reads"):
    ucp_jax.convert(tmp_path, tmp_path / "dst")
  with pytest.raises(ucp_jax.SourceFormatError, match=r"found a.pt, b.bin: pass the file"):
    ucp_jax.convert(tmp_path, tmp_path / "dst", source="torch")


# Into Flax NNX + Optax: the next step is torch's.


def _flax():
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx

  from ucp_jax.rules import Rule, RuleSet, transpose

  class Tiny(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
      self.embed = nnx.Embed(V, D, rngs=rngs)
      self.fc1 = nnx.Linear(D, H, rngs=rngs)
      self.ln = nnx.LayerNorm(H, epsilon=1e-5, use_fast_variance=False, rngs=rngs)
      self.fc2 = nnx.Linear(H, D, rngs=rngs)
      self.gate = nnx.Param(jnp.zeros(H))

    def __call__(self, ids):
      h = self.fc1(self.embed(ids)) * self.gate[...]
      h = self.ln(jax.nn.gelu(h, approximate=False))
      return self.embed.attend(self.fc2(h))

  rules = RuleSet(
    [
      Rule(r"embed\.weight", "embed/embedding"),
      Rule(r"fc(\d)\.weight", "fc{0}/kernel", [transpose()]),
      Rule(r"fc(\d)\.bias", "fc{0}/bias"),
      Rule(r"ln\.weight", "ln/scale"),
      Rule(r"ln\.bias", "ln/bias"),
      Rule(r"gate\.weight", "gate"),
      Rule(r"head\.weight", "embed/embedding", tied=True),
    ]
  )
  decay = set(rules.map_names(DECAY))
  label = lambda path, _: "decay" if "/".join(map(str, path)) in decay else "no_decay"  # noqa: E731
  tx = optax.multi_transform(
    {
      "decay": optax.adamw(HYPER[0]["lr"], *BETAS, EPS, weight_decay=HYPER[0]["weight_decay"]),
      "no_decay": optax.adam(HYPER[1]["lr"], *BETAS, EPS),
    },
    lambda params: nnx.map_state(label, params),
  )
  model = Tiny(nnx.Rngs(0))
  trainable = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("gate")))
  return model, nnx.Optimizer(model, tx, wrt=trainable), rules, trainable


@pytest.mark.parametrize("read", ["in_place", "converted"])
def test_one_jax_step_equals_one_torch_adamw_step(tmp_path, read):
  import jax.numpy as jnp
  import optax
  from flax import nnx

  _trained(tmp_path / "ckpt.pt")
  src = tmp_path / "ckpt.pt"
  if read == "converted":
    src = ucp_jax.convert(src, tmp_path / "converted").dst
  model, opt, rules, trainable = _flax()
  ucp_jax.restore_train_state(src, model, opt, rules=rules)
  assert int(opt.step[...]) == 3

  ids, targets = _batch(3)

  def loss_fn(m):
    logits = m(jnp.asarray(ids.numpy()))
    labels = jnp.asarray(targets.numpy())
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  jax_loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, trainable))(model)
  opt.update(model, grads)

  data = torch.load(tmp_path / "ckpt.pt", weights_only=True)
  torch_model = Net()
  torch_model.load_state_dict(data["model"])
  torch_opt = _adamw(torch_model)
  torch_opt.load_state_dict(data["optimizer"])
  torch_loss = _step(torch_model, torch_opt, 3)

  assert float(jax_loss) == pytest.approx(torch_loss, rel=1e-6)
  ours = rules.export_arrays(nnx.state(model, nnx.Param))
  params = dict(torch_model.named_parameters())
  for name, value in params.items():
    np.testing.assert_allclose(ours[name], value.detach().numpy(), rtol=1e-5, atol=1e-6)
  for label, names in (("decay", DECAY), ("no_decay", NO_DECAY)):
    adam = opt.opt_state.inner_states[label].inner_state[0]
    mu, nu = rules.export_arrays(adam.mu), rules.export_arrays(adam.nu)
    for name in names:
      state = torch_opt.state[params[name]]
      np.testing.assert_allclose(mu[name], state["exp_avg"].numpy(), rtol=1e-5, atol=1e-7)
      np.testing.assert_allclose(nu[name], state["exp_avg_sq"].numpy(), rtol=1e-5, atol=1e-9)
    assert int(adam.count[...]) == 4


def test_a_folder_two_sources_recognize_goes_to_the_one_that_reads_it(tmp_path, capsys):
  from safetensors.numpy import save_file

  hf = tmp_path / "trainer_checkpoint"  # an HF Trainer folder whose global_stepN was pruned
  hf.mkdir()
  (hf / "config.json").write_text(json.dumps({"model_type": "llama"}))
  save_file({"w": np.ones(3, np.float32)}, hf / "model.safetensors")
  (hf / "latest").write_text("global_step500")
  assert ucp_jax.open(hf).keys() == ["params/w"]
  pt = tmp_path / "scripted"  # a config.json beside a torch file
  pt.mkdir()
  (pt / "config.json").write_text("{}")
  torch.save({"w": torch.ones(2)}, pt / "model.pt")
  assert ucp_jax.open(pt).keys() == ["params/w"]
  assert ucp_jax.open(pt / "model.pt", source="torch").keys() == ["params/w"]
  with pytest.raises(ucp_jax.SourceFormatError):
    ucp_jax.open(pt, source="deepspeed")  # named, and not one: its error, no fallback
  assert cli.main(["inspect", str(pt), "--from", "torch"]) == 0
  assert "params/w" in capsys.readouterr().out


def test_a_torch_file_on_an_object_store_reads_as_from_disk(tmp_path):
  from ucp_jax.store import _location

  _trained(tmp_path / "ckpt.pt")
  url = "memory://torch-source/run"
  store = _location.kvstore(_location.resolve(url + "/"))
  store.write("ckpt.pt", (tmp_path / "ckpt.pt").read_bytes()).result()
  for path in (f"{url}/ckpt.pt", url, f"file://{tmp_path / 'ckpt.pt'}"):
    assert _registry.sniff(path).NAME == "torch"
    remote, local = ucp_jax.open(path), ucp_jax.open(tmp_path / "ckpt.pt")
    assert remote.keys() == local.keys() and remote.manifest.schema == local.manifest.schema
    assert remote.step == local.step == 3
    for key in local.keys():
      assert remote.read(key).tobytes() == local.read(key).tobytes(), key
