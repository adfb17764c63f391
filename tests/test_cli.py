"""``python -m blockattn_layers {demo,info,bench}`` and the demo's pieces (pooling, AUC, no-torchrec path)."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch

from blockattn_layers.cli.demo_config import DataConfig, load_demo_config
from blockattn_layers.cli.demo_data import FEATURES, SyntheticClicks
from blockattn_layers.cli.demo_model import build_click_model, mean_pool
from blockattn_layers.cli.demo_train import roc_auc
from blockattn_layers.modules import JaggedTransformerEncoderLayer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY_DEMO = """\
data: {max_history: 64, batch_size: 64, eval_users: 512}
encoder:
  num_layers: 1
  layer: {d_model: 16, nhead: 1, dim_feedforward: 32, dropout: 0.0, block_size: 64, rope_theta: 10000.0}
train: {steps: 40, lr: 1.0e-2}
"""


def _run(*args: str, timeout: float = 120) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "blockattn_layers", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _tiny_config(tmp_path) -> str:
    path = tmp_path / "demo.yaml"
    path.write_text(TINY_DEMO)
    return str(path)


def test_demo_trains_and_reports(tmp_path):
    out = _run("demo", "--config", _tiny_config(tmp_path), "--steps", "30", "--device", "cpu")
    first, last = map(float, re.search(r"loss: ([\d.]+) .* -> ([\d.]+) .*: falling", out).groups())
    assert last < first - 0.05, out
    assert float(re.search(r"held-out AUC: ([\d.]+)", out).group(1)) > 0.7, out
    assert float(re.search(r"throughput: ([\d,]+) tokens/s", out).group(1).replace(",", "")) > 0
    assert "backend used: reference" in out and "speedup vs reference" in out
    assert "30 steps of 64 users" in out
    if _has("torchrec"):
        assert "KeyedJaggedTensor -> torchrec EmbeddingCollection" in out


@pytest.mark.gpu
def test_demo_on_gpu_uses_the_kernels_and_reports_a_speedup():
    out = _run("demo", "--steps", "30", "--device", "cuda", timeout=600)
    assert "backend used: triton" in out, out
    assert float(re.search(r"speedup vs reference: ([\d.]+)x", out).group(1)) > 0


def test_demo_runs_without_torchrec(tmp_path):
    # As on a GPU machine without torchrec: the import fails, the demo falls back to nn.Embedding.
    code = "import sys; sys.modules['torchrec'] = None; from blockattn_layers.cli import main; sys.exit(main())"
    result = subprocess.run(
        [sys.executable, "-c", code, "demo", "--config", _tiny_config(tmp_path), "--steps", "5", "--device", "cpu"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "torchrec unavailable" in result.stdout and "nn.Embedding" in result.stdout
    assert "held-out AUC" in result.stdout


def test_distributed_demo_without_torchrec_says_so(tmp_path):
    code = "import sys; sys.modules['torchrec'] = None; from blockattn_layers.cli import main; sys.exit(main())"
    result = subprocess.run(
        [sys.executable, "-c", code, "demo", "--distributed", "--config", _tiny_config(tmp_path), "--steps", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode != 0 and "demo --distributed needs torchrec" in result.stderr
    assert "Traceback" not in result.stderr


def test_commands_that_need_a_launcher_or_a_gpu_say_how_to_run_them():
    """demo --distributed outside torchrun, and verify-arch on a CPU without Triton's interpreter:
    one line that says what to do, no traceback."""
    from blockattn_layers.cli.main import parser

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "TRITON_INTERPRET")}
    result = subprocess.run([sys.executable, "-m", "blockattn_layers", "demo", "--distributed", "--steps", "1"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode != 0 and "start it with torchrun" in result.stderr and "Traceback" not in result.stderr
    if not torch.cuda.is_available():
        result = subprocess.run([sys.executable, "-m", "blockattn_layers", "verify-arch", "--quick", "--no-bench"],
                                cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
        assert result.returncode == 2 and "run it with TRITON_INTERPRET=1" in result.stderr
        assert "Traceback" not in result.stderr
    assert "verify-arch: check" in parser().description


@pytest.mark.parametrize("args,message", [
    (["--backend", "nope"], "backend must be one of"),
    (["--config", "no/such/demo.yaml"], "No such file"),
    (["--sharding", "row_wise"], "need --distributed"),
    (["--checkpoint", "ckpt"], "need --distributed"),
], ids=["unknown-backend", "missing-config", "sharding-alone", "checkpoint-alone"])
def test_demo_bad_arguments_exit_with_a_message(args, message):
    result = subprocess.run(
        [sys.executable, "-m", "blockattn_layers", "demo", "--device", "cpu", "--steps", "1", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode != 0 and message in result.stderr and "Traceback" not in result.stderr


def test_info_reports_versions_and_auto_choices():
    out = _run("info")
    assert f"torch {torch.__version__}" in out and "triton" in out and "python" in out
    assert "CPU, fp32" in out and "auto -> reference" in out
    assert "GPU training, bf16" in out
    if not torch.cuda.is_available():
        assert "hypothetical: not this machine" in out and "sm_90" in out
        assert re.search(r"GPU training, bf16.*\n\s+auto -> triton", out), out
        assert re.search(r"GPU inference, fp8 e4m3.*\n\s+auto -> fp8 kernels", out), out
        assert re.search(r"GPU, fp8 e4m3, large blocks.*\n\s+auto -> fp8 inputs descaled to bfloat16.*"
                         r"\n\s+auto -> triton_flash", out), out
    assert re.search(r"GPU, float64.*\n\s+auto -> reference", out), out


def test_hypothetical_choices_keep_every_rule_but_the_machines():
    """Judging an sm_90 call on a machine without one: "CUDA is not available" is left out, the
    backends' own rules stay (triton_flash refuses 64-token blocks by name too)."""
    from blockattn_layers.cli.backend_choice import auto_choice
    from blockattn_layers.dispatch import AttentionRequest

    req = AttentionRequest(device_type="cuda", capability=(9, 0), dtype=torch.bfloat16, head_dim=64, num_heads=4,
                           num_kv_heads=4, block_size=64, causal=False, rotary=False)
    choice, reasons = auto_choice(req, hypothetical=True)
    assert choice == "triton" and not any("CUDA is not available" in r for why in reasons.values() for r in why)
    assert any("block_size 64 <= 128" in r for r in reasons["triton_flash"]), reasons


