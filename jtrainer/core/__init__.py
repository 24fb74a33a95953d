"""The core: settings (`env`), errors, version checks, HF's host-side classes (`hf_host`, `callbacks`), host
randomness, the train state's type (`state`) and storage paths. Nothing here imports jtrainer outside `core`."""
