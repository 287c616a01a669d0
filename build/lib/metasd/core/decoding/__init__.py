"""One request: the step loop (``Request``: select an arm, draft, verify, accept, commit, learn), the exact acceptance
rules, sampling, detokenising and stop strings, per-request statistics and rewards, and the small plugin interfaces
(``Drafter``, ``Policy``) with their registries. Reads forwards through the execution layer only."""
