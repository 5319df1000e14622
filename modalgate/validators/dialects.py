"""How each engine reads a chat message's content parts, as data.

The gate must refuse exactly what the server behind it would refuse or
misread, and nothing it takes: so part classification follows that server's
dialect. vLLM and SGLang differ in which part types they take, which payload
shapes (a bare URL string or an object), which ``detail`` values and audio
formats, whether a part may go without ``type``, what a ``uuid`` changes, and
which keys they ignore. Each ``Dialect`` below was read from the engine's own
request models and chat parsing (vLLM 0.33.0, SGLang 0.5.23) and is held to
them by the differential suite in ``tests/conformance/``. ``openai`` is for any
other OpenAI-compatible server: the gate's broad reading of every known part
type, minus the shapes OpenAI's own schema refuses.

Which dialect applies is decided in gateway/ (the rule's ``engine``, else the
upstream's, else what its ``/v1/models`` says) and passed in: validators stay pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from types import MappingProxyType
from typing import Literal

from modalgate.settings import EngineSpec

# A part without ``type``, or one with a ``uuid``: ``refused``, read by its payload
# key (``by_key``: vLLM), or, for ``uuid``, ``ignored`` (SGLang drops it) or
# ``must_agree`` (the payload key and the type must name the same kind: a server
# of unknown dialect may read either).
Inference = Literal["refused", "by_key"]
UuidRule = Literal["by_key", "ignored", "must_agree"]
PayloadForm = Literal["object", "string"]
Flag = Literal["enable_mm_embeds", "enable_prompt_embeds"]
# What a message's reasoning key may hold: a string, also one prompt_embeds part (vLLM),
# or also a list of content parts (read as content: the generic reading).
ReasoningForm = Literal["text", "text_or_embeds_part", "text_or_parts"]

EMBEDS_TYPES = ("image_embeds", "audio_embeds", "video_embeds")
# The modality whose raw inputs each embeddings part stands for.
EMBEDS_MODALITY = MappingProxyType(
    {"image_embeds": "image", "audio_embeds": "audio", "video_embeds": "video"}
)
# The part types vLLM parses as text (its TEXT_PART_TYPES).
VLLM_TEXT_TYPES = frozenset({"text", "input_text", "output_text", "refusal", "thinking"})
# vLLM's order for reading a part by its payload key (no type, or a uuid).
KEY_ORDER = (
    "image_url",
    "image_pil",
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "prompt_embeds",
    "audio_url",
    "input_audio",
    "video_url",
    "tool_reference",
)
OPENAI_DETAILS = ("auto", "low", "high", "original")  # openai's ImageURL.detail


def _frozen(mapping: Mapping[str, object]) -> Mapping[str, object]:
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True, slots=True)
class Dialect:
    """One engine's reading of chat content parts (one server configuration)."""

    engine: str
    # The part types the engine takes with a ``type``, and the server flag each needs.
    types: frozenset[str]
    needs: Mapping[str, Flag] = field(default_factory=lambda: _frozen({}))
    # URL parts (image_url, video_url, audio_url): the payload forms taken when typed.
    url_forms: frozenset[PayloadForm] = frozenset({"object"})
    # Parts without ``type``: refused, or read by payload key (a URL as a string or an
    # object with ``url``).
    typeless: Inference = "refused"
    uuid: UuidRule = "must_agree"
    # A typed part that also carries another kind's payload key: the engine ignores the
    # key (``True``: its models drop unknown keys) or the gate refuses the part.
    ignores_other_keys: bool = False
    # Keys a part of the type must carry besides its payload (vLLM's input_image: detail).
    required_keys: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: _frozen({}))
    # ``detail`` values taken (``None``: an explicit null).
    image_details: frozenset[str | None] = frozenset({"auto", "low", "high", None})
    input_image_details: frozenset[str | None] = frozenset({"auto", "low", "high", None})
    input_image_file_ids: bool = True
    # A bare string where a content part goes (read as text, or refused).
    bare_string_parts: bool = False
    # Raw media and embeddings of one modality in one request (vLLM refuses the mix).
    mixes_raw_and_embeds: bool = True
    reasoning: Mapping[str, ReasoningForm] = field(
        default_factory=lambda: _frozen(
            {"reasoning": "text_or_parts", "reasoning_content": "text_or_parts"}
        )
    )
    audio_formats: frozenset[str] | None = frozenset({"wav", "mp3"})  # None: any string
    # Text-like part types whose payload must be a string (None: all of them), and those
    # whose null payload is dropped instead (vLLM's text and refusal).
    checked_text: frozenset[str] | None = None
    skips_null_text: frozenset[str] = frozenset()
    # Where ``use_audio_in_video`` is read (a video then carries its audio track too).
    audio_in_video: tuple[str, ...] = ()
    # Per-request ``mm_processor_kwargs`` / ``media_io_kwargs`` taken at all.
    takes_mm_kwargs: bool = True
    empty_messages: bool = False
    # Roles the engine takes, lower-cased as it lower-cases them; ``None``: any string.
    roles: frozenset[str] | None = None
    # Of those, the ones it takes only as spelled here (SGLang's user message: a Literal).
    exact_roles: frozenset[str] = frozenset()
    # Roles whose ``content`` may not be missing or null; whether a user's may be ``[]``.
    content_required: frozenset[str] = frozenset({"user", "system", "developer"})
    # Roles whose ``content`` may be an explicit null; None: those it is not required of.
    null_content: frozenset[str] | None = None
    empty_user_content: bool = False
    # Part types valid only in these roles (SGLang's thinking parts: assistant).
    type_roles: Mapping[str, frozenset[str]] = field(default_factory=lambda: _frozen({}))
    # vLLM: a message may be read as OpenAI's instead of vLLM's own (``message_path``);
    # its parts are then read by this stricter dialect.
    fallback: Dialect | None = None

    def refusal(self, part_type: str) -> str | None:
        """Why the engine refuses a part of this type, or None when it takes it."""
        if part_type not in self.types:
            return f"{self.engine} does not take {part_type!r} parts"
        flag = self.needs.get(part_type)
        if flag is not None:
            option = "--" + flag.replace("_", "-")
            return f"{self.engine} takes {part_type!r} parts only when started with {option}"
        return None


