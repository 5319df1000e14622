"""The capability table: loading from YAML/TOML/JSON, the built-in table, matching, errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import REPO_ROOT
from modalgate.errors import ErrorCode
from modalgate.policy import (
    Limits,
    MediaUrls,
    ModelRule,
    Policy,
    PolicyError,
    RuleMatcher,
    Server,
    TokenSpec,
    load_policy,
    parse_policy,
    policy_json_schema,
)

ROOT = REPO_ROOT
DOCS = ROOT / "docs"

# ---------------------------------------------------------------- one policy, three formats

POLICY_YAML = """\
unknown_models: reject
limits:
  max_body_bytes: 1048576
  max_images: 4
  max_image_bytes: 524288
  image_formats: [png, jpeg]
media_roles: [user, tool]
media_urls:
  schemes: [data, https]
  allow_hosts: [images.example.com, "*.cdn.example.com"]
  allow_private: [10.1.0.0/16]
  fetch_timeout_s: 2.5
  max_redirects: 1
models:
  - name: vision
    match: [vision-*, acme/Vision-*]
    accepts: [image, video]
    message: vision takes images and video
    limits: {max_images: 2, min_image_side: 28}
    tokens: {family: qwen_vl, patch_size: 14, merge_size: 2}
    source: test
  - name: vision-encoder
    match: [vision-*]
    mode: encoder
    accepts: [image]
    media_roles: [user]
"""

POLICY_TOML = """\
unknown_models = "reject"
media_roles = ["user", "tool"]

[limits]
max_body_bytes = 1048576
max_images = 4
max_image_bytes = 524288
image_formats = ["png", "jpeg"]

[media_urls]
schemes = ["data", "https"]
allow_hosts = ["images.example.com", "*.cdn.example.com"]
allow_private = ["10.1.0.0/16"]
fetch_timeout_s = 2.5
max_redirects = 1

[[models]]
name = "vision"
match = ["vision-*", "acme/Vision-*"]
accepts = ["image", "video"]
message = "vision takes images and video"
limits = { max_images = 2, min_image_side = 28 }
tokens = { family = "qwen_vl", patch_size = 14, merge_size = 2 }
source = "test"

