"""`userdp train` configuration: defaults, unknown keys, wrong types, --set overrides."""

import pytest
import torch

from userdp.errors import UserError
from userdp.lm import config as C


def test_embedded_default_is_the_shakespeare_uls_eps3_job():
    cfg = C.load_config()
    assert cfg.data.source == "shakespeare"
    assert cfg.training.algorithm == "uls"
    assert cfg.privacy.epsilon == 3.0
    assert cfg.privacy.delta is None  # N^-1.1
    assert cfg.model.preset and cfg.model.pretrain


def test_unknown_key_in_file_is_named(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("training:\n  stepz: 10\n")
    with pytest.raises(UserError, match=r"c.yaml.*unknown key 'training.stepz'"):
        C.load_config(f)
    f.write_text("trainin:\n  steps: 10\n")
    with pytest.raises(UserError, match="unknown key 'trainin'"):
        C.load_config(f)


def test_wrong_type_and_choice_are_named(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("training:\n  steps: ten\n")
    with pytest.raises(UserError, match="training.steps must be an integer"):
        C.load_config(f)
    f.write_text("training:\n  algorithm: dpsgd\n")
    with pytest.raises(UserError, match="training.algorithm must be one of"):
        C.load_config(f)
    f.write_text("model:\n  lora: 3\n")
    with pytest.raises(UserError, match="model.lora must be a mapping"):
        C.load_config(f)


def test_invalid_yaml_names_the_line(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("training:\n  steps: 10\n  lr: [1,\n")
    with pytest.raises(UserError, match="line"):
        C.load_config(f)


def test_set_overrides_dotted_keys_parse_yaml_values(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("training:\n  steps: 10\n")
    cfg = C.load_config(
        f, ["training.steps=25", "model.lora.enabled=true", "model.lora.target_modules=[c_attn]", "privacy.delta=1e-6"]
    )
    assert cfg.training.steps == 25
    assert cfg.model.lora.enabled is True
    assert cfg.model.lora.target_modules == ("c_attn",)
    assert cfg.privacy.delta == 1e-6
    with pytest.raises(UserError, match="unknown key 'training.stepz'"):
        C.load_config(None, ["training.stepz=3"])
    with pytest.raises(UserError, match="key=value"):
        C.load_config(None, ["training.steps"])
    with pytest.raises(UserError, match="unknown key 'nosuch'"):
        C.load_config(None, ["nosuch.x=1"])


def test_cross_field_checks():
    with pytest.raises(UserError, match="privacy.epsilon must be > 0"):
        C.load_config(None, ["privacy.epsilon=0"])
    with pytest.raises(UserError, match="data.path is required"):
        C.load_config(None, ["data.source=jsonl"])
    with pytest.raises(UserError, match="trained on the private"):
        C.load_config(None, ["tokenizer.path=/x", "tokenizer.trained_on_private=true"])


def test_dump_round_trips():
    import yaml

    cfg = C.load_config(None, ["model.lora.target_modules=[c_attn]"])
    again = C.from_dict(yaml.safe_load(C.dump_yaml(cfg)))
    assert again == cfg


def test_engine_config_maps_each_algorithm():
    from userdp.lm.job_plan import engine_config

    CPU = torch.device("cpu")  # where the job resolved model.device

    e = engine_config(
        C.load_config(None, ["training.algorithm=els", "training.cohort_size=50", "training.group_size=3"]), 1000, CPU
    )
    assert type(e.algorithm).__name__ == "ELS" and e.algorithm.sampling_rate == 0.05
    assert e.algorithm.group_size == 3 and e.target_epsilon == 3.0 and e.noise_multiplier is None
    u = engine_config(C.load_config(None, ["training.cohort_size=10"]), 100, CPU)
    assert type(u.algorithm).__name__ == "ULS" and u.algorithm.sampling_rate == 0.1
    f = engine_config(
        C.load_config(None, ["training.algorithm=fedavg", "training.local_epochs=2", "training.local_lr=0.3"]), 100, CPU
    )
    assert type(f.algorithm).__name__ == "FedAvg" and f.algorithm.local_epochs == 2
    n = engine_config(C.load_config(None, ["training.algorithm=nonprivate"]), 100, CPU)
    assert n.noise_multiplier == 0.0 and n.target_epsilon is None
    z = engine_config(C.load_config(None, ["privacy.noise_multiplier=1.5"]), 100, CPU)
    assert z.noise_multiplier == 1.5 and z.target_epsilon == 3.0  # the ledger still enforces the target
    s = engine_config(C.load_config(None, ["privacy.sampler=shuffle"]), 100, CPU)
    assert s.sampling == "shuffle"


def test_schema_refuses_the_hostile_testers_values_with_the_key_named():
    # issue 26: each of these was a traceback after data preparation, or ran as given
    for setting, message in {
        "training.steps=.inf": "training.steps must be an integer, got inf",
        "training.steps=.nan": "training.steps must be an integer, got nan",
        "training.steps=1.0e+309": "training.steps must be an integer, got inf",
        "training.seed=-1": "training.seed must be >= 0, got -1",
        "data.split_seed=-1": "data.split_seed must be >= 0",
        "planning.seed=-1": "planning.seed must be >= 0",
        "training.momentum=-1": "training.momentum must be >= 0",
        "training.momentum=1": "training.momentum must be < 1",
        "training.weight_decay=-1": "training.weight_decay must be >= 0",
        "eval.batch_size=0": "eval.batch_size must be >= 1",
        "eval.batch_size=-1": "eval.batch_size must be >= 1",
        "data.max_eval_users=-1": "data.max_eval_users must be >= 1",
        "model.pretraining.batch_size=0": "model.pretraining.batch_size must be >= 1",
        "model.pretraining.lr=-1": "model.pretraining.lr must be > 0",
        "model.pretraining.warmup=-5": "model.pretraining.warmup must be >= 0",
        "eval.personalize_epochs=-1": "eval.personalize_epochs must be >= 1",
        "training.clip_norm=1e-320": "training.clip_norm must be >= 1e-30",
        "training.steps='5'": "training.steps must be an integer, got '5'",
        "model.lora.enabled=1": "model.lora.enabled must be true or false, got 1",
        "data.sites=[1]": r"data.sites\[0\] must be a string, got 1",
        "privacy.delta=1": "privacy.delta must be < 1",
    }.items():
        with pytest.raises(UserError, match=message):
            C.load_config(None, [setting])


def test_unknown_keys_get_a_did_you_mean_at_every_depth():
    with pytest.raises(UserError, match=r"unknown key 'training.stpes' \(did you mean steps\?\)"):
        C.load_config(None, ["training.stpes=5"])
    with pytest.raises(UserError, match=r"unknown key 'model.lora.rnak' \(did you mean rank\?\)"):
        C.load_config(None, ["model.lora.rnak=5"])
    with pytest.raises(UserError, match=r"unknown key 'privcy' \(did you mean privacy\?\)"):
        C.load_config(None, ["privcy.epsilon=5"])
    with pytest.raises(UserError, match=r"unknown key 'zzz' \(known keys: plugins, plan, planning, data"):
        C.load_config(None, ["zzz=1"])


def test_yaml_merge_keys_load_and_may_be_overridden(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("training:\n  <<: {steps: 7, lr: 0.01}\n  steps: 9\n")
    cfg = C.load_config(f)
    assert (cfg.training.steps, cfg.training.lr) == (9, 0.01)
    f.write_text("training:\n  steps: 3\n  steps: 4\n")  # a key given twice is still refused
    with pytest.raises(UserError, match="appears twice"):
        C.load_config(f)


@pytest.mark.slow
def test_deeply_nested_values_are_one_line_not_a_recursion_error(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("nosuch: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(UserError, match="nested too deeply"):
        C.load_config(f)
    with pytest.raises(UserError, match="nested too deeply"):
        C.load_config(None, ["nosuch=" + "[" * 5000 + "]" * 5000])


def test_integral_floats_and_auto_are_accepted_as_before():
    cfg = C.load_config(
        None, ["training.steps=5.0", "training.chunk_size=auto", "privacy.delta=1e-6", "data.sites=stackoverflow"]
    )
    assert cfg.training.steps == 5 and isinstance(cfg.training.steps, int)
    assert cfg.training.chunk_size is None and cfg.privacy.delta == 1e-6
    assert cfg.data.sites == ("stackoverflow",)