def test_bench_forwards_its_arguments(tmp_path):
    out = _run("bench", "--shapes", "tiny", "--backends", "reference", "--modes", "fwd", "--quick", "--device", "cpu",
               "--dtype", "fp32", "--quiet", "--plot", "--out", str(tmp_path))
    assert "tiny/block" in out and (tmp_path / "results.csv").is_file()
    assert (tmp_path / "results.png").is_file() or not _has("matplotlib")


def test_demo_config_overrides_and_cuda_section():
    base = load_demo_config()
    assert base.encoder.layer.block_size == 64 and base.encoder.layer.rope_theta is not None
    gpu = load_demo_config(cuda=True, steps=7, backend="reference", batch_size=None)
    assert gpu.train.steps == 7 and gpu.train.amp == "bf16" and gpu.data.batch_size > base.data.batch_size
    assert gpu.encoder.layer.backend == "reference"
    with pytest.raises(ValueError, match="unknown train settings"):
        load_demo_config(not_a_setting=1)


def test_mean_pool_matches_a_loop_and_handles_empty_sequences():
    lengths = torch.tensor([3, 0, 1, 5, 0])
    offsets = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
    values = torch.randn(int(lengths.sum()), 4)
    expected = torch.stack([
        values[s:e].mean(0) if e > s else torch.zeros(4) for s, e in zip(offsets[:-1].tolist(), offsets[1:].tolist())
    ])
    torch.testing.assert_close(mean_pool(values, offsets.int()), expected)


def test_roc_auc_counts_pairs_with_ties_as_half():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 5, (200,), generator=gen).float()
    labels = torch.randint(0, 2, (200,), generator=gen).float()
    pos, neg = scores[labels == 1], scores[labels == 0]
    diff = pos[:, None] - neg[None, :]
    expected = ((diff > 0).double() + 0.5 * (diff == 0).double()).mean().item()
    assert roc_auc(scores, labels) == pytest.approx(expected)
    assert roc_auc(torch.tensor([0.2, 0.9]), torch.tensor([0.0, 1.0])) == 1.0


def test_plain_embedding_path_matches_torchrec():
    pytest.importorskip("torchrec")
    cfg = DataConfig(max_history=70, batch_size=6)
    batch = SyntheticClicks(cfg, torch.device("cpu")).batch(6, torch.Generator().manual_seed(3))
    sizes = (cfg.num_items, cfg.num_categories)
    layer = JaggedTransformerEncoderLayer(8, 2, 16, dropout=0.0, block_size=64, rope_theta=10000.0)
    torchrec_model = build_click_model(FEATURES, sizes, layer, 8, 16, use_torchrec=True)
    plain_model = build_click_model(FEATURES, sizes, layer, 8, 16, use_torchrec=False)
    tables = torchrec_model.sequence_encoder.embedding_collection.embeddings
    for feature in FEATURES:
        plain_model.sequence_encoder.embeddings[feature].weight.data.copy_(tables[f"{feature}_table"].weight)
    plain_model.sequence_encoder.encoder.load_state_dict(torchrec_model.sequence_encoder.encoder.state_dict())
    plain_model.head.load_state_dict(torchrec_model.head.state_dict())
    expected = torchrec_model(batch.to_kjt())
    torch.testing.assert_close(plain_model((batch.ids, batch.lengths)), expected)
    assert expected.shape == (6,)
