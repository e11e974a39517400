"""modelling/grad_sinks.py: a vocabulary-wide weight's gradient summed where it is made equals
the sum of autograd's gradients, micro-batch by micro-batch, within the rounding of the sums'
order; the rest of the backward (the input's gradient) is autograd's own, bit for bit.

The bound: each element is a sum of n products or rows (n: the micro-batches' tokens, every
micro-batch's K products for a linear), and two float32 sums of the same n terms in other
orders differ by at most 2 (n - 1) u times the sum of the terms' magnitudes (u = 2^-24, the
standard a priori bound on each). The tests take both sums against float64's and against each
other on those bounds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from modelling.grad_sinks import GradSink, embedding, linear

U = 2.0**-24  # float32's unit roundoff
VOCAB, HIDDEN, TOKENS, MICRO_BATCHES = 97, 16, 24, 4


def _micro_batches(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    # Ids from a dozen words: every micro-batch repeats some, so rows are summed in another
    # order than autograd's (which sums a micro-batch's repeats before adding them).
    ids = [torch.randint(0, 12, (2, TOKENS // 2), generator=g) for _ in range(MICRO_BATCHES)]
    grads = [torch.randn(2, TOKENS // 2, HIDDEN, generator=g) for _ in range(MICRO_BATCHES)]
    return ids, grads


def test_a_sunk_lookup_sums_the_rows_of_every_micro_batch():
    table = torch.randn(VOCAB, HIDDEN, requires_grad=True)
    ids, grads = _micro_batches()
    buffer = torch.full((VOCAB, HIDDEN), float("nan"))  # the first micro-batch overwrites it
    sink = GradSink(buffer)
    reference = torch.zeros(VOCAB, HIDDEN)
    exact = torch.zeros(VOCAB, HIDDEN, dtype=torch.float64)
    magnitude = torch.zeros(VOCAB, HIDDEN, dtype=torch.float64)
    for i, g in zip(ids, grads, strict=True):
        rows = embedding(i, table, sink)
        assert torch.equal(rows, F.embedding(i, table))  # the forward is the lookup
        (placeholder,) = torch.autograd.grad(rows, [table], g)
        assert placeholder.shape == table.shape and placeholder.count_nonzero() == 0
        (dense,) = torch.autograd.grad(F.embedding(i, table), [table], g)
        reference += dense  # the unsunk way: each micro-batch's table, then added
        flat, rows64 = i.reshape(-1), g.reshape(-1, HIDDEN).double()
        exact.index_add_(0, flat, rows64)
        magnitude.index_add_(0, flat, rows64.abs())
    terms = MICRO_BATCHES * TOKENS  # at most this many rows add into one element
    bound = 2 * (terms - 1) * U * magnitude
    assert ((buffer.double() - exact).abs() <= bound).all()
    assert ((reference.double() - exact).abs() <= bound).all()
    assert ((buffer - reference).double().abs() <= 2 * bound).all()
    untouched = torch.ones(VOCAB, dtype=torch.bool)
    untouched[torch.cat([i.reshape(-1) for i in ids])] = False
    assert (buffer[untouched] == 0).all()  # rows no token looked up: zero, not the NaN


def test_a_sunk_linear_multiplies_into_the_sum_and_leaves_the_input_gradient_alone():
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(VOCAB, HIDDEN, generator=g, requires_grad=True)
    buffer = torch.full((VOCAB, HIDDEN), float("nan"))
    sink = GradSink(buffer)
    reference = torch.zeros(VOCAB, HIDDEN)
    exact = torch.zeros(VOCAB, HIDDEN, dtype=torch.float64)
    magnitude = torch.zeros(VOCAB, HIDDEN, dtype=torch.float64)
    for m in range(MICRO_BATCHES):
        x = torch.randn(2, TOKENS // 2, HIDDEN, generator=g, requires_grad=True)
        grad_out = torch.randn(2, TOKENS // 2, VOCAB, generator=g)
        out = linear(x, weight, sink)
        assert torch.equal(out, F.linear(x, weight))
        dx, placeholder = torch.autograd.grad(out, [x, weight], grad_out)
        expected_dx, dense = torch.autograd.grad(F.linear(x, weight), [x, weight], grad_out)
        assert torch.equal(dx, expected_dx)  # the same matmul as autograd's, bit for bit
        assert placeholder.count_nonzero() == 0
        if m == 0:  # the first is written where autograd's product would be: the same product
            assert torch.equal(buffer, dense)
        reference += dense
        a, b = grad_out.reshape(-1, VOCAB).double(), x.detach().reshape(-1, HIDDEN).double()
        exact += a.t() @ b
        magnitude += a.abs().t() @ b.abs()
    terms = MICRO_BATCHES * TOKENS
    bound = 2 * (terms - 1) * U * magnitude
    assert ((buffer.double() - exact).abs() <= bound).all()
    assert ((reference.double() - exact).abs() <= bound).all()


def test_a_16_bit_product_is_added_as_without_a_sink():
    """bfloat16 compute: the product is rounded to bfloat16 and added to the float32 sum,
    as autograd's gradient is without a sink (a CPU has no mixed addmm)."""
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(VOCAB, HIDDEN, generator=g).bfloat16().requires_grad_()
    buffer = torch.empty(VOCAB, HIDDEN)
    sink = GradSink(buffer)
    reference = None
    for _ in range(3):
        x = torch.randn(TOKENS, HIDDEN, generator=g).bfloat16().requires_grad_()
        grad_out = torch.randn(TOKENS, VOCAB, generator=g).bfloat16()
        torch.autograd.grad(linear(x, weight, sink), [x, weight], grad_out)
        (dense,) = torch.autograd.grad(F.linear(x, weight), [weight], grad_out)
        reference = dense.float() if reference is None else reference.add_(dense)
    assert torch.equal(buffer, reference)