[[models]]
name = "vision-encoder"
match = ["vision-*"]
mode = "encoder"
accepts = ["image"]
media_roles = ["user"]
"""

POLICY_DICT = {
    "unknown_models": "reject",
    "limits": {
        "max_body_bytes": 1048576,
        "max_images": 4,
        "max_image_bytes": 524288,
        "image_formats": ["png", "jpeg"],
    },
    "media_roles": ["user", "tool"],
    "media_urls": {
        "schemes": ["data", "https"],
        "allow_hosts": ["images.example.com", "*.cdn.example.com"],
        "allow_private": ["10.1.0.0/16"],
        "fetch_timeout_s": 2.5,
        "max_redirects": 1,
    },
    "models": [
        {
            "name": "vision",
            "match": ["vision-*", "acme/Vision-*"],
            "accepts": ["image", "video"],
            "message": "vision takes images and video",
            "limits": {"max_images": 2, "min_image_side": 28},
            "tokens": {"family": "qwen_vl", "patch_size": 14, "merge_size": 2},
            "source": "test",
        },
        {
            "name": "vision-encoder",
            "match": ["vision-*"],
            "mode": "encoder",
            "accepts": ["image"],
            "media_roles": ["user"],
        },
    ],
}


def _write(tmp_path: Path, name: str, text: str) -> Path:
    file = tmp_path / name
    file.write_text(text, encoding="utf-8")
    return file


def test_yaml_toml_and_json_give_the_same_policy(tmp_path: Path) -> None:
    from_yaml = load_policy(_write(tmp_path, "p.yaml", POLICY_YAML))
    from_yml = load_policy(_write(tmp_path, "p.yml", POLICY_YAML))
    from_toml = load_policy(_write(tmp_path, "p.toml", POLICY_TOML))
    from_json = load_policy(_write(tmp_path, "p.json", json.dumps(POLICY_DICT)))
    assert from_yaml == from_yml == from_toml == from_json
    assert from_yaml == Policy.model_validate(POLICY_DICT)


def test_loaded_values_are_the_written_ones(tmp_path: Path) -> None:
    policy = load_policy(str(_write(tmp_path, "p.yaml", POLICY_YAML)))
    assert policy.unknown_models == "reject"
    assert policy.limits.max_images == 4
    assert policy.limits.image_formats == ("png", "jpeg")
    assert policy.limits.min_image_side == 2  # not written: the default
    assert policy.media_roles == ("user", "tool")
    assert policy.media_urls.fetch_timeout_s == 2.5
    assert [str(net) for net in policy.media_urls.allow_private] == ["10.1.0.0/16"]
    assert [rule.name for rule in policy.models] == ["vision", "vision-encoder"]
    assert policy.models[0].tokens is not None and policy.models[0].tokens.patch_size == 14
    assert policy.models[1].mode == "encoder"


def test_extension_is_case_insensitive(tmp_path: Path) -> None:
    assert load_policy(_write(tmp_path, "P.YAML", POLICY_YAML)) == load_policy(
        _write(tmp_path, "p.yaml", POLICY_YAML)
    )


def test_empty_file_is_the_default_policy(tmp_path: Path) -> None:
    assert load_policy(_write(tmp_path, "empty.yaml", "")) == Policy()


def test_allow_hosts_are_lowercased(tmp_path: Path) -> None:
    policy = parse_policy("media_urls: {allow_hosts: [Images.Example.COM.]}", fmt="yaml")
    assert policy.media_urls.allow_hosts == ("images.example.com",)


# ---------------------------------------------------------------- the built-in table


@pytest.fixture(scope="module")
def builtin() -> Policy:
    return load_policy()


def test_builtin_loads_and_every_rule_has_a_source(builtin: Policy) -> None:
    assert builtin.models
    missing = [rule.name for rule in builtin.models if not (rule.source and rule.source.strip())]
    assert missing == []


def test_builtin_defaults(builtin: Policy) -> None:
    assert builtin.unknown_models == "auto"
    assert builtin.limits == Limits()
    assert builtin.media_roles == ("user", "tool")
    assert builtin.media_urls.schemes == ("data", "https")


def test_builtin_rule_names_are_unique_per_mode(builtin: Policy) -> None:
    keys = [(rule.name.lower(), rule.mode) for rule in builtin.models]
    assert len(keys) == len(set(keys))


def test_builtin_kimi_k3_rules(builtin: Policy) -> None:
    k3 = [rule for rule in builtin.models if "kimi-k3" in (rule.name, *rule.match)]
    full = [rule for rule in k3 if rule.mode is None]
    encoder = [rule for rule in k3 if rule.mode == "encoder"]
    assert len(full) == 1 and len(encoder) == 1
    assert encoder[0].message == "Kimi-K3 encoder mode supports image input only"
    for rule in (full[0], encoder[0]):
        assert rule.accepts == ("image",)
        assert rule.limits is not None
        assert rule.limits.max_images == 16
        assert rule.limits.max_image_bytes == 33554432
        assert rule.limits.max_image_pixels == 51380224


@pytest.mark.parametrize("mode", [None, "encoder"])
def test_builtin_kimi_k3_resolves_in_both_modes(builtin: Policy, mode: str | None) -> None:
    rule = RuleMatcher(builtin, mode).resolve("moonshotai/Kimi-K3-Instruct")
    assert rule.known
    assert rule.mode == mode
    assert rule.accepts == {"image"}
    assert rule.limits.max_images == 16
    assert rule.limits.max_image_bytes == 33554432
    assert rule.limits.max_image_pixels == 51380224
    if mode == "encoder":
        assert rule.name == "kimi-k3-encoder"
        assert rule.message == "Kimi-K3 encoder mode supports image input only"


@pytest.mark.parametrize(
    ("model", "accepts"),
    [
        ("kimi-k3", {"image"}),
        ("moonshotai/Kimi-K3-Instruct", {"image"}),
        ("Kimi-K2.5", {"image", "video"}),
        ("Kimi-VL", {"image"}),
        ("Qwen/Qwen2.5-VL-7B-Instruct", {"image", "video"}),
        ("Qwen/Qwen3-VL-8B-Instruct", {"image", "video"}),
        ("Qwen/Qwen2-Audio-7B-Instruct", {"audio"}),
        ("Qwen/Qwen2.5-Omni-7B", {"image", "video", "audio"}),
        ("Qwen/Qwen3-Omni-30B-A3B-Instruct", {"image", "video", "audio"}),
        ("google/gemma-3-27b-it", {"image"}),
        ("google/gemma-3-1b-it", set()),
        ("meta-llama/Llama-4-Scout-17B-16E-Instruct", {"image"}),
        ("mistralai/Pixtral-12B-2409", {"image"}),
        ("mistralai/Mistral-Small-3.1-24B-Instruct-2503", {"image"}),
        ("microsoft/Phi-4-multimodal-instruct", {"image", "audio"}),
        ("OpenGVLab/InternVL3-8B", {"image", "video"}),
        ("zai-org/GLM-4.5V", {"image", "video"}),
        ("gpt-4o", {"image", "file"}),
        ("gpt-4o-mini", {"image", "file"}),
        ("gpt-4.1", {"image", "file"}),
    ],
)
def test_builtin_families_resolve(builtin: Policy, model: str, accepts: set[str]) -> None:
    rule = RuleMatcher(builtin).resolve(model)
    assert rule.known, model
    assert rule.accepts == accepts
    assert "embeddings" not in rule.accepts


@pytest.mark.parametrize(
    ("model", "rule_name"),
    [
        ("google/gemma-3-1b-it", "gemma-3-1b"),
        ("google/gemma-3-12b-it", "gemma-3"),
        ("Qwen/Qwen3-Omni-30B-A3B-Captioner", "qwen3-omni-captioner"),
        ("Qwen/Qwen3-Omni-30B-A3B-Thinking", "qwen3-omni"),
        ("OpenGVLab/InternVL3-9B", "internvl3-9b"),
        ("gpt-4o-mini-2024-07-18", "gpt-4o-mini"),
        ("gpt-4o-2024-08-06", "gpt-4o"),
        ("gpt-4o-mini-audio-preview-2024-12-17", "gpt-4o-mini-audio-preview"),
        ("gpt-4.1-mini-2025-04-14", "gpt-4.1-mini"),
    ],
)
def test_builtin_overlapping_globs_pick_the_specific_rule(
    builtin: Policy, model: str, rule_name: str
) -> None:
    assert RuleMatcher(builtin).resolve(model).name == rule_name


def test_builtin_gemma_3n_is_not_gemma_3(builtin: Policy) -> None:
    assert not RuleMatcher(builtin).resolve("google/gemma-3n-E4B-it").known


def test_builtin_glm_allows_one_video(builtin: Policy) -> None:
    assert RuleMatcher(builtin).resolve("zai-org/GLM-4.5V").limits.max_videos == 1


# ---------------------------------------------------------------- matching


def _matcher(yaml_text: str, mode: str | None = None) -> RuleMatcher:
    return RuleMatcher(parse_policy(yaml_text, fmt="yaml"), mode)


def test_match_by_exact_name_alias_and_glob() -> None:
    matcher = _matcher(
        """
