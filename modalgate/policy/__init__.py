"""The capability table: which model, in which mode, takes which media, within which limits."""

from modalgate.policy.loading import PolicyError, load_policy, parse_policy, policy_json_schema
from modalgate.policy.matching import ResolvedRule, RuleMatcher
from modalgate.policy.models import (
    EmbedsSpec,
    Limits,
    MediaIds,
    MediaUrls,
    ModelRule,
    Policy,
    Server,
    TokenSpec,
    VerdictCacheSpec,
)

__all__ = [
    "EmbedsSpec",
    "Limits",
    "MediaIds",
    "MediaUrls",
    "ModelRule",
    "Policy",
    "PolicyError",
    "ResolvedRule",
    "RuleMatcher",
    "Server",
    "TokenSpec",
    "VerdictCacheSpec",
    "load_policy",
    "parse_policy",
    "policy_json_schema",
]
