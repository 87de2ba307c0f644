"""An eager function as one operator of a compiled graph, its backward by recompute (``eager_op``).

Packed attention's SDPA calls and Gated DeltaNet's per-document calls follow each batch's
documents (their number and sizes): traced, a compiled block recompiles for nearly every batch of
other documents. As one custom operator, run eagerly, the calls are out of the graph, which sees
only the operator's inputs (their sizes symbols) and its output's shape. An operator's body runs
below autograd's dispatch, so its backward is a second operator that runs the function once more
under ``torch.func.vjp``: eager's gradients, bitwise.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def eager_op(name: str, args: str, fn: Callable, fake: Callable, differentiable: tuple[int, ...]):
    """``fn`` as the operator ``seedckpt::<name>`` taking the schema's ``args`` (``"Tensor q, int?
    window, ..."``) and returning one tensor, whose shape ``fake`` gives from the same inputs. The
    gradients are those of the inputs at the positions ``differentiable`` (in increasing order); one
    of them may be an optional tensor, which gets none where it is ``None``."""
    op = torch.library.custom_op(f"seedckpt::{name}", fn, mutates_args=(), schema=f"({args}) -> Tensor")
    op.register_fake(fake)

    def leaves(inputs) -> list[int]:
        return [i for i in differentiable if inputs[i] is not None]

    def gradients(grad, *inputs) -> list[torch.Tensor]:
        positions = leaves(inputs)

        def run(*xs):
            given = list(inputs)
            for i, x in zip(positions, xs):
                given[i] = x
            return fn(*given)

        grads = torch.func.vjp(run, *(inputs[i] for i in positions))[1](grad)
        return [torch.empty_like(inputs[i]).copy_(g) for i, g in zip(positions, grads)]

    backward = torch.library.custom_op(
        f"seedckpt::{name}_backward", gradients, mutates_args=(), schema=f"(Tensor grad, {args}) -> Tensor[]"
    )
    backward.register_fake(lambda grad, *inputs: [torch.empty_like(inputs[i]) for i in leaves(inputs)])

    def save(ctx, inputs, output) -> None:
        ctx.tensors = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)]
        ctx.save_for_backward(*(inputs[i] for i in ctx.tensors))
        ctx.others = [x for x in inputs if not isinstance(x, torch.Tensor)]

    def grads(ctx, grad):
        others = iter(ctx.others)
        saved = dict(zip(ctx.tensors, ctx.saved_tensors))
        inputs = [saved[i] if i in saved else next(others) for i in range(len(ctx.tensors) + len(ctx.others))]
        computed = iter(backward(grad, *inputs))
        return tuple(next(computed) if i in leaves(inputs) else None for i in range(len(inputs)))

    op.register_autograd(grads, setup_context=save)
    return op
