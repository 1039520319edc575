"""The four wheels install into a clean venv and serve a CPU vLLM engine from there (markers slow, vllm).

``ci/wheels.sh --in-tree`` builds the sdists and wheels (the core's repaired to a manylinux tag). A new venv
gets the engines and their dependencies as hard links of the project venv's site-packages *without* our
four packages (same files, no download, no copy), then our packages from the wheels alone, resolved
offline (``--no-index``: their dependencies must already be there). The engine runs from a folder outside
the repository with no ``PYTHONPATH``, so nothing can come from the source tree: vLLM finds the plugin
through the wheel's entry point, and elastic greedy tokens must equal native ones.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.models import tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

REPO = Path(__file__).resolve().parents[1]
# Our modules and distributions, left out of the engines linked into the clean venv.
OURS = {"elastic_kv", "elastic_kv_core", "vllm_elastic_kv", "sglang_elastic_kv", "elastic_kv_serve"}

# Runs inside the clean venv: one engine, greedy tokens and where our modules came from, as one JSON line.
ENGINE = """
import json, sys
if __name__ == "__main__":
    import elastic_kv._vmm, vllm_elastic_kv, sglang_elastic_kv
    from vllm import LLM, SamplingParams
    model, backend = sys.argv[1], sys.argv[2]
    extra = {"additional_config": {"kv_cache_backend": "elastic"}} if backend == "elastic" else {}
    llm = LLM(model=model, skip_tokenizer_init=True, dtype="float32", max_model_len=256, enforce_eager=True,
              kv_cache_memory_bytes=32 << 20, **extra)
    prompts = [{"prompt_token_ids": list(range(3 + i, 40 + 7 * i))} for i in range(4)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, detokenize=False))
    info = llm.collective_rpc("elastic_kv_info") if backend == "elastic" else []
    print("@@" + json.dumps({
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "info": info,
        "files": [m.__file__ for m in (elastic_kv._vmm, vllm_elastic_kv, sglang_elastic_kv)],
    }))
"""


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    env = {**os.environ, "ELASTIC_KV_VENV": sys.prefix}
    done = subprocess.run(
        ["bash", str(REPO / "ci" / "wheels.sh"), "--in-tree", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def clean_venv(dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    venv = tmp_path_factory.mktemp("clean") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    ours = sysconfig.get_paths()["purelib"]
    theirs = venv / Path(ours).relative_to(sys.prefix)
    shutil.rmtree(theirs)
    # Hard links: the same engine files at no cost; removing our packages from the copy unlinks only there.
    # Across file systems (a tmpfs /tmp) hard links fail, and the files are copied instead.
    if subprocess.run(["cp", "-al", ours, str(theirs)], capture_output=True, timeout=600).returncode != 0:
        shutil.rmtree(theirs, ignore_errors=True)
        subprocess.run(["cp", "-a", ours, str(theirs)], check=True, timeout=1200)
    for entry in theirs.iterdir():
        if entry.name in OURS or entry.name.split("-")[0] in OURS:
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    wheels = sorted(str(w) for w in dist.glob("*.whl"))
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-index", "--no-cache-dir", *wheels],
        check=True,
        timeout=600,
        cwd=venv,
    )
    yield venv
    shutil.rmtree(venv.parent, ignore_errors=True)


def test_sdists_and_wheels_are_complete(dist: Path) -> None:
    names = sorted(p.name for p in dist.iterdir())
    version = (REPO / "VERSION").read_text().strip()
    assert f"vllm_elastic_kv-{version}-py3-none-any.whl" in names
    assert f"sglang_elastic_kv-{version}-py3-none-any.whl" in names
    assert f"elastic_kv_serve-{version}-py3-none-any.whl" in names
    (core,) = [n for n in names if n.startswith(f"elastic_kv_core-{version}-") and n.endswith(".whl")]
    assert "-manylinux" in core, core
    assert {
        f"{n}-{version}.tar.gz"
        for n in ("elastic_kv_core", "vllm_elastic_kv", "sglang_elastic_kv", "elastic_kv_serve")
    } <= set(names)
    with zipfile.ZipFile(dist / core) as whl:
        assert any(n.startswith("elastic_kv/_vmm") and n.endswith(".so") for n in whl.namelist())
        assert any(n.endswith("entry_points.txt") for n in whl.namelist())  # kvctl
    with tarfile.open(dist / f"elastic_kv_core-{version}.tar.gz") as sdist:
        members = set(sdist.getnames())
    root = f"elastic_kv_core-{version}"
    assert {f"{root}/VERSION", f"{root}/core_ext/CMakeLists.txt", f"{root}/CMakeLists.txt"} <= members


def test_engine_runs_from_the_wheels_alone(clean_venv: Path, tmp_path: Path) -> None:
    model = tiny_model()
    script = tmp_path / "engine.py"
    script.write_text(ENGINE)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", ELASTIC_KV_REGISTRY_DIR=str(tmp_path / "reg"))
    (tmp_path / "reg").mkdir(mode=0o700)
    procs = {  # both engines at once: a start-up is mostly one thread's work
        backend: subprocess.Popen(
            [str(clean_venv / "bin" / "python"), str(script), str(model), backend],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
            env=env,
        )
        for backend in ("native", "elastic")
    }
    try:
        outputs = {backend: proc.communicate(timeout=600) for backend, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    runs = {}
    for backend, (stdout, stderr) in outputs.items():
        assert procs[backend].returncode == 0, stderr[-4000:]
        line = next(x for x in stdout.splitlines() if x.startswith("@@"))
        runs[backend] = json.loads(line[2:])
    for path in runs["elastic"]["files"]:
        assert Path(path).resolve().is_relative_to(clean_venv.resolve()), path
    assert runs["elastic"]["info"] and runs["elastic"]["info"][0], "the elastic pool did not serve the worker"
    assert runs["elastic"]["tokens"] == runs["native"]["tokens"]


def test_the_serve_wheel_installs_its_console_script(clean_venv: Path, tmp_path: Path) -> None:
    # The script and its dependencies resolve from the clean venv; a config with an unknown key is refused
    # before any engine starts, with one line naming the key (exit status 2).
    config = tmp_path / "models.toml"
    config.write_text('[server]\nport = 8000\ncolour = "blue"\n')
    done = subprocess.run(
        [str(clean_venv / "bin" / "elastic-kv"), "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("elastic-kv: error:") and "colour" in line, line
