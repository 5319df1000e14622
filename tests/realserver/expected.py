"""The false rejects the gate makes on purpose against ``transformers serve``, each with its reason.

A body the server answers 200 and the gate refuses is a false reject. Each one the
differential finds must match a reason here (by case name and the gate's code);
docs/conformance.md lists the same reasons, by their key, with the why.
"""

from __future__ import annotations

import re

# key -> (case-name pattern, the gate's code)
ON_PURPOSE: dict[str, tuple[str, str]] = {
    # The built-in qwen2-vl rule's min_image_side (28): older processors' smart_resize
    # raises below the patch factor; this transformers scales such an image up.
    "min-image-side": (r"^(size|png)-.*", "image_too_small"),
    # The policy's max_image_pixels (7168^2): a decompression-bomb limit, by design.
    "max-image-pixels": (r"^size-.*", "image_too_large"),
    # Stills only: the server silently keeps an APNG's first frame (or default image).
    "animation": (r"^animated-.*", "animated_image"),
    # Whole scans missing, EOI glued on: libjpeg paints the rest grey; the gate refuses
    # the image the walk can see is incomplete (docs/security.md, truncation).
    "jpeg-scans-missing": (r"^truncated-JPEG-.*-end-glued$", "invalid_image"),
    # Broken chunks after the pixel data: the server never reads them; Pillow's reader
    # and any tool that reads to IEND does.
    "png-broken-after-image": (r"^truncated-PNG-.*", "invalid_image"),
    # Over 64 KiB of inflated data past the last row: inflation is bounded, not continued.
    "png-stream-far-too-long": (r"^png-row-extra-much-.*", "invalid_image"),
    # A file after the image (an MP4, a ZIP after IEND): polyglots are refused.
    "polyglot": (r"^polyglot-png-.*", "invalid_image"),
    # Parts this server drops without a word (the model never sees them): refused as
    # the model's modality table says. (Audio to this image-only model is dropped once
    # the WAV is one a loader can read; a 4-sample one made the server fail.)
    "dropped-part": (
        r"^part-(file|file-id|input_file|image_embeds|audio_embeds|input_audio|audio_url)$",
        "unsupported_modality",
    ),
    "unknown-part-type": (r"^part-(image_pil|unknown-type)$", "unsupported_content_type"),
    # OpenAI's schema: image_url is an object, text a string, detail auto|low|high.
    "schema": (
        r"^part-(image_url-string|text-not-string|image_url-detail-\w+)$",
        "invalid_request",
    ),
    # The policy's media_roles: images in user (and tool) messages only.
    "media-roles": (r"^part-image-in-(system|assistant)$", "role_not_allowed"),
}


def reason_for(name: str, code: str | None) -> str | None:
    for key, (pattern, expected_code) in ON_PURPOSE.items():
        if code == expected_code and re.match(pattern, name):
            return key
    return None
