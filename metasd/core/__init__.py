"""The decoding core: one request on one verifier - the engine and its step loop, the verifier and the hidden states
it keeps, draft trees, exact acceptance rules, sampling, KV-cache bookkeeping, per-request statistics, rewards and
the modeled step cost, and the small interfaces (``Drafter``, ``Policy``) with their registries that plugins fill.
Imports no YAML, MLflow or Ray, and no layer above it (docs/architecture.md)."""
from .acceptance import Acceptance, accept_greedy, accept_match, accept_rejection
from .cost import CostModel
from .drafter import DRAFTERS, BuildContext, Drafter, DrafterParams, StepContext, StepFeedback, register_drafter
from .engine import Engine, EngineBusyError
from .hidden import HiddenStore
from .metrics import RequestStats
from .policy import POLICIES, Context, Policy, register_policy
from .request import GenerationResult
from .rewards import REWARDS, Reward, get_reward
from .sampling import SamplingParams
from .scheduler import (QueueFullError, RequestFinished, RequestHandle, RequestOptions, Scheduler,
                        SchedulerClosedError, SchedulerStep, TokenEvent)
from .tokens import TokenizerMismatchError
from .tree import Draft
from .verifier import Verifier, VerifierOutput

__all__ = [
    "Acceptance", "BuildContext", "Context", "CostModel", "DRAFTERS", "Draft", "Drafter", "DrafterParams", "Engine", "EngineBusyError",
    "GenerationResult", "HiddenStore", "POLICIES", "Policy", "QueueFullError", "REWARDS", "RequestFinished", "RequestHandle",
    "RequestOptions", "RequestStats", "Reward", "SamplingParams", "Scheduler", "SchedulerClosedError", "SchedulerStep",
    "TokenEvent",
    "StepContext", "StepFeedback", "TokenizerMismatchError", "Verifier", "VerifierOutput", "accept_greedy",
    "accept_match", "accept_rejection", "get_reward", "register_drafter", "register_policy",
]
