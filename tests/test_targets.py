"""`jtrainer check --target`: the train step cross-compiled for a TPU slice that is not here (libtpu's
compile-only topologies), its memory per chip against the chip's HBM, and the exit code when it does not fit."""

import os
import subprocess
import sys

import pytest

from jtrainer.cli import main, parse_train_args
from jtrainer.cli.check import run_check
from jtrainer.core.errors import BadInput
from jtrainer.sizing import targets

CONFIG = "configs/llama_1b_fsdp_v5e_16.yaml"
SMALL = [
    "--hidden_size",
    "256",
    "--intermediate_size",
    "512",
    "--num_hidden_layers",
    "2",
    "--num_attention_heads",
    "4",
    "--num_key_value_heads",
    "2",
    "--block_size",
    "128",
    "--tokenizer_vocab_size",
    "512",
    "--per_device_train_batch_size",
    "1",
]

TINY = [
    "--hidden_size",
    "32",
    "--intermediate_size",
    "64",
    "--num_hidden_layers",
    "2",
    "--num_attention_heads",
    "4",
    "--num_key_value_heads",
    "2",
    "--block_size",
    "32",
    "--tokenizer_vocab_size",
    "128",
    "--per_device_train_batch_size",
    "2",
]


@pytest.mark.parametrize(
    "name, chips, shape",
    [
        ("v4-8", 4, (2, 2, 1)),
        ("v4-32", 16, (2, 2, 4)),
        ("v4-64", 32, (2, 4, 4)),
        ("v5p-8", 4, (2, 2, 1)),
        ("v5litepod-8", 8, (2, 4)),
        ("v5e-16", 16, (4, 4)),
        ("v5litepod-32", 32, (4, 8)),
        ("v6e-256", 256, (16, 16)),
        ("v5litepod-1", 1, (1, 1)),
    ],
)
def test_gcloud_accelerator_types_name_their_chips_and_torus(name, chips, shape):
    chip, count = targets.parse(name)
    assert count == chips
    assert targets.torus_shape(count, chip.torus_dims) == shape


@pytest.mark.parametrize(
    "name, says",
    [
        ("v3-8", "not a TPU accelerator type"),
        ("tpu-8", "not a TPU accelerator type"),
        ("v4-7", "two per chip"),
        ("v5litepod-12", "no v5litepod slice has 12 chips"),
    ],
)
def test_a_bad_target_name_is_refused_naming_the_fix(name, says):
    with pytest.raises(BadInput, match=says):
        targets.parse(name)


@pytest.mark.parametrize(
    "name, slices, devices, kind",
    [
        ("v5litepod-16", 1, 16, "TPU v5 lite"),
        ("v4-32", 1, 16, "TPU v4"),
        ("v6e-8", 2, 16, "TPU v6 lite"),
    ],
)
def test_libtpu_builds_the_named_slice(name, slices, devices, kind):
    target = targets.resolve(name, slices)
    assert len(target.devices) == devices == target.chips
    assert {d.device_kind for d in target.devices} == {kind}
    assert len({getattr(d, "slice_index", 0) for d in target.devices}) == slices


def test_check_cross_compiles_for_a_v5e_slice_and_says_it_fits(capsys, tmp_path):
    model_args, data_args, training_args, _ = parse_train_args([CONFIG, *SMALL], "check")
    result = run_check(model_args, data_args, training_args, "v5litepod-16")
    printed = capsys.readouterr().out
    assert result["fits"] and result["devices"] == 16 and result["device_kind"] == "TPU v5 lite"
    assert result["mesh"]["fsdp"] == 16
    memory = result["memory_per_device"]
    # fsdp=16: each chip holds a sixteenth of the float32 parameters and twice that of AdamW's moments.
    assert memory["parameters"] == pytest.approx(result["parameters"] * 4 / 16, rel=0.05)
    assert memory["optimizer state"] == pytest.approx(2 * memory["parameters"], rel=0.05)
    assert 0 < result["step_bytes_per_device"] < 16 * 2**30
    assert result["flops_per_step_per_device"] > 0 and 0 < result["estimate"]["mfu"] < 1
    # The config evaluates: its eval step is compiled too, beside the resident optimizer state.
    assert result["eval_memory_per_device"]["optimizer state (resident)"] == memory["optimizer state"]
    assert result["step_bytes_per_device"] > 0 and "while evaluating (per_device_eval_batch_size 8)" in printed
    assert "compiled for v5litepod-16 (16 x TPU v5 lite, topology v5e:4x4, compiled here, not run)" in printed
    assert "of 16.00 GiB" in printed and "MFU (estimate)" in printed and "fits                       yes" in printed


