"""The decision at each `torch.utils.checkpoint.checkpoint` call (CK1-CK7), in the order a call
flows through its modules:

- `curried_call`: torch 2.14's curried and decorator forms made the direct call.
- `call_facts`: what the call's own arguments (and its first result) show.
- `checkpoint_call`: the decision: facts, votes, resolve, cached per pattern of facts.
- `call_rewrites`: what keeps a caller's reentrant call exact (lifted tensors, a grad input, a
  tuple result).
- `caller`: the original called as if from the user's frame.
- `reentrant_grads`: CK6, gradients taken later through the reentrant checkpoints it made.
"""
