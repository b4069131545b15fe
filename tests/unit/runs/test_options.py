"""The run skeleton's options: one options object checked before anything starts, and one set of
command-line options that every run verb's magic and CLI verb parse the same way."""

from __future__ import annotations

import argparse

import pytest

from cmlcluster import ConfigError
from cmlcluster.runs.options import WorkerOptions, worker_options
from cmlcluster.runs.verbs import VERBS, add_verb_arguments, options_of


@pytest.mark.parametrize(
    ("keywords", "message"),
    [
        ({"cpu": 0}, "cpu=0"),
        ({"memory": "1G"}, "memory='1G'"),
        ({"nvidia_gpu": 1.5}, "nvidia_gpu=1.5"),
        ({"start_timeout": 0}, "start_timeout=0"),
        ({"max_restarts": -1}, "max_restarts=-1"),
        ({"env": {"1BAD": "x"}}, "1BAD"),
        ({"collect": "../outside"}, "outside"),
    ],
)
def test_a_bad_value_is_named(keywords, message):
    with pytest.raises(ConfigError, match=message):
        worker_options(**keywords)


def test_options_are_checked_and_normalized():
    options = worker_options(cpu=2, memory=4, nvidia_gpu=1, env={"A": "1"}, collect="outputs/", max_restarts=2)
    assert options == WorkerOptions(cpu=2, memory=4, nvidia_gpu=1, env={"A": "1"}, collect=("outputs",), max_restarts=2)
    assert (options.resources.cpu, options.resources.memory, options.resources.nvidia_gpu) == (2, 4, 1)


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_every_verb_parses_the_shared_worker_options_the_same_way(verb, monkeypatch):
    parser = argparse.ArgumentParser()
    add_verb_arguments(parser, verb, magic=False, with_script=True)
    line = "--cpu 2 --memory 3 --gpus 1 --backend docker --start-timeout 90 --collect out train.py --epochs 3"
    parsed = parser.parse_args(line.split())
    seen = {}

    def fake_run(*args, **keywords):
        seen.update(keywords, args=args)
        return "result"

    target = {"horovod": "run_horovod", "torchrun": "run_torch", "jaxrun": "run_jax", "accelerate": "run_accelerate"}
    module = options_of(verb).__name__.rsplit(".", 1)[0] + ".run"
    monkeypatch.setattr(f"{module}.{target[verb]}", fake_run)
    assert options_of(verb).run(parsed, parsed.script, parsed.args) == "result"
    assert seen["args"] == ("train.py", ["--epochs", "3"])
    expected = {"cpu": 2, "memory": 3, "nvidia_gpu": 1, "backend": "docker", "start_timeout": 90, "collect": ["out"]}
    assert {key: seen[key] for key in expected} == expected


def test_only_the_horovod_magic_has_reuse():
    for verb in VERBS:
        cli, magic = argparse.ArgumentParser(), argparse.ArgumentParser()
        add_verb_arguments(cli, verb, magic=False, with_script=False)
        add_verb_arguments(magic, verb, magic=True, with_script=False)
        assert not hasattr(cli.parse_args([]), "reuse")
        assert hasattr(magic.parse_args([]), "reuse") == (verb == "horovod")