models:
  - {name: alpha, match: [alpha-latest, "acme/Alpha-*"], accepts: [image]}
"""
    )
    for model in ("alpha", "alpha-latest", "acme/Alpha-7B"):
        assert matcher.resolve(model).name == "alpha", model
    assert not matcher.resolve("acme/Alpha").known  # the glob needs the dash
    assert not matcher.resolve("alpha-").known


def test_match_is_case_insensitive() -> None:
    matcher = _matcher(
        """
models:
  - {name: Alpha, match: ["ACME/alpha-*"], accepts: [image]}
"""
    )
    for model in ("ALPHA", "alpha", "acme/ALPHA-7b", "Acme/Alpha-7B"):
        assert matcher.resolve(model).name == "Alpha", model


def test_exact_beats_glob_even_when_the_glob_comes_first() -> None:
    matcher = _matcher(
        """
models:
  - {name: globbed, match: ["acme/model-*"], accepts: [image, video]}
  - {name: exact, match: [acme/model-x], accepts: [image]}
"""
    )
    assert matcher.resolve("acme/model-x").name == "exact"
    assert matcher.resolve("acme/model-y").name == "globbed"


def test_more_literal_characters_beat_fewer() -> None:
    matcher = _matcher(
        """
models:
  - {name: broad, match: ["acme/*"], accepts: [image, video]}
  - {name: narrow, match: ["acme/tiny-*"], accepts: []}
