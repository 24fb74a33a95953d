"""The code on every page of the manual runs: each page's ```python blocks in order, in one namespace, in a fresh
folder holding the tiny models, tokenizers and rows the page's names refer to (built here, nothing downloaded). A
block that cannot run on this machine is preceded by `<!-- not run: why -->`, and this test says which it skips."""

import os
import re
import textwrap

import numpy as np
import pytest
from conftest import tiny_llama_config, token_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md", *sorted(os.path.join("docs", p) for p in os.listdir(os.path.join(ROOT, "docs")))]
BLOCK = re.compile(
    r"(?:^[ ]*<!-- not run: (?P<why>[^>]*) -->\n)?^(?P<indent>[ ]*)```python\n(?P<code>.*?)^(?P=indent)```", re.S | re.M
)


def blocks(page: str) -> list[tuple[str, str | None]]:
    """(code, reason it is not run or None) of each python block of `page`."""
    text = open(os.path.join(ROOT, page)).read()
    return [(textwrap.dedent(m["code"]), m["why"]) for m in BLOCK.finditer(text)]


def _tokenizer(vocab=300):
    from jtrainer.cli.tasks import train_tokenizer

    texts = [f"def main():\n    return {i} + {i * 2}  # the answer\n" for i in range(200)]
    return train_tokenizer(texts, vocab)


def _class_rows(n, vocab=64):
    rng = np.random.RandomState(0)
    return [{"input_ids": rng.randint(0, vocab, 8), "labels": int(rng.randint(0, 2))} for _ in range(n)]


def _namespace(page: str) -> dict:
    """The names a page's snippets take as given (its prose says what they are), built tiny."""
    import jax
    import jax.numpy as jnp
    import transformers
    from flax import nnx

    import jtrainer
    from jtrainer import Trainer, TrainingArguments

    ns = {
        "jax": jax,
        "jnp": jnp,
        "nnx": nnx,
        "jtrainer": jtrainer,
        "Trainer": Trainer,
        "TrainingArguments": TrainingArguments,
        "DataCollatorForSeq2Seq": transformers.DataCollatorForSeq2Seq,
    }
    quick = dict(report_to="none", disable_tqdm=True, save_strategy="no", max_steps=1)
    if page == "docs/main-job.md":
        import torch

        torch.manual_seed(0)
        transformers.LlamaForCausalLM(tiny_llama_config(vocab_size=300)).save_pretrained("outputs/default")
        _tokenizer().save_pretrained("outputs/default")
    elif page == "docs/models.md":
        import torch

        torch.manual_seed(0)
        config = transformers.Qwen3Config(**tiny_llama_config(vocab_size=300).to_dict())
        transformers.Qwen3ForCausalLM(config).save_pretrained("path/to/local/qwen3")
        ns.update(
            args=TrainingArguments("out", **quick),
            ds=_class_rows(8, vocab=1000),
            path="path/to/local/qwen3",
            tokenizer=_tokenizer(),
        )
    elif page == "docs/training.md":
        from jtrainer.cli.tasks import ModelArguments, build_model

        tokenizer = _tokenizer()
        t5 = build_model(
            ModelArguments(
                task="seq2seq",
                model_type="t5",
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=4,
            ),
            len(tokenizer),
            {"pad_token_id": 0, "eos_token_id": 1},
            0,
        )
        pairs = [{"input_ids": tokenizer(f"def f{i}(): pass")["input_ids"], "labels": [5, 6, 1]} for i in range(8)]
        ns.update(
            model=jtrainer.models.LlamaForCausalLM.from_config(tiny_llama_config()),
            args=TrainingArguments("out", **quick),
            train=token_rows(8),
            val=token_rows(4),
            t5=t5,
            tokenizer=tokenizer,
            test=[{"input_ids": p["input_ids"]} for p in pairs[:4]],
            class_weights=jnp.ones(64),
        )
        ns.update(train=token_rows(8))
    elif page == "docs/trl.md":
        import json

        import torch

        from tests import trl_cases

        trl_cases.torch_llama().save_pretrained("path/to/model")
        trl_cases.tokenizer().save_pretrained("path/to/model")
        for name, rows in (("chat", trl_cases.conversation_rows()), ("prefs", trl_cases.preference_rows())):
            with open(f"{name}.jsonl", "w") as f:
                f.writelines(json.dumps(row) + "\n" for row in rows)
        torch.manual_seed(0)
    elif page == "docs/performance.md":
        ns.update(tokenizer=_tokenizer(), texts=[f"def f{i}(): return {i}" for i in range(20)])
    elif page == "docs/integrations.md":
        ns["trainer"] = Trainer(
            model_init=lambda: jtrainer.models.LlamaForCausalLM.from_config(tiny_llama_config()),
            args=TrainingArguments("out", **quick, eval_strategy="no"),
            train_dataset=token_rows(8),
            eval_dataset=token_rows(4),
        )
    return ns


def test_every_page_has_its_code_found():
    found = {page: blocks(page) for page in PAGES}
    assert len(found["README.md"]) >= 2 and sum(len(b) for b in found.values()) >= 12
    assert all(why.strip() for b in found.values() for _, why in b if why is not None)


def _runnable(page: str) -> bool:
    return any(why is None for _, why in blocks(page))


