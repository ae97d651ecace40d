"""Cold against cached wall time of the Cora pipeline, and the Prefect overhead.

Starts a local Prefect server (database in a temp dir), runs ``retexo run configs/cora_gcn.yaml``
twice against a fresh store, and prints both wall times, their ratio (target: cached <= 20% of
cold), and the Prefect overhead = wall time minus the time spent inside task functions (task run
durations read back from the server).

    .venv/bin/python benchmarks/pipeline_cache.py [--set train.rounds=50 ...]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

from runner.launch import free_port

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def task_seconds(api: str, since: datetime) -> float:
    """Sum of the run times of the task runs that started after ``since``.

    A subflow call is also recorded as a task run of its parent flow, spanning the whole subflow;
    those wrapper task runs are left out so that no second is counted twice.
    """
    after = {"start_time": {"after_": since.isoformat()}}
    flows = httpx.post(f"{api}/flow_runs/filter", json={"flow_runs": after, "limit": 200}, timeout=30)
    flows.raise_for_status()
    wrappers = {run["parent_task_run_id"] for run in flows.json() if run["parent_task_run_id"]}
    tasks = httpx.post(f"{api}/task_runs/filter", json={"task_runs": after, "limit": 200}, timeout=30)
    tasks.raise_for_status()
    return sum(run["total_run_time"] for run in tasks.json() if run["id"] not in wrappers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "cora_gcn.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="retexo-cache-bench-") as tmp:
        port = free_port()
        api = f"http://127.0.0.1:{port}/api"
        env = {**os.environ, "PREFECT_HOME": f"{tmp}/prefect", "PREFECT_API_URL": api,
               "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        server = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            for _ in range(240):
                try:
                    if httpx.get(f"{api}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.5)
            command = [str(BIN / "retexo"), "run", str(args.config), "--store", f"{tmp}/store"]
            for item in args.overrides:
                command += ["--set", item]
            figures = {}
            for label in ("cold", "cached"):
                since = datetime.now(timezone.utc)
                started = time.perf_counter()
                subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                wall = time.perf_counter() - started
                inside = task_seconds(api, since)
                figures[label] = (wall, inside)
                print(f"{label:>6}: wall {wall:7.1f} s, inside task functions {inside:7.1f} s, "
                      f"Prefect and process overhead {wall - inside:6.1f} s", flush=True)
            ratio = figures["cached"][0] / figures["cold"][0]
            print(f"cached / cold wall time: {ratio:.1%} (target <= 20%)")
        finally:
            os.killpg(server.pid, 15)
            server.wait(timeout=30)


if __name__ == "__main__":
    main()
