"""fp32 main-gradient buffers, their DP reduction overlapped with backward, and grad norms.

Each model chunk's gradients live in one flat fp32 buffer; `param.main_grad` (Megatron's
name) is a view into it. fp32 parameters also get `param.grad` = that view, so autograd
accumulates microbatches in place. bf16/fp16 parameters accumulate each microbatch's
gradient into `main_grad` in a post-accumulate-grad hook and drop the low-precision
`.grad` right away. The adds of small parameters (biases, norms: hundreds of tiny kernels
per microbatch) are deferred and run as a few batched kernels per flush; a flush happens
before a bucket is reduced, before a parameter would be queued twice (the next
microbatch's backward reached it) and in `finish`, so every add lands before anything
reads the main grads. With gradient-accumulation fusion (parallel/wgrad_fusion.py) the
linears' weight-gradient GEMMs accumulate into `main_grad` themselves and the hook only
drops a placeholder.

Parameters are placed in reverse order (roughly the order backward produces them) and the
buffer is cut into buckets of about `bucket_mb` MiB. During the *last* microbatch's
backward of a chunk, the hooks count each bucket's parameters; a full bucket is reduced
asynchronously over the DP group while backward continues (Megatron's DDP overlap):
all-reduced, or with the distributed optimizer reduce-scattered so that DP rank r ends
up with the summed gradient of shard r of every bucket (buckets are padded to a multiple
of the DP size). The distributed optimizer also keeps the parameters themselves in a flat
buffer of the same layout, to all-gather updated shards in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megatronapp.parallel import wgrad_fusion

# torch >= 2.13 renames the *_tensor collectives; same signature
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class BucketSpan:
    start: int  # [start, end) in the flat buffer; end - start is a multiple of the padding
    end: int
    params: tuple[int, ...]  # indices (forward order) of the parameters inside


def compute_bucket_layout(
    numels: list[int], bucket_numel: int, pad_multiple: int
) -> tuple[list[int], list[BucketSpan], int]:
    """Offsets of parameters (given in forward order) in a flat buffer, its buckets and size.

    Parameters are placed last-first; a bucket closes once it holds >= bucket_numel
    elements and its end is padded to a multiple of pad_multiple. Example: numels [3, 5],
    bucket_numel 4, pad 2 -> offsets [6, 0], buckets [(0, 6, (1,)), (6, 10, (0,))], size 10.
    """
    offsets, buckets = [0] * len(numels), []
    pos = start = 0
    members: list[int] = []
    for i in reversed(range(len(numels))):
        offsets[i] = pos
        pos += numels[i]
        members.append(i)
        if pos - start >= bucket_numel or i == 0:
            pos = -(-pos // pad_multiple) * pad_multiple
            buckets.append(BucketSpan(start, pos, tuple(members)))
            start, members = pos, []
    return offsets, buckets, pos


class _Bucket:
    def __init__(self, span: BucketSpan, grad: torch.Tensor, params: list[nn.Parameter]):
        self.span, self.grad, self.params = span, grad, params
        self.param_data: torch.Tensor | None = None  # distributed optimizer only
        self.ready = 0
        self.work = None


class ChunkGradBuffer:
    """Flat main-grad storage of one model chunk, fp32 (or `grad_dtype`: bf16 with the
    precision-aware optimizer's --main-grads-dtype bf16), and, if asked, flat parameter storage."""

    def __init__(
        self,
        params: list[nn.Parameter],
        bucket_mb: float,
        pad_multiple: int,
        flat_params: bool,
        grad_dtype: torch.dtype = torch.float32,
    ):
        self.params = params
        self.offsets, spans, total = compute_bucket_layout(
            [p.numel() for p in params], max(1, int(bucket_mb * 2**20 / 4)), pad_multiple
        )
        device = params[0].device if params else "cpu"
        self.grad_data = torch.zeros(total, dtype=grad_dtype, device=device)
        self.param_data = None
        if flat_params and params:
            self.param_data = torch.zeros(total, dtype=params[0].dtype, device=device)
        for p, off in zip(params, self.offsets):
            p.main_grad = self.grad_data[off : off + p.numel()].view_as(p)
            if p.dtype == torch.float32:
                p.grad = p.main_grad  # autograd accumulates straight into the buffer
            if self.param_data is not None:
                view = self.param_data[off : off + p.numel()].view_as(p)
                view.copy_(p.detach())
                p.data = view
        self.buckets = [_Bucket(s, self.grad_data[s.start : s.end], [params[i] for i in s.params]) for s in spans]
        for b in self.buckets:
            if self.param_data is not None:
                b.param_data = self.param_data[b.span.start : b.span.end]
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self._zero_plan: tuple[tuple[int, ...], list[torch.Tensor]] | None = None

    def written_first(self) -> list[int]:
        """Indices of the params whose main grad their first weight-gradient GEMM of a step
        overwrites (gradient-accumulation fusion, parallel/wgrad_fusion.py)."""
        return [i for i, p in enumerate(self.params) if getattr(p, "grad_added_to_main_grad", False)]

    def zero(self, skip: list[int]) -> None:
        """Zero the buffer except the main grads of params `skip` (padding included)."""
        if not skip:
            self.grad_data.zero_()
            return
        if self._zero_plan is None or self._zero_plan[0] != tuple(skip):
            holes = sorted((self.offsets[i], self.offsets[i] + self.params[i].numel()) for i in skip)
            views, pos = [], 0
            for start, end in holes + [(self.grad_data.numel(), self.grad_data.numel())]:
                if start > pos:
                    views.append(self.grad_data[pos:start])
                pos = max(pos, end)
            self._zero_plan = (tuple(skip), views)
        if self._zero_plan[1]:
            torch._foreach_zero_(self._zero_plan[1])


# parameters up to this many elements have their main-grad adds batched (see module doc);
# larger ones are added at once, so no large low-precision grad is kept alive
DEFERRED_ADD_MAX_NUMEL = 1 << 20


class _DeferredAdds:
    """Pending `main_grad += grad` of small low-precision parameters, run as a handful of kernels.

    `_foreach_add_` has a fast path only for lists of one dtype (fp32 += bf16 falls back to one
    kernel per tensor), so the grads are first concatenated (one batched copy) and widened to
    fp32 in one pass; the adds are then one fp32 foreach. Each element still gets exactly one
    fp32 add of its bf16/fp16 value, so the sums are those of adding each grad on its own.
    """

    def __init__(self):
        self.mains: list[torch.Tensor] = []  # flat fp32 main-grad views
        self.grads: list[torch.Tensor] = []  # flat low-precision grads
        self.queued: set[int] = set()

    def add(self, param: nn.Parameter) -> None:
        if id(param) in self.queued:  # its previous microbatch's add must land first
            self.flush()
        self.mains.append(param.main_grad.view(-1))
        self.grads.append(param.grad.reshape(-1))
        self.queued.add(id(param))

    def flush(self) -> None:
        if self.mains:
            widened = torch.cat(self.grads).to(self.mains[0].dtype).split([g.numel() for g in self.grads])
            torch._foreach_add_(self.mains, widened)
            self.mains, self.grads, self.queued = [], [], set()


class GradReducer:
    """Owns the main-grad buffers of all chunks and their DP reduction (and param all-gather)."""

    def __init__(
        self,
        chunks: list[nn.Module],
        dp_group,
        dp_size: int,
        *,
        overlap: bool,
        bucket_mb: float,
        dp_rank: int = 0,
        distributed_optimizer: bool = False,
        grad_dtype: torch.dtype = torch.float32,
        embedding_group=None,
    ):
        self.dp_group, self.dp_size, self.dp_rank = dp_group, dp_size, dp_rank
        self.embedding_group = embedding_group
        self.overlap = overlap and dp_group is not None
        self.distributed = distributed_optimizer
        # 64-element alignment of every shard keeps the collectives' chunks aligned on GPU.
        pad = dp_size * 64 if distributed_optimizer else 1
        self.buffers = [
            ChunkGradBuffer(
                [p for p in c.parameters() if p.requires_grad],
                bucket_mb,
                pad,
                flat_params=distributed_optimizer,
                grad_dtype=grad_dtype,
            )
            for c in chunks
        ]
        self.final_microbatch = [False] * len(chunks)
        self._zeroed = [False] * len(chunks)  # by zero_buffer since the last zero_grad
        self._gather_works: list[list] = [[] for _ in chunks]
        self._deferred = _DeferredAdds()
        # a tied embedding and output layer (model/gpt.py): the sides this rank holds, and the
        # buckets that wait for the sum of their gradients (in finish) before their DP reduction
        tied = [(buf, p) for buf in self.buffers for p in buf.params if getattr(p, "tied_embedding", None)]
        self.tied = [p for _, p in tied]
        self._tied_buckets = {id(buf.bucket_of[p]) for buf, p in tied}
        for i, buf in enumerate(self.buffers):
            for p, bucket in buf.bucket_of.items():
                if self.overlap or p.dtype != torch.float32:
                    p.register_post_accumulate_grad_hook(self._make_hook(i, bucket))

    def _make_hook(self, chunk: int, bucket: _Bucket):
        def hook(param):
            if getattr(param, "weight_grad_in_w", False):  # autograd fires it with no gradient (split
                return  # backward): W accumulates the weight and counts it (weight_grads_done)
            if param.dtype != torch.float32:
                if not getattr(param, "grad_added_to_main_grad", False):  # else the fused GEMM did it
                    if param.numel() <= DEFERRED_ADD_MAX_NUMEL:
                        self._deferred.add(param)
                    else:
                        param.main_grad.add_(param.grad)  # fp32 accumulation of a bf16/fp16 grad
                param.grad = None
            if self.overlap and self.final_microbatch[chunk]:
                self._count_ready(bucket)

        return hook

    def _count_ready(self, bucket: _Bucket) -> None:
        bucket.ready += 1
        if bucket.ready == len(bucket.params) and id(bucket) not in self._tied_buckets:
            self._deferred.flush()
            self._launch(bucket)

    def weight_grads_done(self, chunk: int, weights) -> None:
        """Split backward (parallel/wgrad_defer.py): `chunk`'s last W ran; its `weights` got no
        gradient through autograd (no hook fired), so they count as ready here, and a bucket's
        reduction starts once its last W is done."""
        if self.overlap and self.final_microbatch[chunk]:
            for p in dict.fromkeys(weights):
                self._count_ready(self.buffers[chunk].bucket_of[p])

    def _launch(self, bucket: _Bucket) -> None:
        bucket.grad.div_(self.dp_size)
        if self.distributed:
            shard = bucket.grad.view(self.dp_size, -1)[self.dp_rank]
            bucket.work = reduce_scatter_flat(shard, bucket.grad, group=self.dp_group, async_op=True)
        else:
            bucket.work = dist.all_reduce(bucket.grad, group=self.dp_group, async_op=True)

    def zero_grad(self) -> None:
        """Start a step: main grads read zero until written (fused weights: first write)."""
        self._deferred = _DeferredAdds()  # adds of an abandoned step must not land in the next
        for i, buf in enumerate(self.buffers):
            if not self._zeroed[i]:
                self.zero_buffer(i)
            for b in buf.buckets:
                b.ready, b.work = 0, None
        self._zeroed = [False] * len(self.buffers)
        self.final_microbatch = [False] * len(self.buffers)

    def zero_buffer(self, chunk: int) -> None:
        """Zero one chunk's main grads ahead of the next zero_grad, on the current stream (the
        overlapped update zeroes each chunk right after its last read: engine/overlap_update.py)."""
        buf = self.buffers[chunk]
        first = buf.written_first()
        buf.zero(skip=first)
        wgrad_fusion.mark_first_write([buf.params[i].main_grad for i in first])
        self._zeroed[chunk] = True

    def _zero_unwritten(self) -> None:
        """Main grads still marked for a first write got no gradient this step: zero them."""
        for buf in self.buffers:
            unwritten = wgrad_fusion.take_unwritten([buf.params[i].main_grad for i in buf.written_first()])
            if unwritten:
                torch._foreach_zero_(unwritten)

    def mark_final_microbatch(self, chunk: int) -> None:
        """Called before the last microbatch's backward of `chunk`: its buckets may now be reduced."""
        self.final_microbatch[chunk] = True

    def finish(self) -> None:
        """Complete the DP reduction of every bucket (launching any not yet launched)."""
        self._deferred.flush()
        self._zero_unwritten()
        self._sum_tied_grads()
        if self.dp_group is None:
            return
        for buf in self.buffers:
            for b in buf.buckets:
                if b.work is None:
                    self._launch(b)
        for buf in self.buffers:
            for b in buf.buckets:
                b.work.wait()

    def _sum_tied_grads(self) -> None:
        """Give both sides of a tied embedding the sum of their gradients, before the DP
        reduction (so it also holds for the distributed optimizer's shards): added here when
        this rank holds both, else all-reduced between the first and last pipeline stage."""
        if len(self.tied) == 2:
            total = self.tied[0].main_grad + self.tied[1].main_grad
            for p in self.tied:
                p.main_grad.copy_(total)
        elif self.tied:
            dist.all_reduce(self.tied[0].main_grad, group=self.embedding_group)

    # -- distributed optimizer: parameter all-gather ---------------------------------------
    def start_param_gather(self, wait: bool) -> None:
        """All-gather every bucket's parameter shards in place; with wait=False the works
        are completed by wait_param_gather (e.g. in a forward pre-hook of the chunk)."""
        if not self.distributed or self.dp_group is None:
            return
        for i, buf in enumerate(self.buffers):
            for b in buf.buckets:
                shard = b.param_data.view(self.dp_size, -1)[self.dp_rank]
                self._gather_works[i].append(all_gather_flat(b.param_data, shard, group=self.dp_group, async_op=True))
        if wait:
            self.wait_param_gather()

    def wait_param_gather(self, chunk: int | None = None) -> None:
        for i in range(len(self.buffers)) if chunk is None else (chunk,):
            for work in self._gather_works[i]:
                work.wait()
            self._gather_works[i] = []


def compute_grad_norm(grads: list[torch.Tensor], groups: list, device) -> torch.Tensor:
    """L2 norm of `grads` (each element counted once across ranks), summed over `groups`.

    The caller picks the tensors so that nothing is counted twice: TP-replicated
    parameters on TP rank 0 only, and with the distributed optimizer each rank's own
    shards, summed over DP as well as over the model-parallel (TP x PP) group.
    """
    return compute_grad_norms(grads, groups, device)[0]


def compute_grad_norms(grads: list[torch.Tensor], groups: list, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(global norm as compute_grad_norm, this rank's per-tensor norms (len(grads),)); the
    per-tensor norms are the ones the global norm is made of, so they cost nothing more."""
    if grads:
        # bf16 main grads: each norm accumulated and returned in fp32
        norms = (
            torch._foreach_norm(grads)
            if grads[0].dtype == torch.float32
            else torch._foreach_norm(grads, 2, torch.float32)
        )
        per_tensor = torch.stack([n.float() for n in norms])
        sq = per_tensor.square().sum()
    else:
        per_tensor, sq = torch.zeros(0, device=device), torch.zeros((), device=device)
    for group in groups:
        if group is not None:
            dist.all_reduce(sq, group=group)
    return sq.sqrt(), per_tensor


def clip_coefficient(grad_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """min(1, max_norm / norm), Megatron's clip factor (a device tensor: no host sync)."""
    return (max_norm / (grad_norm + 1e-6)).clamp(max=1.0)


def clip_grads(grads: list[torch.Tensor], grad_norm: torch.Tensor, max_norm: float) -> None:
    """Scale all gradients by the clip coefficient; no host sync."""
    if max_norm <= 0 or not grads:
        return
    torch._foreach_mul_(grads, clip_coefficient(grad_norm, max_norm))
