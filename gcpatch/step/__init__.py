"""The first training steps of each model gcpatch decided for: verify, and the memory budget's
probe and plans.

In the order the data flows:

- `batch`: the batch's size, shape and first rows
- `invisible`: what keeps gcpatch's own passes (verify's) invisible to the user's step
- `training`: which forwards are a training step's
- `verify`: the check of checkpointing as applied against no checkpointing (GCPATCH_VERIFY=1)
- `held`: the instrument of the bytes a forward holds for its backward
- `bytes`: activation bytes at one shape, by how they grow with the tokens
- `probe`: what the job's own first step shows of each checkpointed layer
- `levers.lever`: the interface of a way to run a checkpointed layer
- `levers.policy`: torch's selective checkpointing policy two levers share
- `levers.whole`: the layer checkpointed whole
- `levers.keep_matmuls`: its matmuls' outputs kept
- `levers.keep_attention`: its attention kernel's output kept
- `levers.feed_forward`: run plain, its feed-forward block alone checkpointed
- `levers.offload`: checkpointed whole, its inputs in host memory
- `levers`: the registry of levers
- `solver`: the cheapest plan that meets a budget (pure arithmetic)
- `cost_model`: each layer's costs at any batch shape, from the probed step
- `outcome`: what the budget did for a model (planned, or skipped and why)
- `plan_lines`: what the budget says, and the record's details
- `receipts`: each new shape's step counted against its plan (GCPATCH_VERIFY=1)
- `shapes`: each step's plan by its batch shape
- `planner`: the budget at work (GCPATCH_MEMORY_BUDGET)
- `first_step`: one pair of hooks per model that runs the rest

Nothing is imported here: the pipeline loads `first_step` only where a budget or verify is set.
"""
