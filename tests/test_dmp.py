"""The jagged encoder inside torchrec DistributedModelParallel, trained with TrainPipelineSparseDist.

In-process: every module takes torchrec's lazy awaitables (what a sharded EmbeddingCollection
returns), and torchrec's pipeline tracer follows the click model to the collection. Spawned
(CPU, gloo, 2 processes, one job for all sharding kinds, see tests/dmp_job.py): table-wise,
row-wise, column-wise (fused kernel) and the planner's plan each train under DMP with
TrainPipelineSparseDist; at step 0 each rank's loss equals the single-process model's on that
rank's batch; dense parameters agree across ranks; the loss falls; a checkpoint taken mid-run
and loaded into a fresh model gives the losses of the run that did not stop. Last, the
``torchrun ... -m blockattn_layers demo --distributed`` command trains, saves and resumes.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from blockattn_layers import (
    BlockSelfAttention, JaggedTransformerEncoder, JaggedTransformerEncoderLayer, RotaryBlockAttention,
)
from blockattn_layers.cli.demo_config import SHARDINGS
from blockattn_layers.cli.demo_model import torchrec_problem

if torchrec_problem() is not None:
    pytest.skip(f"torchrec unavailable: {torchrec_problem()}", allow_module_level=True)

from torchrec.distributed.types import LazyAwaitable  # noqa: E402
from torchrec.sparse.jagged_tensor import JaggedTensor  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = """\
data: {num_items: 60, num_categories: 12, hot_categories: 3, max_history: 16, batch_size: 16, eval_users: 128}
encoder:
  num_layers: 1
  layer: {d_model: 8, nhead: 2, dim_feedforward: 16, dropout: 0.0, block_size: 8, rope_theta: 10000.0}
