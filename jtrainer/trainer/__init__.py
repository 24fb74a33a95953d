"""HF's front end and its loop: TrainingArguments (`args`), the Trainer assembled from its parts (`trainer`: the
constructor and the loop; `optimizer_setup`, `evaluation`, `saving`, `hpsearch`, `hub`, `metrics_io`; the
shared state and cross-calls declared in `trainer_parts`), one train() loop's state (`training_run`), the batch
loader (`data`), checks of overridden methods (`overrides`) and Seq2SeqTrainer (`seq2seq`).

`from jtrainer import Trainer, TrainingArguments` is the public way in."""