@pytest.mark.parametrize("page", [page for page in PAGES if _runnable(page)])
def test_the_code_of_the_page_runs(page, tmp_path, monkeypatch):
    """Every block not marked `not run`, in order (pages without python code, or with none runnable here, have
    nothing to run: sizing, accelerators and the gs:// example)."""
    monkeypatch.chdir(tmp_path)
    ns = _namespace(page)
    for source, why in blocks(page):
        if why is None:
            exec(compile(source, f"{page} snippet", "exec"), ns)


# ------------------------------------------------------------------------------------------ the shell commands
SHELL = re.compile(r"^(?P<indent>[ ]*)```bash\n(?P<code>.*?)^(?P=indent)```", re.S | re.M)
# What a reader runs that needs more than this machine (an accelerator, gcloud, a bucket) or minutes: each such
# command's script must exist; `JTRAINER_DOCS_RUN=1` runs the jtrainer ones as written (minutes each).
NEEDS_MORE = {
    "tpu/tpu.sh": "a Cloud TPU project (gcloud)",
    "bash benchmarks/gpu_check.sh": "a GPU",
    "python benchmarks/": "minutes of benchmarking",
}


def commands(page: str) -> list[str]:
    """The commands of a page's ```bash blocks, their comments removed; a synopsis (`[CONFIG.yaml]`) is not one."""
    text = open(os.path.join(ROOT, page)).read()
    found = []
    for block in SHELL.finditer(text):
        for line in block["code"].splitlines():
            command = re.split(r"\s+#\s", " " + line.strip(), maxsplit=1)[0].strip()
            if command and not command.startswith("#") and not re.search(r"\s\[", command):
                found.append(command)
    return found


ALL_COMMANDS = [(page, command) for page in PAGES for command in commands(page)]


def test_every_page_has_its_commands_found():
    pages = {page for page, _ in ALL_COMMANDS}
    assert {"README.md", "docs/main-job.md", "docs/sizing.md", "docs/sharding.md"} <= pages
    assert len(ALL_COMMANDS) >= 15


@pytest.fixture(scope="module")
def readers_folder(tmp_path_factory):
    """What the pages' commands take as the reader's own (a config of theirs, a trained model folder, a script),
    in one folder the commands run in, one after another, as a reader's shell would."""
    import shutil

    import torch
    import transformers

    from jtrainer.cli.config import DEFAULT_CONFIG

    folder = tmp_path_factory.mktemp("reader")
    shutil.copy(DEFAULT_CONFIG, folder / "my_run.yaml")
    torch.manual_seed(0)
    config = tiny_llama_config(vocab_size=300, max_position_embeddings=512)
    transformers.LlamaForCausalLM(config).save_pretrained(folder / "outputs/default")
    _tokenizer().save_pretrained(folder / "outputs/default")
    (folder / "train.py").write_text("print('a script of the reader')\n")
    return folder


@pytest.mark.parametrize("page, command", ALL_COMMANDS, ids=[f"{p}: {c[:60]}" for p, c in ALL_COMMANDS])
def test_the_command_works_as_written(page, command, readers_folder, monkeypatch, capsys):
    """Each command of the manual, from a clone's point of view: the extras it installs exist; `jtrainer train`
    and `check` accept its config and flags and pass the refusals both share (the fields, the model, the mesh
    over the target's devices: the first minutes of the run); help pages print; scripts exist."""
    import shlex
    import tomllib

    argv = shlex.split(command)
    if argv[0] == "python3" and "venv" in argv:  # the README's install lines: what .ci/run does
        ci = open(os.path.join(ROOT, ".ci", "run")).read()
        assert 'pip install -q -e ".[test]"' in ci and "pytest -q -n 2 --dist worksteal" in ci
        assert "pytest -q -n 2 --dist worksteal" in command or command.endswith("jtrainer train")
        return
    if argv[:3] == ["pip", "install", "-e"]:
        extras = re.fullmatch(r"\.\[([a-z0-9,-]+)\]", argv[3])
        assert extras, f'{command}: install from the clone as pip install -e ".[extra]"'
        declared = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]["optional-dependencies"]
        assert set(extras[1].split(",")) <= set(declared), command
        return
    needs = next((why for prefix, why in NEEDS_MORE.items() if command.startswith(prefix)), None)
    if needs is not None:
        script = next(a for a in argv if a.endswith((".sh", ".py")))
        assert os.path.isfile(os.path.join(ROOT, script)), f"{command}: {script} is missing"
        return
    assert argv[0] == "jtrainer", f"{page}: {command!r} is a command test_docs does not know how to check"
    monkeypatch.chdir(readers_folder)
    if os.environ.get("JTRAINER_DOCS_RUN") == "1" and argv[1] in ("train", "check"):
        from jtrainer.cli import main

        assert main(argv[1:]) == 0, command
        return
    if "--help" in argv:
        from jtrainer.cli import main

        with pytest.raises(SystemExit) as done:
            main(argv[1:])
        assert done.value.code == 0 and "usage: jtrainer" in capsys.readouterr().out
        return
    if argv[1] == "launch":
        from jtrainer.cli.launch import command_for, launch_parser

        parsed = launch_parser().parse_args(argv[2:])
        command_for(parsed.target, parsed.args)  # a .py script or a config
        return
    from jtrainer.cli import tasks
    from jtrainer.cli.config import parse_train_args
    from jtrainer.sizing import targets

    model_args, data_args, training_args, run_args = parse_train_args(argv[2:], argv[1])
    devices = None
    if run_args.target is not None:
        devices = len(targets.resolve(run_args.target, run_args.num_slices, run_args.num_nodes).devices)
    tasks.check_run(model_args, data_args, training_args, devices, sizing=argv[1] == "check")
