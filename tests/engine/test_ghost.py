"""The ghost per-unit strategy: its clipped sums equal the vmap strategy's, and its guards hold.

Equality is checked in float64 (to ~1e-12) so that a missing cross term or a misattributed token
shows, and once in float32 at float tolerance. Models: an MLP with LayerNorm, GPT-2 (Conv1D, tied
wte/lm_head, position embeddings, LayerNorm), GPT-2 with LoRA (peft), a Llama-style model (RMSNorm:
no handler, so the per-layer vjp fallback) — ULS with padded users, ELS, flat, per-layer, normalized
and adaptive clipping.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from userdp.engine import TrainConfig, contraction, train
from userdp.engine.algorithms import ELS, ULS, FedAvg
from userdp.engine.clipping import AdaptiveClip, FlatClip, PerLayerClip, StepClipping
from userdp.engine.ghost import GHOST_LAYERS, GROUP_ELEMENTS, GhostPerUnit
from userdp.engine.ghost import factors as ghost_factors
from userdp.engine.ghost import stacks as ghost_stacks
from userdp.engine.optimizers import SGD
from userdp.engine.per_unit import VmapPerUnit, make_per_unit, resolve_per_unit
from userdp.engine.performance import Performance
from userdp.engine.precision import Precision
from userdp.errors import UserError
from userdp.lm import models
from userdp.lm.models import causal_lm_loss

from _engine_helpers import MLP, ce_loss, mlp_data

F64 = torch.float64


def _both(model, loss, algo, batch, mask, weights, clip, acc=F64, precision=None):
    st = clip.initial_state()
    a = VmapPerUnit(model, loss, algo, precision).clipped_sum(batch, mask, weights, StepClipping(clip, st, acc))
    g = GhostPerUnit(model, loss, algo, precision)
    b = g.clipped_sum(batch, mask, weights, StepClipping(clip, st, acc))
    return a, b, g


def _assert_same(a, b, tol):
    sums_a, norms_a, losses_a, bad_a = a
    sums_b, norms_b, losses_b, bad_b = b
    scale = max(float(s.abs().max()) for s in sums_a)
    for x, y in zip(sums_a, sums_b, strict=True):
        assert x.dtype == y.dtype
        assert float((x - y).abs().max()) <= tol * max(scale, 1.0)
    assert torch.allclose(norms_a.to(F64), norms_b.to(F64), rtol=tol, atol=tol)
    assert torch.allclose(losses_a.to(F64), losses_b.to(F64), rtol=tol, atol=tol)
    assert torch.equal(bad_a, bad_b)


def _mlp_chunk(G=4, double=True):
    data = mlp_data([3, 1, 5, 2, 7], seed=1)
    batch, mask = data.draw_records(np.arange(5), G, np.random.default_rng(0))
    if double:
        batch = {k: (v.double() if v.is_floating_point() else v) for k, v in batch.items()}
    return batch, mask.to(F64 if double else torch.float32)


CLIPS = [
    FlatClip(0.3),
    PerLayerClip(0.3),
    FlatClip(0.3, normalized=True),
    AdaptiveClip(initial_norm=0.2),
    FlatClip(1e9),
]


@pytest.mark.parametrize("clip", CLIPS, ids=lambda c: type(c).__name__ + ("N" if c.normalized else ""))
def test_ghost_equals_vmap_on_an_mlp_with_padded_users_and_a_padding_unit(clip):
    torch.manual_seed(0)
    model = MLP().double()
    batch, mask = _mlp_chunk()
    mask[4] = 0.0  # a padding unit (bucket rounding): weight 0, mask all zero
    w = torch.tensor([1.0, 1.0, 2.0, 0.5, 0.0], dtype=F64)
    a, b, _ = _both(model, ce_loss, ULS(4, 0.5), batch, mask, w, clip)
    _assert_same(a, b, 1e-12)
    assert float(b[1][4]) == 0.0  # the padding unit has no gradient at all


def test_ghost_equals_vmap_for_els_records():
    torch.manual_seed(0)
    model = MLP().double()
    data = mlp_data([3, 1, 5], seed=2)
    batch = data.gather(np.array([0, 0, 1, 2, 2, 2]), np.array([0, 2, 0, 1, 3, 4]))
    batch = {k: (v.double() if v.is_floating_point() else v).unsqueeze(1) for k, v in batch.items()}
    mask = torch.ones(6, 1, dtype=F64)
    a, b, _ = _both(model, ce_loss, ELS(2, 0.5), batch, mask, torch.ones(6, dtype=F64), FlatClip(0.2))
    _assert_same(a, b, 1e-12)


def _gpt2(lora=False, vocab=50, seed=0):
    torch.manual_seed(seed)
    m = models.build_preset("tiny", vocab_size=vocab, n_positions=32)
    if lora:
        m = models.apply_lora(m, models.LoraSpec(rank=4))
    return m


def _lm_chunk(m=3, G=2, L=12, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (m, G, L), generator=g)
    labels = ids.clone()
    labels[0, -1, 6:] = -100  # a short record (right padding)
    mask = torch.ones(m, G, dtype=F64)
    if G > 1:
        mask[1, 1] = 0.0  # a user with fewer than G records
    return {"input_ids": ids, "labels": labels}, mask


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("clip", [FlatClip(0.5), PerLayerClip(0.5)], ids=["flat", "per_layer"])
def test_ghost_equals_vmap_on_gpt2_uls(lora, clip):
    model = _gpt2(lora).double()
    batch, mask = _lm_chunk()
    a, b, g = _both(model, causal_lm_loss, ULS(2, 0.5), batch, mask, torch.ones(3, dtype=F64), clip)
    _assert_same(a, b, 1e-10)
    assert set(g.last_choice.values()) <= {"ghost", "materialized", "mixed"}
    assert g.fallback_layers == []  # GPT-2 is covered by the registry (Conv1D, Embedding, LayerNorm, Linear)
    if not lora:  # wte is used twice (embedding and the tied lm_head): cross terms are needed
        assert model.transformer.wte.weight is model.lm_head.weight


def test_ghost_equals_vmap_on_gpt2_els():
    model = _gpt2().double()
    batch, _ = _lm_chunk(m=5, G=1, seed=3)
    mask = torch.ones(5, 1, dtype=F64)
    a, b, _ = _both(model, causal_lm_loss, ELS(1, 0.5), batch, mask, torch.ones(5, dtype=F64), FlatClip(0.5))
    _assert_same(a, b, 1e-10)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=40,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
            attn_implementation="eager",
        )
    )


def _neox():  # Pythia: fused query_key_value, partial rotary, parallel residual, untied embed_in/embed_out
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    return GPTNeoXForCausalLM(
        GPTNeoXConfig(
            vocab_size=40,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            rotary_pct=0.25,
            max_position_embeddings=32,
            use_parallel_residual=True,
            tie_word_embeddings=False,
            attn_implementation="eager",
        )
    )


def _qwen2():  # Llama's layout with biases on q/k/v, tied embeddings
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=40,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
            tie_word_embeddings=True,
            attn_implementation="eager",
        )
    )


@pytest.mark.parametrize(
    "build, seed, fallback",
    [
        (_llama, 4, ["LlamaRMSNorm"]),  # grouped-query attention, RoPE: no handler needed; RMSNorm via the vjp
        (_neox, 6, []),  # every parameter sits in a layer with a ghost handler
        (_qwen2, 7, ["Qwen2RMSNorm"]),
    ],
    ids=["llama", "pythia_gpt_neox", "qwen2"],
)
def test_ghost_equals_vmap_on_other_causal_lm_families(build, seed, fallback):
    torch.manual_seed(0)
    model = build().double()
    assert model.config._attn_implementation == "eager"
    batch, mask = _lm_chunk(vocab=40, seed=seed)
    a, b, g = _both(model, causal_lm_loss, ULS(2, 0.5), batch, mask, torch.ones(3, dtype=F64), FlatClip(0.5))
    _assert_same(a, b, 1e-10)
    assert g.fallback_layers == fallback


@pytest.mark.extras
def test_ghost_on_lora_over_a_4bit_quantized_base_equals_a_per_unit_loop(tmp_path):
    """QLoRA-style: a Llama whose linear layers bitsandbytes holds in 4 bits (NF4, frozen), LoRA
    adapters trained. vmap cannot run bitsandbytes' matmul, so the reference is a Python loop of
    one autograd pass per unit: its clipped sum and norms must equal the ghost strategy's."""
    pytest.importorskip("bitsandbytes")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=40,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
        )
    ).save_pretrained(tmp_path)
    base = models.load_local(tmp_path, quantize="nf4", device="cpu")
    assert models.is_quantized(base)
    model = models.apply_lora(base, models.LoraSpec(4, 8.0, ("q_proj", "v_proj")))
    for n, p in model.named_parameters():
        if "lora_B" in n:
            nn.init.normal_(p, std=0.2)  # B starts at zero: give the units gradients in A
    batch, mask = _lm_chunk(vocab=40, seed=8)
    mask = mask.float()
    clip = FlatClip(0.05)
    g = GhostPerUnit(model, causal_lm_loss, ULS(2, 0.5), None)
    sums, norms, losses, bad = g.clipped_sum(
        batch, mask, torch.ones(3), StepClipping(clip, clip.initial_state(), torch.float32)
    )
    params = [p for p in model.parameters() if p.requires_grad]
    want = [torch.zeros_like(p) for p in params]
    want_norms = []
    for u in range(3):
        flat = {k: v[u] for k, v in batch.items()}
        unit_loss = (causal_lm_loss(model, flat) * mask[u]).sum() / mask[u].sum()
        grads = torch.autograd.grad(unit_loss, params)
        norm = torch.sqrt(sum((x.double() ** 2).sum() for x in grads))
        want_norms.append(float(norm))
        f = min(1.0, 0.05 / float(norm))
        for w, x in zip(want, grads, strict=True):
            w += f * x
    assert norms.dtype == torch.float32 and all(x.dtype == torch.float32 for x in sums)
    assert not bad.any() and bool(torch.isfinite(losses).all())
    torch.testing.assert_close(norms.double(), torch.tensor(want_norms, dtype=F64), rtol=1e-4, atol=1e-7)
    assert min(want_norms) > 0.05  # every unit was clipped: the factors matter
    for x, w in zip(sums, want, strict=True):
        torch.testing.assert_close(x, w, rtol=1e-4, atol=1e-6)


