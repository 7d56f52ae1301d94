"""What is saved: a DCP state dict split into tensors (for torch.distributed.checkpoint) and
JSON-able non-tensor leaves (optimizer hyper-parameters, parameter names), and the trainer's JSON
state. With `CheckpointManager.save_states` the whole checkpoint is {name: Stateful.state_dict()}:
tensor leaves go to DCP under the name, the rest (rank 0's) to trainer_state.json under the name.

Owns the rule that checkpoint contents are tensors or JSON, so loading never needs pickle. It must
never accept an arbitrary object as a leaf (those would need pickling) and never copy tensors: the
split shares tensor objects, so DCP's in-place load lands in the caller's state dict.
"""
from __future__ import annotations

import json

import torch

from hpctrain.checkpoint.disk_format import CheckpointError

try:  # legacy sharded tensors are tensor leaves for DCP too
    from torch.distributed._shard.sharded_tensor import ShardedTensor as _ShardedTensor
except Exception:  # pragma: no cover
    _ShardedTensor = torch.Tensor

_JSON_SCALARS = (type(None), bool, int, float, str)


def _is_tensor(v) -> bool:
    return isinstance(v, (torch.Tensor, _ShardedTensor))


def _has_tensor_or_mapping(v) -> bool:
    return isinstance(v, dict) or _is_tensor(v) or (
        isinstance(v, list) and any(_has_tensor_or_mapping(x) for x in v))


def _json_value(v, where: str):
    """Encode a non-tensor leaf as JSON (tuples tagged so they come back as tuples)."""
    if isinstance(v, _JSON_SCALARS):
        return v
    if isinstance(v, (list, tuple)):
        items = [_json_value(x, f"{where}[{i}]") for i, x in enumerate(v)]
        return {"__tuple__": items} if isinstance(v, tuple) else items
    raise CheckpointError(
        f"state entry {where} is a {type(v).__name__}: checkpoint state may hold only tensors "
        f"and JSON values (None, bool, int, float, str, lists/tuples of them); put other trainer "
        f"state in `json_state`, JSON-encoded")


def _from_json(v):
    if isinstance(v, dict) and set(v) == {"__tuple__"}:
        return tuple(_from_json(x) for x in v["__tuple__"])
    if isinstance(v, list):
        return [_from_json(x) for x in v]
    return v


def split_state(state: dict) -> tuple[dict, list]:
    """(tensors, values): `tensors` mirrors `state` with only tensor leaves (lists become dicts keyed
    "0", "1", ..., which gives DCP the same flattened keys) and shares the tensor objects, so loading
    into it loads into `state`; `values` is [[path, json_value], ...] for every other leaf.
    Traversal follows DCP's rules: dicts are entered, lists only if they hold tensors or dicts."""
    values: list = []

    def walk(node, path):
        if isinstance(node, dict) or (isinstance(node, list) and _has_tensor_or_mapping(node)):
            items = node.items() if isinstance(node, dict) else enumerate(node)
            out = {}
            for k, v in items:
                if isinstance(node, dict) and not isinstance(k, str):
                    raise CheckpointError(f"state key {k!r} under {'.'.join(map(str, path)) or 'top'}"
                                          f" is a {type(k).__name__}; DCP state dicts have str keys (build"
                                          f" it with torch.distributed.checkpoint.state_dict."
                                          f"get_state_dict)")
                sub = walk(v, path + [k])
                if sub is not None:
                    out[str(k)] = sub
            return out or None
        if _is_tensor(node):
            return node
        values.append([path, _json_value(node, ".".join(map(str, path)))])
        return None

    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint state must be a dict, got {type(state).__name__}")
    return walk(state, []) or {}, values


def merge_values(state: dict, saved: list, source: str) -> None:
    """Write saved non-tensor leaves into `state` in place. Every non-tensor leaf `state` has must
    be in the checkpoint (like DCP for tensors); leaves only the checkpoint has are ignored."""
    have = {json.dumps(p): v for p, v in saved}
    _, wanted = split_state(state)
    for path, _ in wanted:
        key = json.dumps(path)
        if key not in have:
            raise CheckpointError(f"{source}: checkpoint has no entry {'.'.join(map(str, path))}")
        parent = state
        for k in path[:-1]:
            parent = parent[k]
        parent[path[-1]] = _from_json(have[key])


def check_json(obj, where="trainer state"):
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, str):
                raise CheckpointError(f"{where}: key {k!r} is not a str (trainer state is JSON)")
            check_json(v, f"{where}[{k!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            check_json(v, f"{where}[{i}]")
    elif not isinstance(obj, _JSON_SCALARS):
        raise CheckpointError(f"{where} is a {type(obj).__name__}, not JSON-able "
                              f"(encode tensors/RNG states as lists or base64 first)")


# ---- a checkpoint from Stateful objects ----------------------------------------------------------
def json_part(tree):
    """`tree` without its tensor leaves (dicts left empty by that are dropped): what goes into
    trainer_state.json. Lists without tensors (e.g. every rank's RNG state) stay lists."""
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            part = json_part(v)
            if not (_is_tensor(v) or (isinstance(v, dict) and not part)):
                out[k] = part
        return out
    if isinstance(tree, list) and _holds_tensor(tree):  # DCP keyed it "0", "1", ...
        return json_part({str(i): v for i, v in enumerate(tree)})
    return tree


def _holds_tensor(v) -> bool:
    if isinstance(v, dict):
        return any(_holds_tensor(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_holds_tensor(x) for x in v)
    return _is_tensor(v)


def overlay(saved, current):
    """`current` (tensors already loaded in place) with its non-tensor leaves taken from `saved`,
    the checkpoint's JSON part; what an object's load_state_dict receives."""
    if isinstance(current, dict):
        saved = saved if isinstance(saved, dict) else {}
        out = {k: overlay(saved.get(k), v) for k, v in current.items()}
        out.update({k: v for k, v in saved.items() if k not in current})
        return out
    if _is_tensor(current) or saved is None:
        return current
    return _from_json(saved)
