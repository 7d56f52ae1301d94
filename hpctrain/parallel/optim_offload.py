"""AdamW with its state and step in host memory (parallel.offload = "optimizer", ZeRO-Offload):
parameters and gradients stay on the device; moments, an fp32 master copy of each parameter's
local part and a gradient buffer live on the host (pinned where the device is a GPU).

Owns `OffloadedAdamW`. Its state is keyed, shaped and sharded as torch's AdamW's (a DTensor shard
per FSDP2 parameter, "step" a 0-dim float32), so checkpoints load across offload modes and
layouts (train/states.py). Host syncs: one stream synchronize per step (its device -> host
copies, the bad-step flag with them). It must never pick the offload mode (hpctrain/parallel/
offload.py and model/optim.py do) or read the config.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.optim.adam import adam as adam_step

from hpctrain.distributed.dtensor import is_dtensor


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t` (a DTensor's local shard; a plain tensor itself)."""
    return t._local_tensor if is_dtensor(t) else t


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` (a host tensor) as `param` is laid out: a DTensor with param's mesh and placements
    (no copy, no check: torch.distributed.tensor.from_local would move it to the mesh's device),
    so that checkpoints reshard it as torch's own AdamW state."""
    if not is_dtensor(param):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor(local, param._spec, requires_grad=False)


class OffloadedAdamW(torch.optim.Optimizer):
    """AdamW whose state and step live in host memory while the parameters stay on the device.

    `param_groups` hold the model's (device) parameters, as torch's AdamW: the learning rate,
    zero_grad, gradient clipping, fp16 unscaling and checkpoints (keyed by the parameters' names)
    work unchanged. `state[p]`: "step" (0-dim float32), "exp_avg" and "exp_avg_sq" in host memory.
    The fp32 master copy of each parameter's local part lives on the host beside them; it is
    refreshed from the device after a checkpoint load (load_state_dict: DCP writes FSDP2's shards
    in place through aliases that leave their version counters alone) and whenever a parameter's
    version counter says something else wrote it since this optimizer's last step. A writer that
    does neither (DiLoCo's outer step) is why config_rules allows offload with sync.mode = "sync"
    only."""

    _step_supports_amp_scaling = True  # loss_scaling.step_unless hands the bad-step flag as found_inf

    def __init__(self, groups: list[dict], lr: float, betas: tuple[float, float], eps: float):
        super().__init__(groups, dict(lr=lr, betas=betas, eps=eps, weight_decay=0.0))
        params = [p for g in self.param_groups for p in g["params"]]
        self._pin = any(p.device.type == "cuda" for p in params)
        self._master: dict[nn.Parameter, torch.Tensor] = {}  # host fp32 copy of p's local part
        self._grad: dict[nn.Parameter, torch.Tensor] = {}    # host buffer for p's local gradient
        self._seen: dict[nn.Parameter, tuple[int, int]] = {}  # (id, version) of p's local part
        self._flag: torch.Tensor | None = None  # host copy of the bad-step flag (found_inf)

    def _host_empty(self, like: torch.Tensor) -> torch.Tensor:
        t = torch.empty(like.shape, dtype=torch.float32, device="cpu")
        return t.pin_memory() if self._pin else t

    def _fresh_master(self, p: nn.Parameter) -> torch.Tensor:
        """p's host master, copied from the device when p changed since the last step wrote it."""
        local = local_part(p)
        master = self._master.get(p)
        if master is None:
            master = self._master[p] = self._host_empty(local)
        if self._seen.get(p) != (id(local), local._version):
            master.copy_(local.detach())
        return master

    def _fetch_grads(self, params: list[nn.Parameter]) -> torch.Tensor | None:
        """Queue every gradient's device -> host copy and the bad-step flag's, then wait once."""
        for p in params:
            local = local_part(p.grad)
            if p not in self._grad:
                self._grad[p] = self._host_empty(local)
            self._grad[p].copy_(local, non_blocking=True)
        flag = getattr(self, "found_inf", None)  # set around step() by loss_scaling.step_unless
        if flag is not None:
            if self._flag is None:
                self._flag = self._host_empty(flag)
            flag = self._flag.copy_(flag, non_blocking=True)
        if self._pin:  # the one host sync offload needs per step: the copies above landed
            torch.cuda.current_stream().synchronize()
        return flag

    def _state_of(self, p: nn.Parameter) -> dict:
        state = self.state[p]
        if not state:  # as torch's fused AdamW lays it out (a DTensor where p is one)
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = _like(p, torch.zeros_like(self._host_empty(local_part(p))))
            state["exp_avg_sq"] = _like(p, torch.zeros_like(self._host_empty(local_part(p))))
        return state

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step on the host over every parameter with a gradient, then the updated
        parameters back to the device (queued, not waited for)."""
        if closure is not None:
            raise ValueError("OffloadedAdamW.step takes no closure")
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        found_inf = self._fetch_grads(params)
        for group in self.param_groups:
            held = [p for p in group["params"] if p.grad is not None]
            if not held:
                continue
            states = [self._state_of(p) for p in held]
            beta1, beta2 = group["betas"]
            adam_step(
                [self._fresh_master(p) for p in held], [self._grad[p] for p in held],
                [local_part(s["exp_avg"]) for s in states], [local_part(s["exp_avg_sq"]) for s in states],
                [], [s["step"] for s in states], fused=True, found_inf=found_inf,
                decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2,
                lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
        for p in params:  # host -> device; the next step's synchronize orders it before reuse
            local = local_part(p)
            local.copy_(self._master[p], non_blocking=True)
            self._seen[p] = (id(local), local._version)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load (which moves the state to each parameter's device), then the state back
        to host memory."""
        super().load_state_dict(state_dict)
        self._seen.clear()  # the weights came with this state: masters from the device next step
        for p, state in self.state.items():
            for name, value in list(state.items()):
                if name == "step":
                    state[name] = value.detach().to("cpu", torch.float32)
                elif local_part(value).device.type != "cpu":
                    state[name] = _like(p, local_part(value).to("cpu"))

    def host_bytes(self) -> int:
        """Host memory this optimizer holds: moments, masters and gradient buffers."""
        tensors = [local_part(v) for s in self.state.values() for v in s.values()]
        tensors += list(self._master.values()) + list(self._grad.values())
        return sum(t.numel() * t.element_size() for t in tensors)
