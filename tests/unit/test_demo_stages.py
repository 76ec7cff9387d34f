"""The demo's stages (tgw.workers.demo_stages) called in-process with a StageBatch, as a worker calls
them: decode of real JPEGs and a corrupt one failing its row alone, tokenize padding and
truncating, top-k labels and softmax scores, L2 normalisation; and their declarations agree
with what they return."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tgw.workers.demo_stages import (LABELS_FILE, DecodeImage, L2Normalize, Sleep, Tokenize, TopK, build_demo_data,
                                     demo_stage_decls)
from tgw.workers.demo_text import TOKENS
from tgw.workers.demo_vision import DECODERS, IMAGE_SIZES, draw_image, label_lines, normalise
from tgw.workers.stage import StageBatch, StageContext


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    return build_demo_data(str(tmp_path_factory.mktemp("demo")))


def ready(cls, **options):
    stage = cls()
    stage.setup(StageContext(name=cls.__name__.lower(), version="1", dir="", device=torch.device("cpu"), threads=1,
                             options=options))
    return stage


def call(stage, rows: int, **inputs):
    batch = StageBatch(rows, torch.device("cpu"), inputs)
    return stage(batch), batch.failed


def test_decode_image_gives_the_resnet_input_and_fails_only_the_corrupt_row():
    images = [draw_image(i, w, h) for i, (w, h) in enumerate(IMAGE_SIZES[:3])]
    corrupt = b"\xff\xd8\xff\xe0 this is not a JPEG after all"
    out, failed = call(ready(DecodeImage), 4, image=[images[0], corrupt, images[1], images[2]])
    pixels = np.asarray(out["pixels"])
    assert pixels.shape == (4, 3, 64, 64) and pixels.dtype == np.float32
    assert list(failed) == [1] and failed[1].startswith("not a decodable JPEG: ")
    # the chosen decoder agrees with Pillow's full decode up to resampling differences
    reference = normalise(DECODERS["pillow"](images[0]))
    assert np.abs(pixels[0] - reference).mean() < 0.1
    assert pixels[0].std() > 0.1   # an image, not the zeros of a failed row


def test_decode_image_fails_a_truncated_jpeg_and_an_empty_row():
    good = draw_image(0, 96, 80)
    _, failed = call(ready(DecodeImage), 3, image=[good[: len(good) // 3], b"", good])
    assert sorted(failed) == [0, 1] and all(m.startswith("not a decodable JPEG") for m in failed.values())


def test_tokenize_pads_short_texts_truncates_long_ones_and_fails_bad_utf8(data):
    stage = ready(Tokenize, tokenizer=data["tokenizer"])
    long = ("the river ran slowly past the old mill " * 10).encode()
    out, failed = call(stage, 3, text=[b"a pipeline", long, b"\xff\xfe not text"])
    tokens = np.asarray(out["tokens"])
    assert tokens.shape == (3, TOKENS) and tokens.dtype == np.int64
    pad = stage.tokenizer.token_to_id("[PAD]")
    assert (tokens[0, 2:] == pad).all() and (tokens[0, :2] != pad).all()   # "a", "pipeline": known words
    assert (tokens[1] != pad).all()                                           # cut to 16, no padding
    assert list(failed) == [2] and "not UTF-8" in failed[2]
    assert tokens.max() < 1000   # the demo embed model's table


def test_tokenize_needs_its_tokenizer_file():
    with pytest.raises(ValueError, match="options.tokenizer"):
        ready(Tokenize)


def test_top5_gives_the_best_labels_with_softmax_scores(data):
    stage = ready(TopK, labels=data["labels"], k=5)
    logits = torch.zeros(2, 1000)
    logits[0, [7, 3, 999, 500, 42]] = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0])
    logits[1, 0] = 10.0
    out, failed = call(stage, 2, logits=logits)
    labels = label_lines()
    assert failed == {}
    assert out["labels"][0] == [labels[i].encode() for i in (7, 3, 999, 500, 42)]
    assert out["labels"][1][0] == b"class-000 tench"
    scores = np.asarray(out["scores"])
    assert scores.shape == (2, 5) and scores.dtype == np.float32
    np.testing.assert_allclose(scores[0], torch.softmax(logits[0], 0)[[7, 3, 999, 500, 42]].numpy(), rtol=1e-6)
    assert (np.diff(scores, axis=1) <= 0).all()


def test_top5_refuses_logits_of_another_width(data):
    with pytest.raises(ValueError, match="1000"):
        call(ready(TopK, labels=data["labels"]), 1, logits=torch.zeros(1, 10))


def test_l2_normalize_scales_to_unit_length():
    x = torch.tensor([[3.0, 4.0] + [0.0] * 30, [0.0] * 32])
    out, _ = call(ready(L2Normalize), 2, vector=x)
    y = torch.as_tensor(out["embedding"])
    torch.testing.assert_close(y[0, :2], torch.tensor([0.6, 0.8]))
    assert torch.count_nonzero(y[1]) == 0


def test_sleep_passes_its_input_through():
    x = torch.arange(4.0).reshape(2, 2)
    out, _ = call(ready(Sleep, ms=0), 2, x=x)
    assert out["x"] is x


def test_declarations_match_what_the_stages_return(tmp_path, data):
    decls = demo_stage_decls(str(tmp_path))
    assert open(tmp_path / LABELS_FILE).read().count("\n") == 1000
    assert set(decls) == {"decode-image", "top5", "tokenize", "l2-normalize"}
    for name, d in decls.items():
        module, cls = d["handler"].split(":")
        assert module == "tgw.workers.demo_stages" and d["device"] == "cpu"
        stage = ready(getattr(__import__(module, fromlist=[cls]), cls), **d["options"])
        inputs = {}
        for t in d["inputs"]:
            inputs[t["name"]] = [draw_image(0, 96, 80)] * 2 if name == "decode-image" else \
                [b"hello world"] * 2 if t["dtype"] == "bytes" else torch.randn(2, *t["shape"])
        out, failed = call(stage, 2, **inputs)
        assert failed == {} and set(out) == {t["name"] for t in d["outputs"]}, name
        for t in d["outputs"]:
            if t["dtype"] == "bytes":
                assert len(out[t["name"]]) == 2 and all(len(row) == t["shape"][0] for row in out[t["name"]])
            else:
                value = np.asarray(out[t["name"]])
                assert value.shape == (2, *t["shape"]) and value.dtype == np.dtype(t["dtype"]), (name, t)
