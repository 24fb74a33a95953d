"""Checkpoints that survive every kill: orbax train states, manifests and commits (`checkpoint`), one run per
output_dir (`run_lock`), and resuming transformers.Trainer's own checkpoints (`hf_checkpoint`)."""
