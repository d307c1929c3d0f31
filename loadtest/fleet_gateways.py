"""serve_fleet's gateways: the in-process one's model and settings, and further replicas as processes.

A gateway is stateless beside its routing view (Redis rebuilds it), so answering capacity past one gateway process
comes from more of them over the same engines, as the fleet's Kubernetes Deployment runs several pods. Replica 0 is
serve_fleet's own in-process gateway; `GatewayReplicas` starts replicas 1..N-1, each a spawned process serving the
same configuration on the next port. Production replicas share one Qdrant server; the GPU machine runs none, so each
replica here keeps its own embedded Qdrant under its own data dir and the clients ingest the corpus into every one
(the engines find each chunk's KV already placed by the first, so only the vectors are written again). Searching a
local copy costs a replica about what a Qdrant server round trip would; everything else is the production path.
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
from dataclasses import dataclass
from multiprocessing.process import BaseProcess

import torch
import uvicorn

from loadtest.bench_prefill import random_qwen2_7b_shell
from loadtest.serve_random import quiet_logging, wait_ready
from service.api.app import create_app
from service.api.connections import ConnectionLimits, server_options
from service.engine.engine import StitchEngine
from service.engine.model import load_model_shell
from service.retrieval.embedder import Embedder
from service.serving.server import Server
from service.settings import Settings
from workers.worker import in_process_worker

NEVER_SWEEP_S = 10**9  # a configuration's fresh collection must not make the gateway release the others' KV
REPLICA_STOP_S = 20.0
MAX_GATEWAYS = 8


@dataclass(frozen=True)
class Configuration:
    """One gateway: which engines (by index) it routes to, and how."""

    phase: str
    name: str
    engines: tuple[int, ...]
    routing: str
    engine_env: tuple[tuple[str, str], ...] = ()  # settings its engines get beyond --engine-env (`--engine-env-b`)
    engine_code: str | None = None  # another source tree its engines run (`--engine-code-b`); None: this one


def gateway_engine(args: argparse.Namespace) -> StitchEngine:
    """The gateway's model: a shell of the engines' (tokenizer, template, key space; no weights)."""
    if args.model:
        dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
        return StitchEngine(load_model_shell(args.model, dtype))
    return StitchEngine(random_qwen2_7b_shell(args.vocabulary_used, args.device))


def gateway_settings(
    args: argparse.Namespace,
    config: Configuration,
    urls: list[str],
    number: int,
    redis_prefix: str | None,
    replica: int = 0,
) -> Settings:
    """Replica 0 keeps the data dir the engines share with Redis; a further replica has a dir (and so an embedded
    Qdrant) of its own and the next port."""
    data_dir = args.data_dir if redis_prefix else args.data_dir / "gateway"
    return Settings(
        model=args.model or "random-qwen2-7b",
        engines=",".join(urls),
        fleet_routing=config.routing,
        device=args.device,
        data_dir=data_dir if replica == 0 else args.data_dir / f"gateway-{number}-replica-{replica}",
        redis_url=args.redis if redis_prefix else None,
        redis_prefix=redis_prefix or "kvstitch",
        collection=f"fleetbench_{number}",
        kv_sweep_grace_s=NEVER_SWEEP_S,
        embedding_model=args.embedding_model,
        embedding_device=args.embedding_device,
        embedding_process="on" if args.device == "cuda" else "off",
        chunk_size=args.chunk_size,
        chunk_overlap=0,
        default_max_new_tokens=args.max_new_tokens,
        max_top_k=max(args.top_k, 1),
        host="127.0.0.1",
        port=args.port + replica,
    )


def gateway_server(
    args: argparse.Namespace,
    config: Configuration,
    urls: list[str],
    number: int,
    redis_prefix: str | None,
    embedder: Embedder,
    replica: int = 0,
) -> Server:
    """Replica `replica`'s gateway (not started): its settings, the model shell, the embedder, the ingest worker."""
    settings = gateway_settings(args, config, urls, number, redis_prefix, replica)
    return Server(settings, gateway_engine(args), embedder, worker_factory=in_process_worker)


def serve_replica(
    args: argparse.Namespace,
    config: Configuration,
    urls: list[str],
    number: int,
    redis_prefix: str | None,
    replica: int,
) -> None:
    """A replica process's whole life: build the gateway, serve until SIGTERM (uvicorn's own handler)."""
    quiet_logging()
    embedder = Embedder(args.embedding_model, device=args.embedding_device)
    gateway = gateway_server(args, config, urls, number, redis_prefix, embedder, replica)
    port = gateway.settings.port
    # `kvstitch serve`'s server options, as the first gateway's (`bench_gateway.GatewayThread`).
    options = server_options(ConnectionLimits())
    uvicorn.run(create_app(gateway), host="127.0.0.1", port=port, log_level="warning", lifespan="on", **options)


class GatewayReplicas:
    """Replicas 1..count-1 of a configuration's gateway, started at once; `wait_ready`, then `stop` ends them."""

    def __init__(
        self,
        args: argparse.Namespace,
        config: Configuration,
        urls: list[str],
        number: int,
        redis_prefix: str | None,
        count: int,
    ) -> None:
        if not 1 <= count <= MAX_GATEWAYS:
            raise ValueError(f"gateways must be within 1..{MAX_GATEWAYS}, not {count}")
        context = multiprocessing.get_context("spawn")  # no CUDA or threads inherited from this process
        self.processes: list[BaseProcess] = []
        self.urls: list[str] = []
        for replica in range(1, count):
            process = context.Process(
                target=serve_replica,
                args=(args, config, urls, number, redis_prefix, replica),
                name=f"gateway-replica-{replica}",
                daemon=False,  # a daemonic process may not start children: the question embedder is one
            )
            process.start()
            self.processes.append(process)
            self.urls.append(f"http://127.0.0.1:{args.port + replica}")

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes if p.pid is not None and p.is_alive()]

    def wait_ready(self) -> None:
        for url, process in zip(self.urls, self.processes, strict=True):
            if not process.is_alive():
                raise RuntimeError(f"gateway replica {url} exited ({process.exitcode}) before it was ready")
            wait_ready(url)

    def stop(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        deadline = time.monotonic() + REPLICA_STOP_S
        for process in self.processes:
            process.join(timeout=max(0.1, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()

    def __enter__(self) -> GatewayReplicas:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