"""
    )
    assert matcher.resolve("acme/tiny-1b").name == "narrow"
    assert matcher.resolve("acme/big-1b").name == "broad"


def test_mode_specific_beats_mode_less() -> None:
    yaml_text = """
models:
  - {name: plain, match: ["acme/*"], accepts: [image, video, audio]}
  - {name: enc, match: ["acme/*"], mode: encoder, accepts: [image]}
  - {name: exact-plain, match: [acme/exact], accepts: [image, video]}
  - {name: exact-enc, match: [acme/exact], mode: encoder, accepts: [image]}
"""
    encoder = _matcher(yaml_text, "encoder")
    assert encoder.resolve("acme/m").name == "enc"
    assert encoder.resolve("acme/m").mode == "encoder"
    assert encoder.resolve("acme/exact").name == "exact-enc"
    full = _matcher(yaml_text)
    assert full.resolve("acme/m").name == "plain"
    assert full.resolve("acme/exact").name == "exact-plain"


def test_mode_outranks_literal_characters() -> None:
    """The documented order: exact/glob, then mode, then literal characters."""
    matcher = _matcher(
        """
models:
  - {name: long-plain, match: ["acme/model-*"], accepts: [image, video]}
  - {name: short-enc, match: ["acme/*"], mode: encoder, accepts: [image]}
""",
        "encoder",
    )
    assert matcher.resolve("acme/model-7b").name == "short-enc"


def test_exact_outranks_mode() -> None:
    matcher = _matcher(
        """
models:
  - {name: glob-enc, match: ["acme/*"], mode: encoder, accepts: [image]}
  - {name: exact-plain, match: [acme/m], accepts: [image, video]}
""",
        "encoder",
    )
    assert matcher.resolve("acme/m").name == "exact-plain"


def test_a_rule_with_a_mode_does_not_apply_elsewhere() -> None:
    yaml_text = """
models:
  - {name: enc-only, match: ["acme/*"], mode: encoder, accepts: [image]}
"""
    assert _matcher(yaml_text, "encoder").resolve("acme/m").name == "enc-only"
    assert not _matcher(yaml_text).resolve("acme/m").known
    assert not _matcher(yaml_text, "prefill").resolve("acme/m").known


def test_file_order_breaks_ties() -> None:
    matcher = _matcher(
        """
models:
  - {name: first, match: ["acme/*-it"], accepts: [image]}
  - {name: second, match: ["acme/m-i*"], accepts: [video]}
"""
    )
    # both globs have 8 literal characters
    assert matcher.resolve("acme/m-it").name == "first"
    swapped = _matcher(
        """
models:
  - {name: second, match: ["acme/m-i*"], accepts: [video]}
  - {name: first, match: ["acme/*-it"], accepts: [image]}
"""
    )
    assert swapped.resolve("acme/m-it").name == "second"


def test_unknown_model_gets_defaults() -> None:
    policy = parse_policy(
        """
limits: {max_images: 3, max_image_bytes: 1000}
media_roles: [user, tool]
models:
  - {name: alpha, accepts: [image]}
