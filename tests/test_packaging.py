"""An installed package starts the job by itself: the wheel built from the repository carries the default config
and the `hacpo-megatron` console script, and the launcher's default config is the package's own file, not a path
into a checkout. (Installing that wheel in a fresh venv and running 2 steps through the script: docs/running.md.)"""
import configparser
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_wheel_carries_the_default_config_and_the_console_script(tmp_path):
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path), str(REPO)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    [wheel] = tmp_path.glob("hacpo_megatron-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        shipped = archive.read("hacpo_megatron/configs/default.yaml")
        [entry_points] = [name for name in archive.namelist() if name.endswith(".dist-info/entry_points.txt")]
        scripts = configparser.ConfigParser()
        scripts.read_string(archive.read(entry_points).decode())
    assert shipped == (REPO / "configs" / "default.yaml").read_bytes()  # a copy of the file, not a link
    assert scripts["console_scripts"]["hacpo-megatron"].strip() == "hacpo_megatron.launch:main"


def test_the_launchers_default_config_is_inside_the_package():
    from hacpo_megatron import launch
    from hacpo_megatron.config import load_config

    package = Path(launch.__file__).resolve().parent
    assert Path(launch.DEFAULT_CONFIG).parent.parent == package
    assert Path(launch.parse_args([]).config).read_bytes() == (REPO / "configs" / "default.yaml").read_bytes()
    assert load_config(launch.DEFAULT_CONFIG).run.name == "default"