def test_ghost_in_float32_matches_at_float_tolerance():
    model = _gpt2()
    batch, mask = _lm_chunk(seed=5)
    a, b, _ = _both(
        model, causal_lm_loss, ULS(2, 0.5), batch, mask.float(), torch.ones(3), FlatClip(0.5), acc=torch.float32
    )
    _assert_same(a, b, 2e-4)


def test_both_ghost_norms_and_materialized_layer_gradients_are_used_and_agree():
    """Long units (T = G*L tokens) make T² exceed a small layer's size: that layer is materialized,
    the embedding stays a ghost — and the result is the same either way."""
    model = _gpt2().double()
    batch, mask = _lm_chunk(m=2, G=4, L=30, seed=6)  # T = G*L = 120 tokens per unit
    a, b, g = _both(model, causal_lm_loss, ULS(4, 0.5), batch, mask, torch.ones(2, dtype=F64), FlatClip(0.5))
    _assert_same(a, b, 1e-10)
    choices = g.last_choice
    assert choices["transformer.h.0.attn.c_proj.weight"] == "ghost"  # 120² <= 128·128
    assert choices["transformer.wte.weight"] == "materialized"  # 120² > 50·128 (both uses)
    assert choices["transformer.h.0.ln_1.weight"] == "materialized"  # a d-vector


