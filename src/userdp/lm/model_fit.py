"""A model folder must fit its tokenizer and the configured sequence length: checked from the
folder's ``config.json`` and ``tokenizer.json`` when the job starts, before any data is read (a
mismatch otherwise surfaced deep inside torch as ``IndexError: index out of range in self``,
after the data was read and tokenized).

Three numbers are compared, and a refusal names the folder and both numbers: the largest token
id the tokenizer can produce (added and special tokens included) against the model's embedding
rows (``vocab_size``), and ``tokenizer.seq_len`` against the model's positions
(``n_positions`` / ``max_position_embeddings``)."""

from __future__ import annotations

import json
from pathlib import Path

from userdp.errors import UserError
from userdp.lm import config as C
from userdp.lm import models
from userdp.lm.tokenization import load_tokenizer

#: config.json keys that hold a model's number of positions, by family (GPT-2's first)
POSITION_KEYS = ("n_positions", "max_position_embeddings", "n_ctx", "seq_length")


def _config_numbers(folder: Path, name: str) -> tuple[int | None, int | None]:
    """(vocab_size, positions) from ``folder/config.json`` (a multimodal config's text part too)."""
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"model.path {name}: config.json is unreadable ({exc})") from None
    if not isinstance(raw, dict):
        raise UserError(f"model.path {name}: config.json is not a JSON object")
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    vocab = raw.get("vocab_size", text.get("vocab_size"))
    positions = next((src[k] for k in POSITION_KEYS for src in (raw, text) if isinstance(src.get(k), int)), None)
    return (vocab if isinstance(vocab, int) else None), positions


def check_model_fits(m: C.ModelConfig, t: C.TokenizerConfig) -> None:
    """Refuse a model folder that cannot read what its tokenizer writes (see the module docstring).
    Nothing to check for a preset (it is built to fit) or an adapter folder (its base is checked
    when it loads).

    Raises:
        UserError: naming model.path (or tokenizer.path) and the two numbers that disagree."""
    if not m.path:
        return
    folder = models.resolve_model_path(m.path)
    if not (folder / "config.json").is_file():
        return
    vocab, positions = _config_numbers(folder, str(m.path))
    source = Path(t.path) if t.path else folder
    tok_file = source / "tokenizer.json" if source.is_dir() else source
    if not tok_file.is_file():
        if t.path:
            raise UserError(f"tokenizer.path: no tokenizer.json at {t.path}")
        raise UserError(
            f"model.path {m.path}: the folder holds no tokenizer.json (save the tokenizer beside the "
            "model with tokenizer.save_pretrained(folder), or give tokenizer.path)"
        )
    tok = load_tokenizer(tok_file)
    ids = tok.get_vocab(with_added_tokens=True).values()
    top = max(ids) if ids else -1
    if vocab is not None and top >= vocab:
        raise UserError(
            f"model.path {m.path}: its tokenizer writes token ids up to {top}, but the model has "
            f"{vocab} embedding rows (config.json vocab_size): resize the embeddings to the tokenizer "
            "(model.resize_token_embeddings(len(tokenizer))) and save the folder again"
        )
    if positions is not None and t.seq_len > positions:
        raise UserError(
            f"tokenizer.seq_len {t.seq_len} is longer than the {positions} positions of {m.path} "
            f"(config.json): set tokenizer.seq_len to at most {positions}"
        )
