"""OpenAI-compatible endpoints on the engine's HTTP port: POST /v1/chat/completions,
POST /v1/completions (both also as server-sent events with `stream: true`), POST /v1/embeddings,
GET /v1/models and GET /v1/models/{id}, for the models engine/openai_models.py serves.

Errors have OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with 4xx for what the
client sent. A stream's events are `data: <one JSON object>\\n\\n`; it ends with `data: [DONE]\\n\\n`
after the last choice's finish_reason (and the usage event with stream_options.include_usage);
a failure after the stream started is one `data: {"error": {...}}\\n\\n` event and no [DONE].
"""

from __future__ import annotations

import base64
import os
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from meshcache.engine import rest_codec
from meshcache.engine.errors import EngineError, InvalidInput, NotFound, TooLarge, Unavailable
from meshcache.engine.openai_models import ServedModel, chat_prompt, pick, rng_for
from meshcache.engine.service import InferenceService

MAX_BODY_BYTES = 1 * 2**20
MAX_TOKENS = 256  # per choice; the default when the request names none is DEFAULT_MAX_TOKENS
DEFAULT_MAX_TOKENS = 16
MAX_CHOICES = 8  # n
MAX_ROWS = 16  # prompts x n in one request (the generator's max_batch_size)
MAX_MESSAGES = 256
MAX_PROMPT_TOKENS = 8192
# Characters of one prompt (a chat's rendered messages, one completion prompt, one embedding
# input): WordPiece on one long text grows faster than linearly (~20 ms at this size), so a 1 MiB
# body of one text would take seconds.
MAX_TEXT_CHARS = 32768
MAX_EMBED_INPUTS = 64
EMBED_BATCH = 16  # the embedder's max_batch_size
MAX_STOP = 4
ROLES = ("system", "developer", "user", "assistant", "tool")
PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models")
ReadBody = Callable[[int], Awaitable[bytes]]


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def from_engine_error(exc: EngineError) -> ApiError:
    if isinstance(exc, NotFound):
        return ApiError(404, str(exc), "model", "model_not_found")
    if isinstance(exc, TooLarge):
        return ApiError(413, str(exc), None, "request_too_large")
    if isinstance(exc, InvalidInput):
        return ApiError(400, str(exc))
    kind = "server_error" if exc.http_status >= 500 else "invalid_request_error"
    return ApiError(exc.http_status, str(exc), None, exc.reason, kind)


@dataclass
class JsonReply:
    status: int
    payload: object


@dataclass
class EventStream:
    events: AsyncGenerator[bytes, None]


def sse(payload: object) -> bytes:
    return b"data: " + rest_codec.dumps(payload) + b"\n\n"


DONE = b"data: [DONE]\n\n"


# ---- request checking ------------------------------------------------------------------------