# Every part type the gate knows (parts.PART_KINDS), bar image_pil (never over HTTP).
_ALL_TYPES = frozenset(
    {
        "text",
        "refusal",
        "image_url",
        "input_audio",
        "file",
        "input_text",
        "output_text",
        "input_image",
        "input_file",
        "video_url",
        "audio_url",
        "image_embeds",
        "audio_embeds",
        "video_embeds",
        "prompt_embeds",
        "thinking",
        "tool_reference",
    }
)

OPENAI = Dialect(
    engine="openai",
    types=_ALL_TYPES,
    image_details=frozenset({"auto", "low", "high", "original", None}),
    input_image_details=frozenset({"auto", "low", "high", "original", None}),
    audio_in_video=("mm_processor_kwargs.use_audio_in_video", "use_audio_in_video"),
)


def _vllm(spec: EngineSpec) -> Dialect:
    needs: dict[str, Flag] = {}
    if not spec.enable_mm_embeds:
        needs.update(dict.fromkeys(EMBEDS_TYPES, "enable_mm_embeds"))
    if not spec.enable_prompt_embeds:
        needs["prompt_embeds"] = "enable_prompt_embeds"
    fallback = Dialect(
        engine="vllm",
        types=frozenset({"text", "image_url", "input_audio"}),
        empty_user_content=True,
        uuid="by_key",
        ignores_other_keys=True,
        image_details=frozenset(OPENAI_DETAILS),
        bare_string_parts=False,
        mixes_raw_and_embeds=False,
    )
    return Dialect(
        engine="vllm",
        types=frozenset(
            {
                "text",
                "input_text",
                "output_text",
                "refusal",
                "thinking",
                "input_image",
                "image_url",
                "video_url",
                "audio_url",
                "input_audio",
                "tool_reference",
                *EMBEDS_TYPES,
                "prompt_embeds",
                "image_pil",  # only as a uuid's reference to an image cached before
            }
        ),
        needs=_frozen(needs),
        typeless="by_key",
        uuid="by_key",
        ignores_other_keys=True,
        required_keys=_frozen({"input_image": ("image_url", "detail")}),
        image_details=frozenset({"auto", "low", "high", "original"}),
        input_image_details=frozenset({"auto", "low", "high", "original"}),
        input_image_file_ids=False,
        mixes_raw_and_embeds=False,
        # vLLM renames reasoning_content to reasoning before validating the request.
        reasoning=_frozen(
            {"reasoning": "text_or_embeds_part", "reasoning_content": "text_or_embeds_part"}
        ),
        audio_formats=None,
        # Text payloads are cast, not checked; a placeholder check reads them as
        # strings when prompt embeddings are on.
        checked_text=VLLM_TEXT_TYPES if spec.enable_prompt_embeds else frozenset(),
        skips_null_text=frozenset({"text", "refusal"}),
        bare_string_parts=True,
        fallback=fallback,
        audio_in_video=("mm_processor_kwargs.use_audio_in_video",),
        takes_mm_kwargs=spec.trust_request_mm_kwargs,
        empty_messages=True,
        content_required=frozenset(),
        null_content=frozenset({"assistant"}),
        empty_user_content=True,
    )


SGLANG = Dialect(
    engine="sglang",
    types=frozenset(
        {"text", "thinking", "image_url", "video_url", "audio_url", "input_audio", "tool_reference"}
    ),
    uuid="ignored",
    ignores_other_keys=True,
    image_details=frozenset({"auto", "low", "high", "default", None}),
    reasoning=_frozen({"reasoning_content": "text"}),
    audio_in_video=("use_audio_in_video",),
    roles=frozenset(
        {
            "user",
            "system",
            "assistant",
            "tool",
            "function",
            "developer",
            "latest_reminder",
            "root",
        }
    ),
    exact_roles=frozenset({"user"}),
    content_required=frozenset({"user"}),
    empty_user_content=True,
    type_roles=_frozen({"thinking": frozenset({"assistant"})}),
)


@cache
def dialect_for(spec: EngineSpec | None) -> Dialect:
    """The dialect of one server configuration; ``None``: an OpenAI-compatible server."""
    if spec is None or spec.name == "openai":
        return OPENAI
    if spec.name == "sglang":
        return SGLANG
    return _vllm(spec)