""",
        fmt="yaml",
    )
    rule = RuleMatcher(policy, "encoder").resolve("somebody/else")
    assert rule.known is False
    assert rule.name == ""
    assert rule.mode == "encoder"
    assert rule.limits == policy.limits
    assert rule.media_roles == {"user", "tool"}
    assert rule.accepts == {"image", "video", "audio", "file", "embeddings"}
    assert rule.message is None and rule.tokens is None


def test_per_model_limits_override_field_by_field() -> None:
    policy = parse_policy(
        """
limits:
  max_images: 8
  max_image_bytes: 1000
  min_image_side: 4
  image_formats: [png]
models:
  - name: alpha
    accepts: [image, video]
    limits: {max_images: 2, max_videos: 1, image_formats: [png, jpeg]}
  - name: beta
    accepts: [image]
    limits: {max_images: null}
  - name: gamma
    accepts: [image]
""",
        fmt="yaml",
    )
    matcher = RuleMatcher(policy)
    alpha = matcher.resolve("alpha").limits
    assert alpha.max_images == 2
    assert alpha.max_videos == 1
    assert alpha.image_formats == ("png", "jpeg")
    # unset fields keep the policy's defaults (not the class defaults)
    assert alpha.max_image_bytes == 1000
    assert alpha.min_image_side == 4
    assert alpha.max_body_bytes == Limits().max_body_bytes
    beta = matcher.resolve("beta").limits
    assert beta.max_images is None  # an explicit null lifts the limit
    assert beta.max_image_bytes == 1000
    assert matcher.resolve("gamma").limits == policy.limits


def test_rule_media_roles_override_the_default() -> None:
    matcher = _matcher(
        """
media_roles: [user]
models:
  - {name: alpha, accepts: [image], media_roles: [user, tool]}
  - {name: beta, accepts: [image]}
"""
    )
    assert matcher.resolve("alpha").media_roles == {"user", "tool"}
    assert matcher.resolve("beta").media_roles == {"user"}


def test_resolve_is_cached() -> None:
    matcher = _matcher("models: [{name: alpha, accepts: [image]}]")
    assert matcher.resolve("alpha") is matcher.resolve("alpha")


# ---------------------------------------------------------------- broken policy files


def _problem(tmp_path: Path, name: str, text: str) -> str:
    file = _write(tmp_path, name, text)
    with pytest.raises(PolicyError) as info:
        load_policy(file)
    message = str(info.value)
    assert str(file) in message
    assert info.value.source == str(file)
    assert "Traceback" not in message
    assert 'File "' not in message
    return message


def test_yaml_syntax_error_names_line_and_column(tmp_path: Path) -> None:
    message = _problem(tmp_path, "bad.yaml", "models:\n  - name: x\n    accepts: [image\n")
    assert re.search(r"line \d+, column \d+", message), message


def test_toml_syntax_error(tmp_path: Path) -> None:
    message = _problem(tmp_path, "bad.toml", "unknown_models = \n[limits\n")
    assert "TOML" in message


def test_json_syntax_error(tmp_path: Path) -> None:
    message = _problem(tmp_path, "bad.json", '{"models": [}')
    assert "line 1, column 13" in message
    assert "JSON" in message


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("limits:\n  max_imgaes: 3\n", "limits.max_imgaes"),
        ("models:\n  - {name: x, accepts: [image], limits: {max_imgaes: 2}}\n", None),
        ("modles: []\n", "modles"),
        ("models:\n  - {name: x, accepts: [image], acepts: [video]}\n", "models.[0].acepts"),
    ],
)
def test_unknown_key_is_named(tmp_path: Path, text: str, field: str | None) -> None:
    message = _problem(tmp_path, "typo.yaml", text)
    assert (field or "models.[0].limits.max_imgaes") in message
    assert "Extra inputs are not permitted" in message


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("limits: {max_images: many}\n", "limits.max_images"),
        ("limits: {max_image_bytes: -1}\n", "limits.max_image_bytes"),
        ("unknown_models: maybe\n", "unknown_models"),
        ("media_urls: {fetch_timeout_s: soon}\n", "media_urls.fetch_timeout_s"),
        (
            "models:\n  - {name: x, accepts: [image], media_roles: [robot]}\n",
            "models.[0].media_roles.[0]",
        ),
        ("models:\n  - {name: x, accepts: image}\n", "models.[0].accepts"),
        ("models:\n  - {name: x}\n", "models.[0].accepts"),
        ("models:\n  - {name: '', accepts: [image]}\n", "models.[0].name"),
        ("models: {x: 1}\n", "models"),
    ],
)
def test_wrong_type_is_named(tmp_path: Path, text: str, field: str) -> None:
    message = _problem(tmp_path, "types.yaml", text)
    assert f": {field}: " in message, message


def test_bad_network_names_a_plain_field_path(tmp_path: Path) -> None:
    """A union-typed field must not leak pydantic's validator names into the path."""
    message = _problem(tmp_path, "net.yaml", "media_urls: {allow_private: [not-a-network]}\n")
    assert ": media_urls.allow_private.[0]: " in message, message
    assert "lax-or-strict" not in message and "function-" not in message, message


