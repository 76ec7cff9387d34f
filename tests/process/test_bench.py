"""The benchmark harness end to end on tiny settings: structure and zero errors, never timings.

Starts its own broker (demo mlp, one cpu worker) with the shared BrokerProc on a short ipc path,
runs `tgw-bench load` in closed and open loop for about a second each (and once in the old form
without a subcommand), checks the JSON it writes, and stops the broker by PID (exit status 0,
nothing left in /dev/shm). The transport echo and the in-process floor run for a fraction of a
second; the comparison's row logic is checked on synthetic rows, wrk's output parser on canned
output, the HTTP fallback generator against a stub server.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import tempfile

import pytest

from tgw.bench import cli
from tgw.bench.harness import comparison, report
from tgw.bench.harness.baselines import EchoServer, floor_row, run_floors
from tgw.bench.harness.loadgen import LoadSpec, _Recorder, _run_one
from tgw.bench.harness.measure import loadgen_drive, measure, stats_diff
from tgw.bench.harness.targets import HEADER_LENGTH, CallError, HttpTarget, ZmqEchoTarget, make_inputs, v2_body
from tgw.bench.harness.wrk import parse_wrk, wrk_lua
from tgw.shm.segment import list_segments
from tgw.testing.child import BrokerProc
from tgw.testing.demo import demo_models, tgw_config


@pytest.fixture(scope="module")
def bench_dir():
    d = tempfile.mkdtemp(prefix="tgwbt-", dir="/tmp")  # ipc paths must stay under 107 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def models(bench_dir):
    return demo_models(os.path.join(bench_dir, "models"))


@pytest.fixture(scope="module")
def broker(bench_dir, models):
    srv = BrokerProc(tgw_config(models, ["mlp"], 1), bench_dir)
    try:
        yield srv.start(timeout=60)
    finally:
        code = srv.stop()
        assert code == 0, f"broker exited {code}:\n{srv.output()}"
        assert list_segments(srv.pid) == [] and not srv.alive()


def _check_run(run: dict, mode: str, level: float) -> None:
    assert run["mode"] == mode and run["level"] == level
    assert run["requests_failed"] == 0 and run["errors"] == {}, run.get("error_messages")
    assert run["requests_ok"] > 0 and run["throughput_rps"] > 0
    assert set(run["latency_ms"]) >= {"p50", "p90", "p99", "p99_9", "mean", "max"}
    assert all(v is not None and v > 0 for v in run["latency_ms"].values())
    gen = run["generator"]
    assert gen["procs"] >= 1 and sum(gen["threads"]) >= 1 and gen["cpu_cores"] >= 0
    assert isinstance(gen["saturated"], bool)
    bs = run["broker_stats"]
    # the snapshots bracket the window only to within the requests in flight at its edges
    assert bs["requests"] >= run["requests_ok"] // 2 and bs["batches"] >= 1
    assert sum(bs["batch_sizes"].values()) == bs["batches"]
    assert sum(int(k) * v for k, v in bs["batch_sizes"].items()) == bs["rows"]
    roles = sorted(p["role"] for p in run["server_processes"])
    assert roles == ["broker", "worker"]
    assert all(p["peak_rss_mb"] > 0 for p in run["server_processes"])
    _check_costs(run, ["broker", "worker"])
    assert isinstance(run["warnings"], list)


def _check_costs(run: dict, roles: list[str]) -> None:
    """CPU per request (broker, workers, generator) and the server tree's PSS: present, never timed."""
    us = run["cpu_us_per_request"]
    assert set(us) == {"broker", "workers", "server", "generator"}
    assert all(v is not None and v >= 0 for v in us.values())
    assert us["server"] == pytest.approx(us["broker"] + us["workers"])
    by_role = {p["role"]: p for p in run["server_processes"]}
    assert sorted(by_role) == sorted(roles)
    assert all(p["pss_mb"] > 0 and p["cpu_us_per_request"] >= 0 for p in by_role.values())
    assert set(run["server_pss_pids"]) >= {p["pid"] for p in by_role.values()}
    assert run["server_pss_mb"] >= max(p["pss_mb"] for p in by_role.values())


