"""The device mesh and what is applied per stage module: tensor parallelism, expert parallelism,
activation checkpointing, compile and FSDP2.

Mesh dimensions are ``(pp, dp_replicate, dp_shard, tp)``, TP innermost (neighbouring ranks: one
node's fast links carry its per-layer collectives). FSDP2 shards over ``dp_shard``, or over the
2-D ``(dp_replicate, dp_shard)`` sub-mesh (HSDP: replicate across, shard within) when
``data_parallel_replicate_degree > 1``, on top of TP's DTensors. Under expert parallelism the
experts live on a second mesh over the same ranks, ``(pp, dp_replicate, efsdp, ep)``
(``ParallelDims.build_expert_mesh``). Degrees are validated before any process group work so a
wrong layout fails with the fix, not a hang.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
from torch.distributed.tensor import DTensor

from models.common.moe import moe_modules
from models.registry import family_of
from seedckpt.config.job_config import JobConfig
from seedckpt.parallel.expert_parallel import apply_expert_parallel
from seedckpt.parallel.pipeline import pipeline_split
from seedckpt.utils.errors import SeedckptError
from seedckpt.utils.tensors import local

# Zero-bubble schedules run backward as separate input-grad and weight-grad passes.
SPLIT_BACKWARD_SCHEDULES = {"ZBVZeroBubble", "InterleavedZeroBubble", "DualPipeV"}


@dataclass(frozen=True)
class ParallelDims:
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int = 1
    ep: int = 1  # carved from dp_shard x tp (``expert_mesh``), not a factor of the world size

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def efsdp(self) -> int:
        """The ranks of ``dp_shard x tp`` that hold the same experts: FSDP shards the experts over them."""
        return self.dp_shard * self.tp // self.ep

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @classmethod
    def from_config(cls, cfg: JobConfig, world_size: int, args) -> ParallelDims:
        """Resolve ``-1`` and validate everything about the layout that can fail later.

        Each key's own range was checked by ``load_config``; what is left needs the world size or
        the model's shape ``args`` (fine-tuning's comes from the pretrained checkpoint: ``resolve``).
        """
        par, train = cfg.parallelism, cfg.training
        pp, rep, shard, tp = (
            par.pipeline_parallel_degree,
            par.data_parallel_replicate_degree,
            par.data_parallel_shard_degree,
            par.tensor_parallel_degree,
        )
        # the degrees other than data_parallel_shard_degree, as the messages name them (TP when used)
        names = ["pipeline_parallel_degree", "data_parallel_replicate_degree"] + ["tensor_parallel_degree"] * (tp > 1)
        values = [pp, rep] + [tp] * (tp > 1)
        others = f"{' x '.join(names)} = {' x '.join(map(str, values))}"
        if shard == -1:
            shard, rem = divmod(world_size, pp * rep * tp)
            if rem or shard < 1:
                raise SeedckptError(
                    f"world size {world_size} is not divisible by {others}; change the degrees or --nproc-per-node"
                )
        if pp * rep * shard * tp != world_size:
            raise SeedckptError(
                f"{' x '.join(names)} x data_parallel_shard_degree = {' x '.join(map(str, values))} x {shard} = "
                f"{pp * rep * shard * tp}, but the world size is {world_size}; make them multiply to the "
                "world size (or set data_parallel_shard_degree = -1)"
            )
        dims = cls(pp, rep, shard, tp, par.expert_parallel_degree)
        if tp > 1:
            check_tensor_parallel(cfg, args, tp)
        if dims.ep > 1:
            check_expert_parallel(cfg, args, dims)
        max_seq_len = args.max_seq_len
        if train.seq_len > max_seq_len:
            raise SeedckptError(
                f"training.seq_len = {train.seq_len} exceeds model.max_seq_len = {max_seq_len}; "
                "shorten the sequences or raise model.max_seq_len"
            )
        pipeline_split(
            args, pp * par.pipeline_parallel_stages_per_rank, par.pipeline_parallel_split_points, train.seq_len
        )
        if pp == 1 and par.pipeline_parallel_stages_per_rank != 1:
            raise SeedckptError("pipeline_parallel_stages_per_rank > 1 needs pipeline_parallel_degree > 1")
        if pp > 1:
            single = issubclass(get_schedule_class(par.pipeline_parallel_schedule), PipelineScheduleSingle)
            if single and par.pipeline_parallel_stages_per_rank != 1:
                raise SeedckptError(
                    f"{par.pipeline_parallel_schedule} runs one stage per rank; set "
                    "pipeline_parallel_stages_per_rank = 1 or use Interleaved1F1B"
                )
            if not single and par.pipeline_parallel_stages_per_rank < 2:
                raise SeedckptError(
                    f"{par.pipeline_parallel_schedule} runs several stages per rank; set "
                    "parallelism.pipeline_parallel_stages_per_rank = 2"
                )
            if par.pipeline_parallel_schedule in SPLIT_BACKWARD_SCHEDULES and cfg.activation_checkpoint.mode != "none":
                raise SeedckptError(
                    f"{par.pipeline_parallel_schedule} splits backward into input and weight "
                    "passes, which activation checkpointing does not support (torch 2.13); set "
                    "activation_checkpoint.mode = none or use Interleaved1F1B"
                )
            microbatches = dims.microbatches(cfg)
            if microbatches < pp:
                raise SeedckptError(
                    f"pipeline_parallel_microbatches = {microbatches} is less than the "
                    f"{pp} pipeline ranks, which would leave stages idle; use at least {pp}"
                )
            if train.local_batch_size % microbatches:
                raise SeedckptError(
                    f"training.local_batch_size = {train.local_batch_size} is not divisible "
                    f"by pipeline_parallel_microbatches = {microbatches}"
                )
        dims.accumulation_steps(cfg)
        return dims

    def microbatches(self, cfg: JobConfig) -> int:
        n = cfg.parallelism.pipeline_parallel_microbatches
        return n if n > 0 else self.pp * cfg.parallelism.pipeline_parallel_stages_per_rank

    def accumulation_steps(self, cfg: JobConfig) -> int:
        """Gradient-accumulation steps implied by ``global_batch_size`` (-1: no accumulation)."""
        train = cfg.training
        per_step = train.local_batch_size * self.dp
        if train.global_batch_size in (-1, per_step):
            return 1
        if train.global_batch_size < per_step or train.global_batch_size % per_step:
            raise SeedckptError(
                f"training.global_batch_size = {train.global_batch_size} must be a multiple of "
                f"local_batch_size x data-parallel degree = {per_step}"
            )
        return train.global_batch_size // per_step

    def global_batch_size(self, cfg: JobConfig) -> int:
        return cfg.training.local_batch_size * self.dp * self.accumulation_steps(cfg)

    def build_mesh(self, device_type: str) -> DeviceMesh:
        return init_device_mesh(
            device_type,
            (self.pp, self.dp_replicate, self.dp_shard, self.tp),
            mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"),
        )

    def build_expert_mesh(self, device_type: str) -> DeviceMesh | None:
        """The experts' mesh, or None without expert parallelism: the same ranks as ``build_mesh``'s
        with ``dp_shard x tp`` (flattened, TP innermost) split into ``(efsdp, ep)``, EP innermost --
        torchtitan's layout. An EP group is ``ep`` neighbouring ranks of ``dp_shard x tp`` (whole TP
        groups when ``ep >= tp``), and ``efsdp`` is the ranks holding the same experts."""
        if self.ep == 1:
            return None
        return init_device_mesh(
            device_type,
            (self.pp, self.dp_replicate, self.efsdp, self.ep),
            mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep"),
        )


def check_tensor_parallel(cfg: JobConfig, args, tp: int) -> None:
    """What tensor parallelism of degree ``tp`` needs from the model and the rest of the config."""
    family = family_of(args)
    if family.tensor_parallel is None:
        raise SeedckptError(
            f"model.name = {family.name!r} has no tensor-parallel plan; set parallelism.tensor_parallel_degree = 1"
        )
    for what, size in family.tensor_parallel.sizes(args).items():
        if size % tp:
            raise SeedckptError(
                f"parallelism.tensor_parallel_degree = {tp} does not divide {what} = {size}: each TP rank "
                f"needs an equal share; use a degree that divides it"
            )
    train = cfg.training
    row = train.row_tokens  # the length of a batch row: seq_len, or a share of a token budget
    what = (
        f"a row of training.max_tokens_per_rank / local_batch_size = {row} tokens"
        if train.max_tokens_per_rank
        else f"training.seq_len = {row}"
    )
    if cfg.parallelism.enable_sequence_parallel and row % tp:
        raise SeedckptError(
            f"sequence parallelism splits each sequence over the {tp} TP ranks, but {what} "
            f"is not divisible by {tp}; use a multiple of {tp}, or set parallelism.enable_sequence_parallel = false"
        )
    if cfg.finetune.mode == "osft":
        raise SeedckptError(
            "finetune.mode = 'osft' does not run under tensor parallelism in this version (each target's SVD "
            "factors and projections need the whole matrix on its ranks); set "
            "parallelism.tensor_parallel_degree = 1 and shard with data_parallel_shard_degree instead"
        )


def check_expert_parallel(cfg: JobConfig, args, dims: ParallelDims) -> None:
    """What expert parallelism of degree ``dims.ep`` needs from the model, the layout and the rest
    of the config."""
    ep = dims.ep
    key = f"parallelism.expert_parallel_degree = {ep}"
    if not getattr(args, "moe_layers", ()):
        raise SeedckptError(f"{key}, but model.name = {family_of(args).name!r} has no experts to split; set it to 1")
    if args.n_experts % ep:
        raise SeedckptError(
            f"{key} does not divide model.n_experts = {args.n_experts}: each EP rank holds an equal share of "
            "every MoE layer's experts; use a degree that divides it"
        )
    if (dims.dp_shard * dims.tp) % ep:
        raise SeedckptError(
            f"{key} must divide data_parallel_shard_degree x tensor_parallel_degree = {dims.dp_shard} x "
            f"{dims.tp} = {dims.dp_shard * dims.tp}: the EP ranks are carved from them; change a degree"
        )
    if cfg.finetune.mode == "osft":
        raise SeedckptError(
            f"finetune.mode = 'osft' does not run under expert parallelism in this version ({key}): its SVDs "
            "need whole matrices on the ranks that hold them; set parallelism.expert_parallel_degree = 1 "
            "(FSDP then shards the experts like every other weight), or use finetune.mode = 'sft'"
        )


def parallelize_stage(
    module: nn.Module,
    cfg: JobConfig,
    dims: ParallelDims,
    mesh: DeviceMesh,
    shard_data_parallel,
    expert_mesh: DeviceMesh | None = None,
) -> None:
    """Everything applied to a stage module on ``meta``, in torchtitan's order: tensor parallelism
    (the family's plan), expert parallelism (the experts over ``expert_mesh["ep"]``), activation
    checkpointing, compile (``training.compile``), then data parallelism (``shard_data_parallel``)
    -- so the compiled code sits inside AC's and FSDP2's hooks, and FSDP2 shards TP's and EP's
    DTensors over the data-parallel ranks."""
    if dims.tp > 1:
        family_of(module.args).tensor_parallel.apply(module, mesh["tp"], cfg.parallelism.enable_sequence_parallel)
    if dims.ep > 1:
        apply_expert_parallel(module, expert_mesh["ep"], mesh["tp"] if dims.tp > 1 else None)
    ac = cfg.activation_checkpoint
    apply_activation_checkpointing(module, ac.mode, ac.selective_every)
    if cfg.training.compile:
        apply_compile(module, whole_blocks=dims.tp == 1, fullgraph=dims.ep == 1)
    shard_data_parallel(module)


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int) -> None:
    """``full``: recompute every block in backward; ``selective``: every ``every``-th block.

    The composable ``checkpoint`` leaves FQNs unchanged (a wrapper module would add a prefix).
    """
    if mode == "none":
        return
    for layer_id, block in family_of(model.args).blocks(model).items():
        if mode == "full" or int(layer_id) % every == 0:
            checkpoint(block)


def apply_compile(model: nn.Module, whole_blocks: bool = True, fullgraph: bool = True) -> None:
    """``torch.compile`` each transformer block's ``forward`` (``training.compile``), after
    activation checkpointing and before data parallelism, as torchtitan does.

    Per block rather than the whole model: the blocks have one structure, so dynamo traces one and
    every other block reuses its graph -- parameters are graph inputs in torch 2.13 (dynamo always
    inlines ``nn.Module`` calls), so guards do not pin a block's identity and a stage compiles once
    whatever its depth (``tests/test_compile.py`` counts it). Pipeline stages (any slice of the
    blocks) and compile time both follow from that.

    Only ``forward`` is compiled, set as an instance attribute, not the module call:

    * the module's hooks stay eager around the compiled code: composable activation checkpointing
      (its hooks enter a generator context manager dynamo cannot trace: ``block.compile(
      fullgraph=True)`` fails on it), FSDP2's all-gather / reshard and manual FSDP's views, so each
      runs exactly as without compile and AC recomputes the compiled forward in backward;
    * FQNs and state-dict keys are untouched (``torch.compile(block)`` would return a wrapper that
      adds ``_orig_mod.``), so compiled and eager runs read each other's checkpoints bitwise.

    The cost of the eager AC: the recomputation is not visible to the compiler's partitioner, which
    torchtitan's wrapper-based AC lets choose what to save. ``fullgraph=True``: a graph break would
    silently run pieces of the block in eager; it is an error at the first step instead.

    Under tensor parallelism (``whole_blocks = False``) each block's parts that hold parameters
    split by the plan are compiled instead (attention, feed-forward: the matmuls), and the plan's
    hooks between them and the sequence-parallel norms stay eager. In torch 2.13 a compiled block
    with those hooks inside fails in DTensor's backward ("'Tensor' object has no attribute
    '_local_tensor'"), and so does a compiled norm on a sequence-sharded DTensor.

    A block with mixture-of-experts layers compiles whole as well: its routing's data-dependent
    counts stay tensors in the graph (the grouped GEMM's offsets; a padded batch's routed positions
    an unbacked size), so one graph serves every batch, whatever it routes where
    (``tests/test_compile.py`` counts it). Each MoE layer's routing record is kept after the graph
    has run (``MoE.record_routed``), where it can tell activation checkpointing's recomputation.
    Under expert parallelism (``fullgraph = False``) two things run eager between a block's graphs:
    the dispatcher's all-to-all, whose splits come to the host (``torch.compiler.disable``), and
    FSDP2's hooks on the experts' own unit, which torch 2.13 keeps from dynamo; the experts' graph
    between them takes any count of received rows without recompiling.
    """
    family = family_of(model.args)
    for block in family.blocks(model).values():
        for unit in [block] if whole_blocks else _split_parts(block, family.tensor_parallel.splits):
            unit.forward = _compiled_forward(unit, fullgraph)


def _compiled_forward(unit: nn.Module, fullgraph: bool):
    """``unit.forward`` compiled whole; with MoE layers inside, each layer's routing record is kept
    after the graph has run (``MoE.record_routed``: eager, where it can tell a recomputation)."""
    compiled = torch.compile(unit.forward, fullgraph=fullgraph)
    layers = moe_modules(unit)
    if not layers:
        return compiled

    def forward(*args, **kwargs):
        out = compiled(*args, **kwargs)
        for layer in layers:
            layer.record_routed()
        return out

    return forward


def _split_parts(block: nn.Module, splits) -> list[nn.Module]:
    """The block's direct children that hold a parameter the TP plan splits."""
    return [
        child
        for name, child in block.named_children()
        if any(splits(f"{name}.{p}") for p, _ in child.named_parameters())
    ]


def check_compile_supported(device_type: str) -> None:
    """Refuse ``training.compile`` where torch cannot compile, before any rendezvous: this Python
    (dynamo's version range), or inductor's code generator for ``device_type`` -- a C++ compiler on
    CPU (torch's own search: ``$CXX``, then ``g++``), Triton on CUDA."""
    from torch._dynamo.eval_frame import is_dynamo_supported
    from torch._inductor import cpp_builder
    from torch._inductor.exc import InvalidCxxCompiler
    from torch.utils._triton import has_triton

    if not is_dynamo_supported():
        raise SeedckptError(
            f"training.compile = true: torch {torch.__version__} cannot compile on Python "
            f"{sys.version.split()[0]}; use a Python torch.compile supports or set training.compile = false"
        )
    if device_type == "cuda" and not has_triton():
        raise SeedckptError(
            "training.compile = true needs Triton for inductor's CUDA kernels; install the triton "
            "matching your torch (pip install triton) or set training.compile = false"
        )
    if device_type == "cpu":
        try:
            cpp_builder.get_cpp_compiler()
        except InvalidCxxCompiler:
            raise SeedckptError(
                "training.compile = true needs a C++ compiler for inductor's CPU backend; install one "
                "(apt-get install g++) or name it in $CXX, or set training.compile = false"
            ) from None


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool,
    expert_mesh: DeviceMesh | None = None,
    dp: int = 1,
) -> None:
    """``fully_shard`` each transformer block, then the root (embeddings, norm, output).

    Under expert parallelism (``expert_mesh``: the ranks holding the same experts) each MoE layer's
    experts are sharded first, over ``expert_mesh``, as units of their own. Their gradients are
    summed over those ranks and divided by ``dp``, the data-parallel degree, not by the mesh's size:
    the loss of every rank is scaled by ``dp`` (``Trainer.loss_scale``), and after the all-to-all
    an expert's gradient on one rank holds the tokens of the whole EP group, so the ranks summed
    over together cover the global batch once (``tests/test_expert_parallel.py`` checks it
    against one process)."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in family_of(model.args).blocks(model).values():
        for layer in moe_modules(block) if expert_mesh is not None else ():
            _shard_experts(layer.experts, expert_mesh, policy, reshard_after_forward, dp)
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)


def _shard_experts(experts: nn.Module, mesh: DeviceMesh, policy, reshard_after_forward: bool, dp: int) -> None:
    fully_shard(experts, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    experts.set_gradient_divide_factor(float(dp))
    if mesh.device_type == "cpu" and mesh[mesh.mesh_dim_names[-1]].size() > 1:
        # Sum, then divide: FSDP2 would ask gloo for PREMUL_SUM, which it lacks. Not over one rank,
        # where torch 2.13 then divides twice (measured: ep4's expert gradients a quarter too small).
        experts.set_force_sum_reduction_for_comms(True)


def reshard_after_forward(policy: str, pp: int) -> bool:
    """``default``: reshard unless pipelining, where each microbatch would re-gather the weights."""
    return pp == 1 if policy == "default" else policy == "always"


class TiedEmbeddings:
    """Tied input embedding and output projection when a pipeline puts them on different stages.

    Megatron's scheme: the first stage's input embedding and the last stage's output projection
    (the family's tied pair) are two copies, loaded with the same values; after every backward both get
    the *sum* of their gradients (all-reduced between the two pipeline ranks of the same data-
    parallel coordinate, or added locally when one rank holds both stages, as V schedules do), so
    identical AdamW steps keep them bitwise equal. ``duplicates`` (the output copies) are left out
    of the gradient norm, which would otherwise count the shared gradient twice. With both on one
    stage the model shares a single parameter and nothing here is needed.
    """

    def __init__(self, modules, specs, mesh: DeviceMesh, pp_degree: int, stage_owner):
        [(output, embedding)] = family_of(modules[0].args).tied_weights(modules[0].args).items()
        self.duplicates = [m.get_parameter(output) for m, s in zip(modules, specs) if s.is_last]
        self.copies = [m.get_parameter(embedding) for m, s in zip(modules, specs) if s.is_first] + self.duplicates
        num_stages = specs[0].num_stages
        first, last = stage_owner(0), stage_owner(num_stages - 1)
        self.group = None
        if first != last:  # one group per data-parallel coordinate: {its first-stage rank, its last-stage rank}
            ranks = mesh.mesh.reshape(pp_degree, -1)
            for column in range(ranks.shape[1]):
                pair = [int(ranks[first, column]), int(ranks[last, column])]
                group = dist.new_group(pair)
                if dist.get_rank() in pair:
                    self.group = group

    def sync_grads(self) -> None:
        grads = [local(_grad_laid_out_as_param(p)) for p in self.copies if p.grad is not None]
        if not grads:
            return
        total = grads[0].clone()
        for g in grads[1:]:
            total += g
        if self.group is not None:
            dist.all_reduce(total, group=self.group)
        for g in grads:
            g.copy_(total)


def _grad_laid_out_as_param(param: nn.Parameter) -> torch.Tensor:
    """``param.grad``, redistributed (in place) to ``param``'s placements if it has others.

    Under tensor parallelism DTensor's embedding backward leaves the embedding's gradient
    ``Replicate`` while the parameter is ``Shard(0)`` (pp2 x tp2, torch 2.13): its local part is the
    whole matrix, not the rows the output copy's gradient holds. Replicate to Shard is a local slice."""
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = grad = grad.redistribute(param.device_mesh, param.placements)
    return grad
