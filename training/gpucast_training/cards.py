"""GPU cards: their memory as the service's catalogue has it (data/gpus.json, the one place it is
written; the binary embeds the same file), and the cards the published rows name.

Standard library only (the stdlib stages and the tests import it).
"""

import functools
import json
import os
import re

CATALOGUE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "data", "gpus.json"
)


@functools.lru_cache(maxsize=None)
def catalogue():
    """The catalogue's entries by id."""
    with open(CATALOGUE) as f:
        return {card["id"]: card for card in json.load(f)["gpus"]}


def memory_mib(gpu):
    """The usable memory (MiB, as nvidia-smi reports it) of the catalogue entry with this id."""
    return catalogue()[gpu]["memory_mib"]


# The cards of the published rows (public_training_memory.csv's `gpu` column, as the rows of
# data/public/*.jsonl.gz carry it, in its own spellings): the catalogue id, or a card the
# catalogue does not hold, described by its memory as a request may describe one; None (no
# pattern matches): not stated.
PUBLIC_CARDS = [
    (r"4070 Ti SUPER", {"name": "RTX 4070 Ti SUPER", "capacity_mib": 16376}),
    (r"A10G", "a10g"),
    (r"A100-SXM4-40GB|A100 40GB|2x 40GB", "a100-40gb"),
    (r"A100 80GB|80GB implied|60 GiB peak", "a100-80gb"),
    (r"V100-SXM2 16GB", "v100-16gb"),
    (r"RTX 3090", "rtx-3090"),
    (r"L40S", "l40s"),
    (r"RTX 4090", "rtx-4090"),
    (r"H100 80GB", "h100-80gb"),
]


def card_of(text):
    """The card a published row's `gpu` text names (a catalogue id or a described card), or None."""
    for pattern, card in PUBLIC_CARDS:
        if re.search(pattern, text):
            return card
    return None


def capacity_of(card):
    """The memory (MiB) of what `card_of` answered: the catalogue's for an id; None for None."""
    if card is None:
        return None
    if isinstance(card, dict):
        return card["capacity_mib"]
    return memory_mib(card)
