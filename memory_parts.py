"""The parts a device's memory is broken into, in one place: the prediction's counters (sim/), the trace and its
page (traces/) and a model's count (profiles/) name them alike. A leaf module (it imports nothing), so that the
shared vocabularies and the profile data may use it."""

# What holds a device's memory, the parts a prediction's peak is broken into (`TraceMeta.peak_memory_parts`):
# weights (with the copies a method keeps), weight gradients as accumulated, optimizer state (a mixed-precision
# master copy of the weights included), what the forward keeps for the backward (boundary tensors included),
# point-to-point buffers in flight, what a runtime keeps allocated for the whole run beside the model's state
# (`runtime_buffers`: Megatron-LM's global memory buffer, `--scores-buffer`), the tensors a pass creates and frees
# within itself while it runs (`transient`: the loss's backward's float32 tokens x vocabulary gradients, an MLP's
# intermediate gradients), and what the CUDA caching allocator holds beyond the tensors, cached segments that no
# request of the step could take (`reserve`, sim/caching_allocator.py; 0 where not replayed): torch's max reserved
# less its max allocated.
MEMORY_PARTS = ("parameters", "gradients", "optimizer_state", "activations", "communication", "runtime_buffers",
                "transient", "reserve")

# What saves an activation (`LayerCount.saved_parts`): the torch function running (a norm, a dropout's mask, the
# attention kernel), else the innermost submodule named for attention or an MLP, else other.
SAVED_PARTS = ("attention", "mlp", "norms", "dropout", "other")

# The activations' part by what saves them, as counters name them ("activations.mlp"), other last.
SAVERS = tuple(f"activations.{saver}" for saver in SAVED_PARTS)