def test_unknown_modality_names_the_field_path(tmp_path: Path) -> None:
    message = _problem(
        tmp_path, "modality.yaml", "models:\n  - name: x\n    accepts: [image, smell]\n"
    )
    assert "models.[0].accepts.[1]" in message
    assert "'image'" in message  # says what is allowed


def test_unknown_image_format(tmp_path: Path) -> None:
    message = _problem(tmp_path, "fmt.toml", '[limits]\nimage_formats = ["png", "jpg"]\n')
    assert "limits.image_formats.[1]" in message


def test_every_problem_is_listed(tmp_path: Path) -> None:
    file = _write(
        tmp_path,
        "many.yaml",
        "limits: {max_imgaes: 1}\nmodels:\n  - {name: x, accepts: [smell]}\n",
    )
    with pytest.raises(PolicyError) as info:
        load_policy(file)
    fields = [field for field, _ in info.value.problems]
    assert "limits.max_imgaes" in fields
    assert "models.[0].accepts.[0]" in fields
    assert len(str(info.value).splitlines()) == len(info.value.problems)


def test_duplicate_rule_names_in_the_same_mode(tmp_path: Path) -> None:
    message = _problem(
        tmp_path,
        "dup.yaml",
        """
models:
  - {name: Alpha, mode: encoder, accepts: [image]}
  - {name: alpha, mode: encoder, accepts: [video]}
""",
    )
    assert "duplicate" in message
    assert "alpha" in message
    # the field path points at the second rule of that name
    assert "models.[1]" in message, message


def test_same_name_in_different_modes_is_fine() -> None:
    policy = parse_policy(
        """
models:
  - {name: alpha, accepts: [image, video]}
  - {name: alpha, mode: encoder, accepts: [image]}
""",
        fmt="yaml",
    )
    assert len(policy.models) == 2


@pytest.mark.parametrize(
    ("name", "text"),
    [("list.yaml", "- a\n- b\n"), ("scalar.yaml", "just words\n"), ("list.json", "[1, 2]")],
)
def test_top_level_must_be_a_mapping(tmp_path: Path, name: str, text: str) -> None:
    assert "mapping" in _problem(tmp_path, name, text)


def test_missing_file(tmp_path: Path) -> None:
    file = tmp_path / "nowhere.yaml"
    with pytest.raises(PolicyError) as info:
        load_policy(file)
    assert str(file) in str(info.value)
    assert "cannot read" in str(info.value)


def test_directory_is_not_a_policy_file(tmp_path: Path) -> None:
    folder = tmp_path / "dir.yaml"
    folder.mkdir()
    with pytest.raises(PolicyError) as info:
        load_policy(folder)
    assert str(folder) in str(info.value)


