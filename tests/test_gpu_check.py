"""scripts/gpu_check.sh: the wheels it fetches for a GPU host are this repository's pinned versions, and
every bench run its steps make parses with that bench's own arguments."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.sh"


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_wheel_gpu_check_fetches_is_pinned_in_constraints():
    text = SCRIPT.read_text()
    wheels = re.search(r"WHEELS=\(([^)]*)\)", text, re.S).group(1).split()
    pinned = {_normal(line.split("==")[0]) for line in (REPO / "constraints.txt").read_text().splitlines()
              if "==" in line and not line.startswith("#")}
    assert wheels and not [w for w in wheels if _normal(w) not in pinned]
    # The engine's own third-party imports that a CUDA image with torch/transformers lacks.
    assert {"pydantic", "xgrammar", "jsonschema", "dill"} <= {_normal(w) for w in wheels}


def test_gpu_check_without_a_command_prints_its_usage():
    proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert "scripts/gpu_check.sh fetch" in proc.stdout and "scripts/gpu_check.sh run" in proc.stdout


def test_a_step_past_its_limit_is_cut_off_and_the_rest_still_run(tmp_path):
    # A lent GPU's minutes are few: one stuck step must not take the others' time. A stand-in
    # python hangs in the kernels benchmark and does everything else at once.
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\ncase "$*" in *kernels_vs_torch*) sleep 30 ;; esac\nexit 0\n')
    fake.chmod(0o755)
    out = tmp_path / "out"
    env = {"PATH": "/usr/bin:/bin", "PYTHON": str(fake), "STEP_LIMIT_kernels": "1"}
    proc = subprocess.run(["bash", str(SCRIPT), "run", str(out), "kernels", "tests"], capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "kernels: exit 124" in proc.stdout and "tests: exit 0" in proc.stdout
    log = (out / "gpu_check.log").read_text()
    assert "==== kernels: cut off at its 1s limit" in log and "==== tests: exit 0" in log


def test_server_env_takes_an_unpacked_tritonserver_and_lets_carried_packages_shadow_the_interpreters(monkeypatch,
                                                                                                     tmp_path):
    # gpu_check's serving step: tritonserver unpacked apart from any wheel (TRITON_HOME), and
    # carried packages (numpy < 2 for the stub) ahead of the host's own site-packages.
    import sysconfig

    from client.local_server import REPO_ROOT, server_env, triton_home

    home = tmp_path / "pytriton" / "tritonserver"
    monkeypatch.setenv("TRITON_HOME", str(home))
    monkeypatch.setenv("PYTHONPATH", "/tmp/serving-site")
    assert triton_home() == home
    env = server_env()
    assert str(tmp_path / "nvidia_pytriton.libs") in env["LD_LIBRARY_PATH"].split(":")
    path = env["PYTHONPATH"].split(":")
    assert path[0] == str(REPO_ROOT)
    assert path.index("/tmp/serving-site") < path.index(sysconfig.get_paths()["purelib"])


def test_the_serving_step_is_a_step():
    text = SCRIPT.read_text()
    assert "serving) step serving" in text and "[serving]=" in text
    # Its packages resolve against the pins; grpcio is the host's own.
    assert re.search(r"-c constraints\.txt", text) and "SERVING_SKIP=(grpcio)" in text


def test_a_serving_variant_can_be_the_frontends_worker_count():
    # SERVING_VARIANTS="frontend_workers=4": the frontend's --workers, not an LLM_ env setting.
    text = SCRIPT.read_text()
    branch = text[text.index('if [ "$key" = frontend_workers ]'):]
    assert "--frontend-workers $val" in branch.split("else")[0] and "LLM_${key^^}" in branch.split("fi")[0]


def _expand(text: str, values: dict[str, str]) -> str:
    """A line of the script with its shell words filled in: ${X:-default} -> values or default."""
    text = re.sub(r"\$\{(\w+)\^\^\}", lambda m: values[m.group(1)].upper(), text)
    text = re.sub(r"\$\{(\w+):-((?:[^{}]|\{[^{}]*\})*)\}", lambda m: values.get(m.group(1), _expand(m.group(2), values)), text)
    text = re.sub(r"\$\{?(\w+)\}?", lambda m: values[m.group(1)], text)
    return text.replace('"', "")


def _bench_commands() -> list[tuple[str, list[str]]]:
    """(module, argv) of every bench run the GPU steps make, with sample values for their variables."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    values = {"OUT": "/tmp/out", "py": "python", "1": "auto", "2": "128", "results": "/tmp/results", "unit": "2048",
              "SCRIPT": "gpu_check.sh"}
    commands = []
    for line in text.splitlines():
        for module, args in re.findall(r'-m (bench\.\w+) (.*?)(?:;;|$)', line):
            if module != "bench.serving_bench":
                commands.append((module, _expand(args, values).split()))
    # serving_bench: the serving() line, once with each SERVING_ARGS a step sets.
    base = re.search(r"-m bench\.serving_bench (.*)", text).group(1)
    variants = re.findall(r'SERVING_ARGS="(.*?)"', text)
    assert len(variants) >= 5, variants
    default = re.search(r"SERVING_VARIANTS:-([^}]*)\}", text).group(1).split() + ["frontend_workers=2"]
    for variant in default:
        key, val = variant.split("=")
        what = re.search(r'what="(--only engine,frontend[^"]*)"' if key == "frontend_workers"
                         else r'what="(--only engine,triton[^"]*)"', text).group(1)
        what = _expand(what, {"key": key, "val": val})
        for serving_args in [""] + variants:
            serving_args = _expand(serving_args, {**values, "what": what, "SERVING_ARGS": ""})
            args = _expand(base, {**values, "SERVING_ARGS": serving_args})
            commands.append(("bench.serving_bench", args.split()))
    return commands


