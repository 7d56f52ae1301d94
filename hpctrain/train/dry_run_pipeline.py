"""What a dry-run pipeline stage's peers would tell it: the shapes torch's stages exchange once.

    with stage_peers(boundary):   # boundary: the residual stream one micro-batch passes on
        ... the pipeline schedule's first step ...

torch's PipelineStage learns its input's shape from the previous stage and its output gradient's
from the next one (`_recv_meta`, one object over the pp group at the first step), which a fake
process group cannot answer. Every boundary between our stages carries the same tensor: the
residual stream of one micro-batch, [micro_batch, block_size (/ tp under sequence parallelism),
n_embd], in the blocks' dtype (parallel/pipeline.py's stage views). So a stage's peers would
send: forward, that tensor's metadata; backward, its gradient's (the same shape and dtype). A
stage's own metadata sends go nowhere.

Owns: those two answers, for the dry run only. It must never change what a real job sends, nor
guess a tensor other than the boundary.
"""
from __future__ import annotations

import contextlib
from unittest import mock

import torch
from torch.distributed.pipelining import stage as stage_module
from torch.distributed.pipelining._utils import (_StageBackwardMeta, _StageForwardMeta,
                                                 extract_tensor_metas)


def boundary_tensor(micro_batch: int, tokens: int, width: int, dtype: torch.dtype,
                    device) -> torch.Tensor:
    """The residual stream one micro-batch passes between stages (an output: requires grad)."""
    return torch.empty(micro_batch, tokens, width, dtype=dtype, device=device, requires_grad=True)


@contextlib.contextmanager
def stage_peers(boundary: torch.Tensor):
    """PipelineStage's metadata exchange answered locally with `boundary`'s metadata."""
    forward = _StageForwardMeta(forward_metas=extract_tensor_metas((boundary,)))
    backward = _StageBackwardMeta(backward_metas=extract_tensor_metas((boundary.detach(),)))

    def recv_meta(stage, src_stage: int):
        return forward if src_stage < stage.stage_index else backward

    with mock.patch.object(stage_module.PipelineStage, "_recv_meta", recv_meta), \
            mock.patch.object(stage_module.PipelineStage, "_send_meta", lambda *args: None):
        yield
