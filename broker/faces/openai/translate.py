"""An OpenAI request as the generations it asks for, and their outputs as OpenAI's JSON.

A request is checked whole before anything runs: every parameter tgw serves is translated
(max_tokens / max_completion_tokens, temperature, top_p, seed, stop, n, and top_k as an
extension), every one it does not (logprobs, tools, echo, best_of, penalties, ...) is refused by
name unless it holds its default, and an unknown one is refused as OpenAI refuses it.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import orjson

from tgw.shm.wire import GenerateParams, Sampling

from .errors import invalid

MAX_CHOICES = 16          # generations one request may ask for (prompts x n)
MAX_STOPS = 4             # OpenAI's limit on `stop`
COMPLETIONS_DEFAULT_MAX_TOKENS = 16   # OpenAI's default for /v1/completions (chat's: the model's cap)

COMMON = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n",
          "user", "priority"}
COMPLETION_KEYS = COMMON | {"prompt"}
CHAT_KEYS = COMMON | {"messages", "max_completion_tokens"}
# parameters tgw does not serve: accepted only holding their default (what the client may send
# unasked), refused by name otherwise
UNSERVED = {
    "logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
    "suffix": (None, ""), "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logit_bias": (None, {}),
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "parallel_tool_calls": (None,), "response_format": (None, {"type": "text"}), "modalities": (None, ["text"]),
    "audio": (None,), "prediction": (None,), "reasoning_effort": (None,), "service_tier": (None, "auto", "default"),
    "store": (None, False), "metadata": (None,), "web_search_options": (None,), "verbosity": (None,),
}


@dataclass
class Plan:
    """What one OpenAI request asks for: a generation per (prompt, n), and how to answer."""
    model: str
    chat: bool
    prompts: list[list[int]]              # token ids of each prompt
    n: int
    stream: bool
    include_usage: bool
    stops: list[str]
    params: list[GenerateParams] = field(default_factory=list)   # one per choice, index order
    priority: int = 0
    id: str = ""
    limit_given: str | None = None        # the parameter that set the output limit, if one did

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)   # each prompt once, as OpenAI counts it with n > 1

    def prompt_of(self, choice: int) -> list[int]:
        return self.prompts[choice // self.n]


def _number(body: dict, key: str, low: float, high: float, integer: bool = False):
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)):
        raise invalid(f"'{key}' must be {'an integer' if integer else 'a number'}, got {v!r}", key)
    if not low <= v <= high:
        raise invalid(f"'{key}' must be between {low} and {high}, got {v!r}", key)
    return v


def _checked_keys(body, allowed: set[str]) -> None:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", None)
    for key, value in body.items():
        if key in allowed:
            continue
        if key in UNSERVED:
            if not any(value == d and isinstance(value, bool) == isinstance(d, bool) for d in UNSERVED[key]):
                raise invalid(f"'{key}' is not supported by this server (tgw serves text generation: "
                              f"docs/OPENAI.md lists the parameters)", key, "unsupported_parameter")
            continue
        raise invalid(f"Unrecognized request argument supplied: {key}", key, "unrecognized_argument")


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or any(not isinstance(s, str) or not s for s in stops):
        raise invalid(f"'stop' must be a non-empty string or a list of them, got {stop!r}", "stop")
    if len(stops) > MAX_STOPS:
        raise invalid(f"'stop' holds at most {MAX_STOPS} strings, got {len(stops)}", "stop")
    return stops


def _encode(tokenizer, text: str, param: str) -> list[int]:
    try:
        ids = [int(t) for t in tokenizer.encode(text)]
    except ValueError as exc:
        raise invalid(f"'{param}' cannot be tokenized: {exc}", param) from None
    return ids


def _prompts(body: dict, tokenizer) -> list[list[int]]:
    p = body.get("prompt")
    if isinstance(p, str):
        prompts = [_encode(tokenizer, p, "prompt")]
    elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        prompts = [_encode(tokenizer, x, "prompt") for x in p]
    elif isinstance(p, list) and p and all(type(x) is int for x in p):
        prompts = [list(p)]
    elif isinstance(p, list) and p and all(isinstance(x, list) and x and all(type(t) is int for t in x) for x in p):
        prompts = [list(x) for x in p]
    else:
        raise invalid("'prompt' must be a string, a list of strings, a list of token ids or a list of such lists",
                      "prompt")
    if any(not ids for ids in prompts):
        raise invalid("'prompt' is empty: a generation needs at least one token", "prompt")
    if any(not 0 <= t < 1 << 31 for ids in prompts for t in ids):
        raise invalid("'prompt' token ids must be integers from 0 to 2**31 - 1", "prompt")
    return prompts


def _plan(body: dict, chat: bool, prompts: list[list[int]], max_tokens) -> Plan:
    model = body.get("model")
    stream = body.get("stream") or False
    if type(stream) is not bool:
        raise invalid(f"'stream' must be a boolean, got {stream!r}", "stream")
    options = body.get("stream_options")
    if options is not None and not stream:
        raise invalid("'stream_options' is only allowed when 'stream' is true", "stream_options")
    options = options or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"} \
            or type(options.get("include_usage", False)) is not bool:
        raise invalid("'stream_options' takes one key, include_usage (a boolean)", "stream_options")
    n = _number(body, "n", 1, MAX_CHOICES, integer=True) or 1
    if n * len(prompts) > MAX_CHOICES:
        raise invalid(f"{len(prompts)} prompts x n={n} is over {MAX_CHOICES} choices a request", "n")
    temperature = _number(body, "temperature", 0, 2)
    top_p = _number(body, "top_p", 0, 1)
    if top_p == 0:
        raise invalid("'top_p' must be above 0", "top_p")
    top_k = _number(body, "top_k", 0, 1 << 31, integer=True)
    seed = _number(body, "seed", -(1 << 63), (1 << 64) - 1, integer=True)
    priority = _number(body, "priority", 0, 255, integer=True) or 0
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise invalid("'user' must be a string", "user")
    plan = Plan(model=model, chat=chat, prompts=prompts, n=n, stream=stream,
                include_usage=options.get("include_usage", False), stops=_stops(body), priority=priority,
                id=("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12))
    for prompt in prompts:
        for j in range(n):
            plan.params.append(GenerateParams(max_outputs=max_tokens, sampling=Sampling(
                temperature=0.0 if temperature is None else float(temperature), top_k=top_k or 0,
                top_p=1.0 if top_p is None else float(top_p),
                seed=None if seed is None else (seed + j) % (1 << 64))))
    return plan


def model_of(body) -> str:
    """The request's `model`, checked first: it names the tokenizer the rest needs."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", None)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("you must provide a model parameter", "model")
    return model


