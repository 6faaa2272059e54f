"""Causal language models the DP engine can train: presets, local checkpoints, LoRA, the loss.

Everything here is local: a preset is built from a ``GPT2Config`` (random weights, then
pretrained by ``userdp pretrain`` on public text) and any other model comes from a local
directory through ``AutoModelForCausalLM.from_pretrained(path, local_files_only=True)``.
Nothing is fetched from a hub.

Two things make a Hugging Face causal LM usable with the engine's vmapped per-unit gradients
:

* attention is SDPA (fused kernels on a GPU); the vmap strategy switches to eager while it runs
  (fused attention has no vmap batching rule);
* the loss never passes an ``attention_mask`` through the model (transformers' masking code
  branches on the mask's values, which vmap cannot trace). Padding is on the right, so no real
  token attends to a later pad, and the loss ignores targets equal to ``-100``.

Dropout is switched off (``p = 0``): random masks under ``vmap`` would need a randomness mode
and would make each unit's gradient depend on the RNG state of the batch.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from torch import nn

from userdp.engine.model_lint import lint_model  # noqa: F401  (the LM jobs lint up front)
from userdp.errors import UserError
from userdp.lm.presets import PRESETS  # noqa: F401  (re-exported)

IGNORE_INDEX = -100


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _no_dropout(model: nn.Module) -> nn.Module:
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    cfg = getattr(model, "config", None)
    if cfg is not None:
        for key in (
            "resid_pdrop",
            "embd_pdrop",
            "attn_pdrop",
            "summary_first_dropout",
            "hidden_dropout_prob",
            "attention_probs_dropout_prob",
            "dropout",
            "attention_dropout",
            "hidden_dropout",
        ):
            if isinstance(getattr(cfg, key, None), float):
                setattr(cfg, key, 0.0)
    return model


def _prepare(model: nn.Module, attention: str = "sdpa") -> nn.Module:
    """Attention by SDPA (flash / memory-efficient kernels on a GPU, O(L) memory) — the ghost
    strategy hooks layers with parameters only, so fused attention is invisible to it; the vmap
    strategy switches a model to eager attention while it runs (``engine.per_unit.eager_attention``),
    since fused kernels have no vmap batching rule. No pad token id (see below)."""
    cfg = getattr(model, "config", None)
    if cfg is not None:
        # transformers' padding warning tests `pad_token_id in input_ids` (data-dependent control
        # flow that vmap refuses); padding is handled by the loss (-100 labels), so no pad id.
        if getattr(cfg, "pad_token_id", None) is not None:
            cfg.pad_token_id = None
        set_attention(model, attention)
    return model


def set_attention(model: nn.Module, impl: str) -> None:
    """Set a transformers model's attention implementation (``"sdpa"`` or ``"eager"``)."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return
    if hasattr(model, "set_attn_implementation"):
        try:
            model.set_attn_implementation(impl)
            return
        except Exception:  # noqa: BLE001 - older/other models: fall back to the attribute
            pass
    cfg._attn_implementation = impl


