"""Part of the zoo (tests/bridge_zoo.py) on 8 CPU devices (set by the caller's XLA_FLAGS): jtrainer's data
parallel batch of 8 x 1 rows beside transformers.Trainer's batch of 8; prints each module's differences as JSON."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bridge_zoo  # noqa: E402
import jax  # noqa: E402

assert jax.device_count() == 8, jax.devices()
names = ["Narrow", "SelectTranspose", "BatchNorm", "CustomAutograd", "TiedAndReused"]
result = {}
for name in names:
    run = bridge_zoo.side_by_side(getattr(bridge_zoo, name), jtrainer_batch=1, torch_batch=8)
    result[name] = bridge_zoo.differences(run)
print(json.dumps(result))
