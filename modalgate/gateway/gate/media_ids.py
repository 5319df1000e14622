"""Media ids the engine can trust: each client-chosen id rewritten to one bound to its
tenant and bytes before the body goes on (docs/security.md#media-ids).

vLLM keys its processor and encoder caches on a part's ``uuid`` verbatim (and a
token-in request's ``features.mm_hashes``): one id reused for other bytes serves the
wrong features (or crashes the engine on a length mismatch), and an id with no payload
reads whatever the engine cached under it, whoever sent it. The gate has the bytes it
checked and the caller, so under ``bind`` the engine gets
``mg-`` + BLAKE3(secret; tenant, modality, client id, digest of the bytes), keyed with a
secret of the deployment's: another tenant's id, or the same id with other bytes, can
never come out as the same key, and nobody without the secret can forge one. A reference
(id, no payload) is resolved in this tenant's own memory of what it sent
(``id_store.py``) and judged as that media (``validators/references.py``).

Modes (``policy.media_ids.mode``, per rule ``media_ids``): ``bind``; ``share``, the key
from the bytes alone (identical bytes share the engine's cache across tenants); ``strip``
(ids dropped, the engine hashes content; references refused); ``refuse`` (a part with an
id is refused: where the body cannot be rewritten, Envoy's ext_authz); ``pass`` (as sent).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterable
from dataclasses import replace

import blake3
import orjson

from modalgate.errors import MAX_LISTED_VIOLATIONS, ErrorCode, Violation, path
from modalgate.gateway.gate.auth import bearer_token
from modalgate.gateway.gate.id_store import MediaIdStore, MemoryIdStore, Remembered
from modalgate.gateway.gate.remote_media import RunCpu, run_inline
from modalgate.policy.models import MediaIds
from modalgate.validators import Verdict
from modalgate.validators.json_body import Location, Unset, locate, location_of
from modalgate.validators.references import CachedMedia, check_references
from modalgate.validators.verdict import MediaPart, amended

SECRET_ENV = "MODALGATE_MEDIA_ID_SECRET"
KEY_PREFIX = "mg-"
_KEY_CONTEXT = "modalgate 2026-12 media ids"
ANONYMOUS = b""  # the tenant of a request with no key (and no tenant header)

Edits = list[tuple[Location, object]]


def deployment_secret() -> bytes:
    """The key every id is derived under: ``MODALGATE_MEDIA_ID_SECRET`` (any text; the same
    on every replica that should give the same media the same key), else one drawn now and
    put in the environment, so processes started from this one (serve's workers) share it."""
    text = os.environ.get(SECRET_ENV)
    if not text:
        text = os.environ[SECRET_ENV] = secrets.token_hex(32)
    return blake3.blake3(text.encode(), derive_key_context=_KEY_CONTEXT).digest()


class MediaIdentity:
    """The policy's ``media_ids`` applied to a verdict: the edits that rebind its ids."""

    def __init__(
        self,
        settings: MediaIds,
        store: MediaIdStore | None = None,
        secret: bytes | None = None,
    ) -> None:
        self.settings = settings
        self.tenant_header = settings.tenant_header.encode() if settings.tenant_header else None
        self.store: MediaIdStore = store or MemoryIdStore(
            settings.remember_entries, settings.remember_bytes, settings.remember_seconds
        )
        self._secret = secret or deployment_secret()

    def with_settings(self, settings: MediaIds) -> MediaIdentity:
        """For a new policy: the same memory and secret (the engine's caches outlive a
        reload), the new settings; a new store only where its bounds changed."""
        same_bounds = (
            settings.remember_entries,
            settings.remember_bytes,
            settings.remember_seconds,
        ) == (
            self.settings.remember_entries,
            self.settings.remember_bytes,
            self.settings.remember_seconds,
        )
        return MediaIdentity(settings, self.store if same_bounds else None, self._secret)

    def tenant_of(self, headers: Iterable[tuple[bytes, bytes]]) -> bytes:
        """Who is asking, as a digest: the tenant header's value where the policy names
        one, else the bearer key (never kept or sent on as it is); no key: one tenant."""
        if self.tenant_header is not None:
            value = None
            for name, found in headers:
                if name == self.tenant_header:
                    value = found
        else:
            value = bearer_token(headers)
        if not value:
            return ANONYMOUS
        return blake3.blake3(b"tenant\0" + value, key=self._secret).digest(16)

    async def bind(
        self, verdict: Verdict, tenant: bytes, run_cpu: RunCpu = run_inline
    ) -> tuple[Verdict, Edits]:
        """``verdict`` with its ids as the engine will get them (``MediaPart.media_id``) and
        references judged, and the edits that write those ids into the body; a verdict
        refused for an id that cannot go on (no edits then)."""
        rule, parts = verdict.rule, list(verdict.parts)
        named = [i for i, part in enumerate(parts) if part.media_id is not None]
        # isolate: parts without an id, where one may stand, get one too.
        unnamed = [
            i
            for i, part in enumerate(parts)
            if part.media_id is None and part.id_param is not None and part.digest is not None
        ]
        if rule is None or rule.media_ids == "pass":
            return verdict, []
        if not (named or verdict.hash_params or (unnamed and rule.media_ids == "isolate")):
            return verdict, []
        mode = rule.media_ids
        if mode == "refuse":
            where = [parts[i].id_param or parts[i].param for i in named]
            return _refused(verdict, [*where, *verdict.hash_params], _REFUSE_MESSAGE), []
        references = [i for i in named if parts[i].source == "cached"]
        if mode == "strip" and references:
            where = [parts[i].id_param or parts[i].param for i in references]
            return _refused(verdict, where, _STRIP_MESSAGE), []
        fills = [i for i in named if parts[i].source != "cached"]
        # Taken as the bytes were checked, nearly always; client tensors are digested here.
        digests = {i: parts[i].digest for i in fills if parts[i].digest is not None}
        undigested = [i for i in fills if i not in digests and parts[i].source == "embeds"]
        if undigested:
            digests.update(await run_cpu(verdict.body_bytes, _digests, verdict, undigested))
        # Hashes an engine would trust whoever sent them: it computes its own instead.
        edits: Edits = [(location_of(param), Unset) for param in verdict.hash_params]
        made: dict[str, Remembered] = {}  # this request's own fills, by client id
        for index in fills:
            part = parts[index]
            digest = digests.get(index)
            key = None
            if digest is not None and (mode != "strip" or part.part_type == "features"):
                # vLLM needs an id for precomputed features: stripped, they get the content's.
                how = "bind" if mode in ("bind", "isolate") else "share"
                key = self._key(how, tenant, part, digest)
            parts[index] = replace(part, media_id=key)
            edits += _id_edits(part, key)
            if key is not None and mode != "strip":
                made[part.media_id or ""] = Remembered(key, CachedMedia.of(part, rule))
        if mode == "isolate":
            for index in unnamed:
                part = parts[index]
                assert part.digest is not None
                key = self._key("bind", tenant, part, part.digest)
                parts[index] = replace(part, media_id=key)
                edits += _id_edits(part, key)
        if references:
            judged = await self._resolved(verdict, parts, references, tenant, made, edits)
        else:
            judged = amended(verdict, parts=tuple(parts))
        # Judged as before (accepted, or shadowed for what shadow mode forwards) or refused
        # for an id; remembered only where the engine is to get the fills.
        goes_on = len(judged.violations) == len(verdict.violations)
        if goes_on and made:
            await self.store.remember(tenant, rule.name, list(made.items()))
        return judged, edits if goes_on else []

    async def _resolved(
        self,
        verdict: Verdict,
        parts: list[MediaPart],
        references: list[int],
        tenant: bytes,
        made: dict[str, Remembered],
        edits: Edits,
    ) -> Verdict:
        """References resolved (their edits added to ``edits``): to this request's own fill
        of the id, else to what the tenant sent before; each judged as the media it names."""
        assert verdict.rule is not None
        ids = [parts[i].media_id or "" for i in references]
        recalled = await self.store.recall(tenant, verdict.rule.name, ids)
        found: dict[int, Remembered | None] = {
            index: made.get(media_id, earlier)
            for index, media_id, earlier in zip(references, ids, recalled, strict=True)
        }
        judged = check_references(
            amended(verdict, parts=tuple(parts)),
            {i: (entry.media if entry is not None else None) for i, entry in found.items()},
        )
        if len(judged.violations) > len(verdict.violations):
            return judged
        parts = list(judged.parts)
        for index, entry in found.items():
            assert entry is not None
            parts[index] = replace(parts[index], media_id=entry.key)
            edits += _id_edits(parts[index], entry.key)
        return amended(judged, parts=tuple(parts))

    def _key(self, how: str, tenant: bytes, part: MediaPart, digest: bytes) -> str:
        """The id the engine gets: a keyed digest of what names the media, each field
        length-prefixed (no two field lists hash the same bytes)."""
        # Token-in tensors stand for the modality ``format`` names (validators/doors.py).
        modality = part.format if part.part_type == "features" and part.format else part.modality
        fields = [how.encode(), modality.encode(), digest]
        if how == "bind":
            fields += [tenant, (part.media_id or "").encode("utf-8", "surrogatepass")]
        hasher = blake3.blake3(key=self._secret)
        for field in fields:
            hasher.update(len(field).to_bytes(4, "little"))
            hasher.update(field)
        return KEY_PREFIX + hasher.hexdigest()


_REFUSE_MESSAGE = (
    "media ids and hashes are not passed on here (this gateway cannot rewrite them to ids"
    " bound to the caller and the bytes); send the media without them"
)
_STRIP_MESSAGE = (
    "this gateway drops media ids, so media cannot be referred to by id alone; send the "
    "media with the part"
)


def _refused(verdict: Verdict, params: list[str], message: str) -> Verdict:
    violations = [
        Violation(ErrorCode.MEDIA_ID_NOT_ALLOWED, f"{where}: {message}", where)
        for where in params[:MAX_LISTED_VIOLATIONS]
    ]
    return verdict.with_violations(*violations)


def _id_edits(part: MediaPart, key: str | None) -> Edits:
    """The body's edits for one part's id: ``key`` in its place, or the id removed."""
    assert part.id_param is not None
    where = location_of(part.id_param)
    if key is not None:
        return [(where, key)]
    edits: Edits = [(where, Unset)]
    if part.type_param == path(part.param, part.part_type):
        # Read by its payload key because of the id: without it, its type must say so.
        edits.append(((*location_of(part.param), "type"), part.part_type))
    return edits


def _digests(verdict: Verdict, indexes: list[int]) -> dict[int, bytes]:
    """BLAKE3 of client tensors (which the gate does not decode): their JSON as sent, keys
    sorted. A URL not fetched or a file id has none: the engine fetches it and keys it by
    its content itself."""
    digests: dict[int, bytes] = {}
    request = verdict.request
    if request is None:
        return digests
    for index in indexes:
        try:
            container, key = locate(request, location_of(verdict.parts[index].payload_at))
            tensors = orjson.dumps(container[key], option=orjson.OPT_SORT_KEYS)
        except (KeyError, IndexError, TypeError, orjson.JSONEncodeError):
            continue  # not where the verdict says (a bug of ours): no digest, the id dropped
        digests[index] = blake3.blake3(tensors).digest()
    return digests
