"""What a step costs and what it is worth: the modeled cost of a forward from the linear layers that ran
(``CostModel``), the measured forward profile, acceptance curves, expected goodput and the allocator that sizes each
request's draft under a shared forward. Knows nothing of requests or of the step loop."""
