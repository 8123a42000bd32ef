"""Experts stacked into one logical array per weight, `[E, ...]`, from DeepSpeed's files.

A layer's experts are one array that an expert mesh axis shards (docs/moe.md): native
DeepSpeed MoE keeps each expert in its own parameter (`...deepspeed_experts.{e}...`, one
file per expert-parallel rank), AutoEP a `[num_local, ...]` shard per rank. `stack_experts`
stacks the ranks' parameters of a ZeRO checkpoint (`_moe`), `stack_universal` those of a
universal folder or a plain one (`_universal`, `_moe_plain`).
"""

from __future__ import annotations

import collections
import dataclasses
import re

from ucp_jax.sources._source_plan import SourceParam, Tensor

EXPP_RE = re.compile(r"^expp_rank_([0-9]+)_mp_rank_([0-9]+)_optim_states\.pt\Z")
NATIVE_RE = re.compile(r"^(.*\.deepspeed_experts\.)([0-9]+)(\..*)\Z")
GROUP_NAME_RE = re.compile(r"^ep_size_([0-9]+)\Z")


@dataclasses.dataclass(frozen=True)
class Group:
  index: int
  ep: int  # expert-parallel degree of a MoE group; 1 for a dense group
  moe: bool


def stack_experts(per_rank: list[list[SourceParam]], group: Group, where: str, problems: list):
  """One stacked parameter per expert weight from each expert-parallel rank's local ones.

  Returns `[(SourceParam, {global expert: (file key, local SourceParam, index in it)})]`: the second
  part says where each expert's own copy is, for `check_expert_files`.
  """
  out = []
  by_name = [{p.name: p for p in params} for params in per_rank]
  native = {n for n in by_name[0] if NATIVE_RE.match(n)}
  if native:
    local: dict[tuple[str, str], dict[int, str]] = collections.defaultdict(dict)
    for n in native:
      m = NATIVE_RE.match(n)
      local[(m.group(1), m.group(3))][int(m.group(2))] = n
    for (head, tail), members in local.items():
      nl = len(members)
      if sorted(members) != list(range(nl)):
        problems.append(f"{where}: local experts {sorted(members)} of {head}*{tail}")
        continue
      parts, owners = [], {}
      for e, params in enumerate(by_name):
        for j in range(nl):
          parts.append(params[members[j]])
          owners[e * nl + j] = (f"{head}{e * nl + j}{tail}", params[members[j]], None)
      name = head.removesuffix(".") + tail  # `...deepspeed_experts.fc1.weight`
      template = f"{head}{{e}}{tail}"
      out.append((_stacked(name, parts, group, len(parts), "native", template), owners))
    rest = [n for n in by_name[0] if n not in native]
  else:
    rest = list(by_name[0])
  for n in rest:  # AutoEP: `...experts.w1` of shape [num_local, ...] on each rank
    parts = [params[n] for params in by_name]
    nl = parts[0].value.shape[0] if parts[0].value.shape else 0
    if nl == 0 or any(p.value.shape != parts[0].value.shape for p in parts):
      problems.append(f"`{n}`: expert shards of shapes {[p.value.shape for p in parts]}")
      continue
    owners = {
      e * nl + j: (f"{n}.{e * nl + j}", p, j) for e, p in enumerate(parts) for j in range(nl)
    }
    out.append((_stacked(n, parts, group, nl * len(parts), "autoep", f"{n}.{{e}}"), owners))
  return out


def _stacked(
  name: str, parts: list[SourceParam], group: Group, n: int, kind: str, names: str
) -> SourceParam:
  first = parts[0]
  per = first.value.shape if kind == "native" else first.value.shape[1:]
  shape = (n, *per)

  def cat(tensors: list[Tensor], slot: str) -> Tensor:
    def pieces():
      return [piece for t in tensors for piece in t.pieces()]

    return Tensor(
      shape, tensors[0].dtype, pieces, f"{name} ({slot}, {n} experts of group {group.index})"
    )

  slots = {k: cat([p.slots[k] for p in parts], k) for k in first.slots}
  pattern = {
    "kind": "expert",
    "cat_dim": 0,
    "num_experts": n,
    "ep": group.ep,
    "experts": {"layout": kind, "names": names},
  }
  value = cat([p.value for p in parts], "value")
  return SourceParam(name, value, slots, group=group.index, pattern=pattern, shard_shape=(1, *per))


def stack_universal(params: list[SourceParam], groups: list, problems: list) -> list[SourceParam]:
  """Per-expert native parameters of a universal folder (`...deepspeed_experts.{e}...`, as
  `ds_to_universal` writes them at ep 1 and `ucp export` at any) stacked like `plan`'s."""
  native: dict[tuple[str, str], dict[int, SourceParam]] = {}
  out = []
  for p in params:
    m = NATIVE_RE.match(p.name)
    if m and p.value is not None:
      native.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = p
    else:
      out.append(p)
  for (head, tail), members in native.items():
    n = len(members)
    parts = [members.get(e) for e in range(n)]
    first = parts[0]
    odd = (
      [
        e
        for e, x in enumerate(parts)
        if x is None
        or (x.value.shape, x.value.dtype, x.group, sorted(x.slots))
        != (first.value.shape, first.value.dtype, first.group, sorted(first.slots))
      ]
      if first is not None
      else [0]
    )
    if odd:
      problems.append(
        f"{head}{{e}}{tail}: experts {sorted(members)}, expert {odd[0]} missing or "
        "unlike expert 0 (shape, dtype, group, slots)"
      )
      continue
    g = first.group
    hyper = groups[g] if isinstance(groups, list) and g is not None and g < len(groups) else {}
    m = GROUP_NAME_RE.match(str(hyper.get("name"))) if isinstance(hyper, dict) else None
    group = Group(g, int(m.group(1)) if m else 1, True)
    name = head.removesuffix(".") + tail
    out.append(_stacked(name, parts, group, n, "native", f"{head}{{e}}{tail}"))
  return out
