"""LM models: presets, the vmappable per-record loss, LoRA, the BatchNorm refusal, saving."""

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from userdp.errors import UserError
from userdp.lm import models


def _batch(n=3, L=12, V=50, pad_from=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (n, L), generator=g)
    labels = ids.clone()
    labels[:, pad_from:] = -100
    return {"input_ids": ids, "labels": labels}


def test_loss_is_per_record_token_average_ignoring_padding():
    m = models.build_preset("tiny", vocab_size=50, n_positions=16)
    b = _batch()
    per = models.causal_lm_loss(m, b)
    assert per.shape == (3,)
    # reference: HF's own shifted mean cross-entropy, one record at a time
    for i in range(3):
        ref = m(input_ids=b["input_ids"][i : i + 1], labels=b["labels"][i : i + 1]).loss
        torch.testing.assert_close(per[i], ref, rtol=1e-5, atol=1e-5)
    # padding content does not change the loss (causal attention, labels -100)
    b2 = {k: v.clone() for k, v in b.items()}
    b2["input_ids"][:, 9:] = 7
    torch.testing.assert_close(models.causal_lm_loss(m, b2), per)
    # a record with no target token has loss 0, not NaN
    b3 = {k: v.clone() for k, v in b.items()}
    b3["labels"][0, :] = -100
    assert models.causal_lm_loss(m, b3)[0].item() == 0.0


def test_vmapped_per_record_gradients_match_loop():
    from userdp.engine.per_unit import eager_attention

    m = models.build_preset("tiny", vocab_size=40, n_positions=16)
    assert m.config._attn_implementation == "sdpa"  # fused attention by default; vmap runs eager inside
    b = _batch(n=4, L=10, V=40, pad_from=7, seed=1)
    params = {k: v.detach() for k, v in m.named_parameters()}

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = m

        def forward(self, ids, lab):
            return models.causal_lm_loss(self.m, {"input_ids": ids[None], "labels": lab[None]})[0]

    w = Wrap()
    params = {"m." + k: v.detach() for k, v in m.named_parameters()}

    def one(p, ids, lab):
        return functional_call(w, p, (ids, lab))

    with eager_attention(m):
        g = vmap(grad(one), in_dims=(None, 0, 0))(params, b["input_ids"], b["labels"])
    key = "m.transformer.h.0.mlp.c_fc.weight"
    for i in (0, 3):
        m.zero_grad()
        models.causal_lm_loss(m, {k: v[i : i + 1] for k, v in b.items()})[0].backward()
        torch.testing.assert_close(g[key][i], m.transformer.h[0].mlp.c_fc.weight.grad, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(
            g["m.transformer.wte.weight"][i], m.transformer.wte.weight.grad, rtol=1e-4, atol=1e-6
        )


def test_lora_trains_only_adapters_and_merges(tmp_path):
    from transformers import AutoModelForCausalLM

    m = models.build_preset("tiny", vocab_size=30, n_positions=16)
    lm = models.apply_lora(m, models.LoraSpec(rank=2, alpha=4))
    trainable = models.trainable_names(lm)
    assert trainable and all("lora_" in n for n in trainable)
    with torch.no_grad():
        for n, p in lm.named_parameters():
            if "lora_B" in n:
                p.fill_(0.01)
    x = _batch(n=2, L=8, V=30)["input_ids"]
    want = lm(input_ids=x).logits
    models.save_model(lm, tmp_path / "m")
    re = AutoModelForCausalLM.from_pretrained(tmp_path / "m", local_files_only=True)
    torch.testing.assert_close(re(input_ids=x).logits, want, rtol=1e-4, atol=1e-5)
    # the adapter alone, on request
    models.save_model(lm, tmp_path / "a", adapter=True)
    assert (tmp_path / "a" / "adapter_config.json").is_file()


def test_lora_adapters_start_the_same_whatever_the_process_drew_before():
    """The adapters' initialisation comes from a fixed public seed: a run that built its pretrained
    model (drawing from the global generator) and one that read it from the cache, or rank 0 and
    rank 1 of a job, start from the same adapters; the global generator is left where it was."""

    def adapters(draws: int):
        torch.manual_seed(123)
        torch.rand(draws)  # what the process drew before (e.g. pretraining the base)
        m = models.build_preset("tiny", vocab_size=32, n_positions=16)
        torch.rand(draws)
        state = torch.get_rng_state()
        lm = models.apply_lora(m, models.LoraSpec(rank=2, alpha=4))
        assert torch.equal(torch.get_rng_state(), state)  # the caller's generator untouched
        return {n: p.detach().clone() for n, p in lm.named_parameters() if p.requires_grad}

    a, b = adapters(0), adapters(1000)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(float(v.abs().sum()) > 0 for k, v in a.items() if "lora_A" in k)  # A is random, not zeros


def test_lora_unknown_target_is_named():
    m = models.build_preset("tiny", vocab_size=30, n_positions=16)
    with pytest.raises(UserError, match="q_proj"):
        models.apply_lora(m, models.LoraSpec(rank=2, target_modules=("q_proj",)))


def test_batchnorm_in_training_mode_is_refused():
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    with pytest.raises(UserError, match="BatchNorm"):
        models.lint_model(net)
    net.eval()
    models.lint_model(net)  # frozen statistics are fine


def test_load_local_refuses_missing_dir_and_round_trips(tmp_path):
    with pytest.raises(UserError, match="not a directory"):
        models.load_local(tmp_path / "nope")
    m = models.build_preset("tiny", vocab_size=30, n_positions=16)
    models.save_model(m, tmp_path / "m")
    re = models.load_local(tmp_path / "m")
    assert re.config._attn_implementation == "sdpa"
    x = torch.randint(0, 30, (1, 6))
    torch.testing.assert_close(re(input_ids=x).logits, m(input_ids=x).logits)


def test_unknown_preset():
    with pytest.raises(UserError, match="preset"):
        models.build_preset("huge", vocab_size=30)


def test_a_hub_id_resolves_through_the_local_hugging_face_cache_and_never_downloads(tmp_path, monkeypatch):
    """Issue 28 (5): ``model.path: org/name`` finds the model in the local Hugging Face cache (as
    ``huggingface-cli download`` leaves it); a model not there is one clear line, no download."""
    import huggingface_hub.constants as hc

    from userdp.errors import UserError

    cache = tmp_path / "hub"
    snap = cache / "models--acme--tiny-gpt" / "snapshots" / ("a" * 40)
    m = models.build_preset("tiny", vocab_size=40, n_positions=16)
    m.save_pretrained(str(snap))
    (cache / "models--acme--tiny-gpt" / "refs").mkdir(parents=True)
    (cache / "models--acme--tiny-gpt" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert models.resolve_model_path("acme/tiny-gpt") == snap
    loaded = models.load_local("acme/tiny-gpt")
    for (n, a), (_, b) in zip(m.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    with pytest.raises(
        UserError, match="model.path acme/absent: not a local directory, and not in the local Hugging Face cache"
    ):
        models.resolve_model_path("acme/absent")
    with pytest.raises(UserError, match="not a directory"):
        models.resolve_model_path(str(tmp_path / "no" / "such" / "dir"))
