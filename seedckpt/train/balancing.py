"""Expert load balancing across a run's ranks: the auxiliary loss's weight, the aux-loss-free bias
updates and the balance statistics of each step.

The model's MoE layers (``models.common.moe``) count the tokens each expert received and sum their
sequence-wise auxiliary loss. Here those counts become global: summed over the data-parallel ranks
(each routes its own rows; tensor-parallel ranks route the same rows and are not counted twice),
so the bias update and the statistics are those of the whole global batch, whatever the layout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from models.common.moe import MoE, balance_summary, moe_modules, update_expert_bias


class ExpertBalancing:
    """The MoE layers of this rank's stages and the groups their statistics are summed over."""

    def __init__(self, modules, mesh, dims, device, global_rows: int, moe_layers: int):
        """``moe_layers``: the model's MoE layers, on every stage (a rank may hold none of them and
        still takes part in the collectives)."""
        self.layers: list[MoE] = [layer for module in modules for layer in moe_modules(module)]
        self.mesh, self.dims, self.device = mesh, dims, device
        self.rows_x_layers = max(1, global_rows * moe_layers)
        for layer in self.layers:
            # the aux loss is averaged over the global batch's rows and the MoE layers; x dp, as the
            # cross-entropy's scale is, because FSDP averages the gradients over the DP ranks
            layer.aux_loss_scale = layer.options.aux_loss_coef * dims.dp / self.rows_x_layers

    def start_step(self) -> None:
        for layer in self.layers:
            layer.routed.clear()

    def finish_step(self, forwards: int) -> dict[str, float]:
        """Before the optimizer step: sum the counts of the step's last ``forwards`` forwards of each
        layer (its micro-batches: a pipeline schedule may first run one more, to infer shapes) over
        the DP ranks, move ``bias`` balancing's bias, and return the step's statistics (the same on
        every rank): ``moe_aux_loss`` (the mean sequence-wise auxiliary loss, unweighted),
        ``moe_max_load`` and ``moe_mean_max_load`` (max / mean tokens per expert: the worst layer's
        and the layers' mean). Collective."""
        counts, aux = [], torch.zeros((), dtype=torch.float64, device=self.device)
        for layer in self.layers:
            step = layer.routed[-forwards:]
            counts.append(torch.stack([c for c, _ in step]).sum(0).double())
            aux = aux + sum((a.double() for _, a in step if a is not None), torch.zeros((), dtype=torch.float64))
        summed = torch.cat([*counts, aux.reshape(1)]).to(self.device)
        self._over_data_parallel(summed)
        offset = 0
        for i, layer in enumerate(self.layers):
            counts[i] = summed[offset : offset + counts[i].numel()]
            offset += counts[i].numel()
            if layer.expert_bias is not None and layer.router.gate.weight.requires_grad:  # OSFT: frozen
                update_expert_bias(layer, counts[i])
        ratios = [balance_summary(c) for c in counts]
        totals = torch.tensor([sum(ratios), len(ratios), summed[-1].item()], dtype=torch.float64, device=self.device)
        worst = torch.tensor([max(ratios, default=0.0)], dtype=torch.float64, device=self.device)
        if self.dims.pp > 1:  # each pipeline rank holds other layers
            dist.all_reduce(totals, group=self.mesh["pp"].get_group())
            dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=self.mesh["pp"].get_group())
        return {
            "moe_aux_loss": totals[2].item() / self.rows_x_layers,
            "moe_max_load": worst.item(),
            "moe_mean_max_load": totals[0].item() / max(1.0, totals[1].item()),
        }

    def _over_data_parallel(self, tensor: torch.Tensor) -> None:
        for dim in ("dp_replicate", "dp_shard"):
            if getattr(self.dims, dim) > 1:
                dist.all_reduce(tensor, group=self.mesh[dim].get_group())