def completion_plan(body: dict, tokenizer) -> Plan:
    _checked_keys(body, COMPLETION_KEYS)
    max_tokens = _number(body, "max_tokens", 1, 1 << 31, integer=True)
    plan = _plan(body, False, _prompts(body, tokenizer),
                 COMPLETIONS_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens)
    plan.limit_given = None if max_tokens is None else "max_tokens"
    _stop_sequences(plan, tokenizer)
    return plan


def chat_plan(body: dict, tokenizer, prompt: str) -> Plan:
    """`prompt`: the messages through the model's chat template (chat.py)."""
    _checked_keys(body, CHAT_KEYS)
    limits = {k: _number(body, k, 1, 1 << 31, integer=True) for k in ("max_completion_tokens", "max_tokens")}
    if None not in limits.values() and len(set(limits.values())) > 1:
        raise invalid("'max_completion_tokens' and 'max_tokens' are one limit: send one", "max_tokens")
    max_tokens = limits["max_completion_tokens"] or limits["max_tokens"]
    ids = _encode(tokenizer, prompt, "messages")
    if not ids:
        raise invalid("the messages make an empty prompt: a generation needs at least one token", "messages")
    plan = _plan(body, True, [ids], max_tokens)
    plan.limit_given = next((k for k in ("max_completion_tokens", "max_tokens") if limits[k] is not None), None)
    _stop_sequences(plan, tokenizer)
    return plan


def _stop_sequences(plan: Plan, tokenizer) -> None:
    """Each stop string as token ids, so the worker ends the sequence there (the face also cuts
    the text at the first stop string, whatever tokens spelled it)."""
    seqs = [_encode(tokenizer, s, "stop") for s in plan.stops]
    for p in plan.params:
        p.sampling.stop_sequences = [s for s in seqs if s]


# ---- answers ------------------------------------------------------------------------------------

FINISH = {"stop_token": "stop", "stop_sequence": "stop", "done": "stop", "stopped": "stop",
          "max_outputs": "length", "max_length": "length"}


def finish_reason(reason: str) -> str:
    return FINISH.get(reason, "stop")


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def choice(plan: Plan, index: int, text: str, finish: str | None) -> dict:
    if plan.chat:
        return {"index": index, "message": {"role": "assistant", "content": text, "refusal": None},
                "logprobs": None, "finish_reason": finish}
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish}


def whole(plan: Plan, created: int, choices: list[dict], completion_tokens: int) -> dict:
    return {"id": plan.id, "object": "chat.completion" if plan.chat else "text_completion", "created": created,
            "model": plan.model, "system_fingerprint": None, "choices": choices,
            "usage": usage(plan.prompt_tokens, completion_tokens)}


def chunk(plan: Plan, created: int, index: int, text: str | None, finish: str | None, first: bool = False) -> dict:
    """One streamed piece of choice `index` (`first`: a chat's opening delta carries the role)."""
    if plan.chat:
        delta = {} if text is None else {"role": "assistant", "content": text} if first else {"content": text}
        c = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        c = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}
    doc = {"id": plan.id, "object": "chat.completion.chunk" if plan.chat else "text_completion", "created": created,
           "model": plan.model, "system_fingerprint": None, "choices": [c]}
    if plan.include_usage:
        doc["usage"] = None
    return doc


_MARK = "\u0000tgw-piece\u0000"


def chunk_frame(plan: Plan, created: int, index: int) -> tuple[bytes, bytes]:
    """A text piece's SSE event of choice `index` as (head, tail): head + orjson.dumps(piece) +
    tail is `data: {chunk(...)}\n\n`, rendered once per choice rather than once per piece."""
    raw = b"data: " + orjson.dumps(chunk(plan, created, index, _MARK, None)) + b"\n\n"
    head, tail = raw.split(orjson.dumps(_MARK))
    return head, tail


def usage_chunk(plan: Plan, created: int, completion_tokens: int) -> dict:
    return {"id": plan.id, "object": "chat.completion.chunk" if plan.chat else "text_completion", "created": created,
            "model": plan.model, "system_fingerprint": None, "choices": [],
            "usage": usage(plan.prompt_tokens, completion_tokens)}
