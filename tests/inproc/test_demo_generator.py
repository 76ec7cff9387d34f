"""The demo's generator in-process (workers/demo_generator.py): the decoder's KV cache against its
cache-free forward, TinyGPT's prefill and step through hand-made PrefillBatch/StepBatch (the
contract's, workers/generator.py) against reference_generate, rows of different prompt lengths
in one padded call against one at a time, a sequence resumed with its delivered outputs as one
never interrupted, slots reused dirty, bad prompts failing only their row, and the exactness
check failing on a wrong token."""
from __future__ import annotations

import inspect
import random

import pytest
import torch
import yaml
from conftest import readme_block

from tgw.broker.cli.demo import model_entry
from tgw.workers import demo_generator

from tgw.workers.demo_generator import (END, MARGIN, GPTConfig, TinyGPT, TinyGPTModule, Tokenizer, build_gpt,
                                        check_against_reference, float64_reference, kv_shape, load_gpt,
                                        reference_generate, save_gpt)
from tgw.workers.demo_models import GPT_CONFIG, GPT_FILE, build_generator_decls
from tgw.workers.generator import PrefillBatch, StepBatch
from tgw.workers.stage import StageContext

CPU = torch.device("cpu")
SLOTS = 8


@pytest.fixture(scope="module")
def model() -> TinyGPTModule:
    """Random weights, scaled up so that greedy outputs vary (the plain init repeats one token);
    small enough a context to stay fast."""
    module = build_gpt(GPTConfig(vocab=256, max_len=64), seed=3)
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(4.0)
    return module


@pytest.fixture(scope="module")
def reference(model) -> TinyGPTModule:
    return float64_reference(model)


@pytest.fixture
def handler(model, tmp_path) -> TinyGPT:
    save_gpt(model, str(tmp_path / "gpt.pt"))
    h = TinyGPT()
    h.setup(StageContext(name="tiny-gpt", version="1", dir=str(tmp_path), device=CPU, threads=1,
                         options={"weights": "gpt.pt"}))
    return h


def pool(cfg: GPTConfig, slots: int = SLOTS) -> dict[str, torch.Tensor]:
    """A slot pool as the worker allocates it, filled with garbage: a reused slot is not cleared."""
    return {"kv": torch.randn(slots, *kv_shape(cfg)) * 100}


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 256) for _ in range(rng.randrange(1, 24))] for _ in range(n)]


def run(handler: TinyGPT, state: dict, slots: list[int], rows: list[list[int]], outputs: int,
        prefix: list[list[int]] | None = None) -> list[list[int]]:
    """The worker's loop in miniature: one prefill of all rows, then greedy steps; each row's
    `outputs` tokens (no end tokens: the lengths stay equal)."""
    slot_t = torch.tensor(slots)
    prefix = prefix or [[] for _ in rows]
    batch = PrefillBatch(len(rows), CPU, slot_t, state, {"prompt": [torch.tensor(r, dtype=torch.long) for r in rows]},
                         {"token": [torch.tensor(p, dtype=torch.long) for p in prefix]})
    logits = handler.prefill(batch)["logits"]
    assert not batch.failed
    got = [[] for _ in rows]
    positions = torch.tensor([len(r) + len(p) for r, p in zip(rows, prefix)])
    for n in range(outputs):
        token = logits.argmax(-1)
        for r, t in enumerate(token.tolist()):
            got[r].append(t)
        if n + 1 < outputs:
            step = StepBatch(len(rows), CPU, slot_t, state, {"token": token}, positions)
            logits = handler.step(step)["logits"]
            assert not step.failed
            positions = positions + 1
    return got


def test_the_kv_cache_computes_what_the_cache_free_forward_does(model):
    tokens = torch.tensor(prompts(1, seed=5)[0] * 2)[None]
    kv = torch.zeros(1, *kv_shape(model.cfg))
    with torch.no_grad():
        whole = model(tokens)
        first = model.forward_tokens(tokens[:, :7], kv, torch.tensor([0]))
        rest = torch.cat([model.step_tokens(tokens[:, t], kv, torch.tensor([t]))[:, None]
                          for t in range(7, tokens.shape[1])], dim=1)
    torch.testing.assert_close(torch.cat([first, rest], dim=1), whole, rtol=0, atol=1e-4)