class _Deep(nn.Module):
    """Three hidden Linears of one shape (a stacked group), with biases (a stacked vector group)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.hidden = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for lin in self.hidden:
            h = torch.tanh(lin(h))
        return self.out(h)


@pytest.mark.parametrize("build,clip", [(MLP, FlatClip(0.3)), (_Deep, PerLayerClip(0.3))], ids=["mlp", "stacked"])
def test_a_unit_with_a_nonfinite_gradient_contributes_zero(monkeypatch, build, clip):
    """A NaN in one unit's input makes every one of its factors non-finite: the unit is zeroed
    (masked_fill, not a multiply by 0) and the others' sums are as without it. In ``_Deep`` the
    unit sits inside stacked groups (the three hidden weights; the biases)."""

    monkeypatch.setattr(ghost_stacks, "STACK_FACTORS", "on")
    seen = []
    real = ghost_stacks.FactorStack.__init__

    def spy(self, members, factored):
        seen.append(len(members))
        real(self, members, factored)

    monkeypatch.setattr(ghost_stacks.FactorStack, "__init__", spy)
    torch.manual_seed(0)
    model = build().double()
    batch, mask = _mlp_chunk()
    batch["x"][2, 0, 0] = float("nan")
    w = torch.ones(5, dtype=F64)
    st = clip.initial_state()
    sums, norms, _, bad = GhostPerUnit(model, ce_loss, ULS(4, 0.5)).clipped_sum(
        batch, mask, w, StepClipping(clip, st, F64)
    )
    assert (3 in seen) == (build is _Deep)  # the three hidden weights were one stack
    assert bad.tolist() == [False, False, True, False, False] and float(norms[2]) == 0.0
    w_ok, mask_ok = w.clone(), mask.clone()
    w_ok[2] = mask_ok[2] = 0.0
    batch_ok = {k: v.clone() for k, v in batch.items()}
    batch_ok["x"][2] = 0.0
    ref, *_ = GhostPerUnit(model, ce_loss, ULS(4, 0.5)).clipped_sum(
        batch_ok, mask_ok, w_ok, StepClipping(clip, st, F64)
    )
    for s, r in zip(sums, ref, strict=True):
        assert torch.isfinite(s).all() and torch.allclose(s, r, atol=1e-12)


def test_each_units_clipped_contribution_is_within_the_bound():
    model = _gpt2()
    batch, mask = _lm_chunk(m=4, seed=7)
    mask = torch.ones(4, 2)
    clip = FlatClip(0.05)
    for u in range(4):
        w = torch.zeros(4)
        w[u] = 1.0
        sums, norms, *_ = GhostPerUnit(model, causal_lm_loss, ULS(2, 0.5)).clipped_sum(
            batch, mask, w, StepClipping(clip, clip.initial_state(), torch.float32)
        )
        total = torch.sqrt(sum((s.double() ** 2).sum() for s in sums))
        assert float(norms[u]) > 0.05  # clipping is active
        assert float(total) <= 0.05 * (1 + 1e-5)


class _Outside(nn.Module):
    """Uses its layer's weight in a functional call of the parent: no hook of the layer sees it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 3)

    def forward(self, x):
        return self.lin(x) + F.linear(x, self.lin.weight)


