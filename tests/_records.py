"""An engine privacy record for tests that build a privacy statement without running training:
every field set, as a run of the given algorithm and event would set it."""

from userdp import accounting as A
from userdp.engine.privacy_record import PrivacyRecord


def engine_record(
    *,
    algorithm="uls",
    dp_event=None,
    epsilon=None,
    delta=1e-4,
    noise_multiplier=1.1,
    sampling_rate=0.05,
    steps=20,
    num_users=4000,
    expected_units=200.0,
    sampler_mode="poisson_users",
    delta_rule="delta = N^-1.1",
    **fields,
) -> PrivacyRecord:
    """A record; ``dp_event`` (a DpEvent or its dict) None makes a non-private one, and epsilon
    defaults to the event's at ``delta``."""
    event = A.event_from_dict(dp_event) if isinstance(dp_event, dict) else dp_event
    private = event is not None
    if epsilon is None and private:
        epsilon = A.epsilon(event, delta)
    base = dict(
        algorithm={"type": algorithm.upper(), "sampling_rate": sampling_rate},
        unit="user",
        num_users=num_users,
        num_units=num_users,
        expected_units_per_step=expected_units,
        denominator=expected_units,
        denominator_kind="fixed",
        sampler_mode=sampler_mode,
        sampler={"name": "poisson", "mode": sampler_mode, "accounted_as": "poisson"},
        noise_mechanism="iid_gaussian",
        noise_multiplier=noise_multiplier,
        update_noise_multiplier=noise_multiplier,
        count_noise_stddev=None,
        clipping={"type": "FlatClip", "clip_norm": 1.0},
        final_clip_norm=1.0,
        optimizer={"type": "SGD", "lr": 0.1},
        accountant="pld",
        steps_applied=steps,
        steps_accounted=steps,
        steps_lost_to_crashes=0,
        epsilon=epsilon if private else float("inf"),
        delta=delta,
        delta_rule=delta_rule,
        target_epsilon=None,
        calibrated=False,
        step_event=A.event_to_dict(event) if private else None,
        adjacency="add/remove" if private else None,
        dp_event_total=A.event_to_dict(event) if private else None,
        journal=None,
        seeded=False,
        randomness="keyed by 256 bits of operating-system entropy",
        noise_generator="PCG64 on the host",
        noise_kernel="host generator",
        precision={
            "autocast": "float32",
            "model": ["float32"],
            "master_weights": "the model's own",
            "norms_sums_noise": ["float32"],
            "float32_contractions": True,
        },
        per_unit={"strategy": "vmap", "requested": "auto", "fallback_reason": None, "device": "cpu"},
        nonfinite_units=0,
        nonfinite_units_note="not privatized",
        counts_treated_as_public=(f"the number of users N = {num_users}",),
        warning=None if private else "noise_multiplier = 0: this run is NOT differentially private",
    )
    base.update(fields)
    return PrivacyRecord(**base)
