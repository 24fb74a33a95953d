"""How big a run is: accelerator targets for cross-compiles (`targets`), auto_find_batch_size's search
(`batch_size`) and FLOPs / tokens per second (`throughput`)."""
