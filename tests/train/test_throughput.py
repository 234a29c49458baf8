"""Model FLOPs per token against hand counts, TFLOP/s and MFU arithmetic, peak memory on CPU."""

from __future__ import annotations

import pytest
import torch

from megatron_lowprec.megatron.cpu import cpu_bridge
from megatron_lowprec.train import throughput
from megatron_lowprec.train.config import ModelConfig


def test_gpt_1_3b_flops_match_a_hand_count_and_palm():
    """GPT-1.3B (24 layers, hidden 2048, 16 heads, seq 2048, vocab 50304), forward per token, layer by
    layer: QKV 2*2048*6144 = 25,165,824; scores and scores x values 2 * 2*2048*2048 = 16,777,216;
    output projection 2*2048*2048 = 8,388,608; MLP 2 * 2*2048*8192 = 67,108,864; so 117,440,512 per
    layer, 2,818,572,288 for 24; LM head 2*2048*50304 = 206,045,184. Training: 3 x 3,024,617,472."""
    model = ModelConfig(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048)
    flops = throughput.training_flops_per_token(model, vocab_size=50304)
    assert flops == 3 * 3_024_617_472 == 9_073_852_416
    # PaLM App. B: 6 N + 12 L H Q T, N the matmul parameters (12 h^2 per layer and the LM head).
    matmul_parameters = 24 * 12 * 2048**2 + 2048 * 50304
    assert flops == 6 * matmul_parameters + 12 * 24 * 16 * 128 * 2048


def test_grouped_query_attention_and_gated_mlp_flops():
    """2 layers, hidden 64, 4 heads of 16 in 2 groups, SwiGLU of width 128, seq 32, vocab 256:
    QKV 2*64*(4+2*2)*16 = 16,384; attention 2 * 2*32*64 = 8,192; output 2*64*64 = 8,192;
    MLP 3 * 2*64*128 = 49,152; 81,920 per layer; LM head 2*64*256 = 32,768."""
    model = ModelConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
        seq_length=32, activation="swiglu",
    )
    assert throughput.training_flops_per_token(model, vocab_size=256) == 3 * (2 * 81_920 + 32_768)


def test_tflops_per_gpu_and_mfu():
    result = throughput.throughput(9.0e9, tokens_per_second=40_000, world_size=2, peak=989.4e12)
    assert result["tflops_per_gpu"] == pytest.approx(180.0)
    assert result["mfu"] == pytest.approx(180.0e12 / 989.4e12)
    assert "mfu" not in throughput.throughput(9.0e9, 40_000, 1, peak=None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU reports the resident set size")
def test_cpu_reports_no_peak_flops_and_its_resident_set_size():
    assert throughput.peak_bf16_flops() is None
    with cpu_bridge():
        ballast = torch.ones(64 * 2**20, dtype=torch.uint8)
        memory = throughput.peak_memory()
    assert set(memory) == {"peak_rss_gib"}
    assert memory["peak_rss_gib"] >= ballast.numel() / throughput.GIB
