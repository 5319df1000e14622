"""The capability table: which model, in which mode, takes which media, within which limits."""

from modalgate.policy.loading import PolicyError, load_policy, parse_policy, policy_json_schema
from modalgate.policy.matching import ResolvedRule, RuleMatcher
from modalgate.policy.models import Limits, MediaUrls, ModelRule, Policy, TokenSpec

__all__ = [
    "Limits",
    "MediaUrls",
    "ModelRule",
    "Policy",
    "PolicyError",
    "ResolvedRule",
    "RuleMatcher",
    "TokenSpec",
    "load_policy",
    "parse_policy",
    "policy_json_schema",
]
