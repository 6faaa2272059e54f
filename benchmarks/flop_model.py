"""The FLOP model of a DP step on a GPU: what the ghost strategy's arithmetic costs against a
non-private step's, before and after the tensor-core contractions (issue 27). A prediction, not a
measurement: ``benchmarks/gpu_check.py`` measures. It prints the arithmetic, so docs/engine.md can
cite it and a reader can redo it.

    python benchmarks/flop_model.py                 # gpt2-small / gpt2-medium, 64 users x G = 4 x 64 tokens
    python benchmarks/flop_model.py --users 512     # the review's setting

Counted (multiply-adds x 2), per step of N = M * G * L tokens, with P the parameters in matmuls:

* non-private: forward 2PN, backward 4PN (input and weight gradients), all bf16 on tensor cores,
  plus attention (4 N L d per layer forward, twice that backward);
* ghost: forward 2PN and the backward to the layers' outputs 2PN (no weight gradients), bf16;
  the Gram matrices 2 m T^2 (X + Y) per captured layer kept as a ghost (T = G L tokens a unit,
  m = M units; X, Y the layer's widths); the clipped sum X^T (c Y), a weight gradient's worth,
  2PN;
  - before: Grams and sum in float32 SIMT (upcast copies);
  - after: Grams bf16 with float32 accumulation, the sum as hi + lo bf16 pieces (2 x 2PN);
  - rounded operand (``contraction.SUM_OPERAND = "rounded"``): the sum one bf16 GEMM on c*y rounded (2PN).

Rates (H100 SXM, dense): bf16 tensor cores 989 TFLOP/s and float32 SIMT 67 TFLOP/s peak, both
taken at ``--efficiency`` (0.55) of peak. Memory traffic, launches and the noise draw are not in
the model (the profiler rows of gpu_check.py show them).
"""

from __future__ import annotations

import argparse
import json

PRESETS = {
    "gpt2-small": dict(d=768, layers=12, ff=3072, vocab=50257),
    "gpt2-medium": dict(d=1024, layers=24, ff=4096, vocab=50257),
}


def model_flops(name: str, users: int, group: int, seq: int, bf16_tflops: float, fp32_tflops: float) -> dict:
    c = PRESETS[name]
    d, nl, ff, vocab = c["d"], c["layers"], c["ff"], c["vocab"]
    per_block = [(d, 3 * d), (d, d), (d, ff), (ff, d)]  # c_attn, attn c_proj, c_fc, mlp c_proj
    p_mm = nl * sum(x * y for x, y in per_block) + d * vocab  # the tied LM head is a matmul too
    t = group * seq  # tokens of one unit (ULS: a user's G records)
    n = users * t
    attn_fwd = 4 * n * seq * d * nl
    nonpriv = 6 * p_mm * n + 3 * attn_fwd
    fwd_bwd_inputs = 4 * p_mm * n + 3 * attn_fwd
    layers = per_block * nl + [(d, vocab)]
    # a use is kept as a ghost when its T x T Gram is no larger than its X x Y gradient (as the code does)
    grams = sum(2 * users * t * t * (x + y) for x, y in layers if t * t <= x * y)
    clipped_sum = 2 * p_mm * n
    r_bf16, r_fp32 = bf16_tflops * 1e12, fp32_tflops * 1e12
    t_np = nonpriv / r_bf16
    before = fwd_bwd_inputs / r_bf16 + (grams + clipped_sum) / r_fp32
    after = fwd_bwd_inputs / r_bf16 + (grams + 2 * clipped_sum) / r_bf16
    rounded = fwd_bwd_inputs / r_bf16 + (grams + clipped_sum) / r_bf16  # contraction.SUM_OPERAND = "rounded"
    return {
        "model": name,
        "users": users,
        "group_size": group,
        "seq_len": seq,
        "tokens": n,
        "matmul_params": p_mm,
        "nonprivate_tflop": nonpriv / 1e12,
        "ghost_fwd_bwd_tflop": fwd_bwd_inputs / 1e12,
        "grams_tflop": grams / 1e12,
        "clipped_sum_tflop": clipped_sum / 1e12,
        "nonprivate_s": t_np,
        "ghost_float32_simt_s": before,
        "ghost_tensor_cores_s": after,
        "ratio_before": before / t_np,
        "ratio_after": after / t_np,
        "ghost_rounded_operand_s": rounded,
        "ratio_rounded_operand": rounded / t_np,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="the FLOP model of a DP step on an H100")
    p.add_argument("--users", type=int, default=64)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--efficiency", type=float, default=0.55, help="fraction of peak both rates reach")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    rows = [model_flops(m, a.users, a.group_size, a.seq_len, 989 * a.efficiency, 67 * a.efficiency) for m in PRESETS]
    if a.json:
        print(json.dumps(rows))
        return 0
    for r in rows:
        print(
            f"{r['model']}: {r['users']} users x G = {r['group_size']} x {r['seq_len']} tokens = {r['tokens']:,} "
            f"tokens; matmul parameters {r['matmul_params'] / 1e6:.0f}M"
        )
        print(f"  non-private 6PN + attention = {r['nonprivate_tflop']:.1f} TFLOP -> {r['nonprivate_s'] * 1e3:.0f} ms")
        print(
            f"  ghost: forward + backward to outputs {r['ghost_fwd_bwd_tflop']:.1f} TFLOP (bf16), Grams "
            f"{r['grams_tflop']:.2f} TFLOP, clipped sum {r['clipped_sum_tflop']:.1f} TFLOP"
        )
        print(
            f"  before (Grams and sum in float32 SIMT): {r['ghost_float32_simt_s'] * 1e3:.0f} ms = "
            f"{r['ratio_before']:.2f}x non-private"
        )
        print(
            f"  after (bf16 Grams, sum as hi + lo bf16 GEMM): {r['ghost_tensor_cores_s'] * 1e3:.0f} ms = "
            f"{r['ratio_after']:.2f}x non-private"
        )
        print(
            f"  with the rounded operand (one bf16 GEMM on c*y rounded, its rounding in the bound): "
            f"{r['ghost_rounded_operand_s'] * 1e3:.0f} ms = {r['ratio_rounded_operand']:.2f}x non-private"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