def test_a_parameter_used_outside_its_layer_is_refused():
    """Refused at the second chunk whose sums differ from autograd's: a missing use fails every chunk,
    while one unit whose records cancel can make a single chunk's float32 sums differ (it is checked
    again on the next chunk, test_a_unit_whose_records_cancel_does_not_refuse_the_model)."""
    model = _Outside().double()
    batch, mask = _mlp_chunk()
    st = GhostPerUnit(model, ce_loss, ULS(4, 0.5))
    args = (batch, mask, torch.ones(5, dtype=F64), StepClipping(FlatClip(1.0), {"clip_norm": 1.0}, F64))
    st.clipped_sum(*args)
    assert not st.coverage.verified
    with pytest.raises(UserError, match="lin.weight.*vmap"):
        st.clipped_sum(*args)


def test_a_unit_whose_records_cancel_does_not_refuse_the_model():
    """ULS units of records whose gradients are 3e4 and cancel, split across two ranks' chunks, made the
    first chunk's float32 sums differ from autograd's batch gradient by more than 1e-4 (summation order):
    an explicit per_unit=ghost run was refused (and `auto` fell back to vmap). The neighbour test of
    tests/guarantee/test_neighbour.py runs this over two gloo ranks; here the chunk alone, then a clean one."""
    from _neighbours import Reg, cancelling, honest, reg_loss

    from userdp.engine.neighbour import join

    torch.manual_seed(3)
    model = Reg(2)
    data = join(honest(g=4), cancelling(3e4))
    units = [6, 0, 2, 4]  # rank 0's half of the cohort, as the engine orders it (fewest records first)
    st = GhostPerUnit(model, reg_loss, ULS(4, 1.0))
    rows = [torch.arange(data.offsets[u], data.offsets[u + 1]) for u in units]
    g = max(len(r) for r in rows)
    mask = torch.zeros(len(units), g)
    idx = torch.zeros(len(units), g, dtype=torch.long)
    for i, r in enumerate(rows):
        mask[i, : len(r)] = 1
        idx[i, : len(r)] = r
    batch = {k: v[idx] for k, v in data.tensors.items()}
    st.clipped_sum(batch, mask, torch.ones(len(units)), StepClipping(FlatClip(1.0), {"clip_norm": 1.0}, torch.float32))
    assert st._mismatches == 1 and not st.coverage.verified  # this chunk's sums are off by more than the tolerance
    clean = {k: v[idx[1:]] for k, v in data.tensors.items()}  # the honest users alone
    st.clipped_sum(clean, mask[1:], torch.ones(3), StepClipping(FlatClip(1.0), {"clip_norm": 1.0}, torch.float32))
    assert st.coverage.verified  # the clean chunk verified the coverage: no refusal


