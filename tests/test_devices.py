"""Device and precision resolution: clear errors for what this machine cannot do, and the
defaults a CPU-only machine gets (the GPU paths are exercised on the device machine, never here)."""

import pytest
import torch

from userdp.devices import describe, resolve_device, resolve_precision
from userdp.errors import UserError
from userdp.lm import config as C


def test_auto_and_cpu_resolve_on_this_machine():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device(" CPU ") == torch.device("cpu")
    assert describe(torch.device("cpu")) == "cpu"


@pytest.mark.parametrize("spec", ["gpu", "cuda:", "cuda:x", "mps0", ""])
def test_a_malformed_device_is_named(spec):
    with pytest.raises(UserError, match=r"model.device must be auto, cpu, cuda or cuda:<index>"):
        resolve_device(spec)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_cuda_on_a_machine_without_one_says_so():
    with pytest.raises(UserError, match=r"--device: cuda:1 was asked for but this machine has no CUDA"):
        resolve_device("cuda:1", name="--device")


def test_precision_auto_is_float32_on_a_cpu_and_float16_is_refused_there():
    cpu = torch.device("cpu")
    assert resolve_precision("auto", cpu) == "float32"
    assert resolve_precision("bfloat16", cpu) == "bfloat16"
    with pytest.raises(UserError, match="training.precision: float16 autocast needs a GPU"):
        resolve_precision("float16", cpu)
    with pytest.raises(UserError, match="training.precision must be auto, float32, bfloat16 or float16"):
        resolve_precision("half", cpu)


def test_config_names_a_bad_device_and_ghost_with_fedavg(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model:\n  device: gpu\n")
    with pytest.raises(UserError, match=r"c.yaml.*model.device must be auto, cpu, cuda"):
        C.load_config(f)
    f.write_text("training:\n  algorithm: fedavg\n  per_unit: ghost\n")
    with pytest.raises(UserError, match=r"training.per_unit: ghost takes gradients.*FedAvg"):
        C.load_config(f)
    f.write_text("training:\n  precision: int8\n")
    with pytest.raises(UserError, match=r"training.precision must be one of"):
        C.load_config(f)
    cfg = C.load_config(None, ["model.device=cpu", "training.per_unit=vmap", "training.precision=bfloat16"])
    assert (cfg.model.device, cfg.training.per_unit, cfg.training.precision) == ("cpu", "vmap", "bfloat16")
