"""TRL's ``SFTTrainer`` made user-level private: :class:`PrivateSFTTrainer` (``pip install userdp[trl]``).

An SFT script keeps its model, tokenizer, ``SFTConfig``, chat template, prompt-completion or
conversational dataset, ``peft_config`` and callbacks; it adds a user column and a userdp
:class:`~userdp.engine.TrainConfig`, and swaps the class::

    from userdp.hf_trl import PrivateSFTTrainer

    trainer = PrivateSFTTrainer(model=model, args=SFTConfig(...), train_dataset=ds,  # rows: prompt, completion, user
                                processing_class=tokenizer, privacy=privacy, user_field="user")
    trainer.train()

TRL prepares the data as it always does (chat template, tokenization, ``labels`` with -100 on
what ``completion_only_loss`` / ``assistant_only_loss`` leave out, truncation to ``max_length``);
the user column rides along, and the prepared rows become userdp's records, grouped by author.
Everything :class:`userdp.hf.PrivateTrainer` says holds here too (the cohort, the clipped and
noised update, the ledger, the run directory that ``userdp report`` verifies). What SFT adds:

* ``packing`` is refused: it concatenates records of different users into one training sequence
  (and drops the user column), so one sequence would carry several people's text.
* ``padding_free`` is refused for the same reason (one flattened batch row across records).
* ``bf16`` (on by default in ``SFTConfig``) is set aside and said, as by ``PrivateTrainer``
  (:func:`userdp.hf.set_aside_bf16`): mixed precision is ``Performance(precision="bfloat16")``'s.
* ``model`` given as a name must be a local folder: userdp downloads nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from trl import SFTTrainer

from userdp.engine import TrainConfig
from userdp.errors import UserError
from userdp.hf import PrivateTrainer
from userdp.lm.models import causal_lm_loss

#: SFTConfig settings refused, with why: (name, is_set(value), reason)
SFT_REFUSED: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    (
        "packing",
        bool,
        "packing joins records of different users into one training sequence (and drops the user "
        "column), so one sequence would carry several people's text: train unpacked (packing=False)",
    ),
    ("padding_free", bool, "padding-free batches flatten several records into one row: set padding_free=False"),
)


def _check_chat_template(dataset: Any, tokenizer: Any) -> None:
    """A conversational dataset (a ``messages`` column, or prompts as lists of messages) needs a
    tokenizer with a chat template: TRL's message for its absence is a paragraph from transformers.

    Raises:
        UserError: naming processing_class."""
    columns = list(getattr(dataset, "column_names", None) or [])
    if not columns or tokenizer is None or getattr(tokenizer, "chat_template", None):
        return
    first = dataset[0] if len(dataset) else {}
    conversational = "messages" in columns or isinstance(first.get("prompt"), list)
    if conversational:
        raise UserError(
            "processing_class: the dataset is conversational (lists of messages) but the tokenizer has no "
            "chat template: set tokenizer.chat_template (or give prompt/completion text)"
        )


class PrivateSFTTrainer(PrivateTrainer, SFTTrainer):
    """TRL's ``SFTTrainer`` whose training steps are userdp's (see the module docstring).

    Args (beyond the SFTTrainer's own): ``privacy``, ``user_field``, ``loss_fn``, as for
    :class:`userdp.hf.PrivateTrainer`.

    Raises:
        UserError: a refused ``SFTConfig`` or ``TrainingArguments`` setting, a model name that is
            not a local folder, or what :class:`~userdp.hf.PrivateTrainer` refuses.
    """

    def __init__(
        self,
        model,
        args=None,
        *rest,
        privacy: TrainConfig,
        user_field: str = "user",
        loss_fn: Callable = causal_lm_loss,
        **kwargs,
    ):
        if isinstance(model, (str, Path)) and not Path(model).is_dir():
            raise UserError(
                f"PrivateSFTTrainer: model {str(model)!r} is not a local folder (userdp downloads "
                "nothing: give a model object or a folder from save_pretrained)"
            )
        set_aside = []
        if args is not None:
            for name, is_set, why in SFT_REFUSED:
                value = getattr(args, name, None)
                if value is not None and is_set(value):
                    raise UserError(f"SFTConfig.{name}={value!r}: {why}")
        dataset = kwargs.get("train_dataset", rest[1] if len(rest) > 1 else None)
        _check_chat_template(dataset, kwargs.get("processing_class", rest[3] if len(rest) > 3 else None))
        before = len(dataset) if hasattr(dataset, "__len__") else None
        try:
            super().__init__(model, args, *rest, privacy=privacy, user_field=user_field, loss_fn=loss_fn, **kwargs)
        except UserError:
            raise
        except (ValueError, TypeError, KeyError) as exc:  # TRL's own preparation of the data refused it
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:240]
            raise UserError(
                f"train_dataset: TRL's SFTTrainer could not prepare it ({type(exc).__name__}: {first})"
            ) from None
        after = len(self.train_dataset) if hasattr(self.train_dataset, "__len__") else None
        if before is not None and after is not None and after < before:  # dropped rows are counted and said
            set_aside.append(
                f"TRL dropped {before - after} of {before} examples with nothing to learn (every label "
                "masked, e.g. a prompt longer than max_length leaves no completion)"
            )
        self.userdp_notes = set_aside + list(self.userdp_notes)
