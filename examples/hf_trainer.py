"""A plain Hugging Face Trainer script, made user-level private with userdp.hf (docs/hf.md).

    python examples/hf_trainer.py                 # 40 private steps on the example commits, ~1 min on a CPU
    python examples/hf_trainer.py --steps 3       # a quick look

The script is what an HF user already has: a tokenizer, a causal LM, a tokenized dataset,
TrainingArguments and a Trainer. The lines marked "userdp" are the whole change: keep the author
column, describe the privacy, and use PrivateTrainer. Nothing is downloaded: the tokenizer is
trained on examples/data/public.txt (text declared public) and the model is built from a config.
"""

import argparse
import json
import os
import tempfile
from pathlib import Path

from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast, TrainingArguments

from userdp.engine import ULS, FlatClip, TrainConfig  # userdp
from userdp.hf import PrivateTrainer  # userdp

DATA = Path(__file__).resolve().parent / "data"


def tokenizer_from_public_text() -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train(
        [str(DATA / "public.txt")],
        trainers.BpeTrainer(
            vocab_size=512, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--output", default=None, help="output_dir (default: a temporary folder)")
    a = ap.parse_args()
    if a.output is None and int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun: one folder for all
        ap.error("--output: give the run's folder under torchrun (each process would make its own temporary one)")

    tok = tokenizer_from_public_text()
    rows = [json.loads(line) for line in (DATA / "commits.jsonl").read_text().splitlines() if line.strip()]
    ds = Dataset.from_list(rows).map(
        lambda r: tok(r["message"], truncation=True, max_length=48), remove_columns=["message"]
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
    args = TrainingArguments(
        output_dir=a.output or tempfile.mkdtemp(prefix="hf-userdp-"),
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
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
    trainer = PrivateTrainer(
        model=model, args=args, train_dataset=ds, processing_class=tok, privacy=privacy, user_field="author"
    )  # userdp: was Trainer(model=..., ...)
    trainer.train()
    rec = trainer.privacy_record()
    if trainer.is_world_process_zero():  # rank 0 wrote the run folder
        print(
            f"user-level ({trainer.epsilon():.3f}, {rec['delta']:.3g})-DP over {rec['steps_accounted']} steps "
            f"({rec['stopped']}); sigma {rec['noise_multiplier']:.3f}; statement in {args.output_dir}/report.md"
        )


if __name__ == "__main__":
    main()