class _Broadcast(nn.Module):
    def __init__(self):
        super().__init__()
        self.pos = nn.Embedding(8, 6)
        self.lin = nn.Linear(6, 3)

    def forward(self, x):
        return self.lin(x + self.pos(torch.zeros(1, dtype=torch.long)))


def test_an_input_broadcast_over_the_batch_is_refused():
    model = _Broadcast().double()
    batch, mask = _mlp_chunk()
    with pytest.raises(UserError, match="broadcast.*vmap"):
        GhostPerUnit(model, ce_loss, ULS(4, 0.5)).clipped_sum(
            batch, mask, torch.ones(5, dtype=F64), StepClipping(FlatClip(1.0), {"clip_norm": 1.0}, F64)
        )


def test_auto_picks_ghost_for_gradients_and_vmap_for_fedavg():
    model = MLP()
    assert resolve_per_unit("auto", ULS(4, 0.5)) == "ghost"
    assert resolve_per_unit("auto", ELS(2, 0.5)) == "ghost"
    assert resolve_per_unit("auto", FedAvg(4, 0.5)) == "vmap"
    assert make_per_unit("auto", model, ce_loss, FedAvg(4, 0.5)).name == "vmap"
    with pytest.raises(UserError, match="local_sgd.*vmap"):
        make_per_unit("ghost", model, ce_loss, FedAvg(4, 0.5))
    assert nn.Linear in GHOST_LAYERS and nn.Embedding in GHOST_LAYERS and nn.LayerNorm in GHOST_LAYERS


@pytest.mark.slow
def test_training_with_ghost_matches_training_with_vmap():
    data = mlp_data([3, 1, 5, 2, 7, 4, 6, 2], seed=3)
    out = {}
    for name in ("vmap", "ghost"):
        torch.manual_seed(0)
        model = MLP().double()
        cfg = TrainConfig(
            algorithm=ULS(4, 0.5),
            steps=6,
            clipping=FlatClip(0.5),
            optimizer=SGD(0.5),
            noise_multiplier=1.0,
            seed=11,
            performance=Performance(chunk_size=3, per_unit=name),
        )
        res = train(model, _double(data), ce_loss, cfg)
        out[name] = (torch.cat([p.detach().flatten() for p in model.parameters()]), res.epsilon)
    assert torch.allclose(out["vmap"][0], out["ghost"][0], atol=1e-10)
    assert out["vmap"][1] == out["ghost"][1]


def _double(data):
    from userdp.engine import TensorUserData

    return TensorUserData(
        {k: (v.double() if v.is_floating_point() else v) for k, v in data.tensors.items()}, data.offsets
    )


# ------------------------------------------------------------------------ precision


def test_bf16_autocast_keeps_norms_sums_and_losses_in_float32_and_agrees_with_float32():
    model = _gpt2()
    batch, mask = _lm_chunk(seed=8)
    mask = mask.float()
    clip = FlatClip(0.5)
    w = torch.ones(3)
    ref = GhostPerUnit(model, causal_lm_loss, ULS(2, 0.5)).clipped_sum(
        batch, mask, w, StepClipping(clip, clip.initial_state(), torch.float32)
    )
    for strategy in (GhostPerUnit, VmapPerUnit):
        sums, norms, losses, bad = strategy(model, causal_lm_loss, ULS(2, 0.5), Precision("bfloat16")).clipped_sum(
            batch, mask, w, StepClipping(clip, clip.initial_state(), torch.float32)
        )
        assert all(s.dtype == torch.float32 for s in sums)
        assert norms.dtype == torch.float32 and losses.dtype == torch.float32 and not bool(bad.any())
        # bf16 has 8 bits of mantissa: ~1% relative agreement on norms, sums a few %
        assert torch.allclose(norms, ref[1], rtol=3e-2)
        num = torch.sqrt(sum(((s - r) ** 2).sum() for s, r in zip(sums, ref[0], strict=True)))
        den = torch.sqrt(sum((r**2).sum() for r in ref[0]))
        assert float(num / den) < 5e-2
    assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights untouched


