"""The process: start-up effects in one explicit function (`startup.initialize`), glibc malloc tuning for XLA's CPU
buffers (`host_allocator`), and the process-wide cache of compiled steps (`compiled_steps`)."""
