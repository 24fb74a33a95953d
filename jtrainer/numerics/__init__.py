"""The step's numerics, as pure functions: the jitted train and eval steps (`step`), losses (`losses`), HF's
optimizers as optax (`optim`, `torch_optimizers`), learning-rate schedules and the run's `LearningRate`
(`schedules`), optimizer-state surgery (`opt_state`) and fp16 loss scaling (`mixed_precision`)."""
