"""The fleet benchmark end to end on the CPU: two engine processes of the tiny model, the gateway over HTTP, both phases
(its timings are the GPU's; here the values that do not depend on the machine)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from loadtest import serve_fleet
from loadtest.serve_fleet import main
from service.devtools.ports import free_ports

pytestmark = pytest.mark.slow

ENGINE_ENV = [
    "KVSTITCH_KV_POOL_MB=16",
    "KVSTITCH_MAX_PRECOMPUTE_TOKENS=256",
    "KVSTITCH_GATE_ON_START=false",
    "KVSTITCH_DISK_CACHE_MB=512",
]

CLOCK_TICK_MS = 10.0  # /proc's CPU times are in clock ticks (USER_HZ = 100)


def test_the_fleet_benchmark_scales_out_and_compares_routing(
    tiny_model_dirs: dict[str, Path], redis_url: str, tmp_path: Path
) -> None:
    """24 one-chunk topics of ~190 tokens (~90 KiB of KV each) against a 1 MiB host tier per engine (the CPU's
    fastest tier; the "GPU" tier is the host's there): two engines' tiers hold the corpus only if each keeps its
    own share, which chunk-aware routing lets them do and round-robin does not."""
    out = tmp_path / "out"
    first = free_ports(3)  # two engines, then the gateway
    argv = ["--model", str(tiny_model_dirs["qwen2"]), "--device", "cpu", "--gpus", "0,1", "--redis", redis_url]
    argv += ["--engine-port", str(first), "--port", str(first + 2), "--engine-env", *ENGINE_ENV]
    argv += ["--host-cache-mb", "1", "--gpu-cache-mb", "0", "--routing-gpu-cache-mb", "0", "--chunk-size", "192"]
    argv += ["--topics", "24", "--sentences", "4", "--top-k", "4", "--max-new-tokens", "4", "--concurrency", "2"]
    # Runs end after 40 questions (the duration only bounds them): the hit ratios compared below rest on as many
    # questions however busy the machine is.
    argv += ["--routing-concurrency", "4", "--duration", "30", "--max-requests", "40", "--warmup-s", "1"]
    argv += ["--warmup-requests", "8"]
    assert main([*argv, "--data-dir", str(tmp_path / "data"), "--out", str(out)]) == 0

    report = json.loads((out / "report.json").read_text())
    assert (out / "table.md").read_text().startswith("| phase | gateway over |")
    runs = {(c["phase"], c["name"]): c["runs"][0] for c in report["configurations"]}
    assert list(runs) == [
        ("scale", "2 engines"),
        ("scale", "1 engine"),
        ("routing", "chunk-aware"),
        ("routing", "round-robin"),
    ]
    engines = [f"http://127.0.0.1:{first}", f"http://127.0.0.1:{first + 1}"]
    for run in runs.values():
        assert run["requests"] == 40 and run["errors"] == run["refused"] == 0 and run["output_tokens_per_s"] > 0
        # `--client-processes` left at 4: a process per client here (2 in the scale phase, 4 in routing), each
        # asking its share of the 40 questions.
        processes = run["concurrency"]
        assert run["client_processes"] == processes
        assert run["requests_per_client_process"] == [40 // processes] * processes
        # Every answer counted by the engines is one the clients had: no answer lost or counted twice.
        assert sum(e["answers"] for e in run["engines"].values()) == run["requests"]
        # Each engine thread's time by phase, as shares of the run, and the answers' server stages.
        for engine in run["engines"].values():
            share = engine["thread_share"]
            assert share["decode"] > 0 and share["admit"] > 0 and 0.5 < sum(share.values()) < 1.5, share
            # The CPU rides no question in a decode step (`prefill_with_decode` is on with CUDA graphs only); questions
            # admitted together are prefilled apart, one admitted alone in neither count.
            prefills = engine["question_prefills"]
            assert prefills["riding"] == 0 and 0 <= prefills["apart"] <= engine["answers"], engine
            assert engine["rider_tokens"] == {"question": 0, "padding": 0}, engine
        assert run["stage_ms"]["retrieve"] > 0 and run["stage_ms"]["decode"] > 0
    assert list(runs["scale", "1 engine"]["engines"]) == engines[:1]
    for (_, name), run in runs.items():
        cpu = run["cpu"]  # where the CPU went, from /proc around the timed run
        assert cpu["answers"] == run["requests"] == 40 and cpu["wall_s"] > 0
        working = ["gateway", "clients", *(f"engine-{i}" for i in range(1 if name == "1 engine" else 2))]
        for role in working:
            assert cpu["processes"][role]["ms_per_answer"] > 0 and cpu["processes"][role]["cores"] > 0, role
            assert 0 < cpu["processes"][role]["busiest_thread_cores"] <= cpu["processes"][role]["cores"] + 0.01
        assert "engine-1" not in cpu["processes"] if name == "1 engine" else "engine-1" in cpu["processes"]
        assert cpu["processes"]["embedder"] is None  # on the CPU questions are embedded in the gateway's process
        groups = cpu["thread_groups"]
        assert groups["event_loop"]["cores"] > 0 and groups["retrieval"]["cores"] > 0
        # The request threads' work is a fraction of a millisecond an answer, and /proc counts CPU in 10 ms ticks:
        # over 40 answers it may be no tick at all (seen in CI), so only its presence is checked here; the sum
        # below still accounts for every thread of the gateway.
        assert groups["request_threads"]["ms_per_answer"] >= 0
        gateway = cpu["processes"]["gateway"]["ms_per_answer"]
        # The threads are read just after their process, so their sum may exceed its total by what ran in between,
        # and each is counted in whole 10 ms ticks: a tick a group (and one for the gap) over the run's answers.
        ticks_per_answer = CLOCK_TICK_MS * (len(groups) + 1) / cpu["answers"]
        assert sum(g["ms_per_answer"] for g in groups.values()) == pytest.approx(gateway, abs=ticks_per_answer)
    cpu_table = (out / "table.md").read_text().split("\n\n", 1)[1]
    assert cpu_table.startswith("CPU per timed run") and cpu_table.count("\n| scale |") == 2
    assert report["summary"]["scale_tokens_per_s_ratio"]["2"] > 0

    aware, robin = runs["routing", "chunk-aware"], runs["routing", "round-robin"]
    assert all(aware["engines"][url]["answers"] > 0 for url in engines)
    split = [robin["engines"][url]["answers"] for url in engines]
    assert abs(split[0] - split[1]) <= 1  # in turn: one apart at most
    # The tiers' hits the answers report agree with the blocks the engines say they served.
    for run in (aware, robin):
        assert run["kv"]["host"] == sum(e["blocks"]["host"] for e in run["engines"].values())
    # Chunk-aware keeps each engine's share in its tier, so it hits more; but 40 questions on a busy 2-core runner
    # move a ratio by several points either way (a CI run saw 0.556 against 0.594), so a clear loss fails here and
    # the routing rule itself is tested exactly in tests/fleet.
    assert aware["host_hit_ratio_done"] >= robin["host_hit_ratio_done"] - 0.1
    assert set(report["summary"]["routing"]["4"]) == {"chunk-aware", "round-robin"}


def test_gateway_replicas_share_the_engines_and_the_clients(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """`--gateways 2`: a second gateway process over the same engines, its own embedded Qdrant, half the clients;
    `--client-processes 2`: the clients in two processes, client j in process j mod 2, so that here each process
    asks one gateway (clients 0 and 2 the first, 1 and 3 the second), half the questions each."""
    out = tmp_path / "out"
    first = free_ports(4)  # two engines, the gateway, then its replica
    argv = ["--model", str(tiny_model_dirs["qwen2"]), "--device", "cpu", "--gpus", "0,1", "--phases", "scale"]
    argv += ["--engine-port", str(first), "--port", str(first + 2), "--gateways", "2", "--engine-env", *ENGINE_ENV]
    argv += ["--chunk-size", "192", "--topics", "12", "--sentences", "4", "--top-k", "4", "--max-new-tokens", "4"]
    argv += ["--concurrency", "4", "--duration", "30", "--max-requests", "24", "--warmup-s", "1"]
    argv += ["--warmup-requests", "4", "--client-processes", "2"]
    assert main([*argv, "--data-dir", str(tmp_path / "data"), "--out", str(out)]) == 0

    report = json.loads((out / "report.json").read_text())
    assert [c["gateways"] for c in report["configurations"]] == [2, 2] and report["args"]["client_processes"] == 2
    for configuration in report["configurations"]:
        run = configuration["runs"][0]
        assert run["requests"] == 24 and run["errors"] == run["refused"] == 0
        per_gateway = run["requests_per_gateway"]  # clients 0 and 2 ask the first gateway, 1 and 3 the second
        assert len(per_gateway) == 2 and min(per_gateway) > 0 and sum(per_gateway) == 24
        # Both processes asked their share (12 each of the 24), the merged results labelled with global gateways.
        assert run["client_processes"] == 2 and run["requests_per_client_process"] == per_gateway == [12, 12]
        assert sum(e["answers"] for e in run["engines"].values()) == 24  # both gateways' answers reach the engines
        replicas = run["cpu"]["processes"]["gateway replicas"]
        assert replicas["cores"] > 0 and replicas["ms_per_answer"] > 0
        clients = run["cpu"]["processes"]["clients"]  # both client processes, summed
        assert clients["cores"] > 0 and 0 < clients["busiest_thread_cores"] <= clients["cores"] + 0.01
    table = (out / "table.md").read_text()
    assert "| scale | 2 engines, 2 gateways | 4 |" in table and "| scale | 1 engine, 2 gateways | 4 |" in table


def test_the_gateways_random_shell_keys_chunks_as_the_engines_random_model() -> None:
    """No 7B weights drawn here: the shell is built on the meta device and names the fingerprint
    `random_qwen2_7b` gives the engines' models on CUDA."""
    from loadtest.bench_prefill import random_fingerprint, random_qwen2_7b_shell
    from service.kvcache.keys import model_fingerprint

    shell = random_qwen2_7b_shell("stand-in", "cuda")

    assert not shell.has_weights and shell.source == "random:qwen2-7b"
    assert {p.device.type for p in shell.hf.parameters()} == {"meta"}
    assert model_fingerprint(shell) == random_fingerprint("stand-in", "cuda")
    assert random_qwen2_7b_shell("stand-in", "cuda").fingerprint == model_fingerprint(shell)  # a second build too
    assert random_fingerprint("stand-in", "cpu") != random_fingerprint("stand-in", "cuda")
    assert random_fingerprint("qwen", "cuda") != random_fingerprint("stand-in", "cuda")


def test_an_engine_keeps_the_callers_python_path_and_gets_its_own_gpu_and_data_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """On the GPU machine the carried wheels are on PYTHONPATH: the engines must import them too."""
    from loadtest.serve_fleet import REPO, engine_environment, parse_args

    monkeypatch.setenv("PYTHONPATH", "/tmp/site")
    monkeypatch.setenv("KVSTITCH_ENGINES", "http://elsewhere:1")
    args = parse_args(["--gpus", "2,3", "--data-dir", str(tmp_path), "--engine-env", "KVSTITCH_MAX_BATCH=8"])

    env = engine_environment(args, 1, 3, 1024, None)

    assert env["PYTHONPATH"] == f"{REPO}:/tmp/site"
    assert (env["CUDA_VISIBLE_DEVICES"], env["KVSTITCH_GPU_CACHE_MB"]) == ("3", "1024")
    assert env["KVSTITCH_DATA_DIR"] == str(tmp_path / "engine-1") and "KVSTITCH_REDIS_URL" not in env
    assert "KVSTITCH_ENGINES" not in env and env["KVSTITCH_MAX_BATCH"] == "8"
    args.redis = "redis://127.0.0.1:6379/0"
    shared = engine_environment(args, 1, 3, 1024, "fleetbench-x")
    assert (shared["KVSTITCH_DATA_DIR"], shared["KVSTITCH_REDIS_URL"]) == (str(tmp_path), args.redis)
    assert (shared["KVSTITCH_REDIS_PREFIX"], shared["KVSTITCH_ENGINE_ID"]) == ("fleetbench-x", "engine1-gpu3")


def test_engine_env_b_runs_the_scale_phase_again_with_those_settings(tmp_path: Path) -> None:
    """An A/B pair in one run: the scale configurations, then the same with the B settings, whose engines (a group
    restarted for them) get both --engine-env and --engine-env-b."""
    from loadtest.serve_fleet import engine_environment, parse_args

    argv = ["--gpus", "0,1", "--phases", "scale", "--data-dir", str(tmp_path), "--engine-env", "KVSTITCH_MAX_BATCH=8"]
    args = parse_args([*argv, "--engine-env-b", "KVSTITCH_LATE_LAUNCH=true"])
    plan = [(c.name, c.engines, c.engine_env) for c in serve_fleet.configurations(args)]
    b = (("KVSTITCH_LATE_LAUNCH", "true"),)
    assert plan == [
        ("2 engines", (0, 1), ()),
        ("1 engine", (0,), ()),
        ("2 engines, KVSTITCH_LATE_LAUNCH=true", (0, 1), b),
        ("1 engine, KVSTITCH_LATE_LAUNCH=true", (0,), b),
    ]
    env = engine_environment(args, 0, 0, 1024, None) | dict(b)
    assert (env["KVSTITCH_MAX_BATCH"], env["KVSTITCH_LATE_LAUNCH"]) == ("8", "true")
    with pytest.raises(SystemExit):
        parse_args([*argv, "--engine-env-b", "KVSTITCH_LATE_LAUNCH"])  # not KEY=VALUE
    with pytest.raises(SystemExit):
        parse_args(["--gpus", "0,1", "--phases", "routing", "--engine-env-b", "A=1"])  # no scale phase to repeat


def test_engine_code_b_runs_the_scale_phase_again_from_another_tree(tmp_path: Path) -> None:
    """Two versions of the engine in one run: the B configurations' engines import the other tree first and run
    in it (the gateway stays this one's); a folder that is no source tree is refused."""
    from loadtest.serve_fleet import REPO, engine_environment, parse_args

    tree = tmp_path / "old"
    (tree / "service").mkdir(parents=True)
    (tree / "loadtest").mkdir()
    (tree / "loadtest" / "random_engine.py").write_text("")
    argv = ["--gpus", "0", "--phases", "scale", "--data-dir", str(tmp_path / "data")]
    args = parse_args([*argv, "--engine-code-b", str(tree), "--engine-env-b", "KVSTITCH_MAX_BATCH=8"])
    plan = [(c.name, c.engine_env, c.engine_code) for c in serve_fleet.configurations(args)]
    b = (("KVSTITCH_MAX_BATCH", "8"),)
    assert plan == [("1 engine", (), None), ("1 engine, KVSTITCH_MAX_BATCH=8 code old", b, str(tree))]
    paths = engine_environment(args, 0, 0, 1024, None, tree)["PYTHONPATH"].split(os.pathsep)
    assert paths[0] == str(tree)
    assert engine_environment(args, 0, 0, 1024, None)["PYTHONPATH"].split(os.pathsep)[0] == str(REPO)
    with pytest.raises(SystemExit):
        parse_args([*argv, "--engine-code-b", str(tmp_path / "data")])  # no service/ there


def test_the_tables_mark_the_levels_py_spy_ran_beside() -> None:
    """py-spy beside a run slows the processes it samples: its level is marked in both tables, the others not."""
    run = {"ttft_ms": {"p50": 1.0, "p95": 2.0, "p99": 3.0}, "requests": 5, "errors": 0, "refused": 0}
    run |= {"output_tokens_per_s": 10.0, "gpu_hit_ratio_done": 1.0, "host_hit_ratio_done": 0.0}
    run |= {"gpu_hit_ratio_engines": 1.0, "engines": {"e": {"answers": 5}}, "cpu": {"processes": {}}}
    runs = [run | {"concurrency": 4, "profiled": False}, run | {"concurrency": 16, "profiled": True}]
    outcome = {"phase": "scale", "name": "1 engine", "gateways": 1, "runs": runs}
    for text in (serve_fleet.table([outcome]), serve_fleet.cpu_table([outcome])):
        cells = [line.split(" | ")[2] for line in text.splitlines() if line.startswith("| scale")]
        assert cells == ["4", "16 (py-spy)"]


@pytest.mark.parametrize("first", ["chunk-aware", "round-robin"])
def test_the_routing_phase_runs_the_policy_asked_for_first(first: str) -> None:
    phases = ["scale", "routing"]
    args = argparse.Namespace(gpus=[0, 1], phases=phases, routing_first=first, engine_env_b=[], engine_code_b=None)
    plan = [(c.phase, c.name, c.routing) for c in serve_fleet.configurations(args)]
    other = "round-robin" if first == "chunk-aware" else "chunk-aware"
    assert plan == [
        ("scale", "2 engines", "chunk-aware"),
        ("scale", "1 engine", "chunk-aware"),
        ("routing", first, first),
        ("routing", other, other),
    ]
