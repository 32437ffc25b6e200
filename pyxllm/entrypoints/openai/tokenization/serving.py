"""``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info`` (vLLM's extensions), in
vLLM's shapes.

``/tokenize`` takes a ``prompt`` (``add_special_tokens`` defaults to true) or chat ``messages``
rendered with the model's template (``add_generation_prompt`` defaults to true,
``add_special_tokens`` to false) and returns ``{"count", "max_model_len", "tokens"}`` (and
``token_strs`` with ``return_token_strs``); ``/detokenize`` takes ``{"tokens"}`` and returns
``{"prompt"}``. ``/tokenizer_info`` (with ``--enable-tokenizer-info-endpoint``, off by default
as in vLLM: it shows the chat template) returns the tokenizer's configuration as its
``tokenizer_config.json`` holds it.
"""

from __future__ import annotations

from typing import Any

from pyxllm.engine.input_processor import TextPrompt
from pyxllm.engine.protocol import EngineClient
from pyxllm.entrypoints.openai.errors import OpenAIError
from pyxllm.entrypoints.openai.protocol import (
    ChatCompletionMessageParam,
    ChatCompletionRequest,
    OpenAIBaseModel,
    RequestModel,
)


class TokenizeRequest(RequestModel):
    """``POST /tokenize``: a ``prompt``, or chat ``messages`` rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatCompletionMessageParam] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False


class TokenizeResponse(OpenAIBaseModel):
    """The token ids, their number, the context limit and (if asked) each token's string."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    """``POST /detokenize``: token ids to text."""

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    """The text of the token ids."""

    prompt: str


# init kwargs that name the server's own files or loading switches, not the tokenizer
_LOCAL_KEYS = frozenset({"name_or_path", "is_local", "local_files_only", "cache_dir"})


def _jsonable(value: Any) -> Any:
    """``value`` with tokenizers' ``AddedToken`` objects as their text and dict keys as strings;
    anything else JSON cannot hold as its ``str``."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return getattr(value, "content", None) or str(value)


class OpenAIServingTokenization:
    """Tokenizes and detokenizes with the engine's tokenizer (and the chat handler's template);
    ``info_endpoint`` turns ``/tokenizer_info`` on."""

    def __init__(self, engine: EngineClient, chat_handler, info_endpoint: bool = False) -> None:
        self.engine = engine
        self.processor = engine.input_processor
        self.chat = chat_handler
        self.info_endpoint = info_endpoint

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        """The token ids of ``request.prompt`` or of its rendered ``messages`` (with a
        vision-language model, each image's placeholder run as the engine would run it).

        Raises:
            OpenAIError: another model's name (404), neither or both of prompt and messages,
                or messages the template cannot render (400).
            InvalidRequestError: an image part refused (400 naming it).
        """
        self.chat.check_model(request.model)
        tokenizer = self.engine.tokenizer
        if (request.prompt is None) == (request.messages is None):
            raise OpenAIError("prompt: give either prompt or messages", 400, "prompt")
        if request.prompt is not None:
            add_special = True if request.add_special_tokens is None else request.add_special_tokens
            prompt = TextPrompt(request.prompt, add_special)
        else:
            chat = ChatCompletionRequest(
                messages=request.messages,
                add_generation_prompt=request.add_generation_prompt,
                chat_template=request.chat_template,
                chat_template_kwargs=request.chat_template_kwargs,
            )
            # on the tokenizer thread: image parts are decoded (http(s) ones fetched) there
            prompt = await self.chat.on_tokenizer_thread(self.chat.chat_prompt, chat)
        tokens = await self.chat.tokenize(prompt)
        ids = list(tokens.token_ids)
        if tokens.multi_modal_data:  # each image token counted as its placeholder run
            ids, _ = await self.chat.on_tokenizer_thread(
                self.processor.process_multimodal, ids, tokens
            )
        if request.messages is not None and request.add_special_tokens:
            bos = getattr(tokenizer.hf, "bos_token_id", None)
            ids = ids if bos is None or ids[:1] == [bos] else [bos, *ids]
        strs = tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return TokenizeResponse(
            count=len(ids), max_model_len=self.engine.max_model_len, tokens=ids, token_strs=strs
        )

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        """The text of ``request.tokens`` (special tokens kept), checked and decoded on the
        tokenizer thread: a body of a million ids takes a second, which the event loop (every
        stream, ``/health``) must not wait for.

        Raises:
            OpenAIError: another model's name (404) or a token id out of the vocabulary (400).
        """
        self.chat.check_model(request.model)

        def decode(tokens: list[int]) -> str:
            self.processor.check_token_ids(tokens, "tokens")
            return self.engine.tokenizer.decode(tokens, skip_special_tokens=False)

        return DetokenizeResponse(
            prompt=await self.chat.on_tokenizer_thread(decode, request.tokens)
        )

    def tokenizer_info(self) -> dict[str, Any]:
        """vLLM's ``GET /tokenizer_info``: the tokenizer's init arguments (its
        ``tokenizer_config.json``: special tokens, added tokens, ``add_bos_token`` ...) without
        the server's file paths, with ``tokenizer_class``, the special tokens, the chat
        template the server renders with and ``model_max_length`` set to the engine's context
        limit (``max_model_len``).

        Raises:
            OpenAIError: the endpoint is off (404, as an unknown path).
        """
        if not self.info_endpoint:
            raise OpenAIError(
                "/tokenizer_info is off: start with --enable-tokenizer-info-endpoint", 404
            )
        hf = self.engine.tokenizer.hf
        info = {
            key: _jsonable(value)
            for key, value in hf.init_kwargs.items()
            if key not in _LOCAL_KEYS and not key.endswith("_file")
        }
        info.update(_jsonable(hf.special_tokens_map))
        info["tokenizer_class"] = type(hf).__name__
        info["chat_template"] = getattr(hf, "chat_template", None)
        info["model_max_length"] = self.engine.max_model_len
        return info
