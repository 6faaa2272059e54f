"""A TRL SFTTrainer script, made user-level private with userdp.hf_trl (docs/hf.md, "TRL's SFTTrainer").

    python examples/trl_sft.py                 # 40 private steps on the example commits, ~1 min on a CPU
    python examples/trl_sft.py --steps 3       # a quick look

The script is what a TRL user already has: a prompt-completion dataset, a tokenizer, a causal LM,
an SFTConfig and an SFTTrainer (TRL tokenizes, masks the prompt out of the loss, truncates). The
lines marked "userdp" are the whole change: keep the author column, describe the privacy, and use
PrivateSFTTrainer. Nothing is downloaded: the tokenizer is trained on examples/data/public.txt
(text declared public) and the model is built from a config.
"""

import argparse
import json
import os
import tempfile
from pathlib import Path

from datasets import Dataset
from hf_trainer import tokenizer_from_public_text
from transformers import GPT2Config, GPT2LMHeadModel
from trl import SFTConfig

from userdp.engine import ULS, FlatClip, TrainConfig  # userdp
from userdp.hf_trl import PrivateSFTTrainer  # userdp

DATA = Path(__file__).resolve().parent / "data"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--output", default=None, help="output_dir (default: a temporary folder)")
    a = ap.parse_args()
    if a.output is None and int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun: one folder for all
        ap.error("--output: give the run's folder under torchrun (each process would make its own temporary one)")

    tok = tokenizer_from_public_text()
    rows = [json.loads(line) for line in (DATA / "commits.jsonl").read_text().splitlines() if line.strip()]
    # prompt-completion: the model learns to write the message, not the prompt (completion_only_loss)
    ds = Dataset.from_list(
        [{"prompt": "commit message:", "completion": " " + r["message"], "author": r["author"]} for r in rows]
    )  # keeps "author" (userdp)
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=len(tok),
            n_positions=64,
            n_embd=64,
            n_layer=2,
            n_head=4,
            bos_token_id=tok.eos_token_id,
            eos_token_id=tok.eos_token_id,
        )
    )
    args = SFTConfig(
        output_dir=a.output or tempfile.mkdtemp(prefix="sft-userdp-"),
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        max_length=48,
        logging_steps=10,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    # userdp: 80 authors; each step a Poisson cohort of ~16 of them, each averaging up to 4 of their
    # commits and clipped to norm 1; sigma calibrated so that the whole run is (3, delta)-DP per author
    privacy = TrainConfig(
        algorithm=ULS(group_size=4, sampling_rate=0.2), steps=a.steps, clipping=FlatClip(1.0), target_epsilon=3.0
    )
    trainer = PrivateSFTTrainer(
        model=model, args=args, train_dataset=ds, processing_class=tok, privacy=privacy, user_field="author"
    )  # userdp: was SFTTrainer(model=..., ...)
    trainer.train()
    rec = trainer.privacy_record()
    if trainer.is_world_process_zero():  # rank 0 wrote the run folder
        print(
            f"user-level ({trainer.epsilon():.3f}, {rec['delta']:.3g})-DP over {rec['steps_accounted']} steps "
            f"({rec['stopped']}); sigma {rec['noise_multiplier']:.3f}; statement in {args.output_dir}/report.md"
        )


if __name__ == "__main__":
    main()