def test_every_bench_run_of_the_gpu_steps_parses_with_its_modules_arguments():
    # A GPU session is a few minutes now and then: a flag renamed in a bench script and left in
    # gpu_check.sh would cost one of its runs. Each run's arguments go through its module's own
    # parser here (argparse's checks, and serving_bench's sections; engine and server settings
    # against the engine's names), stopped before it does anything.
    import json

    from backend.config import EngineConfig
    from backend.triton_io import unknown_llm_env

    commands = _bench_commands()
    modules = {m for m, _ in commands}
    assert {"bench.serving_bench", "bench.chunked_probe", "bench.decode_probe", "bench.prefix_probe"} <= modules
    for module, argv in commands:
        for flag, value in zip(argv, argv[1:]):
            if flag == "--engine-arg":
                assert value.split("=")[0] in EngineConfig.model_fields, (module, argv)
            if flag == "--server-env":
                key, _, val = value.partition("=")
                assert not unknown_llm_env({key: val}), (module, argv)
    driver = (
        "import argparse, json, runpy, sys\n"
        "class Parsed(Exception): pass\n"
        "original = argparse.ArgumentParser.parse_args\n"
        "def parse(self, args=None, namespace=None):\n"
        "    original(self, args, namespace)\n"
        "    raise Parsed\n"
        "argparse.ArgumentParser.parse_args = parse\n"
        "failed = []\n"
        "for module, argv in json.loads(sys.argv[1]):\n"
        "    sys.argv = [module, *argv]\n"
        "    try:\n"
        "        if module == 'bench.serving_bench':  # its own checks follow argparse's\n"
        "            argparse.ArgumentParser.parse_args = original\n"
        "            try:\n"
        "                import bench.serving_bench as sb; sb.parse_args(argv)\n"
        "            finally:\n"
        "                argparse.ArgumentParser.parse_args = parse\n"
        "            continue\n"
        "        runpy.run_module(module, run_name='__main__')\n"
        "        failed.append((module, argv, 'no parse_args'))\n"
        "    except Parsed:\n"
        "        pass\n"
        "    except SystemExit as e:\n"
        "        failed.append((module, argv, f'exit {e.code}'))\n"
        "print(json.dumps(failed))\n"
    )
    run = subprocess.run([str(REPO / ".venv" / "bin" / "python"), "-c", driver, json.dumps(commands)],
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    failed = json.loads(run.stdout.strip().splitlines()[-1])
    assert not failed, (failed, run.stderr[-3000:])


def test_every_test_file_the_gpu_steps_run_exists():
    named = set(re.findall(r"tests/test_\w+\.py", SCRIPT.read_text()))
    assert len(named) >= 10 and {"tests/test_engine.py", "tests/test_decode_graphs.py"} <= named
    assert not [f for f in named if not (REPO / f).is_file()]
