"""`userdp evaluate RUN_DIR|MODEL_DIR [--data ...] [--personalize]`."""

from __future__ import annotations

import math

from userdp.cli import argtypes as A
from userdp.cli import jsonout
from userdp.devices import resolve_device
from userdp.lm.evaluate_job import EvalSource, evaluate_target


def register(p) -> None:
    p.description = (
        "Loss and perplexity on held-out users, averaged over tokens and over users. "
        "A RUN_DIR is evaluated on its own held-out users (same split); a MODEL_DIR "
        "needs --data (or uses the run config given with --config)."
    )
    p.add_argument("target", metavar="RUN_DIR|MODEL_DIR")
    p.add_argument(
        "--data",
        metavar="SOURCE",
        help="data to evaluate on: 'shakespeare' or a path "
        "(with --format); all of its users count as held out unless --config says otherwise",
    )
    p.add_argument(
        "--format",
        choices=["jsonl", "csv", "parquet", "hf", "stackexchange", "shakespeare"],
        help="format of --data (default: from its name or contents, as `userdp data stats`)",
    )
    p.add_argument("--config", metavar="YAML", help="a train config whose split selects the held-out users")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. eval.batch_size=64 (a key that changes the data or the split is "
        "refused for a run directory)",
    )
    p.add_argument("--personalize", action="store_true", help="also run the personalization evaluation (docs/lm.md)")
    p.add_argument("--max-users", type=A.positive_int, help="evaluate at most this many held-out users")
    A.add_device_option(p, "scoring runs")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=main)


def _fmt(x):
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4g}"


def main(args) -> int:
    if args.device is not None:
        resolve_device(args.device, name="--device")  # refused here, naming the flag
    source = EvalSource(data=args.data, fmt=args.format, config=args.config, overrides=tuple(args.overrides or ()))
    res = evaluate_target(
        args.target, source, personalize=args.personalize, max_users=args.max_users, device=args.device
    )
    if args.json:
        print(jsonout.dumps(res))
        return 0
    m = res["heldout"]
    print(f"model:            {res['model']}")
    print(f"held-out users:   {m['num_users']} ({m['num_records']} records, {m['num_tokens']} tokens)")
    print(f"loss/perplexity:  {_fmt(m['loss'])} / {_fmt(m['perplexity'])} (averaged over tokens)")
    print(f"                  {_fmt(m['user_loss'])} / {_fmt(m['user_perplexity'])} (averaged over users)")
    if "personalization" in res:
        p = res["personalization"]
        if p.get("users"):
            print(f"personalization:  {p['users']} users (4 local SGD epochs on half of each user's records)")
            print(f"  non-personalized on the other half: perplexity {_fmt(p['base']['perplexity'])}")
            print(
                f"  personalized on the other half:     perplexity {_fmt(p['personalized']['perplexity'])}"
                f" ({p['users_improved']} of {p['users']} users improved)"
            )
        else:
            print("personalization:  no held-out user has two or more records")
    return 0
