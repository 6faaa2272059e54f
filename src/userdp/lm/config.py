"""The ``userdp train`` configuration: a YAML file validated into frozen dataclasses.

Every key is declared here; an unknown key is refused with its dotted name, a wrong type names
the key, the expected type and the value. ``--set a.b=value`` overrides (value parsed as YAML)
use the same dotted names. The embedded default lives in ``userdp/configs/default.yaml``;
a user's file is layered over it, then the ``--set`` overrides.
"""

import dataclasses
import difflib
import functools
import hashlib
import json
import math
import typing
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

import yaml
from annotated_types import Ge, Gt, Le, Lt
from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    with_config,
)
from pydantic_core import PydanticCustomError

from userdp import plugins
from userdp.accounting.accountants import ACCOUNTANTS
from userdp.accounting.events import MAX_TARGET_EPSILON
from userdp.accounting.mechanism import MAX_BANDS
from userdp.engine.algorithms import ALGORITHMS
from userdp.engine.distributed.distribution import DISTRIBUTIONS
from userdp.engine.distributed.sharding import unshardable
from userdp.engine.noise.mechanism import NOISE_MECHANISMS
from userdp.engine.per_unit import PER_UNIT_STRATEGIES
from userdp.engine.sampling import SAMPLERS
from userdp.errors import UserError
from userdp.fileio import read_input, unclaimable
from userdp.lm.presets import PRESETS
from userdp.validation import DEVICE_SPEC, MAX_EPOCHS, MAX_STEPS, close_names

# --- the schema's value types ----------------------------------------------------------
# pydantic v2 validates the dataclasses below (``TypeAdapter(RunConfig)``): unknown keys, types,
# ranges and finiteness are declared on the fields, not checked by hand. Its lax coercions (the
# string "5" as an integer, "yes" as true) are turned off by the before-validators: a YAML config
# means what it says. Cross-field rules stay in :func:`validate`.


def _bad(kind: str, text: str, got: Any) -> PydanticCustomError:
    return PydanticCustomError(kind, text + ", got {got}", {"got": _show(got)})


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _as_int(v: Any) -> int:
    if isinstance(v, float) and math.isfinite(v) and v == int(v):
        return int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad("userdp_int", "must be an integer", v)
    return v


def _as_float(v: Any) -> float:
    if isinstance(v, str):  # PyYAML reads 1e-6 (no dot) as a string
        try:
            v = float(v)
        except ValueError:
            raise _bad("userdp_float", "must be a number", v) from None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _bad("userdp_float", "must be a number", v)
    try:
        f = float(v)
    except OverflowError:
        f = math.inf
    if not math.isfinite(f):
        raise _bad("userdp_float", "must be a finite number", v)
    return f


def _as_bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise _bad("userdp_bool", "must be true or false", v)
    return v


def _as_str(v: Any) -> str:
    if not isinstance(v, str):
        raise _bad("userdp_str", "must be a string", v)
    return v


def _as_list(v: Any) -> Any:
    if isinstance(v, str):
        return (v,)
    if not isinstance(v, (list, tuple)):
        raise _bad("userdp_list", "must be a list", v)
    return tuple(v)


def _auto_is_none(v: Any) -> Any:
    return None if v == "auto" else v  # "auto": resolved when the job knows the model and the device


def _one_of(*options: str):
    """A string among ``options``: a tuple, or zero-argument callables returning names (a
    registry's ``names``, read when a value is validated so that plugins count)."""

    def check(v: str) -> str:
        names = [n for o in options for n in (o() if callable(o) else (o,))]
        if v not in names:
            close = close_names(v, names)
            hint = f" (did you mean {' or '.join(close)}?)" if close else ""
            raise _bad("userdp_choice", f"must be one of {', '.join(names)}{hint}", v)
        return v

    return AfterValidator(check)