def build_preset(
    name: str,
    vocab_size: int,
    n_positions: int = 128,
    *,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    seed: int = 0,
) -> nn.Module:
    """A randomly initialised GPT-2-style model of the named size (a key of :data:`PRESETS`). Its
    config has no pad token: GPT-2's has none, and the loss masks padding by its labels."""
    from transformers import GPT2Config, GPT2LMHeadModel

    _quiet_transformers()
    if name not in PRESETS:
        raise UserError(f"model.preset: unknown preset {name!r} (choose one of {', '.join(PRESETS)})")
    if vocab_size < 2:
        raise UserError(f"model: vocabulary size must be at least 2, got {vocab_size}")
    cfg = GPT2Config(
        vocab_size=int(vocab_size),
        n_positions=int(n_positions),
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=None,
        **PRESETS[name],
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(cfg)
    return _prepare(_no_dropout(model))


QUANTIZATION_FILE = "userdp_quantization.json"  # beside a saved adapter whose base was quantized


def quantization_config(kind: str, device):
    """bitsandbytes' 4-bit configuration for a QLoRA-style frozen base: ``kind`` (nf4 or fp4),
    double quantization, matmuls computed in bf16 on a GPU that has it, float32 elsewhere.

    Raises:
        UserError: bitsandbytes is not installed."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise UserError(
            f"model.lora.quantize: {kind} needs the bitsandbytes package: pip install 'userdp[qlora]'"
        ) from None
    from transformers import BitsAndBytesConfig

    dev = torch.device(device or "cpu")
    compute = torch.bfloat16 if dev.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=kind, bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=compute
    )


def is_quantized(model: nn.Module) -> bool:
    """Whether any layer of ``model`` holds bitsandbytes 4-bit weights."""
    return any(type(m).__name__ == "Linear4bit" for m in model.modules())


def load_local(path: str | os.PathLike, *, quantize: str = "none", device=None) -> nn.Module:
    """Load a causal LM from a local directory (never the hub), eager attention, no dropout.

    A directory holding a LoRA adapter (``adapter_config.json``) is loaded onto its base model
    (which must also be local) and merged; an adapter trained on a quantized base (it has
    ``userdp_quantization.json``) is loaded onto the base quantized the same way, unmerged
    (merging into 4-bit weights would round the update away), so it is the model evaluated.

    Args:
        path: the directory.
        quantize: ``none``, or ``nf4``/``fp4``: load the base's linear layers in 4 bits
            (bitsandbytes), frozen, on ``device`` (a QLoRA-style base for LoRA adapters).
        device: where a quantized model is placed (quantization happens while loading).

    Raises:
        UserError: not a directory, no config, a damaged model, bitsandbytes missing, or a
            model with no layer bitsandbytes quantizes (GPT-2's Conv1D).
    """
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    p = resolve_model_path(path)
    if (p / "adapter_config.json").is_file() and not (p / "config.json").is_file():
        from peft import PeftModel

        base = json.loads((p / "adapter_config.json").read_text())["base_model_name_or_path"]
        qfile = p / QUANTIZATION_FILE
        if qfile.is_file():
            kind = json.loads(qfile.read_text())["quantize"]
            base_model = load_local(base, quantize=kind, device=device)
            return PeftModel.from_pretrained(base_model, str(p), local_files_only=True)
        base_model = load_local(base)
        model = PeftModel.from_pretrained(base_model, str(p), local_files_only=True)
        return _prepare(_no_dropout(model.merge_and_unload()))
    if not (p / "config.json").is_file():
        raise UserError(
            f"model.path: {path} holds no config.json (expected a model saved with "
            "save_pretrained, or a userdp run's model/ directory)"
        )
    kwargs = {}
    if quantize != "none":
        kwargs = {
            "quantization_config": quantization_config(quantize, device),
            "device_map": {"": str(device or "cpu")},
        }
    try:
        # the absolute path: a saved adapter names its base by it (base_model_name_or_path)
        model = AutoModelForCausalLM.from_pretrained(
            str(p.resolve()), local_files_only=True, attn_implementation="sdpa", **kwargs
        )
    except (OSError, ValueError, RuntimeError, KeyError, SafetensorError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise UserError(f"model.path: cannot load a causal LM from {path} (damaged or incomplete: {first})") from None
    if quantize != "none" and not is_quantized(model):
        raise UserError(
            f"model.lora.quantize: {quantize}: no layer of {path} was quantized (bitsandbytes "
            "quantizes nn.Linear; GPT-2's Conv1D layers are not): drop model.lora.quantize"
        )
    return _prepare(_no_dropout(model))


_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def resolve_model_path(path: str | Path) -> Path:
    """A local model folder: ``path`` itself, or — when ``path`` is a Hugging Face hub id such as
    ``gpt2`` or ``org/name`` and no such folder exists — its snapshot in the local Hugging Face
    cache (``HF_HUB_CACHE``), found without any network access. Nothing is ever downloaded.

    Raises:
        UserError: neither a folder nor a model already in the local cache (one line saying how to
            get it there)."""
    p = Path(path)
    if p.is_dir():
        return p
    if not p.exists() and _HUB_ID.match(str(path)):
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            return Path(snapshot_download(str(path), local_files_only=True))
        except (LocalEntryNotFoundError, OSError, ValueError):
            from huggingface_hub.constants import HF_HUB_CACHE

            raise UserError(
                f"model.path {path}: not a local directory, and not in the local Hugging Face cache "
                f"({HF_HUB_CACHE}); nothing is downloaded at run time: fetch it once where there is "
                f"internet (`huggingface-cli download {path}`) or give a directory"
            ) from None
    raise UserError(
        f"model.path: {path} is not a directory (models are loaded from local "
        "directories or the local Hugging Face cache only; nothing is downloaded)"
    )


@dataclass(frozen=True)
class LoraSpec:
    rank: int = 8
    alpha: float = 16.0
    target_modules: tuple[str, ...] | None = None  # None: the attention projections


def default_lora_targets(model: nn.Module) -> list[str]:
    """Attention projections of common causal LMs (GPT-2's fused ``c_attn``, Llama's ``q/v_proj``)."""
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    for candidates in (["c_attn"], ["q_proj", "v_proj"], ["query_key_value"], ["Wqkv"]):
        if all(c in names for c in candidates):
            return candidates
    raise UserError(
        "model.lora.target_modules: cannot guess the attention projections of this model; name them explicitly"
    )


def apply_lora(model: nn.Module, spec: LoraSpec) -> nn.Module:
    """Wrap ``model`` with LoRA adapters (peft); only the adapters are trainable. Their initialisation
    is drawn from :data:`LORA_INIT_SEED`, whatever the global generator's state."""
    from peft import LoraConfig, get_peft_model

    if spec.rank < 1:
        raise UserError(f"model.lora.rank must be >= 1, got {spec.rank}")
    targets = list(spec.target_modules) if spec.target_modules else default_lora_targets(model)
    present = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    missing = [t for t in targets if t not in present]
    if missing:
        raise UserError(
            f"model.lora.target_modules: {missing} not found in the model (modules include {sorted(present)[:12]})"
        )
    fan_in_fan_out = type(model).__name__.startswith("GPT2")  # GPT-2's Conv1D stores W transposed
    cfg = LoraConfig(
        r=int(spec.rank),
        lora_alpha=float(spec.alpha),
        target_modules=targets,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        fan_in_fan_out=fan_in_fan_out,
    )
    with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
        warnings.simplefilter("ignore")
        torch.manual_seed(LORA_INIT_SEED)  # the adapters' initialisation: public, the same in every run
        return get_peft_model(model, cfg)


#: the seed of the adapters' random initialisation (LoRA's A; B starts at zero): public randomness,
#: fixed, so that a run's adapters do not depend on what the process drew before (a pretrained model
#: built or read from the cache, the number of processes): seeded runs repeat, and every process of a
#: job starts from the same adapters
LORA_INIT_SEED = 0


def is_lora(model: nn.Module) -> bool:
    """Whether ``model`` is a peft LoRA model. A model can only be one once peft is imported: a run
    without LoRA never pays peft's import (~1.5 s with bitsandbytes, which compiles at import)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def merged(model: nn.Module) -> nn.Module:
    """The plain transformers model: LoRA adapters merged into the weights (a copy)."""

    if is_lora(model):
        return copy.deepcopy(model).merge_and_unload()
    return model


def num_trainable(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


# ---------------------------------------------------------------------------------------
# The loss (engine contract: loss_fn(model, batch) -> Tensor[n], vmappable)


def _positions(input_ids: torch.Tensor) -> torch.Tensor:
    """Position ids per record (``[n, L]``), not broadcast from ``[1, L]``: a position embedding
    fed a broadcast input would sum its gradient over the batch, and the ghost per-unit strategy
    could not tell the units' gradients apart."""
    return torch.arange(input_ids.shape[-1], device=input_ids.device).expand(input_ids.shape)


def causal_lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-record next-token cross-entropy, averaged over the record's target tokens.

    ``batch["input_ids"]`` is ``[n, L]`` (right-padded); ``batch["labels"]`` is ``[n, L]`` with
    ``-100`` where no loss is taken (padding, or a prompt). Labels are *not* shifted by the
    caller: position t predicts ``labels[t+1]`` as in Hugging Face. No attention mask is passed
    to the model (see the module docstring); position ids are given per record. A record with no
    target token has loss 0.
    Vmappable: no data-dependent Python control flow.
    """
    nll, valid = _token_nll(model, batch)
    return nll / valid.to(nll.dtype).sum(-1).clamp(min=1.0)


def token_nll(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed NLL and target-token count per record (for token-weighted evaluation), on the host."""
    nll, valid = _token_nll(model, batch)
    return nll.cpu(), valid.sum(-1).cpu()


def _token_nll(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per record: the summed next-token NLL (float32, on the model's device) and the target mask
    ``[n, L-1]``. The batch is moved to the model's device (batches are loaded on the host; a
    no-op on the CPU); position ids are per record."""
    dev = next(model.parameters()).device
    input_ids = batch["input_ids"].to(dev)
    labels = batch.get("labels", batch["input_ids"]).to(dev)
    logits = model(input_ids=input_ids, position_ids=_positions(input_ids)).logits[..., :-1, :]  # [n, L-1, V]
    targets = labels[..., 1:]
    valid = targets != IGNORE_INDEX
    safe_targets = torch.where(valid, targets, torch.zeros_like(targets))
    logp = F.log_softmax(logits.float(), dim=-1)
    nll = -torch.gather(logp, -1, safe_targets.unsqueeze(-1)).squeeze(-1) * valid.to(logp.dtype)
    return nll.sum(-1), valid


# ---------------------------------------------------------------------------------------
# Saving


#: a Hugging Face folder's tokenizer files (a hub download's layout): released as they are
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


def save_model(
    model: nn.Module,
    out_dir: str | os.PathLike,
    tokenizer=None,
    *,
    adapter: bool = False,
    quantize: str = "none",
    tokenizer_folder: str | os.PathLike | None = None,
) -> Path:
    """Save a model ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads (LoRA merged), or,
    with ``adapter=True`` and a LoRA model, the adapter only (peft format). A LoRA model on a
    quantized base (``quantize`` nf4/fp4) is always saved as its adapter, with a
    ``userdp_quantization.json`` that makes :func:`load_local` rebuild the same model.

    ``tokenizer_folder``: the folder the tokenizer came from (a model's own, ``model.path``): its
    tokenizer files are copied byte for byte, so the released model keeps its chat template,
    special tokens and tokenizer class; else ``tokenizer`` is saved as a fast tokenizer."""
    _quiet_transformers()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if quantize != "none" and is_lora(model):
        model.save_pretrained(str(out))
        (out / QUANTIZATION_FILE).write_text(
            json.dumps(
                {
                    "quantize": quantize,
                    "library": "bitsandbytes",
                    "note": "LoRA adapter trained on a 4-bit base; load with userdp (models.load_local), which "
                    "quantizes the base the same way; merging into 4-bit weights would round the update away",
                },
                indent=1,
            )
        )
    elif adapter and is_lora(model):
        model.save_pretrained(str(out))
    else:
        plain = merged(model)
        plain.save_pretrained(str(out), safe_serialization=True)
    files = [Path(tokenizer_folder) / f for f in TOKENIZER_FILES] if tokenizer_folder else []
    files = [f for f in files if f.is_file()]
    if files:
        for f in files:
            shutil.copyfile(f, out / f.name)
    elif tokenizer is not None:
        hf_tokenizer(tokenizer).save_pretrained(str(out))
    return out


def hf_tokenizer(tokenizer):
    """A transformers tokenizer for a ``tokenizers.Tokenizer`` (or pass one through)."""
    from tokenizers import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        from transformers import PreTrainedTokenizerFast

        specials = {}
        vocab = tokenizer.get_vocab()
        for key, cands in (
            ("eos_token", ["<|endoftext|>", "</s>", "<eos>"]),
            ("pad_token", ["<pad>", "<|pad|>"]),
            ("bos_token", ["<s>", "<bos>", "<|endoftext|>"]),
            ("unk_token", ["<unk>"]),
        ):
            for c in cands:
                if c in vocab:
                    specials[key] = c
                    break
        return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **specials)
    return tokenizer


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def trainable_names(model: nn.Module) -> Sequence[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]