def test_tgw_bench_closed_and_open_loop(broker, bench_dir, capsys):
    out = os.path.join(bench_dir, "closed.json")
    png = os.path.join(bench_dir, "closed.png")
    rc = cli.main(["load", "--address", broker.address, "--model", "mlp", "--concurrency", "1,2", "--duration", "1",
                   "--warmup", "0.3", "--procs", "1", "--json", out, "--plot", png])
    assert rc == 0, capsys.readouterr()
    data = json.load(open(out))
    assert data["model"] == "mlp" and data["mode"] == "closed" and len(data["runs"]) == 2
    assert data["command"].startswith("tgw-bench load --address")
    for run, level in zip(data["runs"], (1, 2)):
        _check_run(run, "closed", level)
    assert os.path.getsize(png) > 0
    text = capsys.readouterr().out
    assert "p99.9" in text and "batches" in text

    out = os.path.join(bench_dir, "open.json")  # the old form, without a subcommand, is `load`
    rc = cli.main(["--address", broker.address, "--model", "mlp", "--rate", "40", "--duration", "1",
                   "--warmup", "0.3", "--batch", "2", "--max-inflight", "8", "--json", out])
    assert rc == 0, capsys.readouterr()
    run = json.load(open(out))["runs"][0]
    _check_run(run, "open", 40)
    assert run["batch"] == 2 and run["rows_per_s"] == pytest.approx(2 * run["throughput_rps"])
    assert set(run["send_lag_ms"]) == {"p50", "p99"}


def test_tgw_bench_unknown_model_is_a_clean_error(broker, capsys):
    assert cli.main(["load", "--address", broker.address, "--model", "nope", "--duration", "1"]) == 2
    assert "not served" in capsys.readouterr().err


def test_tgw_bench_without_a_broker_is_a_clean_error(bench_dir, capsys):
    assert cli.main(["load", "--address", f"ipc://{bench_dir}/none.sock", "--model", "mlp", "--duration", "1"]) == 2
    assert "no tgw broker" in capsys.readouterr().err


def test_transport_floor_echo_through_the_loadgen(bench_dir):
    srv = EchoServer(bench_dir)
    try:
        row = measure(ZmqEchoTarget(srv.front, 4096, 40), LoadSpec("closed", 2, 0.5, 0.2, 1), srv.processes)
    finally:
        srv.stop()
    assert row["requests_ok"] > 0 and row["requests_failed"] == 0
    assert not srv.broker.alive() and not srv.worker.alive()
    assert [p["role"] for p in row["server_processes"]] == ["broker", "worker"]
    _check_costs(row, ["broker", "worker"])


def test_in_process_floor(models):
    """Two rounds of one copy on the demo mlp: batch 1, max/4 and max, the best kept per batch size."""
    logged = []
    floors = run_floors(models, ["mlp"], 0.05, 1, logged.append)
    floors = run_floors(models, ["mlp"], 0.05, 1, logged.append, previous=floors)
    floor = floors["mlp"]
    assert [r["batch"] for r in floor["runs"]] == [1, 16, 64] and floor["rounds"] == 2
    assert all(r["calls"] >= 5 and r["samples_per_s"] > 0 for r in floor["runs"])
    row = floor_row(floor)
    assert row["throughput_rps"] == max(r["samples_per_s"] for r in floor["runs"])
    assert row["floor"]["module"] == "frozen" and len(logged) == 2


def test_failures_are_counted_by_code():
    rec = _Recorder()

    def fail():
        raise CallError("OVERLOADED", "queue full")
    for _ in range(3):
        _run_one(fail, rec, 1.0, 1.0, 0.0, 2.0)
    _run_one(lambda: None, rec, 1.0, 1.0, 0.0, 2.0)
    _run_one(lambda: None, rec, 5.0, 5.0, 0.0, 2.0)   # outside the window: not recorded
    assert rec.errors == {"OVERLOADED": 3} and len(rec.lat) == 1


def test_stats_diff():
    before = {"models": {"m": {"requests": 10, "batches": 5, "rows": 10, "batch_sizes": {"1": 2, "4": 2},
                               "errors": {"OVERLOADED": 1}}}}
    after = {"models": {"m": {"requests": 30, "batches": 9, "rows": 30, "batch_sizes": {"1": 4, "4": 4, "8": 1},
                              "errors": {"OVERLOADED": 1}}}}
    d = stats_diff(before, after, "m")
    assert d["batch_sizes"] == {"1": 2, "4": 2, "8": 1} and d["requests"] == 20 and d["errors"] == {}


def _row(rps: float, p50: float) -> dict:
    return {"throughput_rps": rps, "rows_per_s": rps, "requests_failed": 0, "errors": {},
            "latency_ms": {"p50": p50, "p90": p50, "p99": p50 * 2, "p99_9": p50 * 3},
            "generator": {"cpu_cores": 0.1}, "server_pss_mb": 300.0,
            "cpu_us_per_request": {"broker": 40.0, "workers": 60.0, "server": 100.0, "generator": 90.0}}


