"""The decoding core, in layers (docs/architecture.md#layers), with ``Engine`` on top:

- ``batching``: many requests at once - the ``Scheduler`` (continuous batching), its handles, adaptive speculation;
- ``decoding``: one request - its step loop, exact acceptance, sampling, statistics, rewards, and the ``Drafter`` and
  ``Policy`` interfaces with the registries plugins fill;
- ``pricing``: the modeled and profiled cost of forwards, acceptance curves, the allocator (beside ``decoding``,
  neither imports the other);
- ``execution``: executing forwards - the verifier (one request, a batch), KV caches, draft trees and their masks,
  hidden states, host -> device staging;
- ``constraints`` (beside ``execution``): structured output - grammar masks for the committed prefix and along every
  path of a draft tree (llguidance, the ``structured`` extra).

Each imports only the layers below it; the core imports no YAML, MLflow or Ray, and no layer above it."""
from .batching.scheduler import (QueueFullError, RequestFinished, RequestHandle, RequestOptions, Scheduler,
    SchedulerClosedError, SchedulerStep, TokenEvent)
from .decoding.acceptance import Acceptance, accept_greedy, accept_match, accept_rejection
from .decoding.drafter import (DRAFTERS, BuildContext, Drafter, DrafterParams, StepContext, StepFeedback,
    register_drafter)
from .decoding.metrics import RequestStats
from .decoding.policy import POLICIES, Context, Policy, register_policy
from .decoding.request import GenerationResult
from .decoding.rewards import REWARDS, Reward, get_reward
from .decoding.sampling import SamplingParams
from .decoding.tokens import TokenizerMismatchError
from .engine import Engine, EngineBusyError, GenerationInterrupted
from .execution.hidden import HiddenStore
from .execution.tree import Draft
from .execution.verifier import Verifier, VerifierOutput
from .pricing.cost import CostModel

__all__ = [
    "Acceptance", "BuildContext", "Context", "CostModel", "DRAFTERS", "Draft", "Drafter", "DrafterParams", "Engine", "EngineBusyError",
    "GenerationInterrupted", "GenerationResult", "HiddenStore", "POLICIES", "Policy", "QueueFullError", "REWARDS", "RequestFinished", "RequestHandle",
    "RequestOptions", "RequestStats", "Reward", "SamplingParams", "Scheduler", "SchedulerClosedError", "SchedulerStep",
    "TokenEvent",
    "StepContext", "StepFeedback", "TokenizerMismatchError", "Verifier", "VerifierOutput", "accept_greedy",
    "accept_match", "accept_rejection", "get_reward", "register_drafter", "register_policy",
]
