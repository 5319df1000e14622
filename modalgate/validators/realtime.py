"""The realtime websocket (``/v1/realtime``): audio appended event by event, judged as it
comes.

vLLM and SGLang transcribe base64 PCM16 sent in ``input_audio_buffer.append`` events,
for the model a ``session.update`` names (vLLM: ``model``; SGLang and OpenAI:
``session.audio.input.transcription.model``), or the one the URL's ``?model=`` names.
A model that takes no audio is refused at the handshake where the URL names it, else at
the ``session.update`` that does; each appended chunk must be strict base64, and the
audio buffered since the last commit or clear is held to the rule's
``max_audio_seconds``, counted at the session's sample rate (vLLM: 16 kHz; SGLang: the
format's ``rate``, 24 kHz by default).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from modalgate.errors import ErrorCode, Violation
from modalgate.media.data_url import Base64Error, decode_base64
from modalgate.policy.matching import ResolvedRule, RuleMatcher

PCM16_BYTES = 2
# The rate each engine reads PCM16 at when the session does not say (vLLM: always).
DEFAULT_RATES = {"vllm": 16_000, "sglang": 24_000}
# Where an engine's session.update names the model, and the format's rate.
_MODEL_AT = (
    ("model",),
    ("session", "audio", "input", "transcription", "model"),
    ("session", "model"),
)
_RATE_AT = ("session", "audio", "input", "format", "rate")


def _dig(event: dict[str, Any], keys: tuple[str, ...]) -> Any:
    value: Any = event
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    return value


@dataclass(slots=True)
class RealtimeSession:
    """One connection's state: the model its audio is judged for, its rate, its buffer."""

    matcher: RuleMatcher
    model: str
    rule: ResolvedRule
    rate: int
    buffered_bytes: int = 0

    @classmethod
    def opened(cls, matcher: RuleMatcher, model: str | None, engine: str | None) -> RealtimeSession:
        """``model``: the URL's, else the policy's default (judged so until an update)."""
        named = model or matcher.policy.default_model or ""
        rate = DEFAULT_RATES.get(engine or "", DEFAULT_RATES["vllm"])  # unknown: the stricter
        return cls(matcher, named, matcher.resolve(named), rate)

    def handshake_refusal(self) -> Violation | None:
        """A model named at the handshake that takes no audio (or an unknown one, where
        unknown models are refused)."""
        if not self.model:
            return None
        return self._model_refusal("model")

    def judge(self, text: str | bytes) -> Violation | None:
        """What is wrong with one client event; None: it goes on."""
        try:
            event = orjson.loads(text)
        except orjson.JSONDecodeError:
            return None  # the engine answers a frame that is not JSON itself
        if not isinstance(event, dict):
            return None
        kind = event.get("type")
        if kind == "session.update":
            return self._update(event)
        if kind == "input_audio_buffer.append":
            return self._append(event.get("audio"))
        if kind in ("input_audio_buffer.commit", "input_audio_buffer.clear"):
            self.buffered_bytes = 0
        return None

    def _update(self, event: dict[str, Any]) -> Violation | None:
        for keys in _MODEL_AT:
            name = _dig(event, keys)
            if isinstance(name, str) and name:
                self.model, self.rule = name, self.matcher.resolve(name)
                refusal = self._model_refusal(".".join(keys))
                if refusal is not None:
                    return refusal
                break
        rate = _dig(event, _RATE_AT)
        if isinstance(rate, int) and not isinstance(rate, bool) and rate > 0:
            self.rate = rate
        return None

    def _model_refusal(self, param: str) -> Violation | None:
        rule = self.rule
        if not rule.known and self.matcher.refuses_unknown:
            return Violation(
                ErrorCode.UNKNOWN_MODEL, f"{param}: unknown model {self.model[:100]!r}", param
            )
        if "audio" in rule.accepts:
            return None
        accepts = ", ".join(sorted(rule.accepts)) or "text only"
        message = rule.message or (
            f"audio input is not supported by {self.model[:100]} (accepts: {accepts})"
        )
        return Violation(ErrorCode.UNSUPPORTED_MODALITY, f"{param}: {message}", param)

    def _append(self, audio: Any) -> Violation | None:
        refusal = self._model_refusal("audio")
        if refusal is not None:
            return refusal
        if not isinstance(audio, str):
            return Violation(ErrorCode.INVALID_REQUEST, "audio: must be a base64 string", "audio")
        try:
            size = len(decode_base64(audio))
        except Base64Error as exc:
            return Violation(ErrorCode.INVALID_BASE64, f"audio: {exc}", "audio")
        self.buffered_bytes += size
        seconds = self.buffered_bytes / (PCM16_BYTES * self.rate)
        limit = self.rule.limits.max_audio_seconds
        if seconds > limit:
            return Violation(
                ErrorCode.MEDIA_TOO_LARGE,
                f"audio: {seconds:.1f} s of audio buffered since the last commit; at most"
                f" {limit:g} s allowed",
                "audio",
            )
        return None
