"""A tiny tokenizer and data set torchtitan can load offline (its wheel ships no test assets).

The tokenizer is byte-level (the 256 byte symbols of GPT-2's byte-level alphabet, no merges, and
``<|begin_of_text|>`` / ``<|end_of_text|>``), in Hugging Face's ``tokenizer.json`` format, which
torchtitan's ``HuggingFaceTokenizer`` reads. The data set is a JSON-lines file of ``{"text": ...}``
documents, the format of its ``c4_test``: the first Python standard-library sources, one file a
document, the same on every machine with the same Python.
"""

from __future__ import annotations

import json
import os
import sysconfig

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def write_tokenizer(folder: str) -> None:
    """``tokenizer.json`` and ``tokenizer_config.json`` of the byte-level tokenizer in ``folder``."""
    os.makedirs(folder, exist_ok=True)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([BOS, EOS])
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "add_bos_token": True,
                   "add_eos_token": True}, f)


def write_dataset(folder: str, n_docs: int = 64, max_chars: int = 8000) -> None:
    """``train.jsonl`` in ``folder``: the first ``n_docs`` stdlib sources (sorted), each cut."""
    os.makedirs(folder, exist_ok=True)
    root = sysconfig.get_paths()["stdlib"]
    names = sorted(n for n in os.listdir(root) if n.endswith(".py"))[:n_docs]
    with open(os.path.join(folder, "train.jsonl"), "w") as out:
        for name in names:
            with open(os.path.join(root, name), encoding="utf-8", errors="replace") as f:
                out.write(json.dumps({"text": f.read(max_chars)}) + "\n")


def write_assets(folder: str) -> tuple[str, str]:
    """Both, under ``folder``; returns (tokenizer folder, data set folder)."""
    tokenizer, dataset = os.path.join(folder, "tokenizer"), os.path.join(folder, "c4_tiny")
    write_tokenizer(tokenizer)
    write_dataset(dataset)
    return tokenizer, dataset