@pytest.mark.parametrize("lora,materialize", [(False, False), (True, False), (False, True)])
def test_bf16_factors_kept_narrow_give_bit_identical_norms_and_sums(monkeypatch, lora, materialize):
    """Under bf16 autocast the captured activations and output gradients stay bf16 and are upcast
    at each use; that must give exactly what upcasting them once at capture gives (float32 Grams,
    norms and sums from the same values), with the chunk's factors held at half the bytes. GPT-2
    covers Conv1D, the tied wte/lm_head (an embedding's index factor with a dense one: the cross
    terms) and LayerNorm; LoRA covers nn.Linear; ``materialize`` forces every use to be
    materialized (mixed ghost clipping's other branch) instead of kept as Gram matrices."""

    if materialize:
        monkeypatch.setattr(ghost_factors.Factored, "tokens", property(lambda self: 10**9))

    model = _gpt2()
    if lora:
        model = models.apply_lora(model, models.LoraSpec(rank=4, alpha=8.0))
    batch, mask = _lm_chunk(seed=8)
    mask = mask.float()
    w = torch.tensor([1.0, 0.5, 2.0])

    def run(keep, clip):
        monkeypatch.setattr(ghost_factors, "KEEP_NARROW", keep)
        g = GhostPerUnit(model, causal_lm_loss, ULS(2, 0.5), Precision("bfloat16"))
        out = g.clipped_sum(batch, mask, w, StepClipping(clip, clip.initial_state(), torch.float32))
        return out, g.last_choice

    for clip in (FlatClip(0.5), PerLayerClip(0.05)):
        (narrow, choice_n), (wide, choice_w) = run(True, clip), run(False, clip)
        assert choice_n == choice_w
        assert ("ghost" not in choice_n.values()) if materialize else ("ghost" in choice_n.values())
        for a, b in zip(narrow[0], wide[0], strict=True):
            assert a.dtype == torch.float32 and torch.equal(a, b)
        assert torch.equal(narrow[1], wide[1]) and torch.equal(narrow[2], wide[2])


def test_float16_autocast_is_refused_on_cpu():
    with pytest.raises(UserError, match="training.precision.*GPU"):
        Precision("float16").check_device(torch.device("cpu"))
    with pytest.raises(UserError, match="training.precision"):
        Precision("int8")
    assert Precision("float16").loss_scale == 1024.0 and Precision("bfloat16").loss_scale == 1.0


