"""hacpo_megatron/quiet.py hides the listed third-party notices, and nothing else."""
import logging
import os
import subprocess
import sys
import warnings

import pytest

from hacpo_megatron import quiet

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _warn(message: str, module: str) -> None:
    warnings.warn_explicit(message, UserWarning, filename=module.replace(".", "/") + ".py", lineno=1,
                           module=module, registry={})


def test_listed_warnings_are_hidden_and_others_are_not():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet.install(quiet.HIDDEN)
        _warn("Apex is not installed. Falling back to Torch Norm", "megatron.core.models.backends")
        _warn("full scope is deprecated. Use empty cuda_graph_modules to capture the whole layer.",
              "megatron.core.transformer.transformer_config")
        _warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
              "megatron.core.optimizer")
        # not listed: another Megatron warning, and a listed text from a module that is not Megatron
        _warn("Some new Megatron warning", "megatron.core.optimizer")
        _warn("Apex is not installed. Falling back to Torch Norm", "hacpo_megatron.training.loop")
    shown = [(str(w.message), w.filename) for w in caught]
    assert shown == [("Some new Megatron warning", "megatron/core/optimizer.py"),
                     ("Apex is not installed. Falling back to Torch Norm", "hacpo_megatron/training/loop.py")]


def test_listed_log_records_are_hidden_and_others_are_not():
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append((record.name, record.getMessage()))

    gpt = logging.getLogger("megatron.core.models.gpt.gpt_model")
    ray_worker = logging.getLogger("ray._private.worker")
    handler = Keep()
    added, level = [], ray_worker.level
    try:
        ray_worker.setLevel(logging.INFO)  # as Ray sets its loggers up
        for logger in (gpt, ray_worker):
            logger.addHandler(handler)
        added = quiet.install(quiet.HIDDEN)
        gpt.warning("GPTModel IS DEPRECATED. GPTModel is only accepting critical bug fixes, no new features.")
        gpt.warning("GPTModel got a bad argument")  # not listed
        ray_worker.info("Connecting to existing Ray cluster at address: %s...", "127.0.0.1:41234")
        ray_worker.info("Connected to Ray cluster.")
        ray_worker.info("Connecting to existing Ray cluster at address: %s...", "node0:6379")  # --ray-address
        ray_worker.info("Started a local Ray instance.")
    finally:
        ray_worker.setLevel(level)
        for logger in (gpt, ray_worker):
            logger.removeHandler(handler)
        for logger, drop in added:
            logger.removeFilter(drop)
    assert records == [
        ("megatron.core.models.gpt.gpt_model", "GPTModel got a bad argument"),
        ("ray._private.worker", "Connecting to existing Ray cluster at address: node0:6379..."),
        ("ray._private.worker", "Started a local Ray instance."),
    ]


def test_show_all_turns_the_filters_off(monkeypatch):
    monkeypatch.setenv(quiet.SHOW_ALL_ENV, "1")
    assert quiet.active_entries() == ()
    monkeypatch.setenv(quiet.SHOW_ALL_ENV, "0")
    assert quiet.active_entries()


@pytest.mark.skipif(not quiet.torch_is_cpu_build(), reason="the Apex/TE notices are hidden on CPU builds only")
def test_real_megatron_imports_are_quiet():
    """Megatron's own texts, as printed when its modules are imported: gone after `import
    hacpo_megatron`, back with HACPO_SHOW_ALL_WARNINGS=1 (so the test sees them when they change)."""
    code = ("import hacpo_megatron\n"
            "from hacpo_megatron import megatron_cpu\n"
            "megatron_cpu.apply()\n"
            "import megatron.core.optimizer, megatron.core.models.backends, megatron.core.models.mimo\n")
    expected = ["Transformer Engine and Apex are not installed", "Apex is not installed. Falling back to Torch Norm",
                "MimoModelConfig is experimental"]
    for show_all in ("0", "1"):
        env = {**os.environ, quiet.SHOW_ALL_ENV: show_all, "PYTHONWARNINGS": ""}
        result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0, result.stderr
        for text in expected:
            assert (text in result.stderr) == (show_all == "1"), (show_all, text, result.stderr[-2000:])