def test_compare_rows_ratios_and_tables(tmp_path):
    floor = {"procs": 2, "threads": 1, "background_cpu_cores": 0.0, "runs": [
        {"batch": 1, "samples_per_s": 1000.0, "latency_ms": {"p50": 1.0, "p99": 2.0}},
        {"batch": 32, "samples_per_s": 4000.0, "latency_ms": {"p50": 8.0, "p99": 9.0}}]}
    sc = comparison.Scenario("mlp", 16)
    http = {"cpu_cores": 0.3, "kind": "python-fallback"}
    flask = {**_row(500, 16.0), "generator": http}
    tgw_http = {**_row(1500, 5.0), "generator": http, "cpu_us_per_request": {"broker": 100.0, "workers": 60.0}}
    tgw_http_bin = {**_row(1800, 4.5), "generator": http, "cpu_us_per_request": {"broker": 60.0, "workers": 60.0}}
    rows = {"in-process": floor_row(floor), "transport": _row(8000, 1.0), "tgw": _row(2000, 4.0),
            "tgw_http": tgw_http, "tgw_http_bin": tgw_http_bin, "flask": flask}
    res = comparison.scenario_result(sc, 1024, rows)
    r = res["ratios"]
    assert r["tgw_over_flask_throughput"] == pytest.approx(4.0)
    assert r["tgw_over_flask_p50"] == pytest.approx(0.25)
    assert r["tgw_over_floor_throughput"] == pytest.approx(0.5)
    assert r["tgw_over_transport_throughput"] == pytest.approx(0.25)
    assert r["tgw_p50_excess_ms"] == pytest.approx(4.0 - 1.0 - 1.0)  # tgw - transport - floor batch-1
    # the HTTP rows of tgw: over Flask (same generator, same body) and over tgw native (same broker)
    assert r["tgw_http_over_flask_throughput"] == pytest.approx(3.0)
    assert r["tgw_http_over_flask_p50"] == pytest.approx(5.0 / 16.0)
    assert r["tgw_http_over_tgw_throughput"] == pytest.approx(0.75)
    assert r["tgw_http_bin_over_tgw_throughput"] == pytest.approx(0.9)
    assert r["tgw_http_bin_over_flask_throughput"] == pytest.approx(3.6)
    assert r["tgw_http_broker_us_over_tgw"] == pytest.approx(2.5)
    assert r["tgw_http_bin_broker_us_over_tgw"] == pytest.approx(1.5)
    failed = comparison.scenario_result(comparison.Scenario("resnet", 1), 49152,
                                        {**rows, "flask": {"error": "RuntimeError: no gunicorn"}})
    assert failed["ratios"]["tgw_over_flask_throughput"] is None
    assert failed["ratios"]["tgw_http_over_flask_throughput"] is None
    assert failed["ratios"]["tgw_http_over_tgw_throughput"] == pytest.approx(0.75)
    table = report.compare_table([res, failed])
    assert len(table) == 1 + 12 and all(len(t) == len(table[0]) for t in table)
    assert any("FAILED" in c for t in table for c in t)
    labels = [t[2] for t in table]  # the HTTP generator is named on every row it loaded
    assert {"Flask+gunicorn (python-fallback)", "tgw HTTP (python-fallback)",
            "tgw HTTP binary (python-fallback)", "tgw native"} <= set(labels)
    http_line = table[labels.index("tgw HTTP binary (python-fallback)")]
    assert http_line[table[0].index("vs Flask")] == "3.60x" and http_line[table[0].index("vs native")] == "0.90x"
    text, md = report.text_table(table, 3), report.markdown_table(table, 3)
    assert "4.00x" in text and md.count("\n") == len(table)
    costs = report.cost_table([res, failed])
    assert len(costs) == 1 + 5 + 4 and all(len(t) == len(costs[0]) for t in costs)  # no floor or failed rows
    tgw = next(t for t in costs if t[1] == "tgw native")
    assert tgw[3:7] == ["40.0", "60.0", "90.0", "300"] and tgw[7] == "0.25x" and tgw[8] == "+2.000"
    http_cost = next(t for t in costs if t[1] == "tgw HTTP (python-fallback)")
    assert http_cost[3] == "100.0" and http_cost[costs[0].index("broker vs native")] == "2.50x"
    result = {"mode": "quick", "date": "d", "command": "tgw-bench compare --quick", "wall_s": 1.0,
              "machine": report.machine(), "scenarios": [res, failed],
              "settings": {"duration": 2, "warmup": 0.5, "tgw_workers": 2, "flask_workers": 2, "floor_procs": 2,
                           "http_generator": "python fallback (wrk not installed)"}}
    section = report.section_markdown(result, "r.json", "r.png")
    assert "wrk was not installed" in section and "| mlp c=16 |" in section
    assert "broker us/req" in section and "server PSS MiB" in section
    path = str(tmp_path / "RESULTS.md")
    report.update_results_md(path, "quick", "quick body\n")
    report.update_results_md(path, "full", "full body\n")
    report.update_results_md(path, "quick", "quick body 2\n")
    body = open(path).read()
    assert body.index("full body") < body.index("quick body 2") and "quick body\n" not in body
    with open(path, "a") as f:
        f.write("\n## Notes kept as they are\n")
    report.update_results_md(path, "custom", "custom body\n")
    report.update_results_md(path, "full", "full body 2\n")
    body = open(path).read()  # sections stay where they are; a new one goes after the others
    assert body.index("full body 2") < body.index("quick body 2") < body.index("custom body") \
        < body.index("## Notes kept as they are") and "full body\n" not in body