train: {steps: 20, lr: 1.0e-2}
"""
STEPS, SAVE_AT, DISTINCT = 14, 12, 4  # the job's schedule: batches cycle through DISTINCT per rank
RANKS = (0, 1)


class _CountingAwaitable(LazyAwaitable):
    """A LazyAwaitable of ``result`` that counts its waits (a stand-in for EmbeddingCollectionAwaitable)."""

    def __init__(self, result):
        super().__init__()
        self._value, self.waits = result, 0

    def _wait_impl(self):
        self.waits += 1
        return self._value


def _features(dim: int = 16):
    gen = torch.Generator().manual_seed(0)
    return {
        "clicks": JaggedTensor(values=torch.randn(9, dim, generator=gen), lengths=torch.tensor([4, 0, 5])),
        "views": JaggedTensor(values=torch.randn(6, dim, generator=gen), lengths=torch.tensor([1, 3, 2])),
    }


LAYERS = {
    "block_attention": lambda: BlockSelfAttention(16, 2, block_size=4),
    "rotary_attention": lambda: RotaryBlockAttention(16, 2, block_size=None, num_kv_heads=1),
    "encoder_layer": lambda: JaggedTransformerEncoderLayer(16, 2, 32, dropout=0.0, block_size=4, rope_theta=1e4),
    "encoder": lambda: JaggedTransformerEncoder(JaggedTransformerEncoderLayer(16, 2, 32, dropout=0.0), 2),
}


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_every_module_takes_a_lazy_awaitable_of_a_dict(kind):
    module = LAYERS[kind]().eval()
    features = _features()
    awaitable = _CountingAwaitable(features)
    out = module(awaitable)
    expected = module(features)
    assert isinstance(out, dict) and list(out) == list(features)
    for key in features:
        torch.testing.assert_close(out[key].values(), expected[key].values())
        assert torch.equal(out[key].lengths(), features[key].lengths())
    assert awaitable.waits == 1
    module(awaitable)  # the result is cached on the awaitable, as torchrec does
    assert awaitable.waits == 1


def test_rotary_positions_may_be_awaitables_too():
    module = RotaryBlockAttention(16, 2, block_size=4).eval()
    features = _features()
    times = {key: JaggedTensor(values=torch.rand(jt.values().shape[0]) * 100, lengths=jt.lengths())
             for key, jt in features.items()}
    out = module(_CountingAwaitable(features), positions=_CountingAwaitable(times))
    torch.testing.assert_close(out["views"].values(), module(features, positions=times)["views"].values())


def test_pipeline_tracer_reaches_the_collection_straight_from_the_batch():
    from torchrec.distributed.train_pipeline.tracing import Tracer

    from blockattn_layers.cli.demo_data import FEATURES
    from blockattn_layers.cli.demo_model import build_click_model
    from blockattn_layers.cli.dmp_setup import ClickTraining

    training = ClickTraining(build_click_model(FEATURES, (50, 10), LAYERS["encoder_layer"](), 16, 8))
    # As TrainPipelineSparseDist's tracer sees a sharded model: the collection (a ShardedModule
    # there) and every module without a sharded child are leaves; the rest is traced through.
    collection = "model.sequence_encoder.embedding_collection"
    leaves = [collection, "model.sequence_encoder.encoder", "model.head"]
    graph = Tracer(leaf_modules=leaves).trace(training)
    calls = {node.target: node for node in graph.nodes if node.op == "call_module"}
    assert set(calls) == set(leaves)
    (source,) = calls[collection].args
    assert source.op == "call_function" and source.args[1] == "features"  # getattr(batch, "features")
    assert source.args[0].op == "placeholder"
    assert calls["model.sequence_encoder.encoder"].args[0] is calls[collection]


# ----------------------------------------------------------------------------- spawned DMP job
def _torchrun(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )


def _tiny_config(directory) -> str:
    path = directory / "tiny.yaml"
    path.write_text(TINY)
    return str(path)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """Per rank, per sharding kind: what tests/dmp_job.py measured."""
    out = tmp_path_factory.mktemp("dmp_job")
    result = _torchrun(
        os.path.join("tests", "dmp_job.py"), "--config", _tiny_config(out), "--out", str(out),
        "--shardings", ",".join(SHARDINGS), "--steps", str(STEPS), "--save-at", str(SAVE_AT),
        "--distinct", str(DISTINCT), timeout=300,
    )
    if result.returncode != 0:
        pytest.fail(f"the DMP job failed (exit {result.returncode}):\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}")
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in RANKS]


EXPECTED_PLANS = {
    "table_wise": {"item_ids_table": ["table_wise", "fused", [0]], "category_ids_table": ["table_wise", "fused", [1]]},
    "row_wise": {t: ["row_wise", "fused", [0, 1]] for t in ("item_ids_table", "category_ids_table")},
    "column_wise": {t: ["column_wise", "fused", [0, 1]] for t in ("item_ids_table", "category_ids_table")},
}


@pytest.mark.parametrize("kind", SHARDINGS)
def test_dmp_shards_as_asked_and_the_pipeline_takes_the_collection(job, kind):
    for rank in RANKS:
        result = job[rank][kind]
        if kind in EXPECTED_PLANS:
            assert result["plan"] == EXPECTED_PLANS[kind]
        else:
            assert set(result["plan"]) == {"item_ids_table", "category_ids_table"}
        assert result["pipelined"] == ["ShardedEmbeddingCollection"], "the collection was not pipelined"


@pytest.mark.parametrize("kind", SHARDINGS)
def test_step0_loss_under_dmp_equals_the_single_process_model(job, kind):
    for rank in RANKS:
        result = job[rank][kind]
        assert result["dmp_forward_loss"] == pytest.approx(result["plain_loss"], rel=1e-5, abs=1e-6)
        assert result["losses"][0] == pytest.approx(result["plain_loss"], rel=1e-5, abs=1e-6)
    assert job[0][kind]["plain_loss"] != job[1][kind]["plain_loss"]  # each rank trains on its own users


@pytest.mark.parametrize("kind", SHARDINGS)
def test_dense_parameters_agree_across_ranks_and_the_loss_falls(job, kind):
    for rank in RANKS:
        result = job[rank][kind]
        assert result["dense_max_diff"] == 0.0 and result["resumed_dense_max_diff"] == 0.0
        losses = result["losses"]
        first, last = sum(losses[:DISTINCT]) / DISTINCT, sum(losses[SAVE_AT - DISTINCT:SAVE_AT]) / DISTINCT
        assert last < first - 0.05, losses  # the same DISTINCT batches in both windows


@pytest.mark.parametrize("kind", SHARDINGS)
def test_resuming_from_a_checkpoint_gives_the_losses_of_not_stopping(job, kind):
    for rank in RANKS:
        result = job[rank][kind]
        assert result["resumed_from"] == SAVE_AT
        expected = result["losses"][SAVE_AT:]
        assert result["fresh_forward_loss"] != pytest.approx(expected[0], rel=1e-3)  # loading is what matters
        assert result["resumed_forward_loss"] == pytest.approx(expected[0], rel=1e-6, abs=1e-7)
        # The second step after resuming also needs the optimizers' state (Adam's moments, Adagrad's sums).
        assert result["resumed_losses"] == pytest.approx(expected, rel=1e-6, abs=1e-7)


# ----------------------------------------------------------------------------- the command
def test_distributed_demo_trains_checkpoints_and_resumes(tmp_path):
    config, checkpoint = _tiny_config(tmp_path), str(tmp_path / "checkpoint")
    first = _torchrun("-m", "blockattn_layers", "demo", "--distributed", "--config", config, "--sharding", "row_wise",
                      "--checkpoint", checkpoint, timeout=180)
    assert first.returncode == 0, first.stdout + first.stderr
    out = first.stdout
    assert "2 ranks, gloo on cpu" in out and "item_ids_table: row_wise, fused kernel, ranks [0, 1]" in out
    assert re.search(r"loss \(mean over ranks\): [\d.]+ .* -> [\d.]+ .*: falling", out), out
    assert float(re.search(r"held-out AUC: ([\d.]+)", out).group(1)) > 0.6, out
    assert float(re.search(r"throughput: ([\d,]+) tokens/s over 2 ranks", out).group(1).replace(",", "")) > 0
    assert "train (rank 0 of 2)" in first.stderr  # the progress bar (tqdm writes to stderr)
    second = _torchrun("-m", "blockattn_layers", "demo", "--distributed", "--config", config, "--sharding", "row_wise",
                       "--resume", checkpoint, "--steps", "4", timeout=180)
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"resumed from {checkpoint} after step 20" in second.stdout
