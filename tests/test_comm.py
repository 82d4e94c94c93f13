"""Each communication Function's backward is the exact adjoint of its forward."""

import functools

import pytest
import torch
import torch.distributed as dist

from tsp_ext.engine.parallel import comm

pytestmark = pytest.mark.multiproc


def _global_dot(a: torch.Tensor, b: torch.Tensor) -> float:
    s = (a * b).sum().reshape(1)
    dist.all_reduce(s)
    return s.item()


def duals_worker(rank, world):
    group = dist.group.WORLD
    torch.manual_seed(rank)
    ops = {
        "gather_seq": lambda x: comm.gather_seq(x, group),
    }
    out = {}
    for name, op in ops.items():
        x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
        y = op(x)
        g = torch.randn_like(y)
        y.backward(g)
        # <f(x), g> == <x, f^T(g)>, both summed over all ranks
        out[name] = abs(_global_dot(y.detach(), g) - _global_dot(x.detach(), x.grad))
    # a replicated tensor is one logical tensor: its side of the product is counted once
    torch.manual_seed(world)
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(100 + rank)
    g = torch.randn(2, 3, dtype=torch.float64)
    comm.replicated(x, group).backward(g)
    out["replicated"] = abs(_global_dot(x.detach(), g) - (x * x.grad).sum().item())
    # sum_over_ranks: per-rank partials -> one replicated value (its side counted once)
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(world)
    g = torch.randn(2, 3, dtype=torch.float64)
    y = comm.sum_over_ranks(x, group)
    y.backward(g)
    out["sum_over_ranks"] = abs((y.detach() * g).sum().item() - _global_dot(x.detach(), x.grad))
    out.update(_bucket_case(rank, world, group))
    # forward values
    x = torch.full((2, 1), float(rank))
    out["gather_value"] = comm.gather_seq(x[None], group)[0, :, 0].tolist()
    # reduce-scatter, gloo's all-to-all and its lean path (D in-place reduces): row q of every
    # rank summed into rank q
    rows = torch.arange(world, dtype=torch.float64)[:, None, None] * 10 + rank + torch.zeros(2, 3)
    for lean in (False, True):
        got, handle = comm.reduce_scatter_seq(rows.clone(), group, async_op=True, lean=lean)
        handle.wait()
        out[f"scatter_lean={lean}"] = got.tolist()
    return out


def _bucket_case(rank, world, group) -> dict:
    """Replicated tensors used in a bucket get the gradients of per-use ``replicated``, from one
    all-reduce per dtype."""
    torch.manual_seed(world)
    shapes = ((3, torch.float64), (4, torch.float64), (2, torch.float32))
    ts = [torch.randn(n, dtype=dt, requires_grad=True) for n, dt in shapes]
    torch.manual_seed(200 + rank)
    gs = [torch.randn_like(t) for t in ts]

    def loss():  # every tensor used twice
        uses = [comm.replicated(t, group) + comm.replicated(t, group) for t in ts]
        return sum((u * g).sum() for u, g in zip(uses, gs))

    loss().backward()
    expected = [t.grad.clone() for t in ts]
    for t in ts:
        t.grad = None
    calls, real = [], dist.all_reduce
    dist.all_reduce = lambda *a, **k: calls.append(a[0].numel()) or real(*a, **k)
    try:
        with comm.bucketed_replicated(ts, group):
            total = loss()
        total.backward()
    finally:
        dist.all_reduce = real
    error = max((t.grad - e).abs().max().item() for t, e in zip(ts, expected))
    return {"bucket_error": error, "bucket_all_reduces": sorted(calls)}


@functools.cache
def duals(workers, world):
    return workers.run(duals_worker, world)


@pytest.mark.parametrize("world", [2, 4])
def test_functions_are_exact_duals(workers, world):
    for rank, res in enumerate(duals(workers, world)):
        for name in ("gather_seq", "replicated", "sum_over_ranks"):
            assert res[name] < 1e-12, (world, rank, name, res[name])
        assert res["bucket_error"] < 1e-6, res["bucket_error"]  # float32 among them
        assert res["bucket_all_reduces"] == [2, 7]  # one per dtype: 2 float32, 3 + 4 float64
        assert res["gather_value"] == [float(r) for r in range(world) for _ in range(2)]
        expected = torch.full((2, 3), 10.0 * rank * world + sum(range(world))).tolist()
        assert res["scatter_lean=False"] == res["scatter_lean=True"] == expected
