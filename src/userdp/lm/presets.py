"""Model shapes built from a config (no torch import: the CLI lists them in its help)."""

# Small GPT-2-style presets sized for CPUs. The vocabulary and context come from the tokenizer
# and the run's sequence length.
PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"n_layer": 2, "n_embd": 128, "n_head": 4},
    "small": {"n_layer": 4, "n_embd": 256, "n_head": 4},
    "base": {"n_layer": 6, "n_embd": 384, "n_head": 6},
    # GPT-2's published shapes (Radford et al. 2019): 124M / 355M / 774M parameters with GPT-2's
    # 50,257-token vocabulary and 1,024 positions; here the vocabulary and context are the run's.
    "gpt2-small": {"n_layer": 12, "n_embd": 768, "n_head": 12},
    "gpt2-medium": {"n_layer": 24, "n_embd": 1024, "n_head": 16},
    "gpt2-large": {"n_layer": 36, "n_embd": 1280, "n_head": 20},
}
