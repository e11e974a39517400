"""A part's weights bound to its stateless template, once per phase rather than per call.

``torch.func.functional_call`` binds a module's weights for one call: each call walks the
module tree to untie shared tensors and swaps every parameter in and back out. A phase calls
the same template on the same weights for each of its micro-batches, so a body binds them
once (:meth:`WeightSlots.bound`) and calls the template directly inside: the same call as
``functional_call`` makes (parameters read from the modules' own dictionaries, the compiled
template's graph run the same way), at a fraction of the host's time per micro-batch
(gpt3_1.3B's block: 16 parameters, swapped twice for each call).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
from torch import nn


class WeightSlots:
    """Where each parameter of ``template`` is held: its module's parameter dictionary and key,
    found once for the template's life.

    Args:
        template: A stateless part (its parameters on the meta device), bound to each layer's
            weights in turn.
    """

    def __init__(self, template: nn.Module):
        self.module = template
        self.slots: dict[str, tuple[dict, str]] = {}
        for name, _ in template.named_parameters(remove_duplicate=False):
            owner, _, leaf = name.rpartition(".")
            self.slots[name] = (template.get_submodule(owner)._parameters, leaf)

    @contextlib.contextmanager
    def bound(self, weights: Mapping[str, torch.Tensor]) -> Iterator[None]:
        """The template computes with ``weights`` (by parameter name; those not named keep the
        template's own) inside, and holds none of them after."""
        saved = []
        try:
            for name, tensor in weights.items():
                parameters, key = self.slots[name]
                saved.append((parameters, key, parameters[key]))
                parameters[key] = tensor
            yield
        finally:
            for parameters, key, original in reversed(saved):
                parameters[key] = original
