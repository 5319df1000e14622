"""The capability table as pydantic models: the single schema for YAML, TOML and JSON.

Every model forbids unknown keys, so a typo in a policy file is an error that
names the field instead of a limit that silently does not apply.
"""

from __future__ import annotations

from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    IPvAnyNetwork,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from modalgate.policy.surface import (  # EndpointKind: imported from here too
    EndpointKind,  # noqa: F401
    EndpointSpec,
    default_endpoints,
)
from modalgate.settings import EngineSpec, ServerSection, upstream_root

# Media modalities a rule can accept; text always passes.
MediaModality = Literal["image", "video", "audio", "file", "embeddings"]
Modality = Literal["text", "image", "video", "audio", "file", "embeddings"]
OutputModality = Literal["text", "audio"]
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]
# Formats with a header reader in media.pillow (HEIF would need pillow-heif: not offered).
ImageFormat = Literal["jpeg", "png", "webp", "gif", "bmp", "tiff", "avif", "ico"]
UrlScheme = Literal["data", "https", "http", "file"]
# Containers with a walker in media.container_walk and a demuxer in media.av_probe.
VideoFormat = Literal["mp4", "mov", "webm", "mkv", "avi", "ts", "ogv"]
AudioFormat = Literal["wav", "flac", "ogg", "mp3", "m4a", "aac"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Limits(_Strict):
    """Defaults at the top level; a rule's own ``limits`` override them field by field.

    ``None`` for a count means no limit on that modality.
    """

    max_body_bytes: int = Field(64 * 1024 * 1024, gt=0)
    max_images: int | None = Field(16, ge=0)
    # Finite by default: each item is fetched, decoded and processed by the server.
    max_videos: int | None = Field(4, ge=0)
    max_audios: int | None = Field(8, ge=0)
    max_files: int | None = Field(8, ge=0)
    max_embeddings: int | None = Field(16, ge=0)
    max_image_bytes: int = Field(32 * 1024 * 1024, gt=0)
    # All remote media one request may make the gate download, together.
    max_fetched_bytes: int = Field(64 * 1024 * 1024, gt=0)
    max_image_pixels: int = Field((512 * 14) ** 2, gt=0)
    min_image_side: int = Field(2, ge=1)
    image_formats: tuple[ImageFormat, ...] = ("jpeg", "png", "webp", "gif")
    allow_animated: bool = False
    # Frames per image where animation is allowed (counting stops one past it).
    max_image_frames: int = Field(1000, gt=0)
    # Decode every image fully (cost: a decode per image) to refuse truncation that
    # structural checks cannot see; see docs/security.md.
    verify_image_data: bool = False
    # Vision-token budgets, estimated with the rule's `tokens` family; None = no budget.
    max_image_tokens: int | None = Field(None, gt=0)
    max_request_image_tokens: int | None = Field(None, gt=0)
    # Video and audio (media.av_probe: FFmpeg's demuxers, every packet counted). Codecs
    # are FFmpeg's names; None: any FFmpeg decodes.
    video_formats: tuple[VideoFormat, ...] = ("mp4", "mov", "webm", "mkv", "avi")
    video_codecs: tuple[str, ...] | None = ("h264", "hevc", "vp8", "vp9", "av1", "mpeg4", "mjpeg")
    max_video_seconds: float = Field(600.0, gt=0)
    max_video_frames: int = Field(36_000, gt=0)  # ten minutes at 60 fps
    min_video_frames: int = Field(1, gt=0)  # a processor that groups frames may need more
    max_video_pixels: int = Field(4096 * 2160, gt=0)  # per frame
    audio_formats: tuple[AudioFormat, ...] = ("wav", "flac", "ogg", "mp3", "m4a", "aac")
    audio_codecs: tuple[str, ...] | None = None
    max_audio_seconds: float = Field(600.0, gt=0)
    min_audio_seconds: float = Field(0.0, ge=0)  # shorter is media_too_small
    min_audio_sample_rate: int = Field(8_000, gt=0)
    max_audio_sample_rate: int = Field(192_000, gt=0)
    max_audio_channels: int = Field(8, gt=0)
    # Decode every frame of the stream judged (cost: a decode, without conversion), so
    # damage anywhere is refused; off, only the first frame (and audio's last) is.
    verify_media_data: bool = True
    max_verified_pixels: int = Field(1 << 27, gt=0)  # of one video; the rest are counted

    def max_count(self, modality: str) -> int | None:
        return {
            "image": self.max_images,
            "video": self.max_videos,
            "audio": self.max_audios,
            "file": self.max_files,
            "embeddings": self.max_embeddings,
        }.get(modality)

    def merged(self, override: Limits | None) -> Limits:
        if override is None:
            return self
        return self.model_copy(update=override.model_dump(exclude_unset=True))


class TokenSpec(_Strict):
    """How the model's processor turns an image into vision tokens (used for budgets).

    ``family`` names the estimator (``validators.tokens.ESTIMATORS``: kimi_navit,
    qwen_smart_resize, fixed, glm4v, llama4_tiles, pixtral, phi4mm, internvl_tiles,
    openai_tiles); a family without one is a recorded fact without a budget.
    """

    family: str
    patch_size: int | None = Field(None, gt=0)
    merge_size: int | None = Field(None, gt=0)
    max_patches: int | None = Field(None, gt=0)
    max_side: int | None = Field(None, gt=0)
    min_pixels: int | None = Field(None, gt=0)
    max_pixels: int | None = Field(None, gt=0)
    tokens_per_image: int | None = Field(None, gt=0)
    tile_size: int | None = Field(None, gt=0)
    max_tiles: int | None = Field(None, gt=0)
    # Videos (``validators.video_tokens.VIDEO_ESTIMATORS``): every frame resized within
    # these bounds, frames grouped ``temporal_patch_size`` at a time.
    video_family: str | None = None
    video_min_pixels: int | None = Field(None, gt=0)
    video_max_pixels: int | None = Field(None, gt=0)
    temporal_patch_size: int | None = Field(None, gt=0)
    # Audio (``validators.audio_tokens.AUDIO_ESTIMATORS``); not counted in the image budgets.
    audio_family: str | None = None
    audio_window_seconds: float | None = Field(None, gt=0)  # the feature extractor's chunk

    @model_validator(mode="after")
    def _fixed_needs_a_count(self) -> TokenSpec:
        if self.family == "fixed" and self.tokens_per_image is None:
            raise PydanticCustomError(
                "missing_tokens_per_image", "family 'fixed' needs tokens_per_image"
            )
        return self


class MediaUrls(_Strict):
    schemes: tuple[UrlScheme, ...] = ("data", "https")
    # Empty: any public host. Entries are exact hosts or globs (``*.example.com``).
    allow_hosts: tuple[str, ...] = ()
    # Private, loopback, link-local... addresses stay refused unless listed here.
    allow_private: tuple[IPvAnyNetwork, ...] = ()
    file_roots: tuple[str, ...] = ()
    fetch_timeout_s: float = Field(5.0, gt=0)
    max_redirects: int = Field(3, ge=0)
    # The gate downloads remote media to check it like inline media ...
    fetch: bool = True
    # ... and forwards it inline (as a data URL), so the server never downloads it again.
    inline_fetched: bool = True
    max_connections: int = Field(64, gt=0)
    max_connections_per_host: int = Field(8, gt=0)

    @field_validator("allow_hosts")
    @classmethod
    def _lower_hosts(cls, hosts: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(h.lower().rstrip(".") for h in hosts)


# How a media part's client-chosen id (vLLM's ``uuid``, a token-in ``mm_hashes`` entry)
# reaches the engine, whose caches key on it (docs/security.md#media-ids):
# bind: derived from the tenant, the id and the bytes the gate checked;
# share: derived from the bytes alone (tenants sending identical bytes share a key);
# strip: dropped (the engine keys the media by its content; a reference by id alone is
# refused); refuse: a part with an id is refused (where the body cannot be rewritten:
# Envoy's ext_authz); pass: as the client sent it (one trusted client); isolate: bind, and
# every part without an id gets one bound to the tenant and bytes too (vLLM), so not even
# identical bytes share the engine's cache across tenants.
MediaIdMode = Literal["bind", "isolate", "share", "strip", "refuse", "pass"]


class MediaIds(_Strict):
    """Client-chosen media ids: how they are rewritten, and what the gateway remembers so a
    tenant may refer to media it sent before by id alone (``docs/security.md``)."""

    mode: MediaIdMode = "bind"
    # The header an authenticating proxy in front sets to name the tenant; None: the
    # bearer key names it (no key: one tenant). A client must not be able to set it.
    tenant_header: str | None = Field(None, min_length=1, pattern=r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
    # What the gateway remembers of the media it passed on (per process, LRU):
    remember_entries: int = Field(100_000, ge=0)
    remember_bytes: int = Field(64 * 1024 * 1024, ge=0)
    remember_seconds: float = Field(3600.0, gt=0)

    @field_validator("tenant_header")
    @classmethod
    def _lower_header(cls, name: str | None) -> str | None:
        return name.lower() if name is not None else None


class VerdictCacheSpec(_Strict):
    """Accepted media parts remembered by their exact payload, so a conversation's images,
    resent every turn, are not walked again (``validators/verdict_cache.py``). Per process,
    least recently used first; the memory is the payloads' base64 text."""

    enabled: bool = True
    max_entries: int = Field(10_000, ge=0)
    max_bytes: int = Field(128 * 1024 * 1024, ge=0)
    # Smaller payloads are walked again: cheaper than comparing them. A payload is
    # recognised in a body by a window 2 KiB in (validators/verdict_cache.PROBE_AT).
    min_payload_bytes: int = Field(4096, ge=2080)


# The policy file's ``server:`` section: derived from the one settings model.
Server = ServerSection


EmbedsDtype = Literal["float32", "bfloat16", "float16"]


class EmbedsSpec(_Strict):
    """Encode a rule's accepted images at the gateway; the upstream gets ``image_embeds`` parts.

    vLLM (``--enable-mm-embeds``) takes, per image, base64 of a ``torch.save``d tensor
    ``[tokens, hidden]``: alone (string form), or for families whose positions need the
    patch grid (Qwen2-VL's mRoPE) in an object next to a ``(3,)`` int64 ``t, h, w`` grid.
    Which form and which keys a family wants is data here, so a new family is a policy
    edit, not a code change. ``hidden_size``, when set, refuses embeddings of the wrong
    width at the gateway: vLLM documents that a wrong shape may crash its engine.
    """

    format: Literal["vllm"] = "vllm"
    dtype: EmbedsDtype = "float32"
    embeds_key: str = Field("image_embeds", min_length=1)
    grid_key: str | None = Field(None, min_length=1)
    hidden_size: int | None = Field(None, gt=0)


class UpstreamTarget(_Strict):
    """One server of a model's route; traffic is shared by weight among the healthy ones."""

    url: str
    weight: int = Field(1, gt=0)

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")):
            raise PydanticCustomError("upstream_url", "an upstream must be an http(s) URL")
        return upstream_root(url)  # with or without /v1, like --upstream


class ModelRule(_Strict):
    name: str = Field(min_length=1)
    match: tuple[str, ...] = ()
    mode: str | None = None
    accepts: tuple[MediaModality, ...]
    # What the model answers in: a request asking for anything else (``modalities``,
    # ``audio``) is refused, where engines would answer in text alone.
    produces: tuple[OutputModality, ...] = ("text",)
    message: str | None = None
    limits: Limits | None = None
    media_roles: tuple[Role, ...] | None = None
    tokens: TokenSpec | None = None
    # Encoder adapter for /v1/encode, as NAME[:ARG] (e.g. "kimi:/models/kimi-k3-vit").
    encoder: str | None = None
    source: str | None = None
    # Encode accepted images here and forward image_embeds parts (docs/embeds.md).
    embeds: EmbedsSpec | None = None
    # Where this model is served: one URL, or several targets with weights (docs/routing.md).
    upstream: tuple[UpstreamTarget, ...] | None = None
    # Opt-in: a request with media this model cannot take goes to the named model instead.
    fallback: dict[MediaModality, str] | None = None
    # The server this model runs on, whose request parsing the gate follows:
    # ``vllm``, ``sglang``, ``openai`` or {name, enable_mm_embeds, ...}; None: detected.
    engine: EngineSpec | None = None
    # False: shadow mode for this model (refusals logged, counted, forwarded); None: the
    # policy's top-level ``enforce`` (docs/policy.md#shadow-mode-enforce).
    enforce: bool | None = None
    # How this model's media ids reach its server; None: the policy's ``media_ids.mode``.
    media_ids: MediaIdMode | None = None

    @field_validator("engine", mode="before")
    @classmethod
    def _engine_by_name(cls, value: object) -> object:
        return {"name": value} if isinstance(value, str) else value

    @field_validator("upstream", mode="before")
    @classmethod
    def _one_or_many_targets(cls, value: object) -> object:
        if isinstance(value, str):
            return ({"url": value},)
        if isinstance(value, list | tuple):
            return tuple({"url": v} if isinstance(v, str) else v for v in value)
        return value

    @field_validator("upstream")
    @classmethod
    def _some_targets(
        cls, value: tuple[UpstreamTarget, ...] | None
    ) -> tuple[UpstreamTarget, ...] | None:
        if value is not None and not value:
            raise PydanticCustomError("empty_upstream", "'upstream' needs at least one URL")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ModelRule:
        """A rewrite with no images to rewrite is a mistake; client embeddings next to a
        rewrite would let clients feed the upstream raw tensors (the gateway's to send);
        a fallback for an accepted modality, or to the rule itself, never applies."""
        if self.embeds is not None and "image" not in self.accepts:
            raise PydanticCustomError(
                "embeds_without_images", "'embeds' needs 'image' in 'accepts': nothing to encode"
            )
        for modality, target in (self.fallback or {}).items():
            if modality in self.accepts:
                raise PydanticCustomError(
                    "fallback_for_accepted",
                    "fallback for '{modality}', which this rule accepts: it would never apply",
                    {"modality": modality},
                )
            if target.casefold() == self.name.casefold():
                raise PydanticCustomError("fallback_loop", "a rule cannot fall back to itself")
        if self.embeds is not None and "embeddings" in self.accepts:
            raise PydanticCustomError(
                "embeds_with_client_embeddings",
                "a rule with 'embeds' must not accept client 'embeddings': only the gateway"
                " may send the upstream precomputed embeddings",
            )
        return self


# The API surface a proxying gateway forwards, and how each body is read: every engine's
# doors (policy/doors.yaml) bar their admin and control paths (docs/policy.md).
DEFAULT_ENDPOINTS: dict[str, EndpointSpec] = default_endpoints()


class Policy(_Strict):
    # "builtin": this file is applied on top of the built-in table (see loading).
    extends: Literal["builtin"] | None = None
    # auto: refused in a mode that has rules written for it (encoder mode serves one
    # model family), allowed otherwise.
    unknown_models: Literal["allow", "reject", "auto"] = "auto"
    # The model a request without one is judged as; None: such a request is refused.
    default_model: str | None = Field(None, min_length=1)
    # False: shadow mode; the policy's refusals are logged, counted and forwarded anyway.
    enforce: bool = True
    limits: Limits = Limits()
    media_roles: tuple[Role, ...] = ("user", "tool")
    media_urls: MediaUrls = MediaUrls()
    media_ids: MediaIds = MediaIds()
    verdict_cache: VerdictCacheSpec = VerdictCacheSpec()
    server: Server = Server()
    # Paths the gateway forwards and how each body is judged; ``/prefix/*`` covers a subtree.
    endpoints: dict[str, EndpointSpec] = Field(default_factory=lambda: dict(DEFAULT_ENDPOINTS))
    models: tuple[ModelRule, ...] = ()

    @field_validator("endpoints")
    @classmethod
    def _endpoint_paths(cls, endpoints: dict[str, EndpointSpec]) -> dict[str, EndpointSpec]:
        for key in endpoints:
            bare = key[:-2] if key.endswith("/*") else key
            if not key.startswith("/") or "*" in bare or "//" in key or "/." in key:
                raise PydanticCustomError(
                    "endpoint_path",
                    "endpoint '{path}' must be an absolute, normalised path, optionally ending"
                    " in /*",
                    {"path": key},
                )
        return endpoints

    @field_validator("models")
    @classmethod
    def _unique_names_per_mode(cls, models: tuple[ModelRule, ...]) -> tuple[ModelRule, ...]:
        seen: set[tuple[str, str | None]] = set()
        for index, rule in enumerate(models):
            key = (rule.name.lower(), rule.mode)
            if key in seen:
                where = f" in mode {rule.mode!r}" if rule.mode else ""
                raise PydanticCustomError(
                    "duplicate_rule",
                    "duplicate model rule name '{name}'{where}",
                    {"name": rule.name, "where": where, "index": index},
                )
            seen.add(key)
        return models
