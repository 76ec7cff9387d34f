"""The demo `embed-text` pipeline's stages and data: Tokenize (UTF-8 text -> int64 token ids,
padded or cut to a fixed length) with a Hugging Face `tokenizers` WordPiece vocabulary the demo
trains on the text it ships (demo_corpus.CORPUS), and L2Normalize (a vector scaled to unit length).
"""
from __future__ import annotations

import os

import numpy as np
import torch

TOKENS = 16            # every text becomes 16 ids: equal shapes, so the demo embed model batches them
VOCAB_SIZE = 1000      # the demo embed model's table has 1000 rows
PAD, UNKNOWN = "[PAD]", "[UNK]"


def train_tokenizer(path: str) -> str:
    """Train the demo's WordPiece vocabulary on demo_corpus.CORPUS and save it as `path`
    (tokenizer.json, padding and truncation to TOKENS set in it); kept when already there."""
    if os.path.exists(path):
        return path
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    from tgw.workers.demo_corpus import CORPUS
    tokenizer = Tokenizer(models.WordPiece(unk_token=UNKNOWN))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=VOCAB_SIZE, special_tokens=[PAD, UNKNOWN], show_progress=False)
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    tokenizer.enable_padding(pad_id=tokenizer.token_to_id(PAD), pad_token=PAD, length=TOKENS)
    tokenizer.enable_truncation(max_length=TOKENS)
    tokenizer.save(path + ".tmp")
    os.replace(path + ".tmp", path)
    return path


class Tokenize:
    """text bytes [] (UTF-8) -> tokens int64 [16]. options: tokenizer (a tokenizer.json), length
    (default 16: the declared output's). A row that is not UTF-8 fails alone."""

    def setup(self, context) -> None:
        from tokenizers import Tokenizer
        path = context.options.get("tokenizer")
        if not path:
            raise ValueError(f"stage {context.name}: options.tokenizer (a tokenizer.json) is missing")
        self.length = int(context.options.get("length", TOKENS))
        self.tokenizer = Tokenizer.from_file(path)
        pad = self.tokenizer.token_to_id(PAD)
        self.tokenizer.enable_padding(pad_id=pad if pad is not None else 0, pad_token=PAD, length=self.length)
        self.tokenizer.enable_truncation(max_length=self.length)

    def __call__(self, batch) -> dict:
        texts = []
        for row, data in enumerate(batch["text"]):
            try:
                texts.append(bytes(data).decode("utf-8"))
            except UnicodeDecodeError as exc:
                batch.fail(row, f"text is not UTF-8: {exc}")
                texts.append("")
        ids = np.array([e.ids for e in self.tokenizer.encode_batch(texts)], np.int64).reshape(len(texts), self.length)
        return {"tokens": ids}


class L2Normalize:
    """vector float32 [n] -> the same scaled to unit length (a zero vector stays zero).
    options: input and output (the tensor names; default vector and embedding)."""

    def setup(self, context) -> None:
        self.input = context.options.get("input", "vector")
        self.output = context.options.get("output", "embedding")

    def __call__(self, batch) -> dict:
        x = torch.as_tensor(batch[self.input], dtype=torch.float32)
        return {self.output: torch.nn.functional.normalize(x, p=2.0, dim=-1)}