@pytest.mark.parametrize("build", [MLP, _Deep], ids=["mlp", "stacked"])
def test_the_cpu_zeroes_factors_only_when_a_unit_is_bad(monkeypatch, build):
    """Issue 42: zeroing the bad units copies every captured factor (a masked_fill each); on a CPU
    the strategy reads ``bad.any()`` (free there) and skips those copies when no unit is bad, with
    the same sums. With a NaN unit every factor is still zeroed."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.fills = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.fills += func.overloadpacket in (torch.ops.aten.masked_fill, torch.ops.aten.masked_fill_)
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(ghost_stacks, "STACK_FACTORS", "on")
    torch.manual_seed(0)
    model = build().double()
    w = torch.ones(5, dtype=F64)
    clip = FlatClip(0.3)
    out = {}
    for poison in (False, True):
        batch, mask = _mlp_chunk()
        if poison:
            batch["x"][2, 0, 0] = float("nan")
        strategy = GhostPerUnit(model, ce_loss, ULS(4, 0.5))
        strategy.clipped_sum(batch, mask, w, StepClipping(clip, clip.initial_state(), F64))  # the first chunk's check
        with Count() as count:
            sums, *_ = strategy.clipped_sum(batch, mask, w, StepClipping(clip, clip.initial_state(), F64))
        out[poison] = count.fills, sums
    assert out[False][0] == 0  # no unit bad: no masked copy
    assert out[True][0] >= 2  # a bad unit: its factors zeroed (x and y of each factored use at least)
    monkeypatch.setattr(contraction, "must_zero", lambda bad, lazy=False: True)  # the device's path: always zero
    batch, mask = _mlp_chunk()
    strategy = GhostPerUnit(model, ce_loss, ULS(4, 0.5))
    ref, *_ = strategy.clipped_sum(batch, mask, w, StepClipping(clip, clip.initial_state(), F64))
    assert all(torch.equal(a, b) for a, b in zip(out[False][1], ref, strict=True))


def test_auto_falls_back_to_vmap_for_a_parameter_no_layer_owns_in_its_forward():
    """The mean-estimation model's theta is used directly by the loss: no hook can see it, so ghost
    refuses it (even on a first chunk whose values are not finite) and auto uses vmap."""
    from _engine_helpers import Mean, sq_loss, user_data

    data = user_data([3, 2, 4], d=4)
    batch, mask = data.draw_records(np.arange(3), 3, np.random.default_rng(0))
    batch["x"][0, 0, 0] = float("inf")
    with pytest.raises(UserError, match="theta.*vmap"):
        GhostPerUnit(Mean(4), sq_loss, ULS(3, 0.5)).clipped_sum(
            batch, mask, torch.ones(3), StepClipping(FlatClip(1.0), {"clip_norm": 1.0}, torch.float32)
        )
    auto = make_per_unit("auto", Mean(4), sq_loss, ULS(3, 0.5))
    assert auto.name == "ghost"
    sums, norms, _, bad = auto.clipped_sum(
        batch, mask, torch.ones(3), StepClipping(FlatClip(1.0), {"clip_norm": 1.0}, torch.float32)
    )
    assert auto.name == "vmap" and "theta" in auto.fallback_reason
    assert bad.tolist() == [True, False, False] and float(norms[1]) > 0
    assert all(bool(torch.isfinite(x).all()) for x in sums)  # the inf unit contributes zero


def test_ghost_norms_and_sums_are_the_same_under_sdpa_as_under_eager_attention():
    """Issue 27 (6): models use SDPA (fused, O(L) memory on a GPU); the ghost strategy hooks only
    layers with parameters, so attention's kernel changes nothing it computes. The vmap strategy
    runs eager attention inside (fused kernels have no vmap batching rule) and restores SDPA."""
    from userdp.lm.models import set_attention

    model = _gpt2().double()
    assert model.config._attn_implementation == "sdpa"
    batch, mask = _lm_chunk(seed=3)
    w = torch.tensor([1.0, 0.5, 2.0], dtype=F64)
    clip = FlatClip(0.5)
    out = {}
    for impl in ("sdpa", "eager"):
        set_attention(model, impl)
        out[impl] = GhostPerUnit(model, causal_lm_loss, ULS(2, 0.5)).clipped_sum(
            batch, mask, w, StepClipping(clip, clip.initial_state(), F64)
        )
    _assert_same(out["sdpa"], out["eager"], 1e-12)
    set_attention(model, "sdpa")
    vm = VmapPerUnit(model, causal_lm_loss, ULS(2, 0.5)).clipped_sum(
        batch, mask, w, StepClipping(clip, clip.initial_state(), F64)
    )
    assert model.config._attn_implementation == "sdpa"  # restored after the vmap strategy ran eager
    _assert_same(vm, out["sdpa"], 1e-12)


# --------------------------------------------------------------------------- stacked groups (issue 27)
def _grouped_and_alone(monkeypatch, model, loss, algo, batch, mask, w, clip, acc, precision=None):
    """The strategy's output with same-shaped parameters stacked (the default) and one parameter at a
    time (``GROUP_ELEMENTS = 0``), and the group sizes each run formed."""

    sizes = {}
    real_f, real_v = ghost_stacks.factor_groups, ghost_stacks.vector_groups

    def spy(name, real):
        def f(*a):
            out = real(*a)
            sizes[name] = [len(g) for g in out]
            return out

        return f

    monkeypatch.setattr(ghost_stacks, "STACK_FACTORS", "on")  # the CPU keeps one layer at a time by default
    monkeypatch.setattr(ghost_stacks, "factor_groups", spy("factor", real_f))
    monkeypatch.setattr(ghost_stacks, "vector_groups", spy("vector", real_v))
    runs = []
    for elements in (GROUP_ELEMENTS, 0):
        monkeypatch.setattr(ghost_stacks, "GROUP_ELEMENTS", elements)
        sizes.clear()
        out = GhostPerUnit(model, loss, algo, precision).clipped_sum(
            batch, mask, w, StepClipping(clip, clip.initial_state(), acc)
        )
        runs.append((out, dict(sizes)))
    return runs


@pytest.mark.parametrize("clip", [FlatClip(0.5), PerLayerClip(0.05)], ids=["flat", "per_layer"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_stacked_groups_give_what_one_parameter_at_a_time_gives(monkeypatch, clip, lora):
    """GPT-2's same-shaped layers (its blocks' c_attn, c_fc, ...; the biases and LayerNorms; LoRA's
    A and B) are stacked so that their Grams and sums are one batched product per group: the norms
    and sums must be those of one parameter at a time (float64: to rounding)."""
    model = _gpt2(lora=lora).double()
    batch, mask = _lm_chunk(m=3, seed=11)
    w = torch.tensor([1.0, 0.5, 2.0], dtype=F64)
    (grouped, gs), (alone, ga) = _grouped_and_alone(
        monkeypatch, model, causal_lm_loss, ULS(2, 0.5), batch, mask, w, clip, F64
    )
    assert max(gs["vector"]) >= 2 and (lora or max(gs["factor"]) >= 2), gs  # groups really formed
    assert ga == {"vector": [], "factor": []}
    _assert_same(alone, grouped, 1e-12)


@pytest.mark.parametrize("operand", ["split", "rounded"])
def test_stacked_groups_on_tensor_cores_give_what_one_parameter_at_a_time_gives(monkeypatch, operand):
    """The bf16 tensor-core path (forced on the CPU: the same arithmetic, emulated) stacked: same
    norms (float32 Grams of the same bf16 products) and the same sums up to float32 summation order,
    and every unit's contribution still within C; with either clipped-sum operand (the rounded one's
    spreads come from a stack's terms split by member, or from each use's own)."""

    monkeypatch.setattr(contraction, "TENSOR_CORES", "on")
    monkeypatch.setattr(contraction, "SUM_OPERAND", operand)
    model = _gpt2()
    batch, mask = _lm_chunk(m=4, seed=12)
    mask = mask.float()
    for clip in (FlatClip(0.05), PerLayerClip(0.02)):
        (grouped, gs), (alone, _) = _grouped_and_alone(
            monkeypatch,
            model,
            causal_lm_loss,
            ULS(2, 0.5),
            batch,
            mask,
            torch.ones(4),
            clip,
            torch.float32,
            Precision("bfloat16"),
        )
        assert max(gs["factor"]) >= 2
        assert torch.allclose(grouped[1], alone[1], rtol=1e-5)
        for a, b in zip(grouped[0], alone[0], strict=True):
            assert a.dtype == torch.float32 and torch.allclose(a, b, rtol=1e-4, atol=1e-6)
        for u in range(4):  # one unit at a time: its whole clipped contribution within the bound
            w = torch.zeros(4)
            w[u] = 1.0
            g = GhostPerUnit(model, causal_lm_loss, ULS(2, 0.5), Precision("bfloat16"))
            sums, norms, *_ = g.clipped_sum(batch, mask, w, StepClipping(clip, clip.initial_state(), torch.float32))
            bound = clip.sensitivity(clip.initial_state(), len(sums))
            assert float(torch.sqrt(sum((s.double() ** 2).sum() for s in sums))) <= bound


def test_stacked_groups_are_split_to_bound_their_temporaries(monkeypatch):
    """A group never holds more than GROUP_ELEMENTS in its largest temporary: a smaller cap splits
    the groups (more, smaller stacks; a group of one is not stacked at all) and the result does not
    change. Tiny GPT-2's 128-vectors (LayerNorms, biases) take m·128 elements each."""

    model = _gpt2().double()
    batch, mask = _lm_chunk(m=3, seed=13)
    w = torch.ones(3, dtype=F64)
    clip = FlatClip(0.5)
    sizes = []
    real = ghost_stacks.vector_groups
    monkeypatch.setattr(ghost_stacks, "STACK_FACTORS", "on")
    monkeypatch.setattr(ghost_stacks, "vector_groups", lambda *a: sizes.append([len(g) for g in real(*a)]) or real(*a))
    outs = []
    for cap in (GROUP_ELEMENTS, 2 * 3 * 128, 1):  # unbounded here; two 128-vectors a group; none
        monkeypatch.setattr(ghost_stacks, "GROUP_ELEMENTS", cap)
        outs.append(
            GhostPerUnit(model, causal_lm_loss, ULS(2, 0.5)).clipped_sum(
                batch, mask, w, StepClipping(clip, clip.initial_state(), F64)
            )
        )
    big, two, none = sizes
    assert max(big) > 2 and max(two) == 2 and len(two) > len(big) and none == []
    _assert_same(outs[0], outs[1], 1e-12)
    _assert_same(outs[0], outs[2], 1e-12)


def test_the_cpu_keeps_one_layer_at_a_time_and_the_gpu_stand_in_stacks():
    """Stacking saves launches, which the CPU does not have (there it measured slower): by default
    only CUDA and the meta device stack factors."""

    assert ghost_stacks.STACK_FACTORS == "auto"
    assert not ghost_stacks.stack_factors(torch.device("cpu"))
    assert ghost_stacks.stack_factors(torch.device("meta")) and ghost_stacks.stack_factors(torch.device("cuda"))
