"""The ``userdp train`` configuration: a YAML file validated into frozen dataclasses.

Every key is declared here; an unknown key is refused with its dotted name, a wrong type names
the key, the expected type and the value. ``--set a.b=value`` overrides (value parsed as YAML)
use the same dotted names. The embedded default lives in ``userdp/configs/default.yaml``;
a user's file is layered over it, then the ``--set`` overrides.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Optional

import yaml

from userdp.devices import DEVICE_SPEC
from userdp.lm.presets import PRESETS
from userdp.errors import UserError


def _choice(*options: str, default: str) -> Any:
    return field(default=default, metadata={"choices": options})


@dataclass(frozen=True)
class DataConfig:
    """Where the private records come from and how users are split."""

    source: str = _choice("shakespeare", "stackexchange", "jsonl", "csv", "parquet", "hf", default="shakespeare")
    path: Optional[str] = None            # file or folder for stackexchange/jsonl/csv
    sites: Optional[tuple[str, ...]] = None  # stackexchange: sites to fine-tune on (default: main sites)
    public_sites: Optional[tuple[str, ...]] = None  # stackexchange: declared-public sites (meta)
    public_plays: tuple[str, ...] = ("hamlet", "macbeth", "the-tempest", "twelfth-night")
    #                                     shakespeare: whole plays set aside as public text
    user_field: str = "user"              # jsonl/csv
    text_field: str = "text"              # jsonl/csv
    public_path: Optional[str] = None     # jsonl/csv/txt of declared-public text (pretraining)
    max_users: Optional[int] = None       # keep at most this many users (seeded choice), for quick runs
    heldout_users: float = 0.1            # fraction of users held out (whole) for evaluation
    max_eval_users: Optional[int] = 200   # cap on the held-out users evaluated (seeded choice)
    split_seed: int = 0                   # which users are held out (and max_users choice)


@dataclass(frozen=True)
class TokenizerConfig:
    path: Optional[str] = None            # a saved tokenizer (tokenizer.json or a HF folder)
    vocab_size: int = 2048                # BPE trained on the declared-public text
    seq_len: int = 64                     # tokens per record (longer records are truncated)
    declared_public: bool = False         # the tokenizer at `path` saw only public text
    trained_on_private: bool = False      # set when the tokenizer saw the training records
    #  A tokenizer from `path` (or from a model directory not made by `userdp pretrain`) must be
    #  declared public: its training text is outside the DP guarantee (Ponomareva et al. 2023, §5.5.1).


@dataclass(frozen=True)
class LoraConfig:
    enabled: bool = False
    rank: int = 8
    alpha: float = 16.0
    target_modules: Optional[tuple[str, ...]] = None
    save_adapter: bool = False            # save the adapter instead of the merged model
    quantize: str = _choice("none", "nf4", "fp4", default="none")  # QLoRA-style: a 4-bit frozen base (bitsandbytes)


@dataclass(frozen=True)
class PretrainConfig:
    """Non-private pretraining on declared-public text (cached by content)."""

    steps: int = 600
    batch_size: int = 32
    lr: float = 3e-3
    warmup: int = 30
    seed: int = 0


@dataclass(frozen=True)
class ModelConfig:
    preset: Optional[str] = "tiny"        # tiny | small | base (GPT-2 style), or null with path
    path: Optional[str] = None            # local model directory (AutoModelForCausalLM)
    pretrain: bool = True                 # preset: pretrain on the public text first (cached)
    pretraining: PretrainConfig = PretrainConfig()
    lora: LoraConfig = LoraConfig()
    device: str = "auto"                  # auto | cpu | cuda | cuda:<i> (auto: a GPU when there is one)


@dataclass(frozen=True)
class PrivacyConfig:
    epsilon: float = 3.0
    delta: Optional[float] = None         # null: N^-1.1 with N = training users
    noise_multiplier: Optional[float] = None  # fixed sigma instead of calibrating to epsilon
    accountant: str = _choice("pld", "rdp", default="pld")
    sampler: str = _choice("poisson", "shuffle", default="poisson")
    # non-private touches of the data made before this run (e.g. `userdp init` read the per-user
    # counts to choose G): listed in the report's "Not accounted", whichever command made them
    disclosed_touches: Optional[tuple[str, ...]] = None


@dataclass(frozen=True)
class TrainingConfig:
    algorithm: str = _choice("uls", "els", "fedavg", "nonprivate", default="uls")
    steps: int = 200
    cohort_size: float = 64.0             # expected units per step (q = cohort / units)
    group_size: int = 8                   # G: records per user (ULS average / ELS cap)
    clip_norm: float = 1.0
    clipping: str = _choice("flat", "per_layer", "normalized", default="flat")
    optimizer: str = _choice("sgd", "adam", "adafactor", default="adam")
    lr: float = 1e-3
    momentum: float = 0.0
    weight_decay: float = 0.0
    local_epochs: int = 1                 # fedavg: local epochs of SGD per user (over up to G records)
    local_lr: float = 0.1                 # fedavg
    selection: str = _choice("random", "longest", "shortest", "random_chunk",
                             "highest_ppl", "lowest_ppl", default="random")
    chunk_size: Optional[int] = field(default=8, metadata={"auto": True})  # units per per-unit call; auto: fit memory_gb
    memory_gb: Optional[float] = None     # cap for chunk_size: auto (null: 80% of the free device memory)
    per_unit: str = _choice("auto", "ghost", "vmap", default="auto")  # auto: ghost norms for ELS/ULS
    precision: str = _choice("auto", "float32", "bfloat16", "float16", default="auto")  # autocast dtype
    seed: Optional[int] = None            # null: sampling and noise from OS entropy (secret)
    checkpoint_every: int = 25


@dataclass(frozen=True)
class EvalConfig:
    batch_size: int = 64
    before: bool = True                   # evaluate the starting model too
    personalize: bool = False
    personalize_lr: float = 0.05
    personalize_epochs: int = 4


@dataclass(frozen=True)
class OutputConfig:
    dir: Optional[str] = None             # default runs/<timestamp> under the cwd
    plot: bool = True
    cache: str = _choice("shared", "run", default="shared")  # run: caches of this run's data in <run>/cache


@dataclass(frozen=True)
class PlanningConfig:
    """Options of ``plan: auto`` (docs/plan.md, ``userdp.heuristics.plan_for_training``)."""

    compute_budget: Optional[int] = None  # B: gradients per step (required with plan: auto)
    sample_users: int = 128               # users sampled to estimate L(G) (a non-private touch)
    dp_median_epsilon: Optional[float] = None  # release the ELS median with this eps-DP (counted)
    algorithm: str = _choice("recommended", "uls", "els", default="recommended")
    seed: Optional[int] = None            # the user sample / record draws (null: OS entropy)


@dataclass(frozen=True)
class AuditConfig:
    canaries: int = 0                     # K canary users (0: no audit); `userdp audit --canaries K`
    records_per_canary: Optional[int] = None  # null: training.group_size (a canary fills a user's G slots)
    secret_tokens: Optional[int] = None   # tokens of each random secret (null: tokenizer.seq_len)
    score: str = _choice("gradient", "gradient_alignment", "loss", "loss_difference", default="gradient")  # docs/audit.md
    gradient_scale: float = 100.0         # score gradient: a canary's update norm, in clip norms
    confidence: float = 0.95              # of the one-run lower bound
    secrets: Optional[str] = None         # the seed, inclusions and scores (null: <run_dir>.audit-secrets.json)
    seed: Optional[int] = None            # canary seed (null: 128 bits of OS entropy); for reproducible tests
    inference_users: int = 100            # training and held-out users scored for user inference (0: none)
    inference_records: int = 8            # records scored per such user


@dataclass(frozen=True)
class RunConfig:
    plan: Optional[str] = _choice("auto", default=None)  # auto: choose algorithm/G/cohort (docs/plan.md)
    planning: PlanningConfig = PlanningConfig()
    data: DataConfig = DataConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    model: ModelConfig = ModelConfig()
    privacy: PrivacyConfig = PrivacyConfig()
    training: TrainingConfig = TrainingConfig()
    eval: EvalConfig = EvalConfig()
    output: OutputConfig = OutputConfig()
    audit: AuditConfig = AuditConfig()


# ---------------------------------------------------------------------------------------


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_type_name(a) for a in args) + " or null"
    if origin is tuple:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], key, where)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise UserError(f"{where}: {key} must be a mapping, got {value!r}")
        return _build(tp, value, key, where)
    if origin is tuple:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise UserError(f"{where}: {key} must be a list, got {value!r}")
        inner = typing.get_args(tp)[0]
        return tuple(_coerce(v, inner, f"{key}[{i}]", where) for i, v in enumerate(value))
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise UserError(f"{where}: {key} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
            raise UserError(f"{where}: {key} must be an integer, got {value!r}")
        return int(value)
    if tp is float:
        if isinstance(value, str):  # PyYAML reads 1e-6 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"{where}: {key} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise UserError(f"{where}: {key} must be a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config type {tp}")  # pragma: no cover


def _build(cls, raw: dict, prefix: str, where: str):
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            close = [k for k in fields if k.startswith(str(key)[:3])]
            hint = f" (did you mean {', '.join(close)}?)" if close else f" (known keys: {', '.join(fields)})"
            raise UserError(f"{where}: unknown key {dotted!r}{hint}")
        if fields[key].metadata.get("auto") and value == "auto":
            kwargs[key] = None  # "auto": resolved when the job knows the model and the device
            continue
        v = _coerce(value, hints[key], dotted, where)
        choices = fields[key].metadata.get("choices")
        if choices and v is not None and v not in choices:
            raise UserError(f"{where}: {dotted} must be one of {', '.join(choices)}, got {v!r}")
        kwargs[key] = v
    return cls(**kwargs)


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def default_yaml_text() -> str:
    return resources.files("userdp").joinpath("configs/default.yaml").read_text()


class StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} appears twice in one mapping (ambiguous)", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_yaml(path: str | Path) -> dict:
    """The mapping in a YAML config file.

    Raises:
        UserError: missing, a folder, not UTF-8, not valid YAML, a key given twice, or not a mapping."""
    p = Path(path)
    if p.is_dir():
        raise UserError(f"config: {path} is a folder, not a YAML file")
    if not p.is_file():
        raise UserError(f"config: {path} does not exist")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"config: {path}: not a UTF-8 text file ({exc.reason} at byte {exc.start})") from None
    try:
        raw = yaml.load(text, Loader=StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark is not None else ""
        raise UserError(f"config: {path}{line}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise UserError(f"config: {path}: the top level must be a mapping of sections")
    return raw


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise UserError(f"--set {text!r}: expected key=value with a dotted key, e.g. training.steps=100")
    key, value = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise UserError(f"--set {text!r}: empty key")
    try:
        parsed = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError:
        parsed = value
    return key.split("."), parsed


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    out = _merge({}, raw)
    for text in overrides:
        parts, value = parse_override(text)
        node = out
        cls = RunConfig
        for i, part in enumerate(parts[:-1]):
            names = {f.name for f in dataclasses.fields(cls)}
            if part not in names:
                raise UserError(f"--set {text}: unknown key {'.'.join(parts[: i + 1])!r} "
                                f"(known keys: {', '.join(sorted(names))})")
            sub = typing.get_type_hints(cls)[part]
            if not dataclasses.is_dataclass(sub):
                raise UserError(f"--set {text}: {'.'.join(parts[: i + 1])} is not a section")
            cls = sub
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UserError(f"--set {text}: {'.'.join(parts[: i + 1])} is not a section")
        node[parts[-1]] = value
    return out


def from_dict(raw: dict, where: str = "config") -> RunConfig:
    cfg = _build(RunConfig, raw, "", where)
    validate(cfg, where)
    return cfg


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Default YAML, layered with ``path`` (if given), then ``--set`` overrides; validated."""
    base = yaml.safe_load(default_yaml_text()) or {}
    where = "config (embedded default)"
    if path is not None:
        user = load_yaml(path)
        # validate the user's file on its own first so that errors name it
        _build(RunConfig, user, "", f"config {path}")
        base = _merge(base, user)
        where = f"config {path}"
    if overrides:
        base = apply_overrides(base, overrides)
        where = f"{where} with --set"
    return from_dict(base, where)