def test_prefill_and_step_through_the_handler_equal_reference_generate(handler, model, reference):
    rows = prompts(6)
    got = run(handler, pool(model.cfg), [5, 0, 7, 2, 3, 6], rows, 20)
    compared = 0
    for prompt, tokens in zip(rows, got):
        verdict = check_against_reference(reference, prompt, tokens, reason="max_outputs", max_outputs=20)
        assert verdict.ok, verdict.message
        # up to a near tie, the float32 reference_generate picks the same tokens too
        assert tokens[:verdict.compared] == reference_generate(model, prompt, 20)[:verdict.compared]
        compared += verdict.compared
    assert compared >= 0.7 * 6 * 20   # near ties are rare: the check compared most of it
    assert len({tuple(t) for t in got}) > 1


def test_rows_of_different_lengths_in_one_padded_prefill_equal_one_at_a_time(handler, model):
    rows = prompts(8, seed=1)
    assert len({len(r) for r in rows}) > 3
    state = pool(model.cfg)
    batch = PrefillBatch(8, CPU, torch.arange(8), state, {"prompt": [torch.tensor(r) for r in rows]},
                         {"token": [torch.zeros(0, dtype=torch.long)] * 8})
    together = handler.prefill(batch)["logits"]
    alone_state = pool(model.cfg)
    for r, prompt in enumerate(rows):
        one = PrefillBatch(1, CPU, torch.tensor([r]), alone_state, {"prompt": [torch.tensor(prompt)]},
                           {"token": [torch.zeros(0, dtype=torch.long)]})
        torch.testing.assert_close(handler.prefill(one)["logits"][0], together[r], rtol=0, atol=1e-4)
        # each row's cache as far as its prompt goes is the same: the padding wrote only past it
        torch.testing.assert_close(state["kv"][r, :, :, :, :len(prompt)], alone_state["kv"][r, :, :, :, :len(prompt)],
                                   rtol=0, atol=1e-4)


def test_a_resumed_sequence_continues_as_one_never_interrupted(handler, model):
    rows = prompts(3, seed=2)
    whole = run(handler, pool(model.cfg), [0, 1, 2], rows, 16)
    resumed = run(handler, pool(model.cfg), [4, 6, 1], rows, 10, prefix=[w[:6] for w in whole])
    assert [w[:6] + r for w, r in zip(whole, resumed)] == whole


def test_bad_prompts_fail_only_their_row(handler, model):
    cfg = model.cfg
    rows = [[], [1, 300], [-1, 5], list(range(1, cfg.max_len + 2)), [10, 20, 30]]
    batch = PrefillBatch(len(rows), CPU, torch.arange(len(rows)), pool(cfg),
                         {"prompt": [torch.tensor(r, dtype=torch.long) for r in rows]},
                         {"token": [torch.zeros(0, dtype=torch.long)] * len(rows)})
    logits = handler.prefill(batch)["logits"]
    assert set(batch.failed) == {0, 1, 2, 3}
    assert "empty" in batch.failed[0]
    assert "0..255" in batch.failed[1] and "300" in batch.failed[1]
    assert "-1" in batch.failed[2]
    assert f"{cfg.max_len + 1} tokens" in batch.failed[3] and str(cfg.max_len) in batch.failed[3]
    with torch.no_grad():
        alone = model.forward_tokens(torch.tensor([[10, 20, 30]]), torch.zeros(1, *kv_shape(cfg)), torch.tensor([0]))
    torch.testing.assert_close(logits[4], alone[0, -1], rtol=0, atol=1e-4)


def test_a_step_past_the_context_fails_its_row_and_steps_the_others(handler, model):
    cfg, state = model.cfg, pool(model.cfg)
    run(handler, state, [0, 1], [[5, 6], [7, 8]], 1)
    step = StepBatch(2, CPU, torch.tensor([0, 1]), state, {"token": torch.tensor([9, 9])},
                     torch.tensor([cfg.max_len, 2]))
    logits = handler.step(step)["logits"]
    assert list(step.failed) == [0] and f"position {cfg.max_len}" in step.failed[0]
    assert torch.isfinite(logits[1]).all()


