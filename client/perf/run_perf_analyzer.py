"""perf_analyzer concurrency sweep in streaming (decoupled) mode against a running tritonserver.

    python -m client.perf.run_perf_analyzer [--model ensemble|llm] [--url localhost:8001]
        [--metrics-url localhost:8002/metrics] [--input-data client/perf/ensemble_text.json]
        [--concurrency 1 8 64] [--request-count N] [--out DIR] [--install]

For each concurrency level it runs

    perf_analyzer -m MODEL -u URL -i grpc --streaming --input-data FILE
        --concurrency-range C:C --measurement-mode count_windows --measurement-request-count N
        -f DIR/perf_c{C}.csv --verbose-csv --profile-export-file DIR/profile_c{C}.json

(one run per level, so the levels can be any list such as 1 8 64; `--concurrency-range
1:64:...` only steps linearly), then merges the CSVs into DIR/perf_analyzer.csv and writes
DIR/summary.json with, per level, what perf_analyzer reports (requests/s, responses/s, its
latency percentiles) and what its profile export gives per request: output tokens/s, time to
first response (TTFT) p50/p99 and inter-response latency p50/p99.

perf_analyzer ships in `tritonclient[all]==2.51.0` (`.venv/bin/perf_analyzer`) and needs two
shared libraries: `libb64.so.0d` (Debian package libb64-0d) and `libcudart.so.12` (PyPI
nvidia-cuda-runtime-cu12, found through LD_LIBRARY_PATH), even on a host without a GPU.
`--install` (or run_perf_analyzer.sh, or scripts/setup.sh) installs what is missing: the first
with pip, the second unpacked from Debian's package into the environment (LOCAL_LIB_DIR).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any, Optional, Sequence

PERF_DIR = Path(__file__).resolve().parent
REPO_ROOT = PERF_DIR.parents[1]


# ------------------------------------------------------------------ the binary and its libraries
def _site_dirs() -> list[Path]:
    dirs = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *sys.path]
    out: list[Path] = []
    for d in dirs:
        if d and Path(d).is_dir() and Path(d) not in out:
            out.append(Path(d))
    return out


def perf_analyzer_binary() -> Path:
    """$PERF_ANALYZER, else the one tritonclient installed beside this interpreter, else PATH."""
    env = os.environ.get("PERF_ANALYZER")
    if env:
        return Path(env)
    exe = Path(sys.executable).parent / "perf_analyzer"
    if exe.exists():
        return exe
    found = shutil.which("perf_analyzer")
    if found:
        return Path(found)
    for site in _site_dirs():  # pip install --target DIR puts it in DIR/bin
        if (site / "bin" / "perf_analyzer").exists():
            return site / "bin" / "perf_analyzer"
    raise FileNotFoundError("perf_analyzer not found: pip install 'tritonclient[all]==2.51.0'")


def _cudart_dir() -> Optional[Path]:
    for base in _site_dirs():
        lib = base / "nvidia" / "cuda_runtime" / "lib"
        if (lib / "libcudart.so.12").exists():
            return lib
    return None


# libb64 unpacked from Debian's package into the environment itself (no root, nothing system-wide).
LOCAL_LIB_DIR = Path(sys.prefix) / "lib" / "perf_analyzer"


def perf_env() -> dict[str, str]:
    env = dict(os.environ)
    dirs = [str(d) for d in (_cudart_dir(), LOCAL_LIB_DIR) if d is not None and d.is_dir()]
    if dirs:
        env["LD_LIBRARY_PATH"] = ":".join([*dirs, *filter(None, [env.get("LD_LIBRARY_PATH")])])
    return env


def missing_libraries() -> list[str]:
    """Shared libraries perf_analyzer cannot load (from ldd), e.g. ['libb64.so.0d']."""
    try:
        out = subprocess.run(["ldd", str(perf_analyzer_binary())], env=perf_env(), capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.split()[0] for line in out.splitlines() if "not found" in line]


def ensure_installed(install: bool = False) -> None:
    """Check (and with install=True, install) libb64-0d and nvidia-cuda-runtime-cu12."""
    missing = missing_libraries()
    if not missing:
        return
    if not install:
        raise RuntimeError(
            f"perf_analyzer cannot load {', '.join(missing)}: run with --install (or scripts/setup.sh), "
            "or `apt-get install -y libb64-0d` and `pip install nvidia-cuda-runtime-cu12`"
        )
    if any(m.startswith("libcudart") for m in missing):
        # at constraints.txt's pin, as everything else is installed
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-cache-dir", "nvidia-cuda-runtime-cu12",
                        "-c", str(REPO_ROOT / "constraints.txt")], check=True)
    if any(m.startswith("libb64") for m in missing):
        _unpack_libb64()
    still = missing_libraries()
    if still:
        raise RuntimeError(f"perf_analyzer still cannot load {', '.join(still)}")


def _unpack_libb64() -> None:
    """Debian's libb64-0d, downloaded and unpacked into LOCAL_LIB_DIR: `apt-get download` and
    `dpkg-deb -x` need no root, and the host is left as it was. Where apt has no package lists
    yet (a fresh container), they are fetched first when we are root."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        def download() -> bool:
            return subprocess.run(["apt-get", "download", "libb64-0d"], cwd=tmp, capture_output=True).returncode == 0

        downloaded = download()
        if not downloaded and os.geteuid() == 0:
            subprocess.run(["apt-get", "update", "-qq"], capture_output=True)
            downloaded = download()
        if not downloaded:
            raise RuntimeError("could not download Debian's libb64-0d (apt-get download libb64-0d) for perf_analyzer")
        deb = next(Path(tmp).glob("libb64-0d_*.deb"))
        subprocess.run(["dpkg-deb", "-x", str(deb), str(Path(tmp) / "root")], check=True)
        found = sorted((Path(tmp) / "root").rglob("libb64.so.0d*"))
        if not found:
            raise RuntimeError(f"{deb.name} holds no libb64.so.0d")
        LOCAL_LIB_DIR.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(found[0], LOCAL_LIB_DIR / "libb64.so.0d")


