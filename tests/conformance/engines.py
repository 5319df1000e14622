"""What vLLM and SGLang themselves make of a chat-completions body.

Runs the engines' own request-parsing code (installed from PyPI, without their
GPU dependencies, into ``.venv-conformance``: see ``install.sh``) and reports,
per body, whether the engine accepts it and which media items it extracts:

    {"accepted": bool, "error": str | None,
     "modalities": {"image": n, "video": n, "audio": n, "embeddings": n},
     "items": {...the engine's own item kinds and counts...},
     "stage": "request" | "parse" | None, "status": the engine's HTTP status}

Importable only from the conformance venv. The main venv (which cannot import
vLLM or SGLang) calls it as a subprocess, one JSON body per line in, one view
per line out:

    .venv-conformance/bin/python tests/conformance/engines.py --engine vllm \
        [--enable-mm-embeds] [--enable-prompt-embeds] [--supported image,video,audio] \
        [--limit-mm-per-prompt '{"image": 2}'] < bodies.jsonl > views.jsonl

What runs for real, and what stands in:

vLLM (``vllm_view``)
    ``ChatCompletionRequest`` validated as FastAPI does for the endpoint
    (``TypeAdapter(...).validate_python(body, from_attributes=True)``), then
    ``parse_chat_messages_async`` (``vllm/renderers/chat_utils/chat_message.py``,
    the function the server's renderer calls) with its real per-message and
    per-part parsing (``parse_chat_message_content``, ``MM_PARSER_MAP``,
    ``parse_chat_message_content_mm_part``), the real async content parser and
    the real item tracker's ``add`` / ``_validate_add`` and ``_resolve_items``
    (which refuses raw and embedding items of one modality together); refusals
    get their status from vLLM's ``create_error_response``. Stand-ins:
    the model config (a namespace around a real ``MultiModalConfig``), the
    model class (``get_placeholder_str``), and the multimodal processor, whose
    ``validate_num_items`` is vLLM's own function run on stand-in limits. Items
    are recorded, never fetched or decoded: the tracker resolves each item to
    ``None`` instead of awaiting the media connector or the prompt-embeds loader,
    so a malformed data URL, an unreachable URL or a corrupt tensor still counts
    as accepted here (the payload is the gate's media checks' business, not
    classification's).

SGLang (``sglang_view``)
    ``ChatCompletionRequest`` (``sglang/srt/entrypoints/openai/protocol.py``)
    validated as FastAPI does, the first check of ``_validate_request`` (empty
    ``messages``), then, per message, ``model_dump()`` and
    ``process_content_for_template_format`` (``sglang/srt/parser/
    jinja_template_utils.py``), which is how the server's Jinja-template path
    (``OpenAIServingChat._apply_jinja_template``) collects ``image_data``,
    ``video_data`` and ``audio_data``. Not run: the rest of ``OpenAIServingChat.
    _validate_request`` (tools, context length; its import chain needs
    torchvision and tvm_ffi) and the named conversation-template path. Triton
    and IPython are imported by SGLang at module level but never used on this
    path; when they are not installed, empty stand-in modules take their place.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import copy
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import types
from collections.abc import Iterator
from typing import Any, TypedDict

MODALITIES = ("image", "video", "audio", "embeddings")
ERROR_LIMIT = 400


class EngineView(TypedDict):
    accepted: bool
    error: str | None
    modalities: dict[str, int]
    # Beyond the four keys: the engine's own item kinds and counts; where a
    # refusal happened ("request": the FastAPI body model, "parse": the message
    # parsing after it) and the HTTP status the engine's handlers give it.
    items: dict[str, int]
    stage: str | None
    status: int


def _view(
    error: str | None,
    counts: dict[str, int] | None = None,
    items: dict[str, int] | None = None,
    *,
    stage: str | None = None,
    status: int = 200,
) -> EngineView:
    modalities = dict.fromkeys(MODALITIES, 0)
    for key, n in (counts or {}).items():
        modalities[key] = modalities.get(key, 0) + n
    return {
        "accepted": error is None,
        "error": error,
        "modalities": modalities,
        "items": dict(items or {}),
        "stage": stage,
        "status": status,
    }


@functools.cache
def _fastapi_body(model: type) -> Any:
    """Validate a body the way FastAPI does for a ``request: Model`` parameter."""
    from pydantic import TypeAdapter

    adapter = TypeAdapter(model)
    return lambda body: adapter.validate_python(body, from_attributes=True)


def _is_validation_error(exc: BaseException) -> bool:
    from pydantic import ValidationError

    return isinstance(exc, ValidationError)


def _describe(exc: BaseException) -> str:
    """``Type: message``, one line, short, without echoing payloads."""
    if _is_validation_error(exc):
        try:
            found = exc.errors(include_input=False, include_url=False)  # type: ignore[attr-defined]
            text = f"{len(found)} error(s), e.g. {_likely_cause(found)}"
        except Exception:
            text = str(exc)
    else:
        text = str(exc)
    text = " ".join(text.split())
    if len(text) > ERROR_LIMIT:
        text = text[:ERROR_LIMIT] + "..."
    return f"{type(exc).__name__}: {text}"


def _likely_cause(errors: list[dict[str, Any]]) -> str:
    """Of a union's errors, the one that says most: not "wrong ``type`` literal",
    "not a string" or "field missing" from the branches that never applied."""

    def rank(error: dict[str, Any]) -> int:
        loc = [str(p) for p in error.get("loc", ())]
        last = loc[-1] if loc else ""
        if error.get("type") == "literal_error" and last in ("type", "role"):
            return 2
        if error.get("type") in ("string_type", "model_type", "dict_type") or last == "role":
            return 2
        return 1 if error.get("type") == "missing" else 0

    best = min(errors, key=rank) if errors else {}
    loc = [str(p) for p in best.get("loc", ()) if "[" not in str(p) and "(" not in str(p)]
    return ".".join(loc) + ": " + str(best.get("msg", ""))


# ---------------------------------------------------------------------- vLLM

VLLM_EMBEDDINGS = ("image_embeds", "video_embeds", "audio_embeds", "prompt_embeds")
_recorded: contextvars.ContextVar[list[Any]] = contextvars.ContextVar("recorded")


def _vllm_setup() -> None:
    # Logs go to stderr: stdout carries the CLI's JSON lines.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


@contextlib.contextmanager
def _vllm_tracker(model_config: Any, supported: dict[str, int | None]) -> Iterator[list[Any]]:
    """Make ``parse_chat_messages_async`` build a recording item tracker."""
    from vllm.multimodal.processing import BaseProcessingInfo
    from vllm.renderers.chat_utils import chat_message, item_tracker

    real = item_tracker.AsyncMultiModalItemTracker

    class Info:
        """The processor's info: vLLM's own limit check on stand-in limits."""

        def __init__(self) -> None:
            self.supported_mm_limits = supported
            self.ctx = types.SimpleNamespace(get_mm_config=model_config.get_multimodal_config)
            self.allowed_mm_limits = BaseProcessingInfo.allowed_mm_limits.func(self)

        validate_num_items = BaseProcessingInfo.validate_num_items

    class ModelClass:
        @staticmethod
        def get_placeholder_str(modality: str, i: int) -> str | None:
            return f"<{modality}>"

    class RecordingTracker(real):  # type: ignore[misc, valid-type]
        model_cls = ModelClass  # type: ignore[assignment]

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.mm_processor = types.SimpleNamespace(info=Info())  # type: ignore[misc]
            _recorded.get().append(self)

        async def resolve_items(self):  # type: ignore[override]
            if not self._items_by_modality:
                return None, None
            # The real resolution (its mixing and processor checks) on items that
            # stand for the media: nothing is fetched, decoded or loaded.
            _check_empty_items(
                {
                    modality: [_stand_in(item) for item in items]
                    for modality, items in self._items_by_modality.items()
                }
            )
            placeholders = {
                modality: [(None, None)] * len(items)
                for modality, items in self._items_by_modality.items()
            }
            return item_tracker._resolve_items(
                placeholders, self.mm_processor, self._modality_order
            )

    recorded: list[Any] = []
    token = _recorded.set(recorded)
    chat_message.AsyncMultiModalItemTracker = RecordingTracker
    try:
        yield recorded
    finally:
        chat_message.AsyncMultiModalItemTracker = real
        _recorded.reset(token)


def _stand_in(item: Any) -> tuple[Any, Any]:
    """(data, uuid) for a tracked item, a ``partial(loader, payload, uuid, ...)``: the
    data stands in as ``True`` where the loader would load something, ``None`` where
    vLLM's loaders return nothing (an empty payload: ``if image_url`` and the like)."""
    args = getattr(item, "args", ())
    if len(args) >= 2:
        payload, uuid = args[0], args[1]
        return (True if payload else None), uuid
    return True, None


