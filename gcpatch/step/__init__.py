"""The first training step of each model gcpatch decided for: the memory budget's plan and verify.

In the order the data flows:

- `first_step`: one pair of hooks per model that runs the rest, once, at the first training forward
- `batch`: the batch's size, shape and first rows
- `invisible`: what keeps gcpatch's own passes invisible to the user's step (and where it cannot)
- `verify`: the check of checkpointing as applied against no checkpointing (GCPATCH_VERIFY=1)
- `held`: the instrument of the bytes a forward holds for its backward
- `heap`: the C heap's free memory handed back while gcpatch's own passes run
- `layer_costs`: each layer's bytes and recompute, measured
- `solver`: the cheapest plan that meets a budget (pure arithmetic)
- `planner`: the budget at work (GCPATCH_MEMORY_BUDGET)

Nothing is imported here: the pipeline loads `first_step` only where a budget or verify is set.
"""