#: Largest group size G (userdp.accounting.MAX_ELS_GROUP; a ULS step pads every user to G).
MAX_GROUP_SIZE = 10_000


def _numbers(obj, prefix: str = ""):
    """(dotted key, value) of every float in a config (NaN and infinities are refused)."""
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(v):
            yield from _numbers(v, key + ".")
        elif isinstance(v, float):
            yield key, v


def _gradient_canaries(cfg: RunConfig) -> bool:
    """Whether the run audits with gradient canaries (they need the vmap strategy)."""
    return cfg.audit.score == "gradient" and bool(cfg.audit.canaries)


def validate(cfg: RunConfig, where: str = "config") -> None:
    """Cross-field checks (types and choices are checked while building)."""
    def bad(msg):
        raise UserError(f"{where}: {msg}")

    for key, value in _numbers(cfg):
        if not math.isfinite(value):
            bad(f"{key} must be a finite number, got {value}")
    p, t, d, m, tok = cfg.privacy, cfg.training, cfg.data, cfg.model, cfg.tokenizer
    if t.algorithm != "nonprivate" and not p.epsilon > 0:
        bad(f"privacy.epsilon must be > 0, got {p.epsilon}")
    if p.delta is not None and not 0 < p.delta < 1:
        bad(f"privacy.delta must be in (0, 1), got {p.delta}")
    if t.steps < 1:
        bad(f"training.steps must be >= 1, got {t.steps}")
    if t.cohort_size <= 0:
        bad(f"training.cohort_size must be > 0, got {t.cohort_size}")
    if t.group_size < 1:
        bad(f"training.group_size must be >= 1, got {t.group_size}")
    if t.chunk_size is not None and t.chunk_size < 1:
        bad(f"training.chunk_size must be >= 1 or auto, got {t.chunk_size}")
    if t.memory_gb is not None and not t.memory_gb > 0:
        bad(f"training.memory_gb must be > 0, got {t.memory_gb}")
    if not 260 <= tok.vocab_size <= 1_000_000:
        bad(f"tokenizer.vocab_size must be in [260, 1000000] (the 256 bytes plus special tokens), got {tok.vocab_size}")
    if t.group_size > MAX_GROUP_SIZE:
        bad(f"training.group_size must be at most {MAX_GROUP_SIZE:,} (records per user per step; the ELS "
            f"accountant's limit too), got {t.group_size}")
    if t.clip_norm <= 0:
        bad(f"training.clip_norm must be > 0, got {t.clip_norm}")
    if t.lr <= 0:
        bad(f"training.lr must be > 0, got {t.lr}")
    if tok.seq_len < 4:
        bad(f"tokenizer.seq_len must be >= 4, got {tok.seq_len}")
    if not 0 < d.heldout_users < 1:
        bad(f"data.heldout_users must be a fraction in (0, 1), got {d.heldout_users}")
    if m.preset is None and m.path is None:
        bad("model: give model.preset (tiny, small, base) or model.path (a local directory)")
    if m.preset is not None and m.path is None and m.preset not in PRESETS:
        bad(f"model.preset must be one of {', '.join(PRESETS)}, got {m.preset!r}")
    if not DEVICE_SPEC.match(str(m.device).strip().lower()):
        bad(f"model.device must be auto, cpu, cuda or cuda:<index>, got {m.device!r}")
    if t.algorithm == "fedavg" and t.per_unit == "ghost":
        bad("training.per_unit: ghost clips gradients; FedAvg's update is a local-SGD delta (use auto or vmap)")
    if m.lora.quantize != "none":
        q = f"model.lora.quantize: {m.lora.quantize}"
        if not m.lora.enabled:
            bad(f"{q} needs model.lora.enabled: true (a 4-bit base is frozen; only the LoRA adapters train)")
        if not m.path:
            bad(f"{q} quantizes a local model folder (model.path); the presets are GPT-2, whose Conv1D layers "
                "bitsandbytes does not quantize")
        if t.algorithm == "fedavg" or t.per_unit == "vmap":
            bad(f"{q} needs the ghost per-unit strategy (ULS, ELS or nonprivate with training.per_unit: auto or "
                "ghost): torch.func.vmap, which FedAvg and per_unit: vmap use, cannot run bitsandbytes' 4-bit matmul")
        if _gradient_canaries(cfg):
            bad(f"{q}: gradient canaries (audit.score: gradient) run the vmap strategy; use audit.score: loss")
        if cfg.eval.personalize:
            bad(f"{q}: eval.personalize fine-tunes every weight of the merged model, which a 4-bit base cannot be")
    if d.source in ("jsonl", "csv", "stackexchange") and not d.path:
        bad(f"data.path is required for data.source = {d.source}")
    if tok.path and tok.trained_on_private and not tok.declared_public:
        bad("tokenizer: a tokenizer trained on the private training records leaks them "
            "(docs/threat_model.md); train it on public text or set tokenizer.declared_public: true if "
            "that text is public")
    if p.noise_multiplier is not None and p.noise_multiplier <= 0:
        bad(f"privacy.noise_multiplier must be > 0 (use training.algorithm: nonprivate for no "
            f"noise), got {p.noise_multiplier}")
    if t.checkpoint_every < 1:
        bad(f"training.checkpoint_every must be >= 1, got {t.checkpoint_every}")
    a = cfg.audit
    if a.canaries != 0 and a.canaries < 2:
        bad(f"audit.canaries must be 0 (no audit) or at least 2, got {a.canaries}")
    if a.canaries > 1_000_000:
        bad(f"audit.canaries must be at most 1000000, got {a.canaries}")
    if a.records_per_canary is not None and a.records_per_canary < 1:
        bad(f"audit.records_per_canary must be >= 1, got {a.records_per_canary}")
    if a.secret_tokens is not None and not 2 <= a.secret_tokens <= tok.seq_len:
        bad(f"audit.secret_tokens must be in [2, tokenizer.seq_len = {tok.seq_len}], got {a.secret_tokens}")
    if not 0 < a.confidence < 1:
        bad(f"audit.confidence must be in (0, 1), got {a.confidence}")
    if a.seed is not None and a.seed < 0:
        bad(f"audit.seed must be >= 0, got {a.seed}")
    if _gradient_canaries(cfg):
        if t.algorithm == "fedavg":
            bad("audit.score: gradient canaries need a gradient update (uls, els or nonprivate), not fedavg")
        if t.per_unit == "ghost":
            bad("audit.score: gradient canaries add a term the ghost strategy cannot see; use "
                "training.per_unit: auto or vmap (an audit with them runs vmap)")
        if not a.gradient_scale > 1:
            bad(f"audit.gradient_scale must be > 1 (a canary's update must exceed the clip norm), got {a.gradient_scale}")
    if a.inference_users < 0:
        bad(f"audit.inference_users must be >= 0, got {a.inference_users}")
    if a.inference_records < 1:
        bad(f"audit.inference_records must be >= 1, got {a.inference_records}")
    pl = cfg.planning
    if cfg.plan == "auto":
        if pl.compute_budget is None:
            bad("plan: auto needs planning.compute_budget (gradients per step, e.g. 256)")
        if t.algorithm in ("nonprivate", "fedavg"):
            bad(f"plan: auto chooses between uls and els; training.algorithm is {t.algorithm} "
                "(drop plan: auto, or set training.algorithm: uls)")
        if p.noise_multiplier is not None:
            bad("plan: auto calibrates sigma to privacy.epsilon; drop privacy.noise_multiplier")
    if pl.compute_budget is not None and pl.compute_budget < 1:
        bad(f"planning.compute_budget must be >= 1, got {pl.compute_budget}")
    if pl.sample_users < 1:
        bad(f"planning.sample_users must be >= 1, got {pl.sample_users}")
    if pl.dp_median_epsilon is not None and not pl.dp_median_epsilon > 0:
        bad(f"planning.dp_median_epsilon must be > 0, got {pl.dp_median_epsilon}")


def to_dict(cfg) -> dict:
    d = dataclasses.asdict(cfg)

    def fix(x):
        if isinstance(x, dict):
            return {k: fix(v) for k, v in x.items()}
        if isinstance(x, tuple):
            return [fix(v) for v in x]
        return x

    return fix(d)


def dump_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
