"""``sinklab claims``: every claim tested by one rule (docs/claims.md), one row each."""

from sinklab.claims.registry import CLAIM_IDS, CLAIMS, Claim, get_claim
from sinklab.claims.rules import Interval, Verdict, bootstrap_interval, decide, verdict

__all__ = [
    "CLAIMS",
    "CLAIM_IDS",
    "Claim",
    "Interval",
    "Verdict",
    "bootstrap_interval",
    "decide",
    "get_claim",
    "verdict",
]
