"""Fixtures the checkpoint tests share."""
import shutil
import time

import pytest


@pytest.fixture(scope="package")
def smollm2_hf(request, tmp_path_factory):
    """SmolLM2-135M-Instruct as a Hugging Face folder, converted from its GGUF file once for the package
    (~20 s of de-quantisation) by tools/convert_gguf_to_hf.py run as a user runs it: test_gguf.py checks the
    command and the folder against transformers' own GGUF load, test_smollm2_conversion.py converts the folder on
    to Megatron and back (it used to convert the model a second time, into the model cache of
    `resolve_model_source`, which calls the same `convert_gguf_to_hf`). Deleted once the package's tests are done,
    unless one of them failed (as `module_tmp`: the folder is 540 MB)."""
    from tests.checkpoint.test_gguf import NAME, run_tool

    failed_before = request.session.testsfailed
    folder = tmp_path_factory.mktemp("gguf") / NAME
    start = time.monotonic()
    result = run_tool("--gguf", NAME, "--save", folder)
    assert result.returncode == 0, result.stderr[-3000:]
    print(f"\nconvert_gguf_to_hf: {time.monotonic() - start:.1f} s")
    assert f"saved Hugging Face model to {folder}" in result.stdout
    assert not folder.with_name(folder.name + ".partial").exists()
    yield folder.resolve()  # the tools run with the repository as working directory
    if request.session.testsfailed == failed_before:
        shutil.rmtree(folder.parent, ignore_errors=True)