def _check_empty_items(items: dict[str, list[tuple[Any, Any]]]) -> None:
    """The renderer's check on resolved items (``renderers/base.py``): an empty item
    needs the uuid of media cached before."""
    from vllm.exceptions import VLLMValidationError

    for modality, found in items.items():
        for i, (data, uuid) in enumerate(found):
            if data is None and uuid is None:
                raise VLLMValidationError(
                    f"multi_modal_data[{modality!r}][{i}] is empty but "
                    f"multi_modal_uuids[{modality!r}][{i}] is missing.",
                    parameter="multi_modal_uuids",
                )


def vllm_view(
    body: dict[str, Any],
    *,
    enable_mm_embeds: bool = False,
    enable_prompt_embeds: bool = False,
    trust_request_mm_kwargs: bool = False,
    content_format: str = "openai",
    supported: dict[str, int | None] | None = None,
    limit_mm_per_prompt: dict[str, int] | None = None,
) -> EngineView:
    """vLLM's reading of a chat-completions body.

    ``trust_request_mm_kwargs``: the server's ``--trust-request-mm-kwargs``; without
    it the renderer refuses a request carrying ``mm_processor_kwargs`` or
    ``media_io_kwargs`` before parsing its messages (``validate_request_mm_kwargs``).

    ``supported``: the model's modalities and their limits (``None``: no limit of
    its own), as ``get_supported_mm_limits`` returns them; by default image,
    video and audio. ``limit_mm_per_prompt``: the server's ``--limit-mm-per-prompt``.
    ``content_format``: the chat template's content format, ``openai`` or ``string``.
    """
    _vllm_setup()
    try:
        from vllm.config.multimodal import MultiModalConfig
        from vllm.entrypoints.generate.base.protocol import validate_request_mm_kwargs
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.serve.exception_handling.error_response import (
            create_error_response,
        )
        from vllm.renderers.chat_utils import chat_message

        mm_config = MultiModalConfig(
            enable_mm_embeds=enable_mm_embeds,
            limit_per_prompt=dict(limit_mm_per_prompt or {}),
        )
        model_config = types.SimpleNamespace(
            multimodal_config=mm_config,
            get_multimodal_config=lambda: mm_config,
            enable_prompt_embeds=enable_prompt_embeds,
            is_multimodal_model=True,
            hf_config=types.SimpleNamespace(use_unified_vision_chunk=False),
            allowed_local_media_path="",
            allowed_media_domains=None,
        )
        if supported is None:
            supported = {"image": None, "video": None, "audio": None}
    except Exception as exc:
        raise RuntimeError(f"vLLM could not be set up: {_describe(exc)}") from exc
    with _vllm_tracker(model_config, supported) as trackers:
        try:
            request = _fastapi_body(ChatCompletionRequest)(copy.deepcopy(body))
        except Exception as exc:
            # FastAPI's RequestValidationError: vLLM's handler answers 400; an
            # exception of another kind escapes to vLLM's generic handlers.
            status = 400 if _is_validation_error(exc) else create_error_response(exc).error.code
            return _view(_describe(exc), stage="request", status=int(status))
        try:
            validate_request_mm_kwargs(  # the renderer's first step (preprocess_chat)
                mm_processor_kwargs=request.mm_processor_kwargs,
                media_io_kwargs=request.media_io_kwargs,
                trust_request_mm_kwargs=trust_request_mm_kwargs,
            )
            asyncio.run(
                chat_message.parse_chat_messages_async(
                    request.messages,
                    model_config,  # type: ignore[arg-type]
                    content_format,  # type: ignore[arg-type]
                    media_io_kwargs=request.media_io_kwargs,
                    mm_processor_kwargs=request.mm_processor_kwargs,
                )
            )
        except Exception as exc:
            status = int(create_error_response(exc).error.code)  # vLLM's own mapping
            return _view(_describe(exc), stage="parse", status=status)
    items: dict[str, int] = {}
    for tracker in trackers:
        for modality, found in tracker._items_by_modality.items():
            items[modality] = items.get(modality, 0) + len(found)
    return _view(None, _summed(items, VLLM_EMBEDDINGS), items)


