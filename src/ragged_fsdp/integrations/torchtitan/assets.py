"""A small tokenizer and text data set for torchtitan's debug configs, generated locally.

torchtitan's debug configs read ``./tests/assets/tokenizer`` and ``tests/assets/c4_test``
from a torchtitan checkout; the wheel ships neither. :func:`make_assets` builds a byte-level
BPE tokenizer with torchtitan's special tokens and a json-lines corpus of generated
sentences (deterministic for a seed, no downloads), written atomically so that several
ranks may call it at once.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile

__all__ = ["make_assets", "default_root"]

_WORDS = (
    "the of and to in is was for on that with as by at from his her they which this be are "
    "an or had not but were have one all their has been first new would more two some time "
    "after other into over city world year state its school also made people may used part "
    "river music between under both three system early last where large house during game"
).split()
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def default_root() -> str:
    """Where the CPU mode keeps its generated assets (``$RAGGED_FSDP_ASSETS`` if set)."""
    return os.environ.get("RAGGED_FSDP_ASSETS") or os.path.join(
        os.path.expanduser("~"), ".cache", "ragged_fsdp", "torchtitan_cpu"
    )


def _texts(docs: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(docs):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(20, 120))]
        out.append(" ".join(words).capitalize() + ".")
    return out


def _write(tmp: str, texts: list[str], vocab: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok_dir, data_dir = os.path.join(tmp, "tokenizer"), os.path.join(tmp, "data")
    os.makedirs(tok_dir)
    os.makedirs(data_dir)
    with open(os.path.join(data_dir, "train.json"), "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(os.path.join(tok_dir, "tokenizer.json"))
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "add_bos_token": False, "add_eos_token": False}, f)


def make_assets(root: str | None = None, *, vocab: int = 512, docs: int = 400, seed: int = 0) -> tuple[str, str]:
    """The tokenizer folder and the data folder under ``root`` (built on first use)."""
    root = root or default_root()
    tok_dir, data_dir = os.path.join(root, "tokenizer"), os.path.join(root, "data")
    if os.path.exists(os.path.join(tok_dir, "tokenizer.json")):
        return tok_dir, data_dir
    os.makedirs(os.path.dirname(os.path.abspath(root)) or ".", exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".assets-", dir=os.path.dirname(os.path.abspath(root)))
    try:
        _write(tmp, _texts(docs, seed), vocab)
        try:
            os.rename(tmp, root)  # atomic; another rank may have won the race
        except OSError:
            if not os.path.exists(os.path.join(tok_dir, "tokenizer.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tok_dir, data_dir