Int = Annotated[int, BeforeValidator(_as_int)]
Float = Annotated[float, BeforeValidator(_as_float)]
Bool = Annotated[bool, BeforeValidator(_as_bool)]
Str = Annotated[str, BeforeValidator(_as_str)]
Names = Annotated[tuple[Str, ...], BeforeValidator(_as_list)]
#: a seed: any integer a NumPy/PyTorch generator accepts
Seed = Annotated[Int, Ge(0), Le(2**63 - 1)]
Count = Annotated[Int, Ge(1)]
NonNegative = Annotated[Int, Ge(0)]
Positive = Annotated[Float, Gt(0)]
Fraction = Annotated[Float, Gt(0), Lt(1)]


#: what ``plan: auto`` chooses between (docs/plan.md)
PLANNED_ALGORITHMS = ("uls", "els")

#: Largest group size G (userdp.accounting.MAX_ELS_GROUP; a ULS step pads every user to G).
MAX_GROUP_SIZE = 10_000


def _choice(*options: str) -> Any:
    return Annotated[Str, _one_of(*options)]


@with_config(ConfigDict(extra="forbid"))
@dataclass(frozen=True)
class DataConfig:
    """Where the private records come from and how users are split."""

    source: _choice("shakespeare", "stackexchange", "jsonl", "csv", "parquet", "hf") = "shakespeare"
    path: Str | None = None  # file or folder for stackexchange/jsonl/csv
    sites: Names | None = None  # stackexchange: sites to fine-tune on (default: main sites)
    public_sites: Names | None = None  # stackexchange: declared-public sites (meta)
    public_plays: Names = ("hamlet", "macbeth", "the-tempest", "twelfth-night")
    #                                     shakespeare: whole plays set aside as public text
    user_field: Str = "user"  # jsonl/csv
    text_field: Str = "text"  # jsonl/csv
    public_path: Str | None = None  # jsonl/csv/txt of declared-public text (pretraining)
    sample_rate: Fraction | None = None  # keep each training user with this probability (keyed hash of its id,
    #                                      so one user's membership never depends on the others), for quick runs
    max_users: Count | None = None  # about this many training users, at rate K/N (the statement says what
    #                                      that rate's dependence on N leaves), for quick runs
    heldout_users: Fraction = 0.1  # fraction of users held out (whole) for evaluation
    max_eval_users: Count | None = 200  # cap on the held-out users evaluated (seeded choice)
    split_seed: Seed = 0  # which users are held out (and max_users choice)


@with_config(ConfigDict(extra="forbid"))
@dataclass(frozen=True)
class TokenizerConfig:
    path: Str | None = None  # a saved tokenizer (tokenizer.json or a HF folder)
    #                                       BPE trained on the declared-public text: the 256 bytes plus specials
    vocab_size: Annotated[Int, Ge(260), Le(1_000_000)] = 2048
    seq_len: Annotated[Int, Ge(4), Le(1_000_000)] = 64  # tokens per record (longer records are truncated)
    declared_public: Bool = False  # the tokenizer at `path` saw only public text
    trained_on_private: Bool = False  # set when the tokenizer saw the training records
    #  A tokenizer from `path` (or from a model directory not made by `userdp pretrain`) must be
    #  declared public: its training text is outside the DP guarantee (Ponomareva et al. 2023, §5.5.1).


@with_config(ConfigDict(extra="forbid"))
@dataclass(frozen=True)
class LoraConfig:
    enabled: Bool = False
    rank: Count = 8
    alpha: Positive = 16.0
    target_modules: Names | None = None
    save_adapter: Bool = False  # save the adapter instead of the merged model
    quantize: _choice("none", "nf4", "fp4") = "none"  # QLoRA-style: a 4-bit frozen base (bitsandbytes)


@with_config(ConfigDict(extra="forbid"))
@dataclass(frozen=True)
class PretrainConfig:
    """Non-private pretraining on declared-public text (cached by content)."""

    steps: NonNegative = 600
    batch_size: Count = 32
    lr: Positive = 3e-3
    warmup: NonNegative = 30
    seed: Seed = 0


