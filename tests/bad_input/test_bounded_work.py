"""Work a user did not mean is refused up front, in one line: a target epsilon that promises
nothing, step and epoch counts that would run for days, an accountant's grid that cannot fit.

The rule is one bound per quantity, held in one place (``accounting.MAX_TARGET_EPSILON``,
``validation.MAX_STEPS``, ``validation.MAX_EPOCHS``) and applied by every entry that takes it: the
accounting functions, ``TrainConfig`` and the algorithms (``make_private``, the Trainer), and the
CLI's config. Each case is timed against a bound well under what the unbounded work took (the
ELS step search at epsilon = 1e6 ran 107 s; the unamplified one asked numpy for 137 GiB).
"""

import time

import pytest

from userdp import accounting
from userdp.accounting import accountants as acc_mod
from userdp.accounting.mechanism import Mechanism
from userdp.engine import SGD, ULS, FedAvg, TrainConfig
from userdp.errors import UserError
from userdp.lm import config as C
from userdp.lm.evaluate import Personalization
from userdp.validation import MAX_EPOCHS, MAX_STEPS

KINDS = {
    "els": {"sampling_rate": 0.01, "group_size": 8},
    "uls": {"sampling_rate": 0.01},
    "no_amplification": {"group_size": 4},
}


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("epsilon", [1e6, 1e4, accounting.MAX_TARGET_EPSILON * (1 + 1e-9)])
def test_a_step_search_past_the_largest_epsilon_is_refused_at_once(kind, epsilon):
    event = Mechanism(kind, 1.0, 1, **KINDS[kind]).step_event()
    t0 = time.monotonic()
    with pytest.raises(UserError, match=r"epsilon = .* promises nothing.*at most 1000"):
        accounting.max_steps(event, epsilon, 1e-6)
    assert time.monotonic() - t0 < 1.0


@pytest.mark.parametrize("epsilon", [1e6, 1001.0])
def test_every_entry_that_takes_a_target_epsilon_applies_the_same_bound(epsilon):
    event = Mechanism("uls", 1.0, 1, sampling_rate=0.01).step_event()
    with pytest.raises(UserError, match="promises nothing"):
        accounting.max_steps(event, epsilon, 1e-6)
    with pytest.raises(UserError, match="promises nothing"):
        accounting.calibrate_noise_multiplier(
            lambda s: Mechanism("uls", s, 1, sampling_rate=0.01).step_event(), 10, epsilon, 1e-6
        )
    with pytest.raises(UserError, match="target_epsilon = .* promises nothing"):
        TrainConfig(algorithm=ULS(4, 0.01), steps=10, optimizer=SGD(0.1), target_epsilon=epsilon, noise_multiplier=1.0)
    with pytest.raises(UserError, match=r"privacy.epsilon = .* promises nothing"):
        C.load_config(None, [f"privacy.epsilon={epsilon}"])
    # the bound itself is accepted where it is a budget (the search may still refuse on time)
    TrainConfig(algorithm=ULS(4, 0.01), steps=10, optimizer=SGD(0.1), target_epsilon=accounting.MAX_TARGET_EPSILON)


def test_a_grid_that_cannot_fit_in_memory_is_answered_by_rdp_and_says_so(monkeypatch):
    def no_memory(*args, **kwargs):
        raise MemoryError("Unable to allocate 137. GiB")

    event = accounting.compose(Mechanism("no_amplification", 1.0, 1, group_size=4).step_event(), 1000)
    rdp_eps = accounting.epsilon(event, 1e-6, "rdp")
    monkeypatch.setattr(acc_mod._pld_mod, "pld_distribution", no_memory)
    eps, used = accounting.epsilon_and_accountant(event, 1e-6, "pld")
    assert used == "rdp (PLD infeasible: its grid would not fit in memory)"
    assert eps == pytest.approx(rdp_eps)
    assert accounting.delta(event, eps, "pld") == pytest.approx(accounting.delta(event, eps, "rdp"))


def test_steps_past_the_bound_are_refused_by_the_engine_and_the_cli_alike():
    with pytest.raises(UserError, match=f"steps must be at most {MAX_STEPS:,}"):
        TrainConfig(algorithm=ULS(4, 0.01), steps=MAX_STEPS + 1, optimizer=SGD(0.1), noise_multiplier=1.0)
    with pytest.raises(UserError, match="training.steps"):
        C.load_config(None, [f"training.steps={MAX_STEPS + 1}"])
    assert (
        TrainConfig(algorithm=ULS(4, 0.01), steps=MAX_STEPS, optimizer=SGD(0.1), noise_multiplier=1.0).steps
        == MAX_STEPS
    )


@pytest.mark.parametrize("epochs", [MAX_EPOCHS + 1, 100_000])
def test_per_user_epochs_past_the_bound_are_refused_wherever_they_are_given(epochs):
    with pytest.raises(UserError, match=f"personalization epochs must be at most {MAX_EPOCHS:,}"):
        Personalization(epochs=epochs)
    with pytest.raises(UserError, match=f"FedAvg local epochs must be at most {MAX_EPOCHS:,}"):
        FedAvg(4, 0.1, local_epochs=epochs)
    with pytest.raises(UserError, match="eval.personalize_epochs"):
        C.load_config(None, [f"eval.personalize_epochs={epochs}"])
    with pytest.raises(UserError, match="training.local_epochs"):
        C.load_config(None, [f"training.local_epochs={epochs}"])
    assert Personalization(epochs=MAX_EPOCHS).epochs == MAX_EPOCHS
    assert FedAvg(4, 0.1, local_epochs=MAX_EPOCHS).local_epochs == MAX_EPOCHS


def test_a_personalization_with_a_wrong_type_is_one_line():
    for bad in ({"epochs": 2.5}, {"lr": -1.0}, {"batch_size": 0}, {"seed": -1}, {"epochs": "4"}):
        with pytest.raises(UserError, match="personalization"):
            Personalization(**bad)