def test_unknown_extension(tmp_path: Path) -> None:
    message = _problem(tmp_path, "policy.ini", "unknown_models = allow\n")
    assert ".yaml" in message and ".toml" in message and ".json" in message


def test_not_utf8(tmp_path: Path) -> None:
    file = tmp_path / "latin1.yaml"
    file.write_bytes(b"models: []\n# caf\xe9\n")
    with pytest.raises(PolicyError) as info:
        load_policy(file)
    assert str(file) in str(info.value)


def test_policy_error_exposes_problems(tmp_path: Path) -> None:
    file = _write(tmp_path, "one.yaml", "unknown_models: maybe\n")
    with pytest.raises(PolicyError) as info:
        load_policy(file)
    assert info.value.problems and info.value.problems[0][0] == "unknown_models"


# ---------------------------------------------------------------- schema and docs


def test_json_schema_export() -> None:
    schema = policy_json_schema()
    assert isinstance(schema, dict)
    assert "models" in schema["properties"]
    assert set(schema["properties"]) == set(Policy.model_fields)
    json.dumps(schema)  # plain JSON


def test_schema_doc_is_current() -> None:
    doc = DOCS / "policy.schema.json"
    assert doc.is_file(), "run: modalgate schema > docs/policy.schema.json"
    assert json.loads(doc.read_text("utf-8")) == policy_json_schema(), (
        "docs/policy.schema.json is stale; run: modalgate schema > docs/policy.schema.json"
    )


def test_every_error_code_is_documented() -> None:
    text = (DOCS / "errors.md").read_text("utf-8")
    missing = [code.value for code in ErrorCode if f"`{code.value}`" not in text]
    assert missing == []


def test_policy_doc_names_every_field() -> None:
    text = (DOCS / "policy.md").read_text("utf-8")
    fields = [
        *Policy.model_fields,
        *Limits.model_fields,
        *MediaUrls.model_fields,
        *ModelRule.model_fields,
        *TokenSpec.model_fields,
        *Server.model_fields,
    ]
    missing = [field for field in fields if f"`{field}`" not in text]
    assert missing == []


def test_extends_builtin_merges_settings_and_replaces_rules_by_name(tmp_path):
    file = tmp_path / "site.yaml"
    file.write_text(
        """
extends: builtin
unknown_models: reject
limits: {max_images: 8}
media_urls: {schemes: [data, https, http]}
models:
  - name: qwen2.5-vl
    match: ["qwen2.5-vl", "Qwen/Qwen2.5-VL-*"]
    accepts: [image, video, embeddings]
  - name: my-vlm
    match: ["acme/my-vlm-*"]
    accepts: [image]
""",
        "utf-8",
    )
    policy = load_policy(file)
    builtin = load_policy()
    assert policy.unknown_models == "reject"
    assert policy.limits.max_images == 8
    assert policy.limits.max_image_bytes == builtin.limits.max_image_bytes
    assert policy.media_urls.schemes == ("data", "https", "http")
    assert policy.media_urls.max_redirects == builtin.media_urls.max_redirects
    assert len(policy.models) == len(builtin.models) + 1
    matcher = RuleMatcher(policy, None)
    assert matcher.resolve("Qwen/Qwen2.5-VL-7B-Instruct").accepts == {
        "image",
        "video",
        "embeddings",
    }
    assert matcher.resolve("acme/my-vlm-2").name == "my-vlm"
    assert matcher.resolve("kimi-k3").name == "kimi-k3"
    assert RuleMatcher(policy, "encoder").resolve("kimi-k3").message == (
        "Kimi-K3 encoder mode supports image input only"
    )


def test_extends_builtin_errors_point_at_the_files_own_rules(tmp_path):
    file = tmp_path / "site.yaml"
    file.write_text("extends: builtin\nmodels:\n  - {name: x, accepts: [smell]}\n", "utf-8")
    with pytest.raises(PolicyError) as caught:
        load_policy(file)
    assert "models.[0].accepts.[0]" in str(caught.value)