@with_config(ConfigDict(extra="forbid"))
@dataclass(frozen=True)
class ModelConfig:
    preset: Str | None = "tiny"  # tiny | small | base (GPT-2 style), or null with path
    path: Str | None = None  # local model directory (AutoModelForCausalLM)
    pretrain: Bool = True  # preset: pretrain on the public text first (cached)
    pretraining: PretrainConfig = PretrainConfig()
    lora: LoraConfig = LoraConfig()
    device: Str = "auto"  # auto | cpu | cuda | cuda:<i> (auto: a GPU when there is one)


@with_config(ConfigDict(extra="forbid"))
@dataclass(frozen=True)
class PrivacyConfig:
    epsilon: Float = 3.0  # > 0 unless training.algorithm is nonprivate
    delta: Fraction | None = None  # null: N^-1.1 with N = training users
    noise_multiplier: Positive | None = None  # fixed sigma instead of calibrating to epsilon
    accountant: _choice(ACCOUNTANTS.choices()) = "pld"  # a registered accountant (plugins add names)
    sampler: _choice(SAMPLERS.choices()) = "poisson"  # poisson (as accounted), shuffle, fixed_size, or a plugin's
    noise: _choice(NOISE_MECHANISMS.choices()) = "iid_gaussian"  # the noise mechanism (plugins add names)
    # b: with sampler cyclic_poisson, users in b groups (a user's steps b apart); noise bandmf's band count
    bands: Annotated[Int, Ge(1), Le(MAX_BANDS)] = 1
    # non-private touches of the data made before this run (e.g. `userdp init` read the per-user
    # counts to choose G): listed in the report's "Not accounted", whichever command made them
    disclosed_touches: Names | None = None
    # set by `userdp tune` on each trial: the sha256 of the tuning contract (trial-count distribution,
    # delta, the mechanisms' events) the released statement rests on, bound to the journal with the rest
    tuning_contract: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")] | None = None


@with_config(ConfigDict(extra="forbid"))
@dataclass(frozen=True)
class TrainingConfig:
    algorithm: _choice(ALGORITHMS.choices()) = "uls"  # uls, els, fedavg, nonprivate, or a plugin's
    steps: Annotated[Int, Ge(1), Le(MAX_STEPS)] = 200
    cohort_size: Positive = 64.0  # expected units per step (q = cohort / units)
    #                                       G: records per user (ULS average / ELS cap); the ELS accountant's limit
    group_size: Annotated[Int, Ge(1), Le(MAX_GROUP_SIZE)] = 8
    clip_norm: Annotated[Float, Ge(1e-30)] = 1.0  # smaller underflows in float32
    clipping: _choice("flat", "per_layer", "normalized") = "flat"
    optimizer: _choice("sgd", "adam", "adafactor") = "adam"
    lr: Positive = 1e-3
    momentum: Annotated[Float, Ge(0), Lt(1)] = 0.0
    weight_decay: Annotated[Float, Ge(0)] = 0.0
    #                                       fedavg: local epochs of SGD per user (over up to G records)
    local_epochs: Annotated[Int, Ge(1), Le(MAX_EPOCHS)] = 1
    local_lr: Positive = 0.1  # fedavg
    selection: _choice("random", "longest", "shortest", "random_chunk", "highest_ppl", "lowest_ppl") = "random"
    #                                       units per per-unit call; auto (null): fit memory_gb
    chunk_size: Annotated[Count | None, BeforeValidator(_auto_is_none)] = 8
    memory_gb: Positive | None = None  # cap for chunk_size: auto (null: 80% of the free device memory)
    per_unit: _choice(PER_UNIT_STRATEGIES.choices("auto")) = "auto"  # auto: ghost norms for gradient updates
    precision: _choice("auto", "float32", "bfloat16", "float16") = "auto"  # autocast dtype
    # none; fsdp: each of the torchrun processes holds 1/W of the model (FSDP2); or a plugin's distribution
    sharding: _choice(DISTRIBUTIONS.choices()) = "none"
    seed: Seed | None = None  # null: sampling and noise from OS entropy (secret)
    checkpoint_every: Count = 25