def test_a_state_that_does_not_fit_the_model_is_named(handler, model):
    batch = PrefillBatch(1, CPU, torch.tensor([0]), {"kv": torch.zeros(2, 2, 2, 4, 32, 16)},
                         {"prompt": [torch.tensor([1, 2])]}, {})
    with pytest.raises(ValueError, match=r"must be torch.float32 \[2, 2, 4, 64, 16\].*declares torch.float32 "
                                         r"\[2, 2, 4, 32, 16\]"):
        handler.prefill(batch)
    with pytest.raises(KeyError, match="named 'kv'.*\\['cache'\\]"):
        handler.prefill(PrefillBatch(1, CPU, torch.tensor([0]), {"cache": torch.zeros(1)},
                                     {"prompt": [torch.tensor([1])]}, {}))


def test_setup_names_a_missing_or_foreign_weights_file(tmp_path):
    ctx = dict(name="g", version="1", dir=str(tmp_path), device=CPU, threads=1)
    with pytest.raises(ValueError, match="options.weights"):
        TinyGPT().setup(StageContext(**ctx, options={}))
    with pytest.raises(FileNotFoundError, match="nope.pt"):
        TinyGPT().setup(StageContext(**ctx, options={"weights": "nope.pt"}))
    torch.save({"x": torch.zeros(1)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not a TinyGPT weights file"):
        load_gpt(str(tmp_path / "other.pt"))


def test_saved_weights_load_back_equal(model, tmp_path):
    loaded = load_gpt(save_gpt(model, str(tmp_path / "w.pt")))
    assert loaded.cfg == model.cfg
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))


def test_the_check_fails_on_a_wrong_token_and_a_wrong_end(model, reference):
    prompt = prompts(1, seed=7)[0]
    good = reference_generate(reference, prompt, 24)
    assert check_against_reference(reference, prompt, good, reason="max_outputs", max_outputs=24).ok
    for n in (0, 11, 23):
        wrong = list(good)
        wrong[n] = (wrong[n] + 1) % 256
        verdict = check_against_reference(reference, prompt, wrong)
        assert not verdict.ok and verdict.compared == n and f"output {n}: tgw sent {wrong[n]}" in verdict.message
    # it stopped early, claiming an end token the reference does not pick
    verdict = check_against_reference(reference, prompt, good[:10], reason="stop_token")
    assert not verdict.ok and "continues with" in verdict.message
    assert not check_against_reference(reference, prompt, good[:10], reason="max_outputs", max_outputs=24).ok
    # an end token the reference does pick there is accepted
    assert check_against_reference(reference, prompt, good[:10], reason="stop_token", end_tokens=(good[10],)).ok


def test_a_near_tie_ends_the_comparison_and_says_where(reference):
    prompt = prompts(1, seed=8)[0]
    verdict = check_against_reference(reference, prompt, [1, 2, 3], margin=float("inf"))
    assert verdict.ok and verdict.tie_at == 0 and verdict.compared == 0 and "near tie at output 0" in verdict.message


def test_float32_rounding_stays_far_inside_the_margin(handler, model, reference):
    rows = prompts(8, seed=9)
    state = pool(model.cfg)
    batch = PrefillBatch(8, CPU, torch.arange(8), state, {"prompt": [torch.tensor(r) for r in rows]},
                         {"token": [torch.zeros(0, dtype=torch.long)] * 8})
    got = handler.prefill(batch)["logits"].double()
    with torch.no_grad():
        want = torch.stack([reference.forward_tokens(torch.tensor([r]), torch.zeros(1, *kv_shape(model.cfg),
                            dtype=torch.float64), torch.tensor([0]))[0, -1] for r in rows])
    assert float((got - want).abs().max()) < MARGIN / 20


