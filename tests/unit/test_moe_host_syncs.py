"""Host syncs of a mixture-of-experts step, counted on a CPU run (#49 defect 4): the ops that make
the host wait for a GPU where the tensor lives there (`.item()` / `float()` / `bool()` behind
aten._local_scalar_dense, `nonzero`, boolean-mask indexing, `masked_select`, `unique`,
repeat_interleave without its output size, `.tolist()`, `.cpu()`), plus `torch.tensor(host list)`
made inside the step (a pageable host->device copy on a GPU). A one-rank Llama with 2 MoE layers,
its experts on the path a CUDA run takes (the padded grouped matmul: `_cuda_grouped_mm_fits`
forced on), forward and backward, then the MoE monitor at steps between log steps and at a log
step. Measured before #49 (main 4b1b656): 2 syncs in forward (1 per layer: the counts' host copy,
which sizes the padded groups) and 13 in the monitor on every step (7 on device tensors in a CUDA
run: the loads' .cpu(), then each layer's entropy, aux loss and bias spread); after: 2 in forward,
0 in backward, 0 in the monitor between log steps, 1 at a log step (one copy of every layer's
numbers). Under activation checkpointing the recomputation copied the counts again (2 more in
backward); now the forward's copy is kept for it (0). Expert parallelism's step (2 ranks):
tests/mpi/test_expert_parallel.py."""
from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hpctrain.model.llama import Llama, LlamaConfig
from hpctrain.model.moe import MoEConfig
from hpctrain.train.moe_monitor import MoEMonitor

aten = torch.ops.aten
SYNC_OPS = {aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten.is_nonzero,
            aten._unique2, aten.unique_dim, aten.unique_consecutive}


class HostSyncs(TorchDispatchMode):
    """Counts host syncs by kind while active (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self._patched = {}
        self.host: dict[int, torch.Tensor] = {}  # copies made to the host (by id, kept alive):
        # reading them syncs nothing more

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in SYNC_OPS:
            self.counts[str(packet)] += 1
        elif packet in (aten.index, aten.index_put, aten.index_put_) and any(
                i is not None and i.dtype == torch.bool for i in args[1]):
            self.counts[f"{packet} (bool mask)"] += 1
        elif packet is aten.repeat_interleave and kwargs.get("output_size") is None and len(args) < 4:
            self.counts[str(packet)] += 1
        out = func(*args, **kwargs)
        if (packet is aten._to_copy and kwargs.get("device") == torch.device("cpu")
                and kwargs.get("dtype") in (None, args[0].dtype)):  # not a dtype cast on the device
            self.counts["to cpu"] += 1
            self.host[id(out)] = out
        return out

    def _counting(self, name, real):
        def counted(*args, **kwargs):
            if not (args and id(args[0]) in self.host):
                self.counts[name] += 1
            return real(*args, **kwargs)
        return counted

    def __enter__(self):
        for owner, name in ((torch.Tensor, "tolist"), (torch.Tensor, "cpu"), (torch, "tensor")):
            self._patched[(owner, name)] = getattr(owner, name)
            label = f"{'Tensor' if owner is torch.Tensor else 'torch'}.{name}"
            setattr(owner, name, self._counting(label, self._patched[(owner, name)]))
        return super().__enter__()

    def __exit__(self, *exc):
        for (owner, name), real in self._patched.items():
            setattr(owner, name, real)
        return super().__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


@pytest.fixture
def cuda_expert_path(monkeypatch):
    """The experts' CUDA form (pad_groups + grouped matmul, sized by host counts) on the CPU."""
    from hpctrain.model import moe

    monkeypatch.setattr(moe, "_grouped_mm_fits", lambda *tensors: False)
    monkeypatch.setattr(moe, "_cuda_grouped_mm_fits", lambda x, w1: x.shape[0] > 0)


def _model() -> Llama:
    torch.manual_seed(0)
    cfg = LlamaConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=64, multiple_of=16,
                      moe=MoEConfig(n_experts=4, top_k=2, aux_loss_coef=0.01, gate="sigmoid",
                                    bias_update_rate=0.01))
    return Llama(cfg)


def test_one_rank_moe_step_syncs_once_per_layer_in_forward_and_only_at_log_steps(cuda_expert_path):
    model = _model()
    monitor = MoEMonitor(model, warn_ratio=1.5, warn_steps=2, log_interval=4)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    per_phase = {}
    for step in range(1, 5):
        with HostSyncs() as forward:
            loss = model(tokens).float().mean()
        with HostSyncs() as backward:
            loss.backward()
        with HostSyncs() as monitoring:
            rec = monitor.after_step(step)
        per_phase[step] = (forward.total, backward.total, monitoring.total)
        assert bool(rec) == (step == 4), rec.keys()  # the metrics of log steps only
    assert per_phase[1] == (2, 0, 0), (forward.counts, backward.counts, monitoring.counts)
    assert per_phase[2] == per_phase[3] == (2, 0, 0)
    assert per_phase[4] == (2, 0, 1) and monitoring.counts == {"Tensor.cpu": 1}, monitoring.counts
    assert forward.counts == {"to cpu": 2}, forward.counts  # the padded groups' sizes
    assert sorted(rec) == sorted(f"moe.{i}.{k}" for i in "01" for k in
                                 ("max_mean", "load", "entropy", "aux_loss", "bias_spread"))
    assert sum(rec["moe.0.load"]) == 2 * 16 * 2  # the log step's own loads, every routed row


def test_activation_checkpointing_keeps_the_forwards_host_copy_for_the_recomputation(cuda_expert_path):
    """Every block checkpointed (parallel.activation_checkpoint = full): the recomputation in
    backward takes each MoE layer's counts from the forward's host copy (selective checkpointing
    keeps it: hpctrain/parallel/activation.py) instead of copying them again: backward 2 -> 0
    device->host copies; the gradients bit-equal to the model's without checkpointing."""
    import copy

    from hpctrain.parallel.activation import apply_activation_checkpointing

    plain = _model()
    checkpointed = copy.deepcopy(plain)
    assert apply_activation_checkpointing(checkpointed, "full", 1) == 2
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    plain(tokens).float().mean().backward()
    with HostSyncs() as forward:
        loss = checkpointed(tokens).float().mean()
    with HostSyncs() as backward:
        loss.backward()
    # backward reads the kept host copies (.tolist() of a host tensor: no sync on a GPU; this
    # counter cannot tell them from a device tensor's, the copy itself it sees); before: 2 copies
    assert forward.counts == {"to cpu": 2}, forward.counts
    assert backward.counts == {"Tensor.tolist": 2}, backward.counts
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in checkpointed.named_parameters()}
    for name, p in plain.named_parameters():
        assert (p.grad is None and grads[name] is None) or torch.equal(p.grad, grads[name]), name