@with_config(ConfigDict(extra="forbid"))
@dataclass(frozen=True)
class EvalConfig:
    batch_size: Count = 64
    before: Bool = True  # evaluate the starting model too
    personalize: Bool = False
    personalize_lr: Positive = 0.05
    personalize_epochs: Annotated[Int, Ge(1), Le(MAX_EPOCHS)] = 4


@with_config(ConfigDict(extra="forbid"))
@dataclass(frozen=True)
class OutputConfig:
    dir: Str | None = None  # default runs/<timestamp> under the cwd
    plot: Bool = True
    # where the private caches of the data go: shared ($USERDP_CACHE), run (<run>/cache) or a folder
    # that the project's runs, plans and evaluations share (read and tokenized once)
    cache: Str = "shared"
    tensorboard: Bool = False  # also TensorBoard scalars in <run>/tensorboard (userdp[tensorboard])


@with_config(ConfigDict(extra="forbid"))
@dataclass(frozen=True)
class PlanningConfig:
    """Options of ``plan: auto`` (docs/plan.md, ``userdp.planning.plan_for_training``)."""

    compute_budget: Count | None = None  # B: gradients per step (required with plan: auto)
    sample_users: Count = 128  # users sampled to estimate L(G) (a non-private touch)
    dp_median_epsilon: Positive | None = None  # release the ELS median with this eps-DP (counted)
    algorithm: _choice("recommended", *PLANNED_ALGORITHMS) = "recommended"
    seed: Seed | None = None  # the user sample / record draws (null: OS entropy)


@with_config(ConfigDict(extra="forbid"))
@dataclass(frozen=True)
class AuditConfig:
    canaries: Annotated[Int, Ge(0), Le(1_000_000)] = 0  # K canary users (0: no audit); `userdp audit --canaries K`
    records_per_canary: Count | None = None  # null: training.group_size (a canary fills a user's G slots)
    secret_tokens: Annotated[Int, Ge(2)] | None = None  # tokens of each random secret (null: tokenizer.seq_len)
    score: _choice("gradient", "gradient_alignment", "loss", "loss_difference") = "gradient"  # docs/audit.md
    gradient_scale: Positive = 100.0  # score gradient: a canary's update norm, in clip norms
    confidence: Fraction = 0.95  # of the one-run lower bound
    secrets: Str | None = None  # the seed, inclusions and scores (null: <run_dir>.audit-secrets.json)
    seed: Seed | None = None  # canary seed (null: 128 bits of OS entropy); for reproducible tests
    inference_users: NonNegative = 100  # training and held-out users scored for user inference (0: none)
    inference_records: Count = 8  # records scored per such user


@with_config(ConfigDict(extra="forbid"))
@dataclass(frozen=True)
class RunConfig:
    #                                       modules to import first: they register algorithms, accountants,
    #                                       per-unit strategies... (userdp.plugins; names, never file paths)
    plugins: Names = ()
    plan: _choice("auto") | None = None  # auto: choose algorithm/G/cohort (docs/plan.md)
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


@functools.cache
def _adapter(cls) -> TypeAdapter:
    return TypeAdapter(cls)


def _section(cls, path: tuple) -> Any:
    """The dataclass at ``path`` (a tuple of field names) below ``cls``."""
    for part in path:
        cls = typing.get_type_hints(cls)[part]
    return cls


