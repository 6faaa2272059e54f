"""Planning for a Hugging Face Trainer script (docs/hf.md): what ``userdp plan`` does for a config,
done on a ``datasets.Dataset`` and its user column.

    from userdp.hf_plan import plan_privacy
    planned = plan_privacy(model, dataset, "author", TrainConfig(algorithm=ULS(1, 0.01), steps=200,
                           target_epsilon=3.0), compute_budget=64)
    trainer = PrivateTrainer(model=model, args=args, train_dataset=dataset, privacy=planned, user_field="author")

The plan reads the private records without noise (the per-user counts for ELS's median, the
gradient norms of a sample of users for ULS's Estimate-and-Double): :class:`PlannedPrivacy` carries
that sentence with the chosen config, and the run's statement lists it under "Not accounted", as
``userdp train --plan`` does.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from userdp import planning
from userdp.engine import ELS, ULS, TrainConfig
from userdp.errors import UserError
from userdp.hf import UserRecords
from userdp.hf_boundary import PlannedPrivacy
from userdp.lm.models import causal_lm_loss
from userdp.validation import check_instance


def plan_privacy(
    model: Any,
    dataset: Any,
    user_field: str,
    privacy: TrainConfig,
    compute_budget: int,
    sample: planning.NormSample | None = None,
) -> PlannedPrivacy:
    """G, the sampling rate and the algorithm (ELS or ULS, whichever has the smaller noise proxy) for
    ``compute_budget`` gradients a step, over the users of ``dataset[user_field]``, at ``privacy``'s
    target epsilon, delta, accountant and steps; the rest of ``privacy`` (clipping, optimizer, noise,
    seed) is kept.

    Args:
        model: the model the Trainer will train (the gradient norms L(G) are measured on it).
        sample: the users L(G) is measured on (default: 128, unseeded).

    Raises:
        UserError: ``privacy`` without a target epsilon, or a dataset without the user column."""
    check_instance(privacy, "privacy", (TrainConfig,), "a userdp.engine.TrainConfig")
    if privacy.target_epsilon is None:
        raise UserError("plan_privacy: privacy needs target_epsilon (the plan calibrates sigma to it)")
    pad = getattr(getattr(model, "config", None), "pad_token_id", None)
    data = UserRecords(dataset, user_field, pad if pad is not None else 0)
    budget = planning.PlanBudget(
        compute_budget, privacy.target_epsilon, privacy.steps, delta=privacy.delta, accountant=privacy.accountant
    )
    was_training = model.training
    model.train()
    try:
        plan = planning.plan_for_training(data, model, causal_lm_loss, budget, sample or planning.NormSample())
    finally:
        model.train(was_training)
    if plan.recommended == "els":
        algorithm = ELS(int(plan.els["group_size"]), float(plan.els["sampling_rate"]))
    else:
        algorithm = ULS(int(plan.uls["group_size"]), float(plan.uls["sampling_rate"]))
    config = dataclasses.replace(privacy, algorithm=algorithm)
    return PlannedPrivacy(config, (f"userdp.hf_plan: {plan.data_touches}",), plan)