WRK_TEXT = """Running 2s test @ http://127.0.0.1:8000/infer/mlp
  2 threads and 16 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     7.02ms    1.10ms  20.00ms   90.00%
  Latency Distribution
     50%    6.80ms
     75%    7.50ms
     90%    8.20ms
     99%   11.08ms
  4426 requests in 2.01s, 1.00MB read
  Socket errors: connect 0, read 3, write 0, timeout 1
  Non-2xx or 3xx responses: 2
Requests/sec:   2202.00
"""


def test_wrk_output_parsing():
    line = ('TGW_WRK_JSON {"requests":4426,"duration_us":2010000,"bytes":5,"errors":{"connect":0,"read":3,'
            '"write":0,"status":2,"timeout":1},"latency_us":{"p50":6800.0,"p90":8200.0,"p99":11080.0,'
            '"p99_9":12000.0,"mean":7020.0,"max":20000.0}}')
    t = parse_wrk(WRK_TEXT + line + "\n")
    assert t["requests"] == 4426 and t["duration_s"] == pytest.approx(2.01)
    assert t["latency_ms"]["p50"] == pytest.approx(6.8) and t["latency_ms"]["p99"] == pytest.approx(11.08)
    assert t["errors"] == {"read": 3, "timeout": 1, "status": 2}
    with pytest.raises(ValueError, match="TGW_WRK_JSON"):
        parse_wrk(WRK_TEXT)


def test_wrk_script_sends_the_targets_headers():
    t = HttpTarget("127.0.0.1", 1, "/v2/models/m/infer", '/tmp/a "b".bin', content_type="application/octet-stream",
                   headers={HEADER_LENGTH: "152"})
    lua = wrk_lua(t)
    assert 'wrk.headers["Content-Type"] = "application/octet-stream"' in lua
    assert 'wrk.headers["Inference-Header-Content-Length"] = "152"' in lua
    assert 'io.open("/tmp/a \\"b\\".bin", "rb")' in lua and "TGW_WRK_JSON" in lua


def test_v2_bodies(models):
    """The bodies the HTTP rows post: KServe v2 JSON (flat data) and the binary tensor extension."""
    x = make_inputs(models["mlp"])["x"]
    body, n = v2_body(models["mlp"])
    assert n == len(body)
    assert json.loads(body) == {"inputs": [{"name": "x", "shape": [1, 256], "datatype": "FP32",
                                            "data": x.ravel().tolist()}]}
    body, n = v2_body(models["mlp"], binary=True)
    assert json.loads(body[:n]) == {"inputs": [{"name": "x", "shape": [1, 256], "datatype": "FP32",
                                                "parameters": {"binary_data_size": 1024}}],
                                    "parameters": {"binary_data_output": True}}
    assert body[n:] == x.tobytes()
    body, n = v2_body(models["embed"], binary=True)
    assert json.loads(body[:n])["inputs"][0]["datatype"] == "INT64" and len(body) - n == 16 * 8