def _dotted(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _hint(section, key: str) -> str:
    """ " (did you mean …?)" for an unknown ``key`` of a config section, else its known keys."""
    names = [f.name for f in dataclasses.fields(section)]
    close = close_names(key, names, n=3) or [n for n in names if n.startswith(key[:3])]
    return f" (did you mean {', '.join(close)}?)" if close else f" (known keys: {', '.join(names)})"


def _describe(cls, err: dict) -> str:
    """One line for pydantic's first error, in the config's dotted names."""
    loc, kind, got = tuple(err["loc"]), err["type"], err.get("input")
    key = _dotted(loc)
    if kind in ("extra_forbidden", "unexpected_keyword_argument"):
        return f"unknown key {key!r}{_hint(_section(cls, loc[:-1]), str(loc[-1]))}"
    if kind in ("dataclass_type", "dataclass_args_type", "dict_type"):
        return f"{key} must be a mapping, got {_show(got)}"
    bounds = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}
    if kind in bounds:
        limit = next(iter(err["ctx"].values()))
        return f"{key} must be {bounds[kind]} {limit}, got {_show(got)}"
    if kind.startswith("userdp_"):
        return f"{key} {err['msg']}"
    return f"{key}: {err['msg']}"


def _build(cls, raw: dict, where: str):
    """``raw`` validated into ``cls`` by the schema.

    Raises:
        UserError: one line naming ``where`` and the first wrong key."""
    try:
        return _adapter(cls).validate_python(raw)
    except ValidationError as exc:
        raise UserError(f"{where}: {_describe(cls, exc.errors()[0])}") from None


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
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *anchor` merges; its keys may be overridden (SafeLoader flattens it)
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} appears twice in one mapping (ambiguous)", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_yaml(path: str | Path) -> dict:
    """The mapping in a YAML config file.

    Raises:
        UserError: missing, a folder, not UTF-8, not valid YAML, a key given twice, or not a mapping."""
    text = read_input(path, f"config: {path}")
    try:
        raw = yaml.load(text, Loader=StrictLoader)
    except RecursionError:
        raise UserError(f"config: {path}: nested too deeply to be a userdp config") from None
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
    except RecursionError:
        raise UserError(f"--set {key}: the value is nested too deeply") from None
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
            if part not in {f.name for f in dataclasses.fields(cls)}:
                raise UserError(f"--set {text}: unknown key {'.'.join(parts[: i + 1])!r}{_hint(cls, part)}")
            sub = typing.get_type_hints(cls)[part]
            if not dataclasses.is_dataclass(sub):
                raise UserError(f"--set {text}: {'.'.join(parts[: i + 1])} is not a section")
            cls = sub
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UserError(f"--set {text}: {'.'.join(parts[: i + 1])} is not a section")
        node[parts[-1]] = value
    return out


def _load_plugins(raw: Any, where: str) -> None:
    """Import the modules a config's ``plugins:`` names, before its choices are checked."""
    names = raw.get("plugins") if isinstance(raw, dict) else None
    if names is None:
        return
    names = [names] if isinstance(names, str) else names
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise UserError(f"{where}: plugins must be a list of module names, got {_show(names)}")
    for name in names:
        plugins.load(name, source=f"{where}: plugins", allow_path=False)


def from_dict(raw: dict, where: str = "config") -> RunConfig:
    _load_plugins(raw, where)
    cfg = _build(RunConfig, raw, where)
    validate(cfg, where)
    return cfg


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Default YAML, layered with ``path`` (if given), then ``--set`` overrides; validated."""
    base = yaml.safe_load(default_yaml_text()) or {}
    where = "config (embedded default)"
    if path is not None:
        user = load_yaml(path)
        # validate the user's file on its own first so that errors name it
        _load_plugins(user, f"config {path}")
        _build(RunConfig, user, f"config {path}")
        base = _merge(base, user)
        where = f"config {path}"
    if overrides:
        base = apply_overrides(base, overrides)
        where = f"{where} with --set"
    return from_dict(base, where)


def _gradient_canaries(cfg: RunConfig) -> bool:
    """Whether the run audits with gradient canaries (they need the vmap strategy)."""
    return cfg.audit.score == "gradient" and bool(cfg.audit.canaries)


def validate(cfg: RunConfig, where: str = "config") -> None:
    """Cross-field rules (types, choices and ranges are the schema's, checked while building)."""

    def bad(msg):
        raise UserError(f"{where}: {msg}")

    p, t, d, m, tok = cfg.privacy, cfg.training, cfg.data, cfg.model, cfg.tokenizer
    if d.sample_rate is not None and d.max_users is not None:
        bad("data.sample_rate and data.max_users both sample the training users: give one")
    algo = ALGORITHMS.lookup(t.algorithm)
    gradient = algo.update == "gradient"  # the ghost strategy and gradient canaries need a gradient update
    if algo.private and not p.epsilon > 0:
        bad(f"privacy.epsilon must be > 0, got {p.epsilon}")
    if algo.private and p.epsilon > MAX_TARGET_EPSILON:
        most = MAX_TARGET_EPSILON
        bad(f"privacy.epsilon = {p.epsilon:g} promises nothing (e^epsilon overflows past ~709): at most {most:g}")
    if m.preset is None and m.path is None:
        bad("model: give model.preset (tiny, small, base) or model.path (a local directory)")
    if m.preset is not None and m.path is None and m.preset not in PRESETS:
        bad(f"model.preset must be one of {', '.join(PRESETS)}, got {m.preset!r}")
    if not DEVICE_SPEC.match(str(m.device).strip().lower()):
        bad(f"model.device must be auto, cpu, cuda or cuda:<index>, got {m.device!r}")
    if not gradient and t.per_unit in ("ghost", "batch"):
        bad(
            f"training.per_unit: {t.per_unit} takes gradients; {algo.__name__}'s update is {algo.update}, not a "
            "gradient (use auto or vmap)"
        )
    if algo.private and t.per_unit == "batch":
        bad(
            f"training.per_unit: batch computes no per-unit norm, so nothing would bound one user's share: it "
            f"serves training.algorithm: nonprivate only, not {t.algorithm} (use auto, ghost or vmap)"
        )
    if m.lora.quantize != "none":
        q = f"model.lora.quantize: {m.lora.quantize}"
        if not m.lora.enabled:
            bad(f"{q} needs model.lora.enabled: true (a 4-bit base is frozen; only the LoRA adapters train)")
        if not m.path:
            bad(
                f"{q} quantizes a local model folder (model.path); the presets are GPT-2, whose Conv1D layers "
                "bitsandbytes does not quantize"
            )
        if not gradient or t.per_unit == "vmap":
            bad(
                f"{q} needs the ghost per-unit strategy (a gradient update, such as ULS, ELS or nonprivate, with "
                "training.per_unit: auto or ghost): torch.func.vmap, which FedAvg and per_unit: vmap use, cannot "
                "run bitsandbytes' 4-bit matmul"
            )
        if _gradient_canaries(cfg):
            bad(f"{q}: gradient canaries (audit.score: gradient) run the vmap strategy; use audit.score: loss")
        if cfg.eval.personalize:
            bad(f"{q}: eval.personalize fine-tunes every weight of the merged model, which a 4-bit base cannot be")
    if d.source in ("jsonl", "csv", "stackexchange") and not d.path:
        bad(f"data.path is required for data.source = {d.source}")
    if tok.path and tok.trained_on_private and not tok.declared_public:
        bad(
            "tokenizer: a tokenizer trained on the private training records leaks them "
            "(docs/threat_model.md); train it on public text or set tokenizer.declared_public: true if "
            "that text is public"
        )
    cache = cfg.output.cache
    if cache not in ("shared", "run"):
        if not cache.strip():
            bad("output.cache must be shared, run or a folder for the project's private cache, got ''")
        near = difflib.get_close_matches(cache.lower(), ("shared", "run"), n=1, cutoff=0.6)
        if near and "/" not in cache and not cache.startswith((".", "~")) and not Path(cache).exists():
            # a slip for a keyword would put the private store in a new folder of that name, silently
            bad(
                f"output.cache: {cache!r} is not a keyword (shared, run): did you mean {near[0]}? To keep the "
                f"private cache in a folder of that name, write it as a path (./{cache})"
            )
        why = unclaimable(Path(cache).expanduser())
        if why:
            bad(
                f"output.cache: {cache} {why}; give shared, run, or a new or empty folder for the project's "
                "private cache"
            )
    a = cfg.audit
    if a.canaries != 0 and a.canaries < 2:
        bad(f"audit.canaries must be 0 (no audit) or at least 2, got {a.canaries}")
    if a.secret_tokens is not None and not 2 <= a.secret_tokens <= tok.seq_len:
        bad(f"audit.secret_tokens must be in [2, tokenizer.seq_len = {tok.seq_len}], got {a.secret_tokens}")
    if _gradient_canaries(cfg):
        if not gradient:
            bad(
                f"audit.score: gradient canaries need a gradient update (uls, els or nonprivate), not "
                f"{t.algorithm}'s {algo.update}"
            )
        if t.per_unit == "ghost":
            bad(
                "audit.score: gradient canaries add a term the ghost strategy cannot see; use "
                "training.per_unit: auto or vmap (an audit with them runs vmap)"
            )
        if not a.gradient_scale > 1:
            bad(
                "audit.gradient_scale must be > 1 (a canary's update must exceed the clip norm), got "
                f"{a.gradient_scale}"
            )
    pl = cfg.planning
    if cfg.plan == "auto":
        if pl.compute_budget is None:
            bad("plan: auto needs planning.compute_budget (gradients per step, e.g. 256)")
        if t.algorithm not in PLANNED_ALGORITHMS:
            bad(
                f"plan: auto chooses between uls and els; training.algorithm is {t.algorithm} "
                "(drop plan: auto, or set training.algorithm: uls)"
            )
        if p.noise_multiplier is not None:
            bad("plan: auto calibrates sigma to privacy.epsilon; drop privacy.noise_multiplier")


#: settings that change how a run computes, not what it releases: `userdp train --resume RUN --set`
#: may change them, and a run's ledger journal is bound to everything else (:func:`privacy_fingerprint`)
PERFORMANCE_KEYS = {
    "training": ("chunk_size", "memory_gb", "per_unit", "precision", "checkpoint_every", "sharding"),
    "model": ("device",),
    "eval": ("batch_size",),
    "output": ("plot", "tensorboard"),
}


def is_performance_key(dotted: str) -> bool:
    section, _, key = dotted.partition(".")
    return key in PERFORMANCE_KEYS.get(section, ())


def privacy_fingerprint(raw: dict) -> str:
    """sha256 of a config mapping without its performance settings (canonical JSON): what a run's
    ledger journal is bound to. Comments, key order and the performance keys do not count."""
    kept = {
        k: ({kk: vv for kk, vv in v.items() if kk not in PERFORMANCE_KEYS.get(k, ())} if isinstance(v, dict) else v)
        for k, v in raw.items()
    }
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()


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


def check_sharding(cfg: RunConfig, distributed: bool) -> None:
    """``training.sharding: fsdp`` needs a torchrun job and what the sharded step does (refused here, in
    one line, before the run directory is made; ``distributed``: the job has several processes).

    Raises:
        UserError: naming the setting."""
    if cfg.training.sharding != "fsdp":
        return
    why = None
    if not distributed:
        why = "shards the model over the processes of a job: launch with --nproc N (or torchrun)"
    elif cfg.model.lora.enabled and cfg.model.lora.quantize != "none":
        why = (
            f"cannot shard a quantized base (model.lora.quantize: {cfg.model.lora.quantize}): bitsandbytes' weights "
            "are not DTensors"
        )
    else:  # the engine's own rules, read before any work (training.algorithm, training.per_unit)
        why = unshardable(ALGORITHMS.lookup(cfg.training.algorithm).update, cfg.training.per_unit)
    if why:
        raise UserError(f"training.sharding: fsdp {why}; or set training.sharding: none")
