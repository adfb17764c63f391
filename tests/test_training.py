"""Training and serving: autocast, torch.compile, checkpointing, state_dict, torch.export, DDP, FSDP2."""
import io
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.checkpoint import checkpoint

from blockattn_layers import JaggedTransformerEncoder, JaggedTransformerEncoderLayer

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny ops: threads only contend

WORLD = 2


def _encoder(dtype=torch.float32, dropout=0.0, rope_theta=None, seed=0):
    torch.manual_seed(seed)
    layer = JaggedTransformerEncoderLayer(
        16, 2, 32, dropout, block_size=4, rope_theta=rope_theta, num_kv_heads=1, backend="reference", dtype=dtype,
    )
    return JaggedTransformerEncoder(layer, 2, norm=torch.nn.LayerNorm(16, dtype=dtype))


def _batch(lengths, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    offsets = torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0))
    return torch.randn(int(offsets[-1]), 16, generator=g, dtype=dtype), offsets


def _grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _attention_ops(module):
    """Forward attention ops in a graph module, including dynamo's autograd.Function subgraphs."""
    graphs = [m.graph for m in module.modules() if isinstance(m, torch.fx.GraphModule)]
    return [
        n for g in graphs for n in g.nodes
        if n.op == "call_function" and "blockattn" in str(n.target) and "_fwd" in str(n.target)
    ]


def test_autocast_bf16_cpu():
    encoder = _encoder()
    x, offsets = _batch([5, 0, 9, 4])
    reference = encoder(x, offsets)
    seen = []
    encoder.layers[0].self_attn.in_proj.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    x.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = encoder(x, offsets)
    assert seen == [torch.bfloat16]  # attention ran on bf16 q, k, v
    torch.testing.assert_close(out.float(), reference, atol=0.1, rtol=0.05)
    out.float().square().sum().backward()
    assert torch.isfinite(x.grad).all()
    assert all(p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all() for p in encoder.parameters())


def test_compile_fullgraph_dynamic_shapes_never_recompiles():
    torch._dynamo.reset()
    layer = JaggedTransformerEncoderLayer(16, 2, 32, 0.0, block_size=4, rope_theta=100.0, backend="reference")
    aot_eager = torch._dynamo.lookup_backend("aot_eager")
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    compiled = torch.compile(layer, backend=counting_backend, fullgraph=True)
    for step, lengths in enumerate([[5, 0, 9], [17, 3, 3, 1], [2, 6], [30, 1, 8, 8, 4, 0]]):
        x, offsets = _batch(lengths, seed=step)
        if step == 0:
            torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_dynamic(offsets, 0)
        x_eager = x.clone().requires_grad_()
        x.requires_grad_()
        out = compiled(x, offsets)
        expected = layer(x_eager, offsets)
        torch.testing.assert_close(out, expected)
        out.square().sum().backward()
        expected.square().sum().backward()
        torch.testing.assert_close(x.grad, x_eager.grad)
    assert len(graphs) == 1, f"compiled {len(graphs)} times for 4 batch shapes"
    assert len(_attention_ops(graphs[0])) == 1  # the registered op, opaque to dynamo
    torch._dynamo.reset()


def test_activation_checkpointing_gives_equal_grads():
    encoder = _encoder(torch.float64, dropout=0.2)
    x, offsets = _batch([6, 11, 0, 3], torch.float64)
    x.requires_grad_()
    torch.manual_seed(5)
    encoder(x, offsets).square().sum().backward()
    plain, plain_x = _grads(encoder), x.grad.clone()
    encoder.zero_grad()
    x.grad = None
    torch.manual_seed(5)
    checkpoint(encoder, x, offsets, use_reentrant=False).square().sum().backward()
    torch.testing.assert_close(x.grad, plain_x, rtol=1e-12, atol=1e-12)
    for name, grad in _grads(encoder).items():
        torch.testing.assert_close(grad, plain[name], rtol=1e-12, atol=1e-12)


def test_state_dict_round_trip():
    encoder = _encoder(rope_theta=50.0).eval()
    buffer = io.BytesIO()
    torch.save(encoder.state_dict(), buffer)
    fresh = _encoder(rope_theta=50.0, seed=1).eval()
    x, offsets = _batch([3, 12, 7])
    assert not torch.allclose(fresh(x, offsets), encoder(x, offsets))
    buffer.seek(0)
    fresh.load_state_dict(torch.load(buffer))
    assert "layers.1.self_attn.in_proj.weight" in encoder.state_dict()
    assert torch.equal(fresh(x, offsets), encoder(x, offsets))


def test_export_with_dynamic_shapes_matches_eager():
    encoder = _encoder(rope_theta=100.0).eval()
    x, offsets = _batch([5, 0, 9])
    tokens = torch.export.Dim("tokens", min=2, max=1 << 20)
    bounds = torch.export.Dim("bounds", min=2, max=1 << 16)
    program = torch.export.export(encoder, (x, offsets), dynamic_shapes=({0: tokens}, {0: bounds}))
    assert len(_attention_ops(program.graph_module)) == 2
    run = program.module()
    for lengths in ([5, 0, 9], [40, 2], [1, 1, 7, 0, 30, 4]):
        x, offsets = _batch(lengths, seed=len(lengths))
        torch.testing.assert_close(run(x, offsets), encoder(x, offsets), rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- DDP and FSDP2 (gloo, CPU)
RANK_LENGTHS = ([5, 12, 0, 3], [9, 1, 14])


def _rank_batch(rank):
    return _batch(RANK_LENGTHS[rank], torch.float64, seed=rank)


def _loss(model, x, offsets):
    # DDP and FSDP average gradients over ranks; scaling by WORLD makes them sums over all data.
    return model(x, offsets).square().sum() * WORLD


def _worker(rank, port, out_dir):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        x, offsets = _rank_batch(rank)
        ddp = DistributedDataParallel(_encoder(torch.float64))
        _loss(ddp, x, offsets).backward()
        result = {"ddp": _grads(ddp.module)}

        model = _encoder(torch.float64)
        mesh = init_device_mesh("cpu", (WORLD,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        result["fsdp_sharded"] = all(isinstance(p, DTensor) for p in model.parameters())
        _loss(model, x, offsets).backward()
        result["fsdp"] = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def distributed_grads(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("dist"))
    mp.spawn(_worker, args=(_free_port(), out_dir), nprocs=WORLD, join=True)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(WORLD)]


@pytest.fixture(scope="module")
def single_process_grads():
    """Gradients of one process on the concatenation of both ranks' jagged batches."""
    (x0, o0), (x1, o1) = _rank_batch(0), _rank_batch(1)
    x, offsets = torch.cat([x0, x1]), torch.cat([o0, o1[1:] + o0[-1]])
    model = _encoder(torch.float64)
    model(x, offsets).square().sum().backward()
    return _grads(model)


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_distributed_grads_equal_single_process(kind, distributed_grads, single_process_grads):
    for rank_result in distributed_grads:
        grads = rank_result[kind]
        assert grads.keys() == single_process_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, single_process_grads[name], rtol=1e-10, atol=1e-12, msg=name)
    if kind == "fsdp":
        assert all(r["fsdp_sharded"] for r in distributed_grads)