def _bad(message: str, param: str | None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


def _number(body: dict[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(f"'{key}' must be a number, got {type(value).__name__}", key, "invalid_type")
    if not low <= value <= high:
        raise _bad(f"'{key}' must be between {low} and {high}, got {value}", key, "invalid_value")
    return float(value)


def _integer(body: dict[str, Any], key: str, default: int | None, low: int, high: int) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"'{key}' must be an integer, got {type(value).__name__}", key, "invalid_type")
    if not low <= value <= high:
        raise _bad(f"'{key}' must be between {low} and {high}, got {value}", key, "invalid_value")
    return value


def _boolean(body: dict[str, Any], key: str) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(f"'{key}' must be a boolean, got {type(value).__name__}", key, "invalid_type")
    return value


def _refuse(body: dict[str, Any], key: str, unset: Callable[[Any], bool], why: str) -> None:
    if key in body and body[key] is not None and not unset(body[key]):
        raise _bad(f"'{key}' is not supported: {why}", key, "unsupported_parameter")


@dataclass
class Sampling:
    temperature: float
    top_p: float
    seed: int | None
    n: int
    max_tokens: int
    stop: list[str]
    presence_penalty: float
    frequency_penalty: float
    stream: bool
    include_usage: bool


def parse_sampling(body: dict[str, Any], max_tokens_keys: tuple[str, ...]) -> Sampling:
    max_tokens: int | None = None
    for key in max_tokens_keys:  # the first one given wins (max_completion_tokens over max_tokens)
        max_tokens = _integer(body, key, None, 1, MAX_TOKENS)
        if max_tokens is not None:
            break
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= MAX_STOP:
        stops = list(stop)
    else:
        raise _bad(f"'stop' must be a string or a list of up to {MAX_STOP} strings", "stop", "invalid_type")
    if any(not s for s in stops):
        raise _bad("'stop' strings must not be empty", "stop", "invalid_value")
    stream = _boolean(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise _bad("'stream_options' is only allowed when 'stream' is true", "stream_options", "invalid_value")
        if not isinstance(options, dict):
            raise _bad("'stream_options' must be an object", "stream_options", "invalid_type")
        include_usage = _boolean(options, "include_usage")
    _refuse(body, "logprobs", lambda v: v is False, "this engine returns no log probabilities")
    _refuse(body, "top_logprobs", lambda v: v == 0, "this engine returns no log probabilities")
    _refuse(body, "logit_bias", lambda v: v == {}, "this engine applies no logit bias")
    _refuse(body, "tools", lambda v: v == [], "the demo models make no tool calls")
    _refuse(body, "functions", lambda v: v == [], "the demo models make no function calls")
    _refuse(body, "response_format", lambda v: v == {"type": "text"}, "only {\"type\": \"text\"} is served")
    return Sampling(
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0) or 1e-9,
        seed=_integer(body, "seed", None, -(2**63), 2**64 - 1),
        n=_integer(body, "n", 1, 1, MAX_CHOICES) or 1,
        max_tokens=max_tokens or DEFAULT_MAX_TOKENS,
        stop=stops,
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        stream=stream,
        include_usage=include_usage,
    )


def _message_text(index: int, message: object) -> tuple[str, str]:
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise _bad(f"'{param}' must be an object", param, "invalid_type")
    role = message.get("role")
    if role not in ROLES:
        raise _bad(f"'{param}.role' must be one of {', '.join(ROLES)}, got {role!r}", f"{param}.role", "invalid_value")
    content = message.get("content")
    if content is None and role == "assistant":
        return role, ""
    if isinstance(content, str):
        return role, content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise _bad(f"'{param}.content[{j}]' must be a text part {{\"type\": \"text\", \"text\": ...}}",
                           f"{param}.content[{j}]", "invalid_value")
            texts.append(part["text"])
        return role, "".join(texts)
    raise _bad(f"'{param}.content' must be a string or a list of text parts", f"{param}.content", "invalid_type")


def parse_model(body: dict[str, Any], served: dict[str, ServedModel], kind: str) -> ServedModel:
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise _bad("'model' is required and must be a non-empty string", "model", "invalid_type")
    model = served.get(name)
    if model is None:
        raise ApiError(404, f"The model '{name}' does not exist; models: {', '.join(sorted(served))}",
                       "model", "model_not_found")
    if model.kind != kind:
        what = "chat and text completions" if kind == "generation" else "embeddings"
        raise _bad(f"model '{name}' is a {model.kind} model and does not serve {what}", "model",
                   "model_not_supported")
    return model


# ---- generation ------------------------------------------------------------------------------

@dataclass
class Choice:
    index: int
    context: list[int]
    rng: np.random.Generator
    ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    counts: dict[int, int] = field(default_factory=dict)
    sent: int = 0  # characters of `text` a stream has sent


class Generation:
    """The choices of one request, stepped together: each step is one batched run of the
    generator for the choices still open."""

    def __init__(self, service: InferenceService, model: ServedModel, prompts: list[list[int]], sampling: Sampling,
                 leading_space: bool) -> None:
        # leading_space: the first word is preceded by a space (a text completion continues its
        # prompt); words are always separated by one.
        self.service, self.model, self.sampling, self.leading_space = service, model, sampling, leading_space
        n = sampling.n
        self.choices = [Choice(p * n + j, list(ids), rng_for(sampling.seed, p * n + j))
                        for p, ids in enumerate(prompts) for j in range(n)]

    def _feed(self, choice: Choice) -> np.ndarray:
        window = choice.context[-self.model.context:]
        return np.array([0] * (self.model.context - len(window)) + window, dtype=np.int64)

    def _penalised(self, choice: Choice, logits: np.ndarray) -> np.ndarray:
        s = self.sampling
        if not choice.counts or (s.presence_penalty == 0 and s.frequency_penalty == 0):
            return logits
        logits = logits.copy()
        for token, count in choice.counts.items():
            logits[token] -= s.presence_penalty + s.frequency_penalty * count
        return logits

    async def step(self, call: Any) -> list[Choice]:
        """One token for every open choice; returns the choices that were open."""
        open_choices = [c for c in self.choices if c.finish_reason is None]
        if not open_choices:
            return []
        model = call.resolve("")
        feeds = np.stack([self._feed(c) for c in open_choices])
        logits = (await self.service.infer(call, model, {"context": feeds}, ["logits"], 0))["logits"]
        for choice, row in zip(open_choices, logits, strict=True):
            token = pick(self._penalised(choice, row), self.sampling.temperature, self.sampling.top_p, choice.rng)
            if token == self.model.eos_token_id:
                choice.finish_reason = "stop"
            else:
                choice.ids.append(token)
                choice.context.append(token)
                choice.counts[token] = choice.counts.get(token, 0) + 1
                space = " " if len(choice.ids) > 1 or self.leading_space else ""
                choice.text += space + self.model.token_text(token)
                self._apply_stop(choice)
                if choice.finish_reason is None and len(choice.ids) >= self.sampling.max_tokens:
                    choice.finish_reason = "length"
        return open_choices

    def sendable(self, choice: Choice) -> str:
        """The text of `choice` a stream may send now: all of it once the choice finished, else all
        but the tail that could still be the start of a stop string (which would be cut), so the
        streamed text always equals the whole answer."""
        hold = 0 if choice.finish_reason else max((len(s) - 1 for s in self.sampling.stop), default=0)
        end = max(choice.sent, len(choice.text) - hold)
        text, choice.sent = choice.text[choice.sent:end], end
        return text

    def _apply_stop(self, choice: Choice) -> None:
        cuts = [i for i in (choice.text.find(s) for s in self.sampling.stop) if i >= 0]
        if cuts:
            choice.text = choice.text[:min(cuts)]
            choice.finish_reason = "stop"

    @property
    def done(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    def completion_tokens(self) -> int:
        return sum(len(c.ids) for c in self.choices)


# ---- the endpoints ---------------------------------------------------------------------------

class OpenAIEndpoints:
    def __init__(self, service: InferenceService, served: dict[str, ServedModel], max_body_bytes: int) -> None:
        self.service = service
        self.served = served
        self.max_body_bytes = min(max_body_bytes, MAX_BODY_BYTES)

    def handles(self, path: str) -> bool:
        return path in PATHS or path.startswith("/v1/models/")

    async def route(self, method: str, path: str, read_body: ReadBody) -> JsonReply | EventStream:
        try:
            return await self._route(method, path, read_body)
        except ApiError as exc:
            return JsonReply(exc.status, exc.body())
        except EngineError as exc:
            error = from_engine_error(exc)
            return JsonReply(error.status, error.body())
        except Exception as exc:  # a bug must answer in OpenAI's shape, not take the connection down
            error = ApiError(500, f"internal error: {type(exc).__name__}", kind="server_error")
            return JsonReply(error.status, error.body())

    async def _route(self, method: str, path: str, read_body: ReadBody) -> JsonReply | EventStream:
        if path == "/v1/models" or path.startswith("/v1/models/"):
            if method not in ("GET", "HEAD"):
                raise ApiError(405, f"{method} is not allowed on {path}; use GET", None, "method_not_allowed")
            return self._models(path[len("/v1/models/"):] if path != "/v1/models" else None)
        if method != "POST":
            raise ApiError(405, f"{method} is not allowed on {path}; use POST", None, "method_not_allowed")
        raw = await read_body(self.max_body_bytes)
        try:
            body = rest_codec.parse_json(raw)
        except InvalidInput as exc:
            raise _bad(f"We could not parse the JSON body of your request: {exc}", None, "invalid_json") from None
        if path == "/v1/embeddings":
            return await self._embeddings(body)
        chat = path == "/v1/chat/completions"
        model = parse_model(body, self.served, "generation")
        texts = [] if chat else self._completion_texts(body)
        chat_text = self._chat_text(body) if chat else ""
        sampling = parse_sampling(body, ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",))
        echo = False if chat else _boolean(body, "echo")
        if not chat:
            _refuse(body, "suffix", lambda v: v == "", "the demo models do not insert text")
            _refuse(body, "best_of", lambda v: v == sampling.n or v == 1, "best_of must equal n")
        rows = 1 if chat else len(texts)
        if rows * sampling.n > MAX_ROWS:
            raise _bad(f"prompts x n must be at most {MAX_ROWS}, got {rows} x {sampling.n}", "n",
                       "invalid_value")
        self._check_loaded(model)
        prompts = await (self._tokens(model, [chat_text], "messages") if chat else self._tokens(model, texts, "prompt"))
        generation = Generation(self.service, model, prompts, sampling, leading_space=not chat)
        reply = _Reply(chat, model.name, prompt_tokens=sum(len(p) for p in prompts),
                       echo_texts=texts if echo else [], n=sampling.n)
        if sampling.stream:
            if self.service.draining:  # refused now, while the answer can still be a status
                raise Unavailable("engine is shutting down")
            return EventStream(self._stream(generation, reply, sampling.include_usage))
        async with self.service.request(model.repository_name, "http") as call:
            while not generation.done:
                await generation.step(call)
        self._count(reply.usage(generation), model.repository_name)
        return JsonReply(200, reply.whole(generation))

    def _count(self, usage: dict[str, int], model: str) -> None:
        self.service.metrics.tokens.labels(model, "prompt").inc(usage["prompt_tokens"])
        self.service.metrics.tokens.labels(model, "completion").inc(usage.get("completion_tokens", 0))

    def _check_loaded(self, model: ServedModel) -> None:
        # Unloaded through the repository API: refuse before a stream starts.
        try:
            self.service.repository.get(model.repository_name)
        except NotFound as exc:
            raise ApiError(404, str(exc), "model", "model_not_found") from None

    @staticmethod
    def _chat_text(body: dict[str, Any]) -> str:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("'messages' must be a non-empty list", "messages", "invalid_type")
        if len(messages) > MAX_MESSAGES:
            raise _bad(f"'messages' holds {len(messages)} messages; at most {MAX_MESSAGES}", "messages",
                       "invalid_value")
        return chat_prompt([_message_text(i, m) for i, m in enumerate(messages)])

    @staticmethod
    def _completion_texts(body: dict[str, Any]) -> list[str]:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            prompts = prompt
        else:
            raise _bad("'prompt' must be a string or a non-empty list of strings (token arrays are not served)",
                       "prompt", "invalid_type")
        if len(prompts) > MAX_ROWS:
            raise _bad(f"'prompt' holds {len(prompts)} prompts; at most {MAX_ROWS}", "prompt", "invalid_value")
        return prompts

    @staticmethod
    def _check_length(texts: list[str], param: str) -> None:
        for text in texts:
            if len(text) > MAX_TEXT_CHARS:
                raise _bad(f"'{param}' holds a text of {len(text)} characters; at most {MAX_TEXT_CHARS}", param,
                           "context_length_exceeded")

    async def _tokens(self, model: ServedModel, texts: list[str], param: str) -> list[list[int]]:
        self._check_length(texts, param)
        prompts = await model.tokenize(texts, special=False)
        for ids in prompts:
            if len(ids) > MAX_PROMPT_TOKENS:
                raise _bad(f"the prompt is {len(ids)} tokens; at most {MAX_PROMPT_TOKENS}", param,
                           "context_length_exceeded")
        return prompts

    async def _stream(self, generation: Generation, reply: _Reply, include_usage: bool) -> AsyncGenerator[bytes, None]:
        usage_field = {"usage": None} if include_usage else {}
        try:
            async with self.service.request(generation.model.repository_name, "http") as call:
                for choice in generation.choices:
                    yield sse({**reply.chunk(choice.index, "", None, first=True), **usage_field})
                while not generation.done:
                    for choice in await generation.step(call):
                        text = generation.sendable(choice)
                        if text:
                            yield sse({**reply.chunk(choice.index, text, None), **usage_field})
                        if choice.finish_reason is not None:
                            yield sse({**reply.chunk(choice.index, "", choice.finish_reason, last=True),
                                       **usage_field})
        except EngineError as exc:
            yield sse(from_engine_error(exc).body())
            return
        except Exception as exc:  # a bug must end the stream with an error event, not a cut connection
            yield sse(ApiError(500, f"internal error: {type(exc).__name__}", kind="server_error").body())
            return
        usage = reply.usage(generation)
        self._count(usage, generation.model.repository_name)
        if include_usage:
            yield sse({**reply.envelope(), "choices": [], "usage": usage})
        yield DONE

    def _models(self, name: str | None) -> JsonReply:
        loaded = {n: m for n, m in self.served.items() if m.repository_name in self.service.repository.models}
        if name is not None:
            model = loaded.get(name)
            if model is None:
                raise ApiError(404, f"The model '{name}' does not exist", "model", "model_not_found")
            return JsonReply(200, _model_card(model))
        return JsonReply(200, {"object": "list", "data": [_model_card(m) for _, m in sorted(loaded.items())]})

    async def _embeddings(self, body: dict[str, Any]) -> JsonReply:
        model = parse_model(body, self.served, "embedding")
        raw = body.get("input")
        inputs = [raw] if isinstance(raw, str) else raw
        if not isinstance(inputs, list) or not inputs or not all(isinstance(s, str) for s in inputs):
            raise _bad("'input' must be a string or a non-empty list of strings (token arrays are not served)",
                       "input", "invalid_type")
        if len(inputs) > MAX_EMBED_INPUTS:
            raise _bad(f"'input' holds {len(inputs)} items; at most {MAX_EMBED_INPUTS}", "input", "invalid_value")
        if any(not s for s in inputs):
            raise _bad("'input' strings must not be empty", "input", "invalid_value")
        encoding = body.get("encoding_format", "float")
        if encoding not in ("float", "base64"):
            raise _bad(f"'encoding_format' must be 'float' or 'base64', got {encoding!r}", "encoding_format",
                       "invalid_value")
        dimensions = _integer(body, "dimensions", None, 1, 2**31)
        self._check_length(inputs, "input")
        self._check_loaded(model)
        async with self.service.request(model.repository_name, "http") as call:
            engine_model = call.resolve("")
            width = engine_model.config.outputs[0].shape[-1]
            if dimensions is not None and dimensions != width:
                raise _bad(f"model '{model.name}' embeds in {width} dimensions; 'dimensions' {dimensions} is not "
                           f"served", "dimensions", "invalid_value")
            # With [CLS] and [SEP], cut to the model's length as sentence-transformers does.
            encoded = await model.tokenize(inputs, special=True)
            encoded = [ids if len(ids) <= model.max_input_tokens else ids[:model.max_input_tokens - 1] + ids[-1:]
                       for ids in encoded]
            vectors: list[np.ndarray] = []
            for start in range(0, len(encoded), EMBED_BATCH):
                chunk = encoded[start:start + EMBED_BATCH]
                longest = max(len(ids) for ids in chunk)
                ids = np.array([e + [0] * (longest - len(e)) for e in chunk], dtype=np.int64)
                mask = np.array([[1] * len(e) + [0] * (longest - len(e)) for e in chunk], dtype=np.int64)
                out = await self.service.infer(call, engine_model, {"input_ids": ids, "attention_mask": mask},
                                               ["embedding"], 0)
                vectors.extend(out["embedding"])
        tokens = sum(len(e) for e in encoded)
        self._count({"prompt_tokens": tokens}, model.repository_name)
        data = [{"object": "embedding", "index": i,
                 "embedding": (base64.b64encode(v.astype("<f4").tobytes()).decode() if encoding == "base64"
                               else v.astype(np.float32).tolist())}
                for i, v in enumerate(vectors)]
        return JsonReply(200, {"object": "list", "data": data, "model": model.name,
                               "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def _model_card(model: ServedModel) -> dict[str, Any]:
    return {"id": model.name, "object": "model", "created": model.created, "owned_by": "meshcache"}


class _Reply:
    """Builds the response objects of one chat or text completion (whole or as chunks)."""

    def __init__(self, chat: bool, model: str, prompt_tokens: int, echo_texts: list[str], n: int) -> None:
        self.chat, self.model, self.prompt_tokens = chat, model, prompt_tokens
        self.echo_texts, self.n = echo_texts, n
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.fingerprint = "fp_" + os.environ.get("MESHCACHE_ENGINE_FINGERPRINT", "meshcache")

    def envelope(self, chunk: bool = True) -> dict[str, Any]:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}

    def usage(self, generation: Generation) -> dict[str, int]:
        completion = generation.completion_tokens()
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    def _echo(self, index: int) -> str:
        return self.echo_texts[index // self.n] if self.echo_texts else ""

    def chunk(self, index: int, text: str, finish_reason: str | None, first: bool = False,
              last: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {} if last else {"content": text}
            if first:
                delta = {"role": "assistant", "content": ""}
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": self._echo(index) if first else text, "logprobs": None,
                      "finish_reason": finish_reason}
        return {**self.envelope(), "choices": [choice]}

    def whole(self, generation: Generation) -> dict[str, Any]:
        if self.chat:
            choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text, "refusal": None},
                        "logprobs": None, "finish_reason": c.finish_reason} for c in generation.choices]
        else:
            choices = [{"index": c.index, "text": self._echo(c.index) + c.text, "logprobs": None,
                        "finish_reason": c.finish_reason} for c in generation.choices]
        return {**self.envelope(chunk=False), "choices": choices, "usage": self.usage(generation)}