def test_reference_generate_stops_at_an_end_token_and_at_the_context(model):
    prompt = prompts(1, seed=4)[0]
    free = reference_generate(model, prompt, 10)
    assert reference_generate(model, prompt, 10, end_tokens=(free[4],)) == free[:free.index(free[4])]
    full = reference_generate(model, [1] * (model.cfg.max_len - 3), 10)
    assert len(full) == 3


def test_the_tokenizer_round_trips_utf8_and_refuses_nul():
    tok = Tokenizer()
    text = "A model serves ünïcode, too."
    assert tok.decode(tok.encode(text)) == text and END not in tok.encode(text)
    assert tok.decode(tok.encode(text) + [END]) == text
    with pytest.raises(ValueError, match="NUL"):
        tok.encode("a\0b")


def test_gpt_config_refuses_what_cannot_be_built():
    with pytest.raises(ValueError, match="multiple of n_heads"):
        GPTConfig(vocab=10, d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="vocab"):
        GPTConfig(vocab=0)
    assert kv_shape(GPTConfig(vocab=256)) == [2, 2, 4, 256, 16]


def test_training_is_deterministic_and_lowers_the_loss():
    cfg = GPTConfig(vocab=256, max_len=32)
    text = "A model server answers each caller. " * 20
    a, b = (build_gpt(cfg, seed=2, train_steps=40, text=text) for _ in range(2))
    untrained = build_gpt(cfg, seed=2)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    ids = torch.tensor([demo_generator.training_ids(text)[:33]])
    with torch.no_grad():
        def loss(m):
            return float(torch.nn.functional.cross_entropy(m(ids[:, :-1])[0], ids[0, 1:]))
        assert loss(a) < 0.8 * loss(untrained)


def test_the_docs_config_is_the_demos_declaration(tmp_path):
    save_gpt(build_gpt(GPTConfig(**GPT_CONFIG)), str(tmp_path / GPT_FILE))   # no training: the file is there
    entry = model_entry("tiny-gpt", build_generator_decls(str(tmp_path))["tiny-gpt"])
    documented = yaml.safe_load(readme_block("generator-example:config"))[0]
    assert entry["options"]["weights"] == str(tmp_path / GPT_FILE)
    assert {**documented, "options": None} == {**entry, "options": None}


def test_the_docs_handler_excerpt_is_the_code():
    """Each line of the excerpt but its `...` is a line of workers/demo_generator.py, in order."""
    source = inspect.getsource(demo_generator).splitlines()
    at = 0
    for line in readme_block("generator-example:handler").splitlines():
        if line.strip().startswith("...") or not line.strip():
            continue
        assert line in source[at:], f"not in workers/demo_generator.py (after line {at}): {line!r}"
        at = source.index(line, at) + 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_a_gpu_the_handler_generates_what_the_float64_reference_does(model, reference, tmp_path):
    cuda = torch.device("cuda")
    save_gpt(model, str(tmp_path / "gpt.pt"))
    h = TinyGPT()
    h.setup(StageContext(name="tiny-gpt", version="1", dir=str(tmp_path), device=cuda, threads=1,
                         options={"weights": "gpt.pt"}))
    rows = prompts(6, seed=11)
    state = {"kv": torch.randn(SLOTS, *kv_shape(model.cfg), device=cuda)}
    slots = torch.tensor([3, 0, 5, 1, 7, 2], device=cuda)
    batch = PrefillBatch(6, cuda, slots, state, {"prompt": [torch.tensor(r, device=cuda) for r in rows]},
                         {"token": [torch.zeros(0, dtype=torch.long, device=cuda)] * 6})
    logits = h.prefill(batch)["logits"]
    positions = torch.tensor([len(r) for r in rows], device=cuda)
    got: list[list[int]] = [[] for _ in rows]
    for n in range(16):
        token = logits.argmax(-1)
        for r, t in enumerate(token.tolist()):
            got[r].append(t)
        logits = h.step(StepBatch(6, cuda, slots, state, {"token": token}, positions))["logits"]
        positions = positions + 1
    for prompt, tokens in zip(rows, got):
        verdict = check_against_reference(reference, prompt, tokens)
        assert verdict.ok, verdict.message