def test_compare_http_rows_end_to_end(models):
    """tgw native, tgw HTTP (the JSON body Flask gets), tgw HTTP binary and tgw gRPC (unary and stream) against one broker, and
    Flask+gunicorn, through the comparison's own Servers on tiny settings: every row filled, the
    broker's stats and CPU accounting on the HTTP rows, the ratios, a clean broker stop."""
    work = tempfile.mkdtemp(prefix="tgwbh-", dir="/tmp")
    a = argparse.Namespace(systems=["tgw", "tgw_http", "tgw_http_bin", "tgw_grpc", "tgw_grpc_stream", "flask"], duration=0.5, warmup=0.2, procs=1,
                           tgw_workers=1, flask_workers=1, floor_seconds=0.05, floor_procs=1, floor_module="freeze",
                           floor_rounds=1)
    try:
        res = comparison.collect(a, work, models, [comparison.Scenario("mlp", 2)], lambda msg: None)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    srv = res["tgw_server"]
    assert srv["exit_status"] == 0 and srv["shm_leftovers"] == [] and srv["http"].startswith("http://127.0.0.1:")
    assert res["http_generator"] != "-"
    (sc,) = res["scenarios"]
    rows = sc["rows"]
    assert sorted(rows) == sorted(a.systems)
    for system, row in rows.items():
        assert "error" not in row, row.get("traceback")
        assert row["requests_ok"] > 0 and row["requests_failed"] == 0, row["errors"]
    assert rows["flask"]["body_bytes"] == rows["tgw_http"]["body_bytes"] > rows["tgw_http_bin"]["body_bytes"]
    for system in ("tgw_http", "tgw_http_bin"):
        row = rows[system]
        assert row["generator"]["kind"] in ("wrk", "python-fallback") and row["target"] == system
        assert row["broker_stats"]["requests"] >= row["requests_ok"] // 2 and "worker_busy" in row["batching"]
        _check_costs(row, ["broker", "worker"])
    assert srv["grpc"].startswith("127.0.0.1:")
    for system in ("tgw_grpc", "tgw_grpc_stream"):
        # the broker's window and the generator's are not the same instants (as for the HTTP rows)
        assert rows[system]["target"] == system and rows[system]["broker_stats"]["requests"] >= rows[system]["requests_ok"] // 2
        _check_costs(rows[system], ["broker", "worker"])
    for key in ("tgw_http_over_flask_throughput", "tgw_http_bin_over_tgw_throughput", "tgw_http_broker_us_over_tgw",
                "tgw_http_bin_broker_us_over_tgw", "tgw_grpc_over_http_bin_throughput", "tgw_grpc_stream_over_http_bin_throughput",
                "tgw_grpc_broker_us_over_tgw"):
        assert sc["ratios"][key] > 0


def test_http_fallback_generator(bench_dir):
    """The Python HTTP generator (used where wrk is missing) against a stub: keep-alive, codes counted."""
    import http.server
    import threading

    class Stub(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            code = 200 if self.path == "/ok" else 503
            self.send_response(code)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    body = os.path.join(bench_dir, "body.json")
    with open(body, "w") as f:
        f.write('{"inputs": {}}')
    try:
        spec, drive = LoadSpec("closed", 2, 0.5, 0.1, 1), functools.partial(loadgen_drive, kind="python-fallback")
        ok = measure(HttpTarget("127.0.0.1", srv.server_address[1], "/ok", body), spec, [], drive=drive)
        bad = measure(HttpTarget("127.0.0.1", srv.server_address[1], "/bad", body), spec, [], drive=drive)
    finally:
        srv.shutdown()
        srv.server_close()
    assert ok["requests_ok"] > 0 and ok["requests_failed"] == 0 and ok["generator"]["kind"] == "python-fallback"
    assert bad["requests_ok"] == 0 and set(bad["errors"]) == {"HTTP_503"}


def test_batching_figures_from_the_broker_counters_and_the_floor():
    from tgw.bench.harness.comparison import batching
    floor = {"runs": [{"batch": 1, "latency_ms": {"mean": 1.0}}, {"batch": 8, "latency_ms": {"mean": 4.5}},
                      {"batch": 32, "latency_ms": {"mean": 16.5}}]}
    # 10 batches of 8 (floor 4.5 ms each) and 10 of 20 rows (floor interpolated: 10.5 ms) in 2 s on 1 worker
    tgw = {"duration_s": 2.0, "broker_stats": {"compute_us": 180_000, "rows": 280, "batch_sizes": {"8": 10, "20": 10}}}
    out = batching(tgw, floor, workers=1)
    assert out["worker_busy"] == pytest.approx(0.09)
    assert out["compute_us_per_row"] == pytest.approx(180_000 / 280)
    assert out["compute_over_floor"] == pytest.approx(180_000 / 150_000)
    assert batching({"duration_s": 1.0, "broker_stats": {}}, floor, 1)["worker_busy"] is None
