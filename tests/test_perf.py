"""``python3 -m tests.perf``, the research benchmarks: the quick run end to end (embedded Redis, the generated tiny
models, worker and gateway subprocesses), its outputs and its pieces.

No wall-clock thresholds: the numbers depend on the machine; only their presence and consistency are held.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from tests.perf import paths, report, runs, suite
from tests.perf.results import BenchResult
from tests.support import quick_run_fixtures

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(600)]  # a research run: a bound, not a target

ROOT = Path(__file__).resolve().parents[1]


def _args(out: Path, **over: Any) -> argparse.Namespace:
    ns = argparse.Namespace(out=str(out), quick=True, sizes=None, concurrency=None, max_tokens=None)
    for k, v in over.items():
        setattr(ns, k, v)
    return ns


# One quick research run (tiny models, N in {1, 4}) shared by the tests below; no re-exec, whatever BLAS runs.
quick_run, results = quick_run_fixtures(lambda out: suite.run_suite(_args(out), reexec=False))


def test_the_quick_run_writes_the_three_files_and_prints_the_table(quick_run: tuple[Path, int, str]) -> None:
    out, code, stdout = quick_run
    assert code == 0
    assert (out / "results.json").stat().st_size > 0
    assert (out / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "results.md").read_text()
    for section in ("## Throughput and TTFT", "## TTFT at N=1", "## Cancel", "## Redis round trips",
                    "## Image jobs (tiny-vl: a generated qwen2_vl, mlx-vlm)", "## Enqueue rate", "## Targets"):
        assert section in md
    assert "| size | N | raw tok/s | queue tok/s | serial tok/s |" in stdout
    assert "| size | N | raw tok/s | engine tok/s | queue tok/s | engine/raw | queue/engine |" in stdout
    assert md.startswith("# mlxq research bench") and md.strip() in stdout


def test_results_record_the_machine_and_the_quick_config(results: dict[str, Any]) -> None:
    m = results["machine"]
    assert m["blas"] and m["mlx"] and m["mlx_lm"] and m["date"] and m["cpus"] >= 1
    assert m["probe_ms_start"] > 0 and m["probe_ms_end"] > 0
    cfg = results["config"]
    assert cfg["quick"] is True
    assert cfg["sizes"] == ["tiny"]
    assert cfg["concurrency"] == [1, 4]
    assert results["seconds"] > 0


def test_every_path_and_n_has_throughput_and_consistent_ratios(results: dict[str, Any]) -> None:
    (size,) = results["sizes"]
    assert size["size"] == "tiny"
    assert [r["n"] for r in size["rows"]] == [1, 4]
    for row in size["rows"]:
        for path in ("raw", "engine", "queue", "serial"):
            p = row[path]
            assert p["tok_s"] > 0 and p["tokens"] > 0 and p["seconds"] > 0
            assert p["tok_s"] == pytest.approx(p["tokens"] / p["seconds"])
            assert p["tok_s"] == max(p["runs_tok_s"])
            assert p["ttft_samples"] >= row["n"] and 0 < p["ttft_p50_ms"] <= p["ttft_p99_ms"]
        # Greedy, no EOS from the random model: every request runs to max_tokens on every path.
        assert row["raw"]["tokens"] == row["queue"]["tokens"] == row["n"] * results["config"]["max_tokens"]
        assert row["engine"]["tokens"] == row["raw"]["tokens"]
        assert row["engine_over_raw_paired"] == pytest.approx(row["engine"]["tok_s"] / row["raw"]["tok_s"])  # 1 run
        assert row["queue_over_engine_paired"] == pytest.approx(row["queue"]["tok_s"] / row["engine"]["tok_s"])
        assert row["queue_over_raw"] == pytest.approx(row["queue"]["tok_s"] / row["raw"]["tok_s"])
        assert row["queue_over_serial"] == pytest.approx(row["queue"]["tok_s"] / row["serial"]["tok_s"])
        assert row["added_ttft_p50_ms"] == pytest.approx(row["queue"]["ttft_p50_ms"] - row["raw"]["ttft_p50_ms"])
        assert row["added_ttft_p99_ms"] == pytest.approx(row["queue"]["ttft_p99_ms"] - row["raw"]["ttft_p99_ms"])


def test_ttft_probe_cancel_round_trips_and_enqueue_are_measured(results: dict[str, Any]) -> None:
    (size,) = results["sizes"]
    probe = size["ttft_n1"]
    assert probe["samples"] == results["config"]["ttft_probes"]
    assert probe["added_p50_ms"] == pytest.approx(probe["queue_p50_ms"] - probe["raw_p50_ms"])
    cancel = size["cancel"]
    assert cancel["jobs"] == 4 and cancel["cancelled"] >= 1
    assert 0 < cancel["p50_ms"] <= cancel["p99_ms"] <= cancel["max_ms"]
    assert cancel["budget_ms"] == pytest.approx(cancel["step_ms_mean"] + 50)
    trips = size["round_trips"]
    for worker in ("queue", "serial"):
        stats = trips[f"{worker}_worker"]
        assert stats["engine_steps"] > 0 and stats["redis_writes"] > 0 and stats["events"] > 0
        assert stats["other"].get("dropped", 0) == 0
        assert trips[f"{worker}_writes_per_step"] == pytest.approx(stats["redis_writes"] / stats["engine_steps"])
        assert trips[f"{worker}_writes_per_step"] <= 1.0
    assert trips["commandstats"]["publish"] > 0 and trips["commandstats"]["xadd"] > 0
    assert trips["commandstats"]["total"] >= trips["commandstats"]["publish"]
    for path in ("raw", "queue", "serial"):
        cpu = size["cpu"][path]
        assert cpu["wall_s"] > 0 and cpu["bench_s"] >= 0 and cpu["redis_s"] >= 0
        assert (cpu["worker_s"] > 0) is (path != "raw")
    enq = results["enqueue"]
    assert enq["jobs"] == 200 and enq["sequential_jobs_s"] > 0 and enq["gathered_jobs_s"] > 0


def test_the_gateway_path_is_measured_beside_the_client_on_the_same_worker(results: dict[str, Any],
                                                                         quick_run: tuple[Path, int, str]) -> None:
    (size,) = results["sizes"]
    gateway = size["gateway"]
    assert [r["n"] for r in gateway["rows"]] == [1, 4]
    for row in gateway["rows"]:
        for path in ("queue", "gateway"):
            p = row[path]
            assert p["tok_s"] == pytest.approx(p["tokens"] / p["seconds"]) and p["tok_s"] == max(p["runs_tok_s"])
            assert p["ttft_samples"] >= row["n"] and 0 < p["ttft_p50_ms"] <= p["ttft_p99_ms"]
        # Greedy, no EOS from the random model: both run every request to max_tokens.
        assert row["gateway"]["tokens"] == row["queue"]["tokens"] == row["n"] * results["config"]["max_tokens"]
        assert row["gateway_over_queue"] == pytest.approx(row["gateway"]["tok_s"] / row["queue"]["tok_s"])
        assert row["gateway_over_queue_paired"] == pytest.approx(row["gateway_over_queue"])  # one pair each
        assert row["added_ttft_p50_ms"] == pytest.approx(row["gateway"]["ttft_p50_ms"] - row["queue"]["ttft_p50_ms"])
    probe = gateway["probe"]
    assert probe["samples"] == results["config"]["ttft_probes"]
    assert probe["added_p50_ms"] == pytest.approx(probe["gateway_p50_ms"] - probe["queue_p50_ms"])
    # CPU is read in clock ticks (10 ms): two short runs may show none.
    assert gateway["gateway_s"] >= 0 and gateway["cpu_gateway"]["wall_s"] > 0 and gateway["cpu_queue"]["wall_s"] > 0
    targets = {t["name"]: t for t in results["targets"]}
    ttft = targets["gateway-added TTFT p50 tiny N=1"]
    assert ttft["value"] == probe["added_p50_ms"] and ttft["passed"] is (ttft["value"] <= 5.0)
    ratio = targets["gateway/queue tiny N=4 (median of pairs)"]
    assert ratio["value"] == gateway["rows"][1]["gateway_over_queue_paired"]
    out, _, stdout = quick_run
    assert "## HTTP gateway" in stdout and (out / "logs" / "gateway-tiny.log").exists()


def test_targets_are_judged_from_the_reported_numbers(results: dict[str, Any]) -> None:
    targets = {t["name"]: t for t in results["targets"]}
    (size,) = results["sizes"]
    rt = targets["round trips per step tiny"]
    assert rt["value"] == size["round_trips"]["queue_writes_per_step"] and rt["passed"] is (rt["value"] <= 1)
    q = targets["queue/raw tiny N=4 (best runs)"]
    assert q["value"] == size["rows"][1]["queue_over_raw"] and q["passed"] is (q["value"] >= 0.8)
    paired = targets["queue/raw tiny N=4 (median of pairs)"]
    assert paired["value"] == size["rows"][1]["queue_over_raw_paired"] > 0
    assert paired["passed"] is (paired["value"] >= 0.8)
    enq = targets["enqueue jobs/s (sequential awaits)"]
    assert enq["value"] == results["enqueue"]["sequential_jobs_s"]
    assert all(isinstance(t["passed"], bool) for t in results["targets"])
    tenants = results["tenants"]  # issue 37's phase, in the same table
    assert targets["tenants max-running 2 on two workers: most running (tiny)"]["value"] == tenants["most_running"]
    iso = targets["tenants isolation: B's queue wait p50 flooded / alone (tiny)"]
    assert iso["passed"] is (iso["value"] <= 2)


def test_image_jobs_are_measured_on_mlx_vlm_and_through_the_queue(results: dict[str, Any]) -> None:
    (vision,), cfg = results["vision"], results["config"]  # the small qwen2_vl only beside the small text model
    assert vision["name"] == "tiny-vl" and vision["model"].endswith("tiny-vl-v1")
    assert cfg["vision_concurrency"] == [1, 2]
    assert [r["n"] for r in vision["rows"]] == [1, 2]
    for row in vision["rows"]:
        for path in ("raw", "engine", "queue"):
            p = row[path]
            assert p["tok_s"] == pytest.approx(p["tokens"] / p["seconds"]) and p["tok_s"] == max(p["runs_tok_s"])
            assert p["tokens"] == row["n"] * cfg["max_tokens"]  # every image job runs to max_tokens on every path
            runs = cfg["tiny_repeats"]  # the tiny qwen2_vl's pairs (BenchConfig.vision_repeats_for)
            assert len(p["runs_tok_s"]) == runs and p["ttft_samples"] == row["n"] * runs
        assert row["queue_over_raw"] == pytest.approx(row["queue"]["tok_s"] / row["raw"]["tok_s"])
        assert row["engine_over_raw_paired"] == pytest.approx(row["engine"]["tok_s"] / row["raw"]["tok_s"])  # one run
        assert row["queue_over_engine_paired"] == pytest.approx(row["queue"]["tok_s"] / row["engine"]["tok_s"])
    for row in vision["text_rows"]:
        assert row["vlm"]["tokens"] == row["lm"]["tokens"] == row["n"] * cfg["max_tokens"]
        assert row["vlm_over_lm_paired"] == pytest.approx(row["vlm"]["tok_s"] / row["lm"]["tok_s"])  # one run
    mixed = vision["mixed"]
    assert mixed["n"] == 2 and mixed["one_batch"]["tokens"] == mixed["split"]["tokens"] == 2 * cfg["max_tokens"]
    targets = {t["name"]: t for t in results["targets"]}
    t = targets["queue/raw images tiny-vl N=2 (median of pairs)"]  # the tiny model's floor (the small one: 0.9)
    assert t["value"] == vision["rows"][1]["queue_over_raw_paired"] and t["passed"] is (t["value"] >= 0.8)


# --- fast: configuration, the re-exec, the stats line ----------------------------------------------
def test_config_defaults_quick_and_overrides(tmp_path: Path) -> None:
    full = runs.BenchConfig.from_args(_args(tmp_path, quick=False))
    assert (full.sizes, full.concurrency, full.max_tokens, full.capacity) == (("tiny", "small"), (1, 8, 32, 64), 64, 64)
    assert (full.repeats_for("tiny"), full.repeats_for("small")) == (15, 7)  # tiny runs are short: more pairs
    over = runs.BenchConfig.from_args(_args(tmp_path, sizes="small", concurrency="16,2,2", max_tokens=5))
    assert (over.sizes, over.concurrency, over.max_tokens, over.quick) == (("small",), (2, 16), 5, True)


def test_bad_concurrency_is_exit_code_2(tmp_path: Path) -> None:
    assert suite.run_suite(_args(tmp_path, concurrency="0"), reexec=False) == 2


def test_scrape_stats_reads_the_workers_counters_from_its_metrics_endpoint() -> None:
    import http.server
    import threading

    from prometheus_client import CollectorRegistry, Counter, generate_latest

    registry = CollectorRegistry()
    Counter("mlxq:engine_steps", "", ["model_name"], registry=registry).labels("tiny").inc(10)
    Counter("mlxq:redis_writes", "", registry=registry).inc(8)
    Counter("mlxq:events", "", registry=registry).inc(30)
    Counter("mlxq:reaped", "", registry=registry).inc(1)
    body = generate_latest(registry)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        stats = paths.scrape_stats(f"http://127.0.0.1:{server.server_port}/metrics")
    finally:
        server.shutdown()
        server.server_close()
    assert stats == runs.WorkerStats(10, 8, 30, {"reaped": 1})
    assert stats.writes_per_step == pytest.approx(0.8)
    assert paths.scrape_stats(f"http://127.0.0.1:{server.server_port}/metrics") is None  # nobody answers


def test_status_and_metrics_were_sampled_live_during_the_queue_run(quick_run: tuple[Path, int, str]) -> None:
    out, _, _ = quick_run
    status = (out / "live-status.txt").read_text()
    row = next(ln for ln in status.splitlines() if ln.startswith("tiny "))
    assert int(row.split()[5]) > 0  # RUNNING: sequences in the batch when it was read
    metrics = (out / "live-metrics.txt").read_text()
    running = next(ln for ln in metrics.splitlines() if ln.startswith('mlxq:num_requests_running{model_name="tiny"}'))
    assert float(running.split()[-1]) > 0


def test_blas_threads_are_chosen_only_where_openblas_runs(results: dict[str, Any]) -> None:
    (size,) = results["sizes"]
    if results["machine"]["blas"].startswith("openblas"):
        threads = size["blas_threads"]
        assert threads["chosen"] in {int(k) for k in threads["raw_tok_s"]}
        assert all(v and min(v) > 0 for v in threads["raw_tok_s"].values())
    else:
        assert size["blas_threads"] is None  # nothing to tune: the workers keep their default


def test_pick_threads_takes_more_threads_only_when_they_clearly_pay() -> None:
    assert suite.pick_threads({1: [100.0, 90.0, 95.0], 2: [80.0, 120.0, 85.0]}) == 1  # 95 against 85
    assert suite.pick_threads({1: [50.0, 60.0], 2: [70.0, 71.0]}) == 2
    assert suite.pick_threads({1: [70.0], 2: [70.0]}) == 1
    assert suite.pick_threads({1: [100.0], 2: [104.0]}) == 1  # within 5 %: noise on this machine


def test_the_blas_section_lists_each_sizes_runs() -> None:
    threads = runs.BlasThreads(1, {1: [11556.0, 12340.0], 2: [9151.0, 9885.0]})
    result = SimpleNamespace(sizes=[SimpleNamespace(size="tiny", blas_threads=threads)],
                             config=SimpleNamespace(capacity=32))
    md = "\n".join(report.md_blas(cast(BenchResult, result)))
    assert "## OpenBLAS threads" in md and "raw at N=32" in md
    assert "| tiny | 1 | 1: 11556.0, 12340.0; 2: 9151.0, 9885.0 |" in md


def test_two_engines_in_one_worker_process_were_timed_side_by_side(results: dict[str, Any],
                                                                   quick_run: tuple[Path, int, str]) -> None:
    models = results["models"]
    assert len(models["sequential_s"]) == len(models["concurrent_s"]) == 1
    assert all(s > 0 for s in models["sequential_s"] + models["concurrent_s"])
    assert models["speedup"] == pytest.approx(models["sequential_s"][0] / models["concurrent_s"][0])
    assert all(c > 0 for c in models["concurrent_cores"])  # the worker's CPU over the run was read
    for pair in ("threads", "processes"):  # the same pair without the queue, timed
        assert len(models[pair]["sequential_s"]) == len(models[pair]["concurrent_s"]) == 1
        assert all(s > 0 for s in models[pair]["sequential_s"] + models[pair]["concurrent_s"])
    (target,) = [t for t in results["targets"] if t["name"].startswith("two models in one process")]
    threads = models["threads"]  # mlx-lm alone as two threads: what one process allows (one pair here)
    bound = threads["sequential_s"][0] / threads["concurrent_s"][0]
    assert target["value"] == round(models["speedup"], 3)
    assert target["passed"] is (models["speedup"] >= 1.2 or models["speedup"] >= 0.95 * bound)
    out, _, _ = quick_run
    assert "## Two models in one worker process" in (out / "results.md").read_text()
    assert "| two processes |" in (out / "results.md").read_text()


def test_scheduling_features_are_measured_on_the_engine(results: dict[str, Any]) -> None:
    (size,) = results["sizes"]
    sch, probes = size["scheduling"], results["config"]["scheduling_probes"]
    p = sch["prefix"]
    assert len(p["cold_ms"]) == len(p["warm_ms"]) == probes and min(p["cold_ms"] + p["warm_ms"]) > 0
    assert p["hits"] == probes and p["tokens_saved"] >= probes * p["system_tokens"] > 0  # each cached probe hit
    assert p["speedup"] == pytest.approx(p["cold_p50_ms"] / p["warm_p50_ms"])
    o = sch["oversubscribed"]
    assert o["jobs"] == 3 * o["capacity"] and o["demand_bytes"] // 3 == o["headroom_bytes"]
    assert 0 < o["peak_kv_bytes"] <= o["headroom_bytes"]  # never over, whatever the machine
    assert o["completed"] == o["expected"] == o["jobs"] * results["config"]["scheduling_repeats"]
    assert 1 <= o["most_running"] <= o["capacity"] and o["peak_rss_bytes"] > 0 and o["mlx_peak_bytes"] > 0
    assert o["best_ratio"] == pytest.approx(max(o["tok_s"]) / max(o["unlimited_tok_s"]))
    q = sch["priority"]
    assert len(q["ttft_ms"]) == probes and 1 <= q["preemptions"] <= probes
    assert q["budget_ms"] == pytest.approx(q["idle_ttft_ms"] + 2 * q["step_ms"])
    targets = {t["name"]: t for t in results["targets"]}
    peak = targets["over-subscribed peak KV / headroom tiny"]
    assert peak["value"] == o["peak_kv_bytes"] / o["headroom_bytes"] and peak["passed"] is True
    assert "prefix-cache TTFT speedup tiny" not in targets  # a target of the small model
    assert "priority TTFT / (prefill + 2 decode steps) tiny" in targets


def test_one_documented_command_runs_it_and_pytest_collects_none_of_it() -> None:
    done = subprocess.run([sys.executable, "-m", "tests.perf", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    for flag in ("--out", "--quick", "--sizes", "--concurrency", "--max-tokens"):
        assert flag in done.stdout
    assert not [f.name for f in (ROOT / "tests" / "perf").glob("*.py") if f.name.startswith("test")]
