"""Non-private pretraining on text declared public (the paper's recipe: public pretraining,
then private fine-tuning). Produces a local directory that ``userdp train`` accepts as
``model.path`` and that ``AutoModelForCausalLM.from_pretrained`` loads, with its tokenizer.

The text is tokenized, joined with an end-of-text token and cut into blocks of ``seq_len``
tokens (standard LM packing); AdamW with linear warm-up and cosine decay. This touches only
the public text: nothing here is accounted, and nothing here may see private records.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from userdp.caches import fingerprint
from userdp.errors import UserError
from userdp.fileio import write_atomic, write_json
from userdp.lm import models
from userdp.lm.tokenization import encode_texts, special_ids
from userdp.progress import LOOP_LINES
from userdp.progress import bar as progress_bar


def pack(token_lists: Iterable[Sequence[int]], seq_len: int, eos_id: int | None) -> torch.Tensor:
    """Concatenate documents (separated by ``eos_id``) and cut into ``[n, seq_len]`` blocks."""
    flat: list[int] = []
    for ids in token_lists:
        flat.extend(ids)
        if eos_id is not None:
            flat.append(eos_id)
    n = len(flat) // seq_len
    if n < 1:
        raise UserError(f"pretrain: the public text holds {len(flat)} tokens, fewer than one block of {seq_len}")
    return torch.tensor(flat[: n * seq_len], dtype=torch.long).view(n, seq_len)


@dataclass(frozen=True)
class PretrainSpec:
    """What public pretraining builds and how it trains: the preset built (or ``base_model``, a local
    model folder, loaded), blocks of ``seq_len`` tokens, ``steps`` steps of AdamW on batches of
    ``batch_size`` blocks (learning rate ``lr``, linear warm-up over ``warmup`` steps, cosine decay,
    ``weight_decay``), batches drawn from ``seed``."""

    preset: str = "tiny"
    seq_len: int = 64
    steps: int = 600
    batch_size: int = 32
    lr: float = 3e-3
    warmup: int = 30
    seed: int = 0
    weight_decay: float = 0.01
    base_model: str | None = None


@dataclass(frozen=True)
class Reporting:
    """How a training reports and checkpoints: a progress bar (``progress``, titled ``desc``),
    ``log(step, loss)`` after each step, ``say(line)`` lines of progress (where it resumed, how long
    it will take), and at ``state_path`` a checkpoint every ``every`` steps."""

    progress: bool = True
    desc: str = "pretrain"
    log: Callable | None = None
    say: Callable | None = None
    every: int = 50
    state_path: Path | None = None


def train_lm(
    model: torch.nn.Module, blocks: torch.Tensor, spec: PretrainSpec, report: Reporting = Reporting()
) -> list[float]:
    """Plain (non-private) LM training on packed blocks, as ``spec`` says; returns the loss per step.

    ``report.state_path``: a checkpoint of this training (model, optimizer, batch generator, step),
    written atomically every ``report.every`` steps and removed at the end; a run that finds one
    made with the same settings continues from it (bit for bit what an uninterrupted run computes)."""
    steps, batch_size, lr, warmup, seed = spec.steps, spec.batch_size, spec.lr, spec.warmup, spec.seed
    weight_decay, state_path, every, say, log = (
        spec.weight_decay,
        report.state_path,
        report.every,
        report.say,
        report.log,
    )
    if steps < 1:
        raise UserError(f"pretrain: steps must be >= 1, got {steps}")
    gen = torch.Generator().manual_seed(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))
    setting = fingerprint(
        steps,
        batch_size,
        lr,
        warmup,
        seed,
        weight_decay,
        tuple(blocks.shape),
        int(blocks.sum()),
        sum(p.numel() for p in params),
    )
    start, losses = 0, []
    if state_path is not None and Path(state_path).is_file():
        try:
            st = torch.load(state_path, map_location="cpu", weights_only=True)
            assert st["setting"] == setting
            model.load_state_dict(st["model"])
            opt.load_state_dict(st["optimizer"])
            gen.set_state(st["generator"])
            start, losses = int(st["step"]), [float(x) for x in st["losses"]]
            if say is not None:
                say(f"pretraining: continuing from step {start} of {steps} ({state_path})")
        except Exception:  # noqa: BLE001 - another setting, or a damaged file: start over (public data only)
            start, losses = 0, []
            gen = torch.Generator().manual_seed(seed)

    def save(step: int) -> None:
        state = {
            "setting": setting,
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "generator": gen.get_state(),
            "step": step,
            "losses": losses,
        }
        write_atomic(state_path, lambda p: torch.save(state, p))

    def lr_at(step: int) -> float:
        if warmup and step < warmup:
            return lr * (step + 1) / warmup
        frac = (step - warmup) / max(1, steps - warmup)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))

    model.train()
    bar = None
    if report.progress:
        bar = progress_bar(steps, report.desc, "step", initial=start, lines=LOOP_LINES)
    t0 = time.time()
    for step in range(start, steps):
        idx = torch.randint(0, blocks.shape[0], (min(batch_size, blocks.shape[0]),), generator=gen)
        x = blocks[idx].to(params[0].device)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        loss = models.causal_lm_loss(model, {"input_ids": x, "labels": x}).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if bar is not None:
            bar.update(1)
            tok_s = (step + 1) * x.numel() / max(1e-9, time.time() - t0)
            bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tok_s:.0f}")
        if say is not None and step - start == 4 and steps - step > 1:
            left = (time.time() - t0) / 5 * (steps - step - 1)
            say(
                f"pretraining: about {left:.0f} s for the {steps - step - 1} steps left "
                f"(checkpointed every {every} steps; stopping loses at most that many)"
            )
        if state_path is not None and (step + 1) % every == 0 and step + 1 < steps:
            save(step + 1)
        if log is not None:
            log(step, losses[-1])
    if bar is not None:
        bar.close()
    if state_path is not None:
        Path(state_path).unlink(missing_ok=True)
    model.eval()
    return losses


def pretrain_model(
    texts: Sequence[str], tokenizer, spec: PretrainSpec, *, device=None, report: Reporting = Reporting()
):
    """Build (``spec.preset``) or load (``spec.base_model``) a causal LM and train it on public
    ``texts`` as ``spec`` says (on ``device``, default the CPU; the model is returned on the CPU)."""
    ids = encode_texts(tokenizer, texts)
    sp = special_ids(tokenizer)
    blocks = pack(ids, spec.seq_len, sp.get("eos"))
    if spec.base_model:
        model = models.load_local(spec.base_model)
    else:
        model = models.build_preset(
            spec.preset,
            vocab_size=tokenizer.get_vocab_size(),
            n_positions=max(spec.seq_len, 128),
            bos_token_id=sp.get("eos"),
            eos_token_id=sp.get("eos"),
            seed=spec.seed,
        )
    if device is not None:
        model.to(device)
    losses = train_lm(model, blocks, spec, report)
    model.cpu()
    return model, {
        "blocks": int(blocks.shape[0]),
        "tokens": int(blocks.numel()),
        "final_loss": float(np.mean(losses[-20:])),
        "steps": spec.steps,
    }


def save_pretrained(model, tokenizer, out_dir: str | Path, info: dict) -> Path:
    out = models.save_model(model, out_dir, tokenizer)
    write_json(out / "userdp_pretrain.json", info)
    return out
