"""The mixed-precision recipe: what one train step does to numbers.

Precision policies and casting (`precision`), loss scaling (`loss_scale`), the train state and
the step itself (`train_state`, `step`), the optimizer and its 8-bit moments (`optim`, `q8`,
`schedules`), fp8 matmuls (`fp8`), sharding across devices with fp32 reductions (`sharding`) and
the per-layer numerics taps the step can carry (`numerics`). It imports only the base modules
(`mptrain.errors`, `mptrain.files`, ...): models, data, runs and records build on it.
"""
