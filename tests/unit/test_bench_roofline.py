"""The roofline estimate of a batched workload (``bench.common.roofline``), on
a model shape small enough to count by hand."""

from __future__ import annotations

import pytest

from bench.common.roofline import ModelCost, machine_matmul_rate, model_cost, throughput_roofline

# hidden 4, MLP 8, 2 layers, 2 query heads and 1 KV head of dim 2, vocab 10
MODEL = {"hidden_size": 4, "intermediate_size": 8, "num_layers": 2, "num_attention_heads": 2, "num_kv_heads": 1,
         "head_dim": 2, "vocab_size": 10}


def test_model_cost_counts_each_projection_and_the_kv_row():
    cost = model_cost(MODEL, "float32", weight_bytes=500)
    # a layer: q 4x4 + k, v 4x2 each + o 4x4 + gate, up, down 4x8 each = 144 multiply-adds
    assert cost == ModelCost(body_flops=2 * 2 * 144, head_flops=2 * 10 * 4, weight_bytes=500,
                             kv_bytes=2 * 2 * 2 * 4, attention_flops=2 * 2 * 2 * 4)
    assert model_cost(MODEL, "bfloat16", weight_bytes=250).kv_bytes == 2 * 2 * 2 * 2


def test_throughput_roofline_by_hand():
    cost = model_cost(MODEL, "float32", weight_bytes=500)
    # 1000 FLOP/s and 1000 B/s: seconds are thousandths of the counts
    est = throughput_roofline(cost, [3, 1], [3, 1], matmul_gflops=1e-6, read_gb_per_s=1e-6)
    # prefill: 4 prompt tokens x 576 + 2 sampled rows x 80 + (6 + 1) causal pairs x 32 = 2688 FLOPs
    assert est["prefill_seconds"] == pytest.approx(2.688)
    # decode steps 1 and 2 run the 3-token request alone (the other's budget is its first token):
    # 576 + 80 FLOPs (more than the 500 weight bytes' time), then 4 and 5 positions of 32 bytes
    assert est["decode_steps"] == 2
    assert est["decode_seconds"] == pytest.approx(2 * 0.656 + 0.128 + 0.160)
    assert est["kv_read_seconds"] == pytest.approx(0.288)
    assert est["seconds"] == pytest.approx(est["prefill_seconds"] + est["decode_seconds"])


def test_a_step_that_reads_more_than_it_computes_takes_the_read_time():
    cost = model_cost(MODEL, "float32", weight_bytes=3000)  # 3 s to read
    est = throughput_roofline(cost, [3], [2], matmul_gflops=1e-6, read_gb_per_s=1e-6)
    assert est["prefill_seconds"] == pytest.approx(3.0)  # against 2 s of arithmetic (3 x 576 + 80 + 6 x 32)
    assert est["decode_seconds"] == pytest.approx(3.0 + 4 * 32 / 1000)  # against 0.656 s


def test_lengths_must_pair_up():
    cost = model_cost(MODEL, "float32", weight_bytes=500)
    with pytest.raises(ValueError, match="2 prompt lengths against 1 token budgets"):
        throughput_roofline(cost, [3, 1], [3], matmul_gflops=1.0, read_gb_per_s=1.0)


def test_machine_matmul_rate_reports_a_rate():
    rate = machine_matmul_rate("float32", size=64, repeats=3)
    assert rate["dtype"] == "float32" and rate["repeats"] == 3
    assert 0 < rate["gflop_per_s"] <= rate["best_gflop_per_s"]
