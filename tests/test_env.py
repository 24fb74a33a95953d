"""Environment variables: every one jtrainer reads is declared and documented in jtrainer/core/env.py, and only
env.py reads jtrainer's own from os.environ."""

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sources():
    for folder, _, files in os.walk(os.path.join(ROOT, "jtrainer")):
        for file in files:
            if file.endswith(".py"):
                path = os.path.join(folder, file)
                yield os.path.relpath(path, ROOT), open(path).read()


def test_every_variable_named_in_the_package_is_declared_and_documented():
    from jtrainer.core import env

    declared = {setting.name for setting in env.ALL}
    named = {name for _, text in _sources() for name in re.findall(r"JTRAINER_[A-Z_]+", text)}
    assert named == declared
    assert all(f"`{name}`" in env.__doc__ for name in declared)


def test_only_env_reads_jtrainers_variables():
    """No other module calls os.environ / os.getenv with a JTRAINER_ name (env.py's Settings do)."""
    offenders = []
    for rel, text in _sources():
        if rel == os.path.join("jtrainer", "core", "env.py"):
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("JTRAINER_"):
                offenders.append(f"{rel}:{node.lineno}")
    assert offenders == []


def test_settings_read_at_call_time(monkeypatch):
    from jtrainer.core import env

    monkeypatch.setenv(env.DEVICE_MEMORY_BYTES.name, "1024")
    assert env.DEVICE_MEMORY_BYTES.get_int() == 1024
    monkeypatch.setenv(env.DEVICE_MEMORY_BYTES.name, "")
    assert env.DEVICE_MEMORY_BYTES.get_int() is None
    monkeypatch.delenv(env.HEARTBEAT_TIMEOUT.name, raising=False)
    assert env.HEARTBEAT_TIMEOUT.get_int() == 20
