"""The phases sum the vocabulary-wide weights' gradients where they are made
(:mod:`modelling.grad_sinks`): a step makes no tensor of the word table's (or the untied head's)
size for any micro-batch, where autograd made two per micro-batch (the head's product, the
embedding's zero-filled table). That the gradients are still autograd's, within the rounding
of the sums' order, is ``test_phased_equivalence.py``'s (tied and untied, whole and chunked
heads: every gradient within 1e-5 of an ordinary autograd step's).
"""

from __future__ import annotations

import pytest

from execution.engine.engine import StepHooks
from execution.parallel.mesh import ParallelLayout
from modelling.gpt import GPTShapes
from tests.distributed import CPU, global_batches, planned_engine, replica_batch
from tests.reference import LLAMA_VARIANTS, small_config
from utils.torch_private import TorchDispatchMode


class FreshTables(TorchDispatchMode):
    """Counts the ops whose result is a new tensor of ``shape`` (not a view of an input)."""

    def __init__(self, shape: tuple[int, ...]):
        super().__init__()
        self.shape, self.made = shape, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            a.untyped_storage().data_ptr()
            for a in (*args, *(kwargs or {}).values())
            if hasattr(a, "untyped_storage")
        }
        for result in out if isinstance(out, (tuple, list)) else (out,):
            fresh = getattr(result, "shape", None) == self.shape
            if fresh and result.untyped_storage().data_ptr() not in inputs:
                self.made.append(str(func))
        return out


@pytest.mark.parametrize("variant", [(), tuple(LLAMA_VARIANTS)], ids=["tied", "untied"])
def test_a_step_makes_no_vocabulary_table_for_a_micro_batch(variant):
    config = small_config(*variant, "--global_batch_size", "8", "--micro_batch_size", "1")
    assert config.gradient_accumulation == 8
    engine = planned_engine(config, ParallelLayout.single(CPU))
    shapes = GPTShapes.from_config(config.model)
    table = (shapes.vocab_padded, shapes.hidden)
    batches = global_batches(config, 2, seed=3)
    engine.train_step(replica_batch(config, batches[0], 0), 0, 1e-3, StepHooks())  # warm
    with FreshTables(table) as seen:
        engine.train_step(replica_batch(config, batches[1], 0), 1, 1e-3, StepHooks())
    assert seen.made == []