def test_a_layout_that_does_not_fit_exits_1_naming_what_to_change(tmp_path, capsys):
    """A 250k-token vocabulary replicated on every chip (data parallel only) needs more than a v5e's 16 GiB;
    XLA's own refusal is the reason, and nothing of the cross-compile enters the compilation cache."""
    cache = tmp_path / "cache"
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from jtrainer.cli import main\n"
        f"sys.exit(main(['check', {CONFIG!r}, '--target', 'v5litepod-16', '--hidden_size', '4096',"
        " '--intermediate_size', '256', '--num_hidden_layers', '1', '--num_attention_heads', '32',"
        " '--num_key_value_heads', '8', '--tokenizer_vocab_size', '250000', '--block_size', '128',"
        " '--per_device_train_batch_size', '1', '--mesh_shape', '{\"data\": -1}']))\n"
    )
    env = dict(os.environ, JTRAINER_COMPILATION_CACHE_DIR=str(cache))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-3000:]
    assert "does not fit v5litepod-16" in run.stdout and "the train step: RESOURCE_EXHAUSTED" in run.stdout
    assert "RESOURCE_EXHAUSTED" in run.stdout and "exceeds available HBM" in run.stdout
    assert "mesh_shape fsdp" in run.stdout
    assert not cache.exists() or not any(cache.rglob("*-cache*")), sorted(p.name for p in cache.rglob("*"))


def test_target_is_an_option_of_check_only(capsys):
    assert main(["train", CONFIG, "--target", "v5litepod-16"]) == 1
    assert "--target is an option of `jtrainer check`" in capsys.readouterr().err


