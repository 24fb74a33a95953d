"""examples/colab_tpu.ipynb executes on the CPU (nbclient), shortened, and draws its loss plot."""

import os

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")


def test_colab_notebook_executes(tmp_path, monkeypatch):
    notebook = nbformat.read("examples/colab_tpu.ipynb", as_version=4)
    monkeypatch.setenv("JTRAINER_NOTEBOOK_STEPS", "4")
    monkeypatch.setenv("JTRAINER_NOTEBOOK_CHARS", "40000")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nbclient.NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    outputs = "".join(
        o.get("text", "") for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])
    )
    assert "train loss" in outputs and "eval loss" in outputs
    assert os.path.getsize(tmp_path / "colab-run" / "loss.png") > 1000
    assert os.path.isfile(tmp_path / "colab-run" / "model" / "model.safetensors")