def _summed(items: dict[str, int], embeddings: tuple[str, ...]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for kind, n in items.items():
        key = "embeddings" if kind in embeddings else kind
        counts[key] = counts.get(key, 0) + n
    return counts


# -------------------------------------------------------------------- SGLang


class _EmptyModule(types.ModuleType):
    """A module that answers every attribute with a do-nothing object."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Nothing()


class _Nothing:
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # used as a decorator: leave the function as it is
        return self

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self

    def __getitem__(self, key: Any) -> Any:
        return self


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: frozenset[str]) -> None:
        self.roots = roots

    def find_spec(self, name: str, path: Any = None, target: Any = None):
        if name.partition(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _EmptyModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []  # type: ignore[attr-defined]


# Imported at module level by SGLang, used only on GPU or in notebooks.
SGLANG_STAND_INS = ("triton", "IPython")


@contextlib.contextmanager
def _stand_ins(names: tuple[str, ...] = SGLANG_STAND_INS) -> Iterator[None]:
    """Empty modules for those of ``names`` that are not installed, for the
    duration of the block only: torch and vLLM probe for triton too, and must
    go on finding it missing afterwards."""
    missing = frozenset(
        m for m in names if m not in sys.modules and importlib.util.find_spec(m) is None
    )
    if not missing:
        yield
        return
    finder = _StandInFinder(missing)
    sys.meta_path.append(finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n.partition(".")[0] in missing]:
            del sys.modules[name]


def sglang_view(body: dict[str, Any], *, content_format: str = "openai") -> EngineView:
    """SGLang's reading of a chat-completions body (the Jinja-template path).

    ``content_format``: what SGLang detected in the chat template, ``openai``
    (content lists kept, media collected) or ``string`` (text joined; media parts
    are dropped without an error, so nothing is extracted).
    """
    with _stand_ins():
        return _sglang_view(body, content_format)


def _sglang_view(body: dict[str, Any], content_format: str) -> EngineView:
    try:
        from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest
        from sglang.srt.parser.jinja_template_utils import process_content_for_template_format
    except Exception as exc:
        raise RuntimeError(f"SGLang could not be set up: {_describe(exc)}") from exc
    image_data: list[Any] = []
    video_data: list[Any] = []
    audio_data: list[Any] = []
    modalities: list[Any] = []
    try:
        request = _fastapi_body(ChatCompletionRequest)(copy.deepcopy(body))
    except Exception as exc:
        # FastAPI's RequestValidationError: SGLang's handler answers 400; an
        # exception of another kind escapes validation as a 500.
        status = 400 if _is_validation_error(exc) else 500
        return _view(_describe(exc), stage="request", status=status)
    try:
        if not request.messages:  # the first check of OpenAIServingChat._validate_request
            raise ValueError("Messages cannot be empty.")
        for message in request.messages:
            msg_dict = message.model_dump()
            if msg_dict.get("content") is None:
                msg_dict["content"] = ""
            process_content_for_template_format(
                msg_dict, content_format, image_data, video_data, audio_data, modalities
            )
    except Exception as exc:
        # OpenAIServingBase.handle_request: ValueError and HTTPException are 400s,
        # anything else a 500.
        status = getattr(exc, "status_code", None) or (400 if isinstance(exc, ValueError) else 500)
        return _view(_describe(exc), stage="parse", status=status)
    items = {
        "image_data": len(image_data),
        "video_data": len(video_data),
        "audio_data": len(audio_data),
    }
    counts = {"image": len(image_data), "video": len(video_data), "audio": len(audio_data)}
    return _view(None, counts, {k: n for k, n in items.items() if n})


# ----------------------------------------------------------------------- CLI


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("vllm", "sglang", "openai", "pydantic", "transformers", "torch"):
        with contextlib.suppress(PackageNotFoundError):
            found[name] = version(name)
    return found


def view_of(body: Any, config: dict[str, Any]) -> EngineView:
    """One engine configuration's view of one body.

    ``config``: ``engine`` (``vllm`` or ``sglang``) and, for vLLM, any of
    ``enable_mm_embeds``, ``enable_prompt_embeds``, ``trust_request_mm_kwargs``,
    ``supported`` (a list of modalities), ``limit_mm_per_prompt``; for both,
    ``content_format``.
    """
    if not isinstance(body, dict):
        return _view("the body is not a JSON object", stage="request", status=400)
    content_format = config.get("content_format", "openai")
    if config["engine"] == "sglang":
        return sglang_view(body, content_format=content_format)
    supported = config.get("supported")
    return vllm_view(
        body,
        enable_mm_embeds=bool(config.get("enable_mm_embeds")),
        enable_prompt_embeds=bool(config.get("enable_prompt_embeds")),
        trust_request_mm_kwargs=bool(config.get("trust_request_mm_kwargs")),
        content_format=content_format,
        supported=None if supported is None else dict.fromkeys(supported),
        limit_mm_per_prompt=config.get("limit_mm_per_prompt"),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=("vllm", "sglang"))
    parser.add_argument("--enable-mm-embeds", action="store_true")
    parser.add_argument("--enable-prompt-embeds", action="store_true")
    parser.add_argument("--trust-request-mm-kwargs", action="store_true")
    parser.add_argument("--content-format", choices=("openai", "string"), default="openai")
    parser.add_argument(
        "--supported",
        default="image,video,audio",
        help="vLLM: the model's modalities, comma-separated (default: image,video,audio)",
    )
    parser.add_argument(
        "--limit-mm-per-prompt",
        type=json.loads,
        default=None,
        help="vLLM: the server's --limit-mm-per-prompt as JSON, e.g. '{\"image\": 2}'",
    )
    parser.add_argument(
        "--configs",
        type=json.loads,
        default=None,
        help="several configurations in one process, as a JSON object {name: config}"
        " (see view_of); each output line is then {name: view}",
    )
    parser.add_argument(
        "--versions", action="store_true", help="print the installed versions as JSON and exit"
    )
    args = parser.parse_args(argv)
    out = sys.stdout
    sys.stdout = sys.stderr  # whatever the engines print stays off the JSON stream
    if args.versions:
        out.write(json.dumps(versions()) + "\n")
        return 0
    if args.engine is None and args.configs is None:
        parser.error("--engine or --configs is required")
    single = {
        "engine": args.engine,
        "enable_mm_embeds": args.enable_mm_embeds,
        "enable_prompt_embeds": args.enable_prompt_embeds,
        "trust_request_mm_kwargs": args.trust_request_mm_kwargs,
        "content_format": args.content_format,
        "supported": list(filter(None, args.supported.split(","))),
        "limit_mm_per_prompt": args.limit_mm_per_prompt,
    }
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            body = json.loads(line)
        except ValueError as exc:
            bad = _view(f"invalid_json: {_describe(exc)}", stage="request", status=400)
            views = {name: bad for name in args.configs or {"": None}}
        else:
            views = {name: view_of(body, c) for name, c in (args.configs or {"": single}).items()}
        out.write(json.dumps(views if args.configs else views[""]) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