def test_a_bad_target_exits_1_before_any_compile(capsys):
    assert main(["check", CONFIG, *SMALL, "--target", "v5litepod-12"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no v5litepod slice has 12 chips" in err[0]


def test_flops_count_every_micro_batch():
    """XLA's cost analysis counts the micro-batch loop's body once; the check counts it GA times, so doubling
    gradient_accumulation_steps doubles the step's FLOPs, as it doubles 6ND."""
    results = []
    for ga in ("1", "2"):
        parsed = parse_train_args(
            [CONFIG, *TINY, "--eval_strategy", "no", "--gradient_accumulation_steps", ga], "check"
        )
        results.append(run_check(*parsed[:3]))
    one, two = results
    assert two["model_flops_per_step"] == 2 * one["model_flops_per_step"]
    assert two["flops_per_step_per_device"] == pytest.approx(2 * one["flops_per_step_per_device"], rel=0.02)


@pytest.mark.parametrize(
    "name, per_node, kind",
    [
        ("h100x8", 8, "NVIDIA H100 80GB HBM3"),
        ("h200x8", 8, "NVIDIA H200"),
        ("a100x4", 4, "NVIDIA A100-SXM4-80GB"),
    ],
)
def test_the_cuda_plugin_builds_gpu_nodes_without_a_gpu(name, per_node, kind):
    target = targets.resolve(name, num_nodes=2)
    assert len(target.devices) == target.chips == 2 * per_node and target.topology == f"1x2x{per_node}"
    assert {d.device_kind for d in target.devices} == {kind}
    with pytest.raises(BadInput, match="a node holds 1 to 8 GPUs"):
        targets.resolve("h100x16")
    with pytest.raises(BadInput, match="GPU targets take --num_nodes"):
        targets.resolve("h100x8", num_slices=2)


def test_check_sizes_a_gpu_node_itself_and_refuses_what_overflows(capsys):
    """XLA compiles a GPU layout whatever its size; the check compares memory with the GPU's itself (fits: exit 0;
    a batch whose logits need 120 GiB: exit 1 naming them and what to change) and, without XLA's FLOPs,
    gives only the
    6ND lower bound of the step time."""
    parsed = parse_train_args([CONFIG, *SMALL, "--eval_strategy", "no", "--mesh_shape", '{"fsdp": -1}'], "check")
    result = run_check(*parsed[:3], "h100x8")
    printed = capsys.readouterr().out
    assert result["fits"] and result["devices"] == 8 and result["device_kind"] == "NVIDIA H100 80GB HBM3"
    assert result["memory_per_device"]["parameters"] == pytest.approx(result["parameters"] * 4 / 8, rel=0.05)
    assert "of 79.65 GiB" in printed and "at least" in printed and "lower bound: 6ND at peak" in printed
    assert "MFU (estimate)" not in printed and result["estimate"]["mfu"] is None
    code = (
        "import sys; sys.modules['torch'] = None\nfrom jtrainer.cli import main\n"
        f"sys.exit(main(['check', {CONFIG!r}, '--target', 'a100x1', *{TINY!r}, '--eval_strategy', 'no', "
        "'--hidden_size', '256', '--tokenizer_vocab_size', '250000', '--block_size', '2048', "
        "'--per_device_train_batch_size', '128', '--loss_chunk_size', '0']))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-3000:]
    assert "jtrainer check: the train step does not fit:" in run.stdout and "of 80.00 GiB" in run.stdout
    assert "logits: [128 x 2048 x 250000]" in run.stdout, run.stdout[-2000:]
    assert "-> whole [tokens, vocabulary] logits: something reads them" in run.stdout


def test_the_check_of_scanned_layers_gives_no_mfu_from_counts_xla_makes_once(capsys):
    parsed = parse_train_args([CONFIG, *TINY, "--eval_strategy", "no", "--scan_layers", "true"], "check")
    result = run_check(*parsed[:3], "v5litepod-16")
    printed = capsys.readouterr().out
    assert result["fits"] and result["estimate"]["mfu"] is None
    assert "(the scanned layers counted once)" in printed and "XLA counts the scanned layers once" in printed


@pytest.mark.parametrize(
    "name, slices, sizes, ring",
    [
        ("v5litepod-16", 1, {"data": 1, "fsdp": 16, "tensor": 1, "sequence": 1}, True),
        ("v4-32", 1, {"data": 2, "fsdp": 8, "tensor": 1, "sequence": 1}, False),
        ("v5litepod-16", 1, {"data": 1, "fsdp": 4, "tensor": 4, "sequence": 1}, True),
        ("v6e-8", 2, {"data": 2, "fsdp": 8, "tensor": 1, "sequence": 1}, False),
    ],
)
def test_the_mesh_follows_the_torus_keeps_each_hosts_rows_together_and_puts_slices_on_data(name, slices, sizes, ring):
    from jtrainer.parallel import sharding

    target = targets.resolve(name, slices)
    grid = sharding.make_mesh(sizes, list(target.devices)).devices
    rows = grid.reshape(sizes["data"] * sizes["fsdp"], -1)
    owners = [row[0].process_index for row in rows]
    assert all(len({d.process_index for d in row}) == 1 for row in rows)  # a row's tensor shards on one host
    assert owners == sorted(owners)  # each process's rows: one contiguous block, in process order
    for i in range(sizes["data"]):  # several slices: the data axis runs over them (DCN), fsdp inside one
        assert len({getattr(d, "slice_index", 0) for d in grid[i].reshape(-1)}) == 1
    if slices > 1:
        assert [grid[i, 0, 0, 0, 0].slice_index for i in range(sizes["data"])] == list(range(slices))
    if ring:  # inside a v5e host (a 2x2 block) the chips run along the torus (mesh_utils), not by device id
        host = list(rows[:4, 0]) if sizes["tensor"] == 1 else list(rows[0])
        for a, b in zip(host, host[1:]):
            assert sum(abs(x - y) for x, y in zip(a.coords, b.coords)) == 1, [d.coords for d in host]


def test_auto_find_batch_size_on_a_target_finds_the_batch_that_fits(capsys):
    """The search training would run on that machine, done by cross-compiling: a 250k vocabulary at 64 rows of 512
    tokens per v5e chip overflows; HF's smaller sizes are tried (effective batch kept) until one fits."""
    parsed = parse_train_args(
        [
            CONFIG,
            "--hidden_size",
            "256",
            "--intermediate_size",
            "256",
            "--num_hidden_layers",
            "1",
            "--num_attention_heads",
            "4",
            "--num_key_value_heads",
            "2",
            "--block_size",
            "512",
            "--tokenizer_vocab_size",
            "250000",
            "--per_device_train_batch_size",
            "64",
            "--eval_strategy",
            "no",
            "--auto_find_batch_size",
            "true",
        ],
        "check",
    )
    result = run_check(*parsed[:3], "v5litepod-16")
    printed = capsys.readouterr().out
    found = result["per_device_train_batch_size"], result["gradient_accumulation_steps"]
    assert result["fits"] and found[0] < 64
    assert found[0] * found[1] == 64
    assert (parsed[2].per_device_train_batch_size, parsed[2].gradient_accumulation_steps) == (64, 1)  # unchanged
    assert "auto_find_batch_size: per_device_train_batch_size 64 does not fit v5litepod-16" in printed
    assert result["step_bytes_per_device"] <= 16 * 2**30


def test_check_sizes_a_transformers_model_through_the_bridge_without_weights(capsys):
    """`bridge: true`: transformers' own Gemma3 (a family jtrainer has no native model of), built on torch's
    meta device (no weights allocated) and cross-compiled for v5litepod-16."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import importlib.util

    if importlib.util.find_spec("torchax") is None:
        pytest.skip("torchax is not installed")
    import torch
    import transformers

    args = [CONFIG, *SMALL, "--bridge", "--model_type", "gemma3_text", "--head_dim", "64", "--eval_strategy", "no"]
    model_args, data_args, training_args, _ = parse_train_args(args, "check")
    result = run_check(model_args, data_args, training_args, "v5litepod-16")
    printed = capsys.readouterr().out
    config = transformers.AutoConfig.for_model(
        "gemma3_text",
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
    )
    with torch.device("meta"):
        expected = transformers.AutoModelForCausalLM.from_config(config).num_parameters()
    assert result["fits"] and result["devices"] == 16 and result["parameters"] == expected
    assert result["memory_per_device"]["parameters"] == pytest.approx(expected * 4 / 16, rel=0.05)
    assert "compiled for v5litepod-16" in printed and "fits                       yes" in printed

    # The same model with a LoRA adapter (r=8 on q/v): the base frozen (its own row, no optimizer state for it),
    # the adapters the only parameters.
    pytest.importorskip("peft")
    lora = ["--use_peft", "--lora_r", "8", "--lora_target_modules", "q_proj", "v_proj"]
    model_args, data_args, training_args, _ = parse_train_args(args + lora, "check")
    adapted = run_check(model_args, data_args, training_args, "v5litepod-16")
    printed = capsys.readouterr().out
    per_layer = 8 * (256 + 4 * 64) + 8 * (256 + 2 * 64)  # q: [256 -> 256], v: [256 -> 128], A [r, in] + B [out, r]
    assert adapted["fits"] and adapted["trainable_parameters"] == 2 * per_layer
    assert adapted["parameters"] == expected + 2 * per_layer
    memory = adapted["memory_per_device"]
    assert memory["frozen weights (no gradients)"] == pytest.approx(expected * 2 / 16, rel=0.05)  # bf16: held so
    assert memory["optimizer state"] < 2 * 4 * 2 * per_layer  # AdamW's moments of the adapters only (replicated)
    assert f"({2 * per_layer:,} trainable)" in printed


LONG_ROWS = [
    *SMALL[: SMALL.index("--block_size")],
    "--block_size",
    "32768",
    "--max_position_embeddings",
    "32768",
    "--tokenizer_vocab_size",
    "512",
    "--per_device_train_batch_size",
    "1",
    "--eval_strategy",
    "no",
]


def test_long_rows_fit_a_v5e_through_the_splash_kernel_and_xla_attention_is_named_as_the_cause(capsys, monkeypatch):
    """32k-token rows: XLA's attention needs [32768 x 32768] scores per head (17 GiB a chip), and the check says
    so, with the advice that follows; the splash kernel (the default on TPUs) never holds them and fits."""
    model_args, data_args, training_args, _ = parse_train_args([CONFIG, *LONG_ROWS], "check")
    result = run_check(model_args, data_args, training_args, "v5litepod-16")
    printed = capsys.readouterr().out
    assert result["fits"], printed[-3000:]
    assert "splash attention (Pallas kernel, blockwise)" in printed
    assert "(with " in printed and "in the attention kernel, from its shapes)" in printed

    monkeypatch.setenv("JTRAINER_ATTENTION", "xla")
    model_args, data_args, training_args, _ = parse_train_args([CONFIG, *LONG_ROWS], "check")
    result = run_check(model_args, data_args, training_args, "v5litepod-16")
    printed = capsys.readouterr().out
    assert not result["fits"]
    assert result["largest_values"][0].kind == "attention scores", printed
    assert "attention scores: [" in printed and "32768 x " in printed and "GiB a chip each" in printed
    assert "-> attention holds [length, length] scores" in printed and "sequence: M" in printed


def test_check_needs_no_reporting_integration_and_shows_its_phases(tmp_path, capsys, monkeypatch):
    """A config that reports to TensorBoard (as the shipped 1B config does) is checked without the integration
    (`check` never logs: here its callback cannot even be built), and each long phase is said on stderr."""
    import transformers.integrations.integration_utils as integrations

    def unavailable(*args, **kwargs):
        raise RuntimeError("TensorBoardCallback requires tensorboard to be installed.")

    monkeypatch.setattr(integrations.TensorBoardCallback, "__init__", unavailable)
    argv = ["check", CONFIG, *TINY, "--report_to", "tensorboard", "--output_dir", str(tmp_path / "out")]
    assert main(argv) == 0
    printed = capsys.readouterr()
    assert "report_to" in printed.out and "fits" not in printed.err  # the field is reported, as set
    phases = [line for line in printed.err.splitlines() if line.startswith("jtrainer check: ")]
    assert phases[0] == "jtrainer check: tracing the train step (per_device_train_batch_size 2) ..."
    assert "jtrainer check: XLA compiling the train step for this machine ..." in phases
    assert any(
        line.startswith("jtrainer check: XLA compiling the train step for this machine: done (") for line in phases
    )


def test_check_compares_the_native_and_bridged_steps_of_one_config(capsys):
    """`--compare_bridge`: the config's native Llama and transformers' LlamaForCausalLM of the same shape through
    the bridge, both cross-compiled for the target, then one table with both step estimates; `train` refuses it."""
    pytest.importorskip("torch")
    import importlib.util

    if importlib.util.find_spec("torchax") is None:
        pytest.skip("torchax is not installed")
    argv = [CONFIG, *TINY, "--eval_strategy", "no", "--target", "v5litepod-8", "--compare_bridge", "true"]
    assert main(["check", *argv]) == 0
    printed = capsys.readouterr().out
    table = printed[printed.index("native and bridged, the same shape") :].splitlines()
    rows = {line[:32].strip(): line[32:].split() for line in table[2:]}
    assert len(rows["step time (estimate)"]) == 4 and rows["fits"] == ["yes", "yes"]  # "0.001 s" twice
    counts = [line.split()[1] for line in printed.splitlines() if line.startswith("  parameters ")]
    assert len(counts) == 2 and counts[0] == counts[1]  # the same model, native and bridged
    assert main(["train", CONFIG, *TINY, "--compare_bridge", "true"]) == 1
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("jtrainer train: ")]
    assert len(said) == 1 and "--compare_bridge is an option of `jtrainer check`" in said[0]


def test_check_builds_no_trainer(monkeypatch):
    """`jtrainer check` compiles the train and eval steps from the free functions the Trainer builds its steps
    with (`sizing.abstract_step`, `kinds.loss_rules`): no Trainer is constructed."""
    from jtrainer.trainer.trainer import Trainer

    def refuse(*args, **kwargs):
        raise AssertionError("jtrainer check constructed a Trainer")

    monkeypatch.setattr(Trainer, "__init__", refuse)
    parsed = parse_train_args([CONFIG, *TINY, "--mesh_shape", '{"fsdp": -1}'], "check")
    result = run_check(*parsed[:3])
    assert result["fits"] and result["step_bytes_per_device"] > 0 and result["eval_bytes_per_device"] > 0


def test_the_checks_step_is_the_trainers_step():
    """The train step `jtrainer check` compiles from free functions (`sizing.abstract_step.AbstractRun`) is the
    program the Trainer compiles for the same model and arguments: the same StableHLO, the same memory and FLOPs."""
    from jtrainer import Trainer
    from jtrainer.cli import tasks
    from jtrainer.cli.check import sample_batch
    from jtrainer.sizing import abstract_step

    model_args, data_args, training_args = parse_train_args([CONFIG, *TINY, "--eval_strategy", "no"], "check")[:3]

    def model():
        special = {"eos_token_id": 0, "bos_token_id": 0, "pad_token_id": 1}
        return tasks.build_model(model_args, data_args.tokenizer_vocab_size, special, 0, abstract=True)

    example = sample_batch("causal_lm", training_args.per_device_train_batch_size, data_args.block_size, 0)
    run = abstract_step.AbstractRun.of(model(), training_args)
    traced, _ = run.trace_train(example, 100)
    given = model()
    given.gradient_checkpointing_enable(training_args.activation_checkpointing_kwargs)  # as train() does
    trainer = Trainer(model=given, args=training_args)
    trainers = trainer.trace_train_step(example, 100)
    with run.layout.tracing():
        assert traced.lower().as_text() == trainers.lower().as_text()  # (source locations aside)
    checked, trained = abstract_step.compile_traced(traced, run.layout), trainer.compile_traced(trainers)
    assert checked.memory_analysis().temp_size_in_bytes == trained.memory_analysis().temp_size_in_bytes
    assert checked.cost_analysis()["flops"] == trained.cost_analysis()["flops"]