# ------------------------------------------------------------------ running
def command(model: str, url: str, input_data: Path, concurrency: int, request_count: int, out_dir: Path,
            metrics_url: Optional[str] = None, extra: Sequence[str] = ()) -> list[str]:
    cmd = [
        str(perf_analyzer_binary()),
        "-m", model,
        "-u", url,
        "-i", "grpc",
        "--streaming",
        "--input-data", str(input_data),
        "--concurrency-range", f"{concurrency}:{concurrency}",
        "--measurement-mode", "count_windows",
        "--measurement-request-count", str(request_count),
        # Generation requests are long and of mixed length: windows differ more than the default
        # 10% while the server is perfectly steady, so accept any three windows.
        "--stability-percentage", "999",
        "--max-trials", "3",
        "-f", str(out_dir / f"perf_c{concurrency}.csv"),
        "--verbose-csv",
        "--profile-export-file", str(out_dir / f"profile_c{concurrency}.json"),
    ]
    if metrics_url:
        cmd += ["--collect-metrics", "--metrics-url", metrics_url]
    return cmd + list(extra)


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """The q-th percentile (0-100), linear between the nearest ranks; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _num_tokens(outputs: Any) -> int:
    if not isinstance(outputs, dict):
        return 0
    ids = outputs.get("output_ids")
    if ids is None or ids == "":
        return 0
    return len(ids) if isinstance(ids, list) else 1


def summarize_profile(path: Path) -> dict[str, Any]:
    """Per-request figures from a perf_analyzer profile export (timestamps in ns)."""
    data = json.loads(path.read_text())
    out: dict[str, Any] = {}
    for exp in data.get("experiments", []):
        reqs = exp.get("requests", [])
        ttft, itl, tokens, starts, ends = [], [], 0, [], []
        for r in reqs:
            ts = r.get("response_timestamps") or []
            outputs = r.get("response_outputs") or []
            counts = [_num_tokens(o) for o in outputs] if outputs else [1] * len(ts)
            # Only responses that carry tokens (not the empty final one) count.
            token_ts = [t for t, c in zip(ts, counts) if c > 0]
            if not token_ts:
                continue
            starts.append(r["timestamp"])
            ends.append(ts[-1])
            tokens += sum(counts)
            ttft.append((token_ts[0] - r["timestamp"]) / 1e6)
            itl.extend((b - a) / 1e6 for a, b in zip(token_ts, token_ts[1:]))
        span = (max(ends) - min(starts)) / 1e9 if starts else 0.0
        level = exp.get("experiment", {}).get("value")
        out[str(level)] = {
            "requests": len(starts),
            "output_tokens": tokens,
            "output_tok_s": tokens / span if span > 0 else None,
            "ttft_ms_p50": percentile(ttft, 50),
            "ttft_ms_p99": percentile(ttft, 99),
            "itl_ms_p50": percentile(itl, 50),
            "itl_ms_p99": percentile(itl, 99),
            "mean_itl_ms": statistics.fmean(itl) if itl else None,
        }
    return out


def failure_text(output: str, limit: int = 2000) -> str:
    """What a failed perf_analyzer run says went wrong: its `Error:` lines first (it prints its
    usage text after them, which alone filled the last 2000 characters; QA), then the tail."""
    errors = "\n".join(line for line in output.splitlines() if line.lstrip().lower().startswith("error"))
    if not errors:
        return output[-limit:]
    head = errors[: limit // 2] + "\n...\n"
    return head + output[len(head) - limit :]


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def sweep(
    model: str = "ensemble",
    url: str = "localhost:8001",
    input_data: Optional[Path] = None,
    concurrency: Sequence[int] = (1, 8, 64),
    out_dir: Path = Path("perf_results"),
    request_count: Optional[int] = None,
    metrics_url: Optional[str] = None,
    timeout_s: float = 1800.0,
    extra: Sequence[str] = (),
    keep_profiles: bool = True,
    log=print,
) -> dict[str, Any]:
    """Run the sweep; returns (and writes to out_dir/summary.json) the merged results."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # A rerun into the same directory replaces what a run writes there: perf_analyzer refuses a
    # --profile-export-file that exists (every level failed), and a stale merged csv sat beside a
    # summary that said nothing measured.
    for stale in [*out_dir.glob("perf_c*.csv"), *out_dir.glob("perf_c*.log"), *out_dir.glob("profile_c*.json"),
                  out_dir / "perf_analyzer.csv", out_dir / "summary.json"]:
        stale.unlink(missing_ok=True)
    concurrency = list(dict.fromkeys(concurrency))  # a level twice would overwrite its own files
    input_data = Path(input_data or PERF_DIR / ("ensemble_text.json" if model == "ensemble" else "llm_ids.json"))
    rows: list[dict[str, str]] = []
    summary: dict[str, Any] = {"model": model, "url": url, "input_data": str(input_data), "out": str(out_dir),
                               "levels": {}}
    for c in concurrency:
        n = request_count or max(2 * c, 16)
        cmd = command(model, url, input_data, c, n, out_dir, metrics_url, extra)
        log(f"[perf_analyzer] concurrency {c}: {' '.join(cmd)}")
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=perf_env(), capture_output=True, text=True, timeout=timeout_s)
        (out_dir / f"perf_c{c}.log").write_text(proc.stdout + proc.stderr)
        level: dict[str, Any] = {"returncode": proc.returncode, "wall_s": time.perf_counter() - t0}
        csv_path = out_dir / f"perf_c{c}.csv"
        if proc.returncode != 0 or not csv_path.exists():
            level["error"] = failure_text(proc.stdout + proc.stderr)
            log(f"[perf_analyzer] concurrency {c} failed (rc={proc.returncode}); see {out_dir / f'perf_c{c}.log'}")
        else:
            got = read_csv(csv_path)
            rows.extend(got)
            if got:
                r = got[0]
                level["perf_analyzer"] = {
                    "requests_s": float(r["Inferences/Second"]),
                    "responses_s": float(r.get("Response Throughput") or 0) or None,
                    "latency_us_p50": float(r["p50 latency"]),
                    "latency_us_p99": float(r["p99 latency"]),
                    "latency_us_avg": float(r["Avg latency"]),
                }
            profile = out_dir / f"profile_c{c}.json"
            if profile.exists():
                level["profile"] = summarize_profile(profile).get(str(c))
                if not keep_profiles:
                    profile.unlink()
        summary["levels"][str(c)] = level
    if rows:
        fields: list[str] = []
        for r in rows:
            fields += [k for k in r if k not in fields]
        with open(out_dir / "perf_analyzer.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(rows)
        summary["csv"] = str(out_dir / "perf_analyzer.csv")
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def print_summary(summary: dict[str, Any]) -> None:
    print(f"{'conc':>5} {'req/s':>8} {'tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}  (ms)")
    for c, level in summary["levels"].items():
        pa, pr = level.get("perf_analyzer") or {}, level.get("profile") or {}
        if not pa:
            print(f"{c:>5}  failed: see {Path(summary['out']) / f'perf_c{c}.log'}")
            continue

        def f(v: Any, w: int, p: int = 1) -> str:
            return f"{v:>{w}.{p}f}" if isinstance(v, (int, float)) else f"{'-':>{w}}"

        print(f"{c:>5} {f(pa['requests_s'], 8, 2)} {f(pr.get('output_tok_s'), 9)} {f(pr.get('ttft_ms_p50'), 9)} "
              f"{f(pr.get('ttft_ms_p99'), 9)} {f(pr.get('itl_ms_p50'), 8, 2)} {f(pr.get('itl_ms_p99'), 8, 2)}")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="ensemble", choices=["ensemble", "llm"])
    ap.add_argument("--url", default="localhost:8001", help="Triton gRPC host:port")
    ap.add_argument("--metrics-url", default=None, help="e.g. localhost:8002/metrics: perf_analyzer's --collect-metrics (its GPU columns in the csv; "
                         "empty on a CPU host)")
    ap.add_argument("--input-data", type=Path, default=None,
                    help="default: client/perf/ensemble_text.json (ensemble) or client/perf/llm_ids.json (llm)")
    ap.add_argument("--concurrency", type=_positive, nargs="+", default=[1, 8, 64])
    ap.add_argument("--request-count", type=_positive, default=None,
                    help="requests per measurement window (default max(2*concurrency, 16))")
    ap.add_argument("--out", type=Path, default=None,
                    help="default: perf_results/<model>-<timestamp>; a rerun into one replaces the files a run writes")
    ap.add_argument("--install", action="store_true", help="install libb64-0d / nvidia-cuda-runtime-cu12 if missing")
    ap.add_argument("extra", nargs="*", help="after --: more perf_analyzer arguments")
    args = ap.parse_args(argv)
    out = args.out or Path("perf_results") / f"{args.model}-{time.strftime('%Y%m%d-%H%M%S')}"
    if out.exists() and not out.is_dir():
        ap.error(f"--out {out} is a file, not a directory")
    try:
        binary = perf_analyzer_binary()
        if not binary.is_file():
            raise FileNotFoundError(f"perf_analyzer not found at {binary} ($PERF_ANALYZER)")
        ensure_installed(args.install)
    except (FileNotFoundError, RuntimeError, subprocess.CalledProcessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    summary = sweep(args.model, args.url, args.input_data, args.concurrency, out, args.request_count,
                    args.metrics_url, extra=args.extra)
    print_summary(summary)
    # The merged CSV exists only when some level measured; the summary always (errors included).
    report = f"report: {summary['csv']}  " if "csv" in summary else "no report (every level failed)  "
    print(f"{report}summary: {out / 'summary.json'}")
    return 0 if all("error" not in lv for lv in summary["levels"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
